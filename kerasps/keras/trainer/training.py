"""`model.fit` under a kerasps strategy."""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np
import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import elastic, recovery, staleness
from kerasps.keras.trainer import epochs as epochs_module
from kerasps.keras.trainer.checks import build, check_model
from kerasps.keras.trainer.dispatch import reads_batch_logs
from kerasps.keras.trainer.evaluation import Evaluation
from kerasps.keras.trainer.inputs import (
    is_array_like,
    make_source,
    per_worker_dataset,
    total_batches,
)
from kerasps.keras.trainer.steps import step_functions
from kerasps.policy._validation import positive_int
from kerasps.policy.failures import Progress

_log = logging.getLogger("kerasps")


def iterations_of(model):
    optimizer = model.optimizer
    return None if optimizer is None or not optimizer.built else int(optimizer.iterations.numpy())


def _record(history, key, value, usual):
    """Appends an epoch's `value` to `history.history[key]` once one epoch's differs
    from `usual`: a count that never left its usual value is not there. The epochs of
    the call before the first unusual one count `usual`."""
    if history is None:
        return
    if key not in history.history:
        if value == usual:
            return
        history.history[key] = [usual] * len(getattr(history, "epoch", ()))
    history.history[key].append(value)


def _record_epoch_counts(model, history, epoch, iterations_before, steps, rerun, pool):
    """Reports in the History what departed from a plain run in an epoch: the steps
    that ran twice, those run again after restoring a backup, the workers running.

    Scheduled functions run at least once: one whose worker failed before its
    result reached the coordinator runs again elsewhere, and the steps it had
    already applied count twice in `optimizer.iterations` (a counter on the ps
    that every applied step increments). `history.history["reexecuted_steps"]`
    holds one count per epoch once a step ran twice;
    `history.history["rolled_back_steps"]` the steps run again after a lost ps
    task's state was restored from a backup, once that happened;
    `history.history["workers"]` the workers running at each epoch's end, once one
    of the declared workers was missing there.

    Returns the counter's value read: the next epoch counts from it, so that a step a
    cut-off worker applies between two epochs counts in the next one.
    """
    after = iterations_of(model)
    count = 0 if iterations_before is None or after is None else max(
        0, after - iterations_before - steps)
    _record(history, "reexecuted_steps", count, 0)
    _record(history, "rolled_back_steps", rerun, 0)
    _record(history, "workers", pool.running_workers, pool.membership.spec.max_workers)
    if count:
        _log.warning("Epoch %d: %d step(s) ran twice: a worker failed before its results "
                     "reached the coordinator (training is at-least-once).", epoch + 1, count)
    return after


def _known(total):
    return total if total is not None and total > 0 else None


