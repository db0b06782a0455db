"""Bringing a lost ps task's state back inside `fit`, from `keras.callbacks.BackupAndRestore`.

A ps task killed and started again on its address (by `kerasps launch`'s
restart agent, or by Kubernetes) comes back empty. When `fit` has a
`BackupAndRestore` among its callbacks:

1. Every backup it writes records how far the call was (`failures.Progress`:
   the epoch, and the steps of it that the backup's weights hold: those whose
   results had reached the coordinator, and those applied ahead of them,
   counted by the ps tasks in `optimizer.iterations`), as an attribute of the
   weights file itself, so the record and the weights cannot disagree; a
   backup replaces the previous one only once written whole (a save cut
   short by the loss leaves the last good one). `fit` also writes a backup
   when it starts and, with an integer `save_freq`, at the end of each
   epoch: there is always one to restore, and a recovery never crosses an
   epoch.
2. After an error, one variable on each ps task is read; the tasks whose
   reads fail lost their state (`failures.decide` takes it from there).
3. `restore_lost_state` waits for those tasks to answer, re-establishes the
   coordinator's context with the cluster, starts every worker's input pipeline
   again (a function failed or cancelled while it waited for its next element
   ended its iterator for good), gives every variable they held a
   new resource, restores every variable from the latest backup (those on
   the surviving tasks too, so the state is exactly the backup's), resets
   the metrics and forgets the traced step functions. Layers with other
   resources on the lost tasks (`kerasps.layers.DynamicEmbedding`'s maps and
   locks) make them again first; restoring their state rebuilds the maps.
4. `fit` goes on from the backup's step: the steps since (at most
   `save_freq`) run again, and the call ends at the requested step count.

The same record lets a restarted coordinator resume `fit` mid-epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time

import h5py
import tensorflow as tf

from kerasps.backend import _keras, _tf, tf_logs
from kerasps.keras.trainer.steps import forget_step_functions
from kerasps.params import changes as changes_lib
from kerasps.policy import failures
from kerasps.policy.failures import Progress, PsTaskFailedError, Recovery

# Seconds `fit` waits for a lost ps task to answer again before giving up, and between
# two asks (a restarted task is often back within a second).
PS_RECOVERY_TIMEOUT = 600.0
PS_POLL_INTERVAL = 0.1
_PROGRESS = "kerasps_progress"
_RESTORES = "_kerasps_restores"

_log = logging.getLogger("kerasps")


class Backup:
    """The `BackupAndRestore` callback of a `fit` call, with kerasps' progress record.

    Args:
        callback: a `keras.callbacks.BackupAndRestore`.
    """

    def __init__(self, callback):
        self.callback = callback
        self.latest, self.previous = _keras.backup_paths(callback)

    @classmethod
    def of(cls, callbacks) -> Backup | None:
        callback = _keras.backup_callback(callbacks)
        return None if callback is None else cls(callback)

    @contextlib.contextmanager
    def recording(self, progress):
        """Inside the block, backups are written whole or not at all, and each
        records `progress()` (a `Progress`)."""
        self._progress = progress
        with _keras.backups_written_by(self.callback, self.save):
            yield

    def save(self):
        """Writes a backup now (inside `recording`).

        The progress is read before the weights: the backup holds at least the
        steps it records (a step applied while the weights are read is in the
        backup but not in the record, and runs again after a restore)."""
        progress = self._progress()

        def record(path):
            with h5py.File(path, "a") as f:
                f.attrs[_PROGRESS] = json.dumps(dataclasses.asdict(progress))

        _keras.write_backup(self.callback, record)

    def save_at_epoch_end(self):
        """Backs up at the end of an epoch unless the callback already did."""
        if not _keras.backup_saves_each_epoch(self.callback):
            self.save()

    def progress(self) -> Progress | None:
        """The progress recorded in the latest backup; `None` without one."""
        try:
            with h5py.File(self.latest, "r") as f:
                record = f.attrs.get(_PROGRESS)
        except OSError:
            return None
        if record is None:
            return None
        try:
            return Progress(**json.loads(record))
        except (ValueError, TypeError):
            raise RuntimeError(
                f"The backup {self.latest} holds an unreadable kerasps progress record "
                f"({record!r:.200}), so the step to go on from is unknown; restore the "
                f"previous backup ({self.previous}) by hand or remove the backup directory "
                "to start over.") from None

    def restore(self, model) -> Progress:
        """Loads the latest backup into `model` (the previous one if the latest is
        unreadable, as `BackupAndRestore(double_checkpoint=True)` does) and returns
        its progress."""
        try:
            model.load_weights(self.latest)
        except OSError:
            if not os.path.exists(self.previous):
                raise
            _log.warning("The latest backup %s is unreadable; restoring the previous one.",
                         self.latest)
            shutil.copyfile(self.previous, self.latest)
            model.load_weights(self.latest)
        progress = self.progress()
        if progress is None:
            raise RuntimeError(f"The backup {self.latest} holds no kerasps progress record, so "
                               "the step to go on from is unknown.")
        return progress


def _optimizer_variables(model) -> list:
    """The variables of the model's optimizer and of the optimizers of its tables (keras-rs
    tables train with optimizers of their own, state of their layer)."""
    optimizers = _keras.own_optimizers(model)
    if model.optimizer is not None:
        optimizers.insert(0, model.optimizer)
    return [v for optimizer in optimizers for v in optimizer.variables]


def _state_variables(model):
    """Every variable of the model, its optimizers and its metrics, once each."""
    variables = [*model.variables, *model.metrics_variables, *_optimizer_variables(model)]
    unique = {id(v): v for v in variables if _tf.resource_variable(v) is not None}
    return list(unique.values())


def _ps_task(variable):
    return _tf.device_ps_task(_tf.resource_variable(variable).device)


def lost_ps_tasks(model, error) -> list[int]:
    """The ps tasks that no longer hold the model's variables, after `error`.

    Reads one variable on each ps task: a task that died, or died and came
    back empty, fails the read.
    """
    if not isinstance(error, tf.errors.OpError):
        return []
    probes = {}
    for variable in _state_variables(model):
        probes.setdefault(_ps_task(variable), variable)
    return sorted(task for task, variable in probes.items()
                  if task is not None and not _tf.holds_state(variable))


def raise_if_ps_lost(error, model, method):
    """Raises `PsTaskFailedError` from `error` if a ps task lost the model's state."""
    lost = lost_ps_tasks(model, error)
    if lost:
        raise PsTaskFailedError(lost[0], method) from error


def recover(error, model, backup: Backup | None, epoch: int, finished: int,
            retried: int = 0, scheduled: int | None = None) -> Progress:
    """After `error` in epoch `epoch` of `fit` (`finished` steps delivered, `scheduled`
    scheduled): restores the state lost with ps tasks and returns where to go on from.

    `retried`: how many times the steps after `finished` were already run again
    after an unreachable ps task; past `failures.UNREACHABLE_RETRIES`, `error` is
    raised.

    Raises:
        error: again, if no ps task lost its state (the error is not a ps loss).
        PsTaskFailedError: a ps task lost its state and there is no backup, or
            it did not come back within `PS_RECOVERY_TIMEOUT`.
    """
    # `evaluate` (fit's validation pass) names a lost ps task in a `PsTaskFailedError`
    # raised from TensorFlow's error: the same loss, recovered the same way.
    cause = error.__cause__ if isinstance(error, PsTaskFailedError) else error
    lost = lost_ps_tasks(model, cause)
    unreachable = isinstance(cause, tf.errors.UnavailableError) and "/job:ps/" in str(cause)
    decision = failures.decide(lost, has_backup=backup is not None, ps_unreachable=unreachable)
    delay = failures.retry_delay(retried) if decision is Recovery.RETRY else None
    if decision is None or (decision is Recovery.RETRY and delay is None):
        raise error
    if decision is Recovery.RAISE:
        raise PsTaskFailedError(lost[0], "fit") from error
    if decision is Recovery.RETRY:
        _log.warning("A ps task was unreachable at epoch %d step %d but holds its variables; "
                     "running the failed steps again in %.1f s.", epoch + 1, finished, delay)
        time.sleep(delay)  # the workers' connections to it back off before reconnecting
        restart_training_input(model)
        return Progress(epoch, finished)
    _log.warning("ps task(s) %s lost their variables at epoch %d step %d; restoring the latest "
                 "backup once they answer again.%s", ", ".join(map(str, lost)), epoch + 1,
                 finished, tf_logs.detail_note())
    start = time.monotonic()
    progress = restore_lost_state(model, backup, lost)
    rerun = failures.steps_rolled_back(progress, epoch, finished, scheduled)
    _log.warning("Restored the backup of epoch %d step %d in %.1f s: %d step(s) run again.",
                 progress.epoch + 1, progress.step, time.monotonic() - start, rerun)
    return progress