def _repeated_input_advice(source) -> str:
    """What a `fit` call whose input `source` is read exactly once can change so that
    each worker reads its input repeated instead, in the form of its `x`."""
    if source.once_by_default:  # arrays or a finite dataset, without `steps_per_epoch`
        return ("give `steps_per_epoch`: each worker then reads its shard of the data, "
                "repeated")
    if source.creator is not None:
        return ("make the `kerasps.DatasetCreator` with "
                "`input_options=kerasps.InputOptions(exactly_once=False)` and give "
                "`steps_per_epoch`")
    return ("pass the dataset itself, or distributed with "
            "`kerasps.InputOptions(exactly_once=False)`, and give `steps_per_epoch`")


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`model.fit` under a kerasps strategy; arguments as in `keras.Model.fit`."""
    check_model(model, "fit")
    from kerasps.runtime.coordinator import ClusterCoordinator

    if x is None:
        raise ValueError("Invalid value for argument `x`: training data is required. "
                         "Received: x=None")
    if validation_split:
        raise ValueError(
            "Invalid value for argument `validation_split`: it is not supported under a "
            "kerasps strategy; pass `validation_data` instead. Received: "
            f"validation_split={validation_split!r}")
    if class_weight is not None:
        raise ValueError(
            "Invalid value for argument `class_weight`: it is not supported under a "
            "kerasps strategy; weight samples in the dataset instead. Received: "
            f"class_weight={class_weight!r}")
    epochs = positive_int("epochs", epochs)
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, (int, np.integer)) or (
            initial_epoch < 0):
        raise ValueError("Invalid value for argument `initial_epoch`: it must be an integer "
                         f">= 0. Received: initial_epoch={initial_epoch!r}")
    steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch, allow_none=True)
    validation_steps = positive_int("validation_steps", validation_steps, allow_none=True)
    validation_freq = positive_int("validation_freq", validation_freq)

    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = make_source(x, y, sample_weight, batch_size, shuffle, training=True,
                         strategy=coordinator.strategy, steps=steps_per_epoch)
    if source.exactly_once and model.distribute_strategy.consistency.sync:
        raise ValueError(
            "Invalid value for argument `x`: exactly-once input (a tf.data service job "
            "per epoch) is not supported with `mode='sync'` or `mode='hybrid'` yet; "
            f"{_repeated_input_advice(source)}. Received: x={type(x).__name__} read "
            "exactly once")
    per_worker = per_worker_dataset(coordinator, source, "train")
    to_end = per_worker.exactly_once  # an epoch is one pass over the data
    if steps_per_epoch is None and not to_end:
        total = total_batches(source, coordinator)
        if total is None or total == tf.data.INFINITE_CARDINALITY or total == 0:
            kind = {None: "of unknown size", tf.data.INFINITE_CARDINALITY: "infinite",
                    0: "empty"}[total]
            raise ValueError(
                "Invalid value for argument `steps_per_epoch`: it is required when the "
                f"training dataset is {kind} (an epoch is `steps_per_epoch` steps over all "
                "workers). Received: steps_per_epoch=None")
        steps_per_epoch = total

    build(model, per_worker)
    validation = None
    if validation_data is not None:
        val_x, val_y, val_sw = _keras.unpack_x_y_sample_weight(validation_data) if (
            isinstance(validation_data, (list, tuple))) else (validation_data, None, None)
        validation = Evaluation(model, coordinator, make_source(
            val_x, val_y, val_sw, validation_batch_size or (batch_size if is_array_like(val_x)
                                                             else None),
            shuffle=False, training=False, strategy=coordinator.strategy,
            arg="validation_data"), validation_steps,
            steps_argument="validation_steps")

    if not isinstance(callbacks, _keras.CallbackList):
        callbacks = _keras.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch or _known(source.total_batches), model=model)

    consistency = model.distribute_strategy.consistency
    if consistency.sync and model.steps_per_execution > 1:
        warnings.warn(
            f"`steps_per_execution={model.steps_per_execution}` is not used in synchronous "
            "mode: every global step waits for the workers' gradients, one step at a time.",
            stacklevel=2)
    call = epochs_module.FitCall(model, coordinator, per_worker, callbacks,
                                 elastic.watcher(coordinator), steps_per_epoch,
                                 reads_batch_logs(callbacks))
    runner = epochs_module.for_call(call)
    per_worker.reading = not to_end
    model.stop_training = False
    callbacks.on_train_begin()
    training_logs = _EpochLoop(call, runner, recovery.Backup.of(callbacks), validation,
                               validation_freq).run(model._initial_epoch or initial_epoch,
                                                    epochs)
    per_worker.reading = False
    if model.optimizer is not None and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history


class _EpochLoop:
    """The epochs of one `fit` call: callbacks, backups, recovery from a lost ps task
    and a repeated input that ended, around the steps `runner` (an
    `epochs.Epochs`) runs.

    Args:
        call: the `epochs.FitCall`.
        runner: the way the call runs its epochs' steps.
        backup: the call's `recovery.Backup`, or `None`.
        validation: an `Evaluation` of the `validation_data`, or `None`.
        validation_freq: as in `keras.Model.fit`.
    """

    def __init__(self, call, runner, backup, validation, validation_freq):
        self.call, self.runner, self.backup = call, runner, backup
        self.model = call.model
        self.validation, self.validation_freq = validation, validation_freq
        self.position = None  # between epochs: where the next one starts
        self.origin = None  # (epoch, optimizer iterations before its first step)
        self.renewed_at = None  # (epoch, step) where the input pipelines were last rebuilt
        self.retried_at, self.retries = None, 0  # (epoch, step) of the last recovery; count

    def run(self, initial_epoch, epochs):
        """Runs epochs `initial_epoch` to `epochs - 1` (from where the latest backup
        says, for a restarted coordinator); returns the last epoch's logs."""
        model, callbacks, backup = self.model, self.call.callbacks, self.backup
        resumed = backup.progress() if backup is not None else None
        if resumed is not None and resumed.epoch >= initial_epoch:
            initial_epoch = resumed.epoch
        self.position = Progress(initial_epoch, resumed.step if (
            resumed is not None and resumed.epoch == initial_epoch) else 0)
        training_logs, counted = None, None
        with backup.recording(self._backed_up) if backup else contextlib.nullcontext(), (
                self.call.pool.running()), _tf.quiet_end_of_input() if (
                    self.call.per_worker.exactly_once) else contextlib.nullcontext():
            if backup is not None:
                backup.save()  # there is always a backup to go back to
            for epoch in range(initial_epoch, epochs):
                model.reset_metrics()
                staleness.reset(model, step_functions(model))
                callbacks.on_epoch_begin(epoch)
                if self.call.coordinator.tracing:
                    self.call.coordinator.set_trace_phase("train", model.steps_per_execution)
                start = self.position.step if self.position.epoch == epoch else 0
                # From the previous epoch's count where the counter went on from there:
                # between two epochs a worker cut off mid-step can still apply its step,
                # after the step ran again elsewhere (a callback may load a lower count).
                iterations_before = applied = iterations_of(model)
                if applied is not None:
                    self.origin = (epoch, applied - start)
                    if counted is not None:
                        iterations_before = min(counted, applied)
                self.runner.begin(epoch, start)
                self.position = None  # the runner's progress from here
                epoch_logs, rerun = self._epoch(epoch, initial_epoch)
                history = _keras.history_of(callbacks)
                counted = _record_epoch_counts(model, history, epoch, iterations_before,
                                               self.runner.scheduled - start, rerun,
                                               self.call.pool)
                self.position = Progress(epoch + 1, 0)
                callbacks.on_epoch_end(epoch, epoch_logs)
                if backup is not None:
                    backup.save_at_epoch_end()
                training_logs = epoch_logs
                if model.stop_training:
                    break
        return training_logs

    def _epoch(self, epoch, initial_epoch):
        """Runs the attempts at epoch `epoch` (its steps, then its validation pass) until
        one completes; returns its logs and the steps run again after restoring a backup."""
        runner, rerun = self.runner, 0
        while True:
            try:
                logs = runner.run()
            except tf.errors.OutOfRangeError:
                runner.abandon()
                done = runner.done
                if epoch == initial_epoch and done == 0 and self.renewed_at is None:
                    # Nothing was read: the input is empty (Keras warns and stops).
                    warnings.warn(
                        "Your input ran out of data; interrupting training. Make sure "
                        "that your dataset can generate at least `steps_per_epoch * "
                        "epochs` batches.", stacklevel=4)
                    self.model.stop_training = True
                    return dict(_keras.metrics_result_or_logs(self.model, runner.logs)), rerun
                # Training input is repeated, so it cannot run out: a pipeline
                # rebuilt after a restart ended. Rebuild them all, once per step.
                if self.renewed_at == (epoch, done):
                    raise RuntimeError(
                        f"A worker's training input ended at epoch {epoch + 1} step "
                        f"{done}, and again after every worker's input pipeline was "
                        "rebuilt, although kerasps repeats training input: the dataset "
                        "yields no elements on a later pass (files removed while "
                        "training?).") from None
                _log.warning("A worker's training input ended at epoch %d step %d although "
                             "it is repeated (after a restart?); rebuilding every worker's "
                             "input pipeline.", epoch + 1, done)
                runner.input_ended()
                self.renewed_at = (epoch, done)
                runner.restart(done)
                continue
            except BaseException as error:
                rerun += self._recover(error, epoch)
                continue
            # The validation pass belongs to the epoch: a ps task lost during it is
            # restored like one lost during the steps, the steps since the backup run
            # again, then the validation pass again.
            try:
                logs.update(self._validation_logs(epoch))
                return logs, rerun
            except BaseException as error:
                rerun += self._recover(error, epoch)

    def _validation_logs(self, epoch) -> dict:
        """The epoch's validation logs (`val_` keys); none where it does not validate."""
        if self.validation is None or not _keras.should_eval(self.model, epoch,
                                                             self.validation_freq):
            return {}
        logs = self.validation.run(callbacks=self.call.callbacks, verbose=0, return_dict=True)
        return {f"val_{k}": v for k, v in logs.items()}

    def _recover(self, error, epoch) -> int:
        """Brings back what a lost ps task held, from the backup (or raises `error`);
        restarts the epoch's attempt at the backup's step; returns the steps that run
        again."""
        runner = self.runner
        runner.abandon()
        done = runner.done
        self.retries = self.retries + 1 if self.retried_at == (epoch, done) else 0
        position = recovery.recover(error, self.model, self.backup, epoch, done,
                                    retried=self.retries, scheduled=runner.scheduled)
        self.retried_at = (epoch, done)
        runner.abandon()  # errors of functions that failed meanwhile
        # The restored counters are the backup's: `iterations_before` still holds, and
        # `position` counts the steps the backup had applied.
        if self.call.per_worker.exactly_once and done > position.step:
            _log.warning(
                "Epoch %d: the %d step(s) rolled back read exactly-once input that is not "
                "read again: this epoch misses their batches.", epoch + 1,
                done - position.step)
        runner.restart(position.step)
        return max(0, done - position.step)

    def _progress(self) -> Progress:
        if self.position is not None:
            return self.position
        return Progress(self.runner.epoch, self.runner.done)

    def _backed_up(self) -> Progress:
        """The progress a backup written now records: with repeated input, the steps
        of the epoch that its weights hold, those applied ahead of the delivered ones
        included (they are not run again after a restore: each kill repeats at most
        the steps applied while the weights are read)."""
        position = self._progress()
        applied = iterations_of(self.model)
        if self.call.per_worker.exactly_once or self.origin is None or (
                self.origin[0] != position.epoch or applied is None):
            return position
        ahead = min(applied - self.origin[1], self.call.steps_per_epoch)
        return Progress(position.epoch, max(position.step, ahead))