def restart_training_input(model):
    """Starts every worker's training input pipeline again (the persistent iterators of
    `fit`), after a failure that failed or cancelled the functions in flight.

    A function failed or cancelled while it waited for its next element leaves its
    worker's iterator cancelled for good, and every later read of it ends the
    input although it is repeated (see `per_worker.restart_persistent_iterators`).
    Which iterators were hit is not known, so all start again, as a restarted
    worker's do.
    """
    from kerasps.runtime.coordinator import ClusterCoordinator
    from kerasps.runtime.input import per_worker

    per_worker.restart_persistent_iterators(
        ClusterCoordinator(model.distribute_strategy)._tf_coordinator)


def restore_lost_state(model, backup: Backup, ps_tasks) -> Progress:
    """Waits for `ps_tasks`, gives their variables new resources and restores the backup."""
    deadline = time.monotonic() + PS_RECOVERY_TIMEOUT
    for task in ps_tasks:
        # At the address the cluster's resolver gives now: a Ray actor restarted on
        # another node serves at another one (`kerasps.ray.cluster`).
        while not _tf.ps_task_alive(task):
            if time.monotonic() > deadline:
                raise PsTaskFailedError(task, "fit", reason=(
                    f"It did not answer again within {PS_RECOVERY_TIMEOUT:.0f} s, so the "
                    "backup could not be restored."))
            time.sleep(PS_POLL_INTERVAL)
    _log.info("ps task(s) %s answer again.", ", ".join(map(str, ps_tasks)))
    from kerasps.runtime.coordinator import ClusterCoordinator

    _tf.reconnect_cluster(ClusterCoordinator(model.distribute_strategy)._tf_coordinator)
    restart_training_input(model)
    renewed = [v for v in _state_variables(model) if _ps_task(v) in ps_tasks]
    for variable in renewed:
        _tf.renew_variable(variable)
        if changes_lib.changes_of(variable) is not None:  # its changed-row flags, lost too
            changes_lib.track(variable, renew=True)
    for layer in model._flatten_layers():
        # Other resources on those tasks (a dynamic table's maps and locks).
        renew = getattr(layer, "_kerasps_renew_resources", None)
        if renew is not None:
            renew(ps_tasks)
    progress = backup.restore(model)
    model.reset_metrics()
    restored = {id(v) for v in [*model.weights, *model.metrics_variables,
                                *_optimizer_variables(model)]}
    others = [v for v in renewed if id(v) not in restored]
    for variable in others:  # e.g. random seed states, which backups do not hold
        variable.assign(tf.zeros(variable.shape, variable.dtype))
    if others:
        _log.warning("Not in the backup, set to zeros: %s",
                        ", ".join(v.path for v in others))
    forget_step_functions(model)
    # Every variable is the backup's now, on the surviving tasks too: what was published
    # since is newer (`kerasps.callbacks.PublishDeltas` publishes a full version next).
    object.__setattr__(model, _RESTORES, restores(model) + 1)
    return progress


def restores(model) -> int:
    """How many times a backup was restored into `model` after a lost ps task."""
    return getattr(model, _RESTORES, 0)
