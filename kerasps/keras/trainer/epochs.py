"""The ways `fit` runs the steps of an epoch, one class each, behind one interface.

`training.fit` writes the epoch loop once (callbacks, backups, recovery from
a lost ps task, a repeated input that ended) and hands the steps of each
epoch to one of these:

* `AsyncEpochs`: repeated input, each scheduled function applying its own
  gradients (`mode="async"`), `steps_per_execution` steps per function.
* `SyncEpochs`: repeated input, global steps whose gradients are averaged
  over the first workers to finish (`mode="sync"`, `sync.SyncSteps`); in
  `mode="hybrid"` the embedding tables' row updates are applied as they
  arrive and only the dense gradients wait for the global step.
* `ExactlyOnceEpochs`: one pass over a tf.data service job per epoch
  (`kerasps.InputOptions(exactly_once=True)`), until every worker found its
  end.

The loop calls `begin(epoch, step)` once per epoch, `run()` for each attempt
at it (after a recovery, `restart(step)` first), and `abandon()` after an
error. While a method runs, `done` counts the epoch's steps whose results
reached the callbacks and `scheduled` those sent to workers; `logs` are the
latest step's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import staleness
from kerasps.keras.trainer.dispatch import Window, to_logs
from kerasps.keras.trainer.steps import (
    make_train_function,
    make_train_to_end_function,
    prepare,
    step_functions,
    train_arguments,
    unpack,
)
from kerasps.keras.trainer.sync import SyncSteps
from kerasps.policy.consistency import StalenessBound

# Where the step's logs are the metrics' results (Keras' `train_step`), the logs
# `on_train_batch_end` receives are the epoch's logs so far, read from the metrics on
# the ps tasks at most once per this many seconds, not returned by every step: a
# progress bar or a batch callback costs a read a few times a second, not a copy of
# every function's result to the coordinator (which also keeps a few kilobytes on
# the worker for each read, for good: TensorFlow caches the copy's send kernel).
BATCH_LOGS_INTERVAL_S = 0.25


@dataclasses.dataclass(frozen=True)
class FitCall:
    """What every way of running an epoch reads, fixed for one `fit` call.

    Attributes:
        model: the Keras model.
        coordinator: its `kerasps.ClusterCoordinator`.
        per_worker: the training input (`inputs.per_worker_dataset`).
        callbacks: the call's `CallbackList`.
        pool: the worker pool's watcher (`elastic.watcher`).
        steps_per_epoch: steps per epoch; `None` for exactly-once input
            without `steps_per_epoch` (an epoch is one pass over the data).
        batch_logs: whether a callback reads the logs of each batch.
    """

    model: Any
    coordinator: Any
    per_worker: Any
    callbacks: Any
    pool: Any
    steps_per_epoch: int | None
    batch_logs: bool


class Epochs:
    """Runs the steps of `fit`'s epochs one way; see the module's docstring.

    Subclasses write `_steps()` (schedule the attempt's steps and deliver
    their results as they arrive) and may extend `_drain()` and `restart()`.
    """

    # Whether the epoch logs are the step's logs, which may hold more than the metrics
    # (a custom `train_step`), or the metrics' results read on the ps tasks.
    custom_logs = True

    def __init__(self, call: FitCall):
        self.call = call
        self.model = call.model
        self.spe = self.model.steps_per_execution
        self.logs = {}
        self.epoch = self.done = self.scheduled = self.dropped = 0
        self.window = None
        self._read_at = None  # when `_batch_logs` last read the metrics
        self.first = True  # no function of this attempt was scheduled yet
        strategy = self.model.distribute_strategy
        self.sync = strategy.consistency.sync
        self.hidden = staleness.meaningless(self.sync, strategy.num_workers,
                                            strategy.consistency.hybrid,
                                            strategy.backup_workers)

    def begin(self, epoch: int, step: int):
        """Starts epoch `epoch` at its step `step` (a resumed `fit` starts mid-epoch)."""
        self.epoch, self.dropped = epoch, 0
        self._read_at = None  # the metrics were reset: read them for the first batch
        self.restart(step)

    def restart(self, step: int):
        """Starts an attempt at the current epoch from its step `step`."""
        self.scheduled = self.done = step
        self.first = True
        bound = self.model.distribute_strategy.consistency.max_staleness
        self.window = Window(self.call.coordinator, steps=self.spe,
                             bound=None if bound is None else StalenessBound(bound))

    def run(self) -> dict:
        """Runs the epoch's remaining steps; returns its logs for `on_epoch_end`."""
        self._steps()
        self._drain()
        if self.custom_logs:
            logs = dict(_keras.metrics_result_or_logs(
                self.model, staleness.without_counts(self.logs)))
            logs.update(staleness.epoch_logs(self.model, step_functions(self.model),
                                             self.dropped))
            return logs
        return self._logs_so_far()

    def _logs_so_far(self) -> dict:
        """The epoch's logs as they stand: its metrics' results read on the ps tasks."""
        logs = dict(self.model.get_metrics_result())
        logs.update(staleness.epoch_logs(self.model, step_functions(self.model),
                                         self.dropped))
        return logs

    def _batch_logs(self) -> dict:
        """The logs for `on_train_batch_end`: the latest step's, or (where they are the
        metrics' results) the epoch's so far, read again once `BATCH_LOGS_INTERVAL_S`
        have passed since the last read: at most that old, with the steps that ran
        meanwhile (some of them after the batch reported) not in them yet."""
        if self.custom_logs:
            return self.logs
        now = time.monotonic()
        if self._read_at is None or now - self._read_at >= BATCH_LOGS_INTERVAL_S:
            self._read_at, self.logs = now, _keras.pythonify_logs(self._logs_so_far())
        return self.logs

    def abandon(self):
        """After an error: waits for the functions still running and drops their results."""
        self.window.abandon()

    def input_ended(self):
        """A repeated input reported its end (a pipeline rebuilt after a restart):
        rebuilds every worker's input pipeline."""
        raise NotImplementedError

    def _more(self) -> bool:
        return self.scheduled < self.call.steps_per_epoch and not self.model.stop_training

    def _steps(self):
        raise NotImplementedError

    def _drain(self):
        self.deliver(self.window.drain())

    def deliver(self, results):
        """Takes in `(last step, result)` pairs in step order: the logs, the count of
        steps done, and `on_train_batch_end` where a callback reads batch logs."""
        for end, result in results:
            self.done = end + 1
            if result is not None:
                logs = to_logs(unpack(self.model, result))
                if isinstance(logs, dict):
                    logs = {k: v for k, v in logs.items() if k not in self.hidden}
                    if staleness.DROPPED not in self.hidden:
                        logs[staleness.DROPPED] = self.dropped
                self.logs = logs
            if self.call.batch_logs:
                self.call.callbacks.on_train_batch_end(end, self._batch_logs())

    def _before_steps(self, step: int):
        """Holds until enough workers run, then calls `on_train_batch_begin(step)`."""
        self.call.pool.wait_for_quorum()
        self.call.callbacks.on_train_batch_begin(step)


class _RepeatedInput(Epochs):
    """Epochs of `steps_per_epoch` steps over each worker's repeated input, read
    through one persistent iterator per worker across epochs and `fit` calls."""

    def __init__(self, call: FitCall):
        super().__init__(call)
        self.iterator = call.per_worker.persistent_iterator()

    def input_ended(self):
        self.iterator = self.call.per_worker.renew_persistent_iterator()


class AsyncEpochs(_RepeatedInput):
    """Asynchronous steps: each scheduled function runs `steps_per_execution` steps
    on whichever worker is free and applies its gradients itself."""

    def __init__(self, call: FitCall):
        super().__init__(call)
        # Functions return logs only where the step's logs are not the metrics' results
        # (a custom `train_step`): at an epoch's ends, and at every step if a callback
        # reads batch logs (otherwise `_batch_logs` reads the metrics). `prepare` also
        # sends the steady-state function to the workers.
        self.custom_logs = not prepare(call.coordinator, self.model, self.iterator)

    def _steps(self):
        steps_per_epoch = self.call.steps_per_epoch
        while self._more():
            n = min(self.spe, steps_per_epoch - self.scheduled)
            self._before_steps(self.scheduled)
            with_logs = self.custom_logs and (
                self.call.batch_logs or self.first or self.scheduled + n == steps_per_epoch)
            self.window.schedule(make_train_function(self.model, with_logs),
                                 train_arguments(self.model, self.iterator, n),
                                 self.scheduled + n - 1, steps=n)
            self.scheduled, self.first = self.scheduled + n, False
            self.deliver(self.window.ready())


class SyncEpochs(_RepeatedInput):
    """Synchronous global steps, one at a time (`sync.SyncSteps`): every worker
    computes a gradient, the first `num_workers - backup_workers` are averaged
    and applied once, the others dropped (counted in `dropped`)."""

    logs_checked = False  # whether the first step's logs told `custom_logs`

    def restart(self, step: int):
        super().restart(step)
        self.synchronous = SyncSteps.of_model(self.model, self.call.coordinator)

    def _steps(self):
        steps_per_epoch = self.call.steps_per_epoch
        while self._more():
            self._before_steps(self.scheduled)
            # Logs from the first step (which tells whether they are the metrics'
            # results) and the last; from every step only where a callback reads batch
            # logs and they are not the metrics' (otherwise `_batch_logs` reads those).
            with_logs = self.first or self.scheduled + 1 == steps_per_epoch or (
                self.call.batch_logs and self.custom_logs)
            results, lost = self.synchronous.run(
                (self.iterator,), self.epoch * steps_per_epoch + self.scheduled, with_logs)
            self.dropped += lost
            self.scheduled, self.first = self.scheduled + 1, False
            if self.logs_checked is False and results[-1] is not None:
                self.logs_checked = True  # once per `fit` call
                self.custom_logs = not _metrics_results(self.model, results[-1])
            self.deliver([(self.scheduled - 1, results[-1])])

    def _drain(self):
        super()._drain()
        self.synchronous.drain()


class ExactlyOnceEpochs(Epochs):
    """One pass over the data per epoch, through a new tf.data service job that every
    worker reads from, until each worker found its end (or no longer answers).

    Plain steps run until one finds the end of the data (TensorFlow then cancels
    the queued ones, which had read nothing); each worker then trains on the
    batches its reader still holds, one step at a time. With
    `steps_per_execution > 1` the scheduled functions count the steps they ran.
    """

    def begin(self, epoch: int, step: int):
        self.iterator, self.ended = iter(self.call.per_worker), set()  # a new pass
        self.fresh = True
        super().begin(epoch, step)

    def restart(self, step: int):
        """After an error (a lost ps task): every worker's reader joins the epoch's job
        again. A function that failed or was cancelled while its `next` waited for an
        element ended its worker's reader for good (`per_worker.restart_persistent_iterators`
        says why), which would end the epoch early, the data nobody read left unread;
        the new readers read on from the job, losing what the old ones had fetched. A
        worker whose reader had found the end finds it again."""
        if not self.fresh:
            _tf.rebuild_per_worker_resources(self.call.coordinator._tf_coordinator,
                                             self.iterator)
            self.ended = set()
        self.fresh = False
        super().restart(step)

    def _more(self) -> bool:
        steps_per_epoch = self.call.steps_per_epoch
        return not self.model.stop_training and not (
            steps_per_epoch is not None and self.scheduled >= steps_per_epoch) and not (
                _everyone_ended(self.ended, self.call.pool.membership))

    def _steps(self):
        steps_per_epoch = self.call.steps_per_epoch
        while self._more():
            n = self.spe if steps_per_epoch is None else min(
                self.spe, steps_per_epoch - self.scheduled)
            self._before_steps(self.done)
            if n == 1 and not self.ended:
                # Plain steps until the data ends (a step inside a `tf.cond` costs a
                # function call on every ps task), then each worker trains on what its
                # reader still holds.
                try:
                    self.window.schedule(
                        make_train_function(self.model, self.call.batch_logs or self.first),
                        train_arguments(self.model, self.iterator, 1), None)
                    self.scheduled, self.first = self.scheduled + 1, False
                    self._deliver_counted(self.window.ready())
                except tf.errors.OutOfRangeError:
                    self._deliver_counted(_results_so_far(self.window))
                    self._train_what_readers_hold()
                continue
            self.window.schedule(
                make_train_to_end_function(self.model, self.call.batch_logs or self.first),
                (self.iterator, n), n, steps=n)
            self.scheduled, self.first = self.scheduled + n, False
            self._deliver_counted(self.window.ready())

    def _drain(self):
        self._deliver_counted(self.window.drain())
        self.scheduled = self.done
        if not self.logs:  # no function returning logs ran a step: short data
            self.logs = self.model.get_metrics_result()

    def _deliver_counted(self, results):
        """`deliver` for results tagged None (one plain step's) or with the steps asked
        for (a function that returns how many steps it ran and which worker's input
        ended)."""
        for requested, outputs in results:
            if requested is None:
                self.deliver([(self.done, outputs)])
                continue
            count, worker, *result = outputs
            count, result = int(count), (result[0] if result else None)
            if count < requested:
                self.ended.add(int(worker))
            if count:
                self.deliver([(self.done + count - 1, result)])

    def _train_what_readers_hold(self):
        """After the data ended on a worker: each worker trains on the batches its reader
        still holds, until it finds the end too (or no longer answers)."""
        coordinator = self.call.coordinator
        for worker in range(coordinator.num_workers):
            while worker not in self.ended:
                if not _tf.task_alive("worker", worker):
                    self.ended.add(worker)
                    break
                remote = coordinator.schedule_on(
                    worker, make_train_to_end_function(self.model, with_logs=True),
                    (self.iterator, 1))
                self._deliver_counted([(1, remote.fetch())])


def _metrics_results(model, result) -> bool:
    """True if a step's `result` holds its logs and they are the model's metrics' results
    (Keras' `train_step`), the counts aside."""
    logs = unpack(model, result) if result is not None else None
    return isinstance(logs, dict) and (
        set(staleness.without_counts(logs)) == set(model.get_metrics_result()))


def for_call(call: FitCall) -> Epochs:
    """The way `call` runs its epochs."""
    if call.per_worker.exactly_once:
        return ExactlyOnceEpochs(call)
    if call.model.distribute_strategy.consistency.sync:
        return SyncEpochs(call)
    return AsyncEpochs(call)


def _everyone_ended(ended, pool) -> bool:
    """True once every worker's input has ended, or every worker still answering
    (a worker that failed for good holds no data any more), as `pool` last saw them."""
    if not ended:
        return False
    return all(i in ended or i not in pool.running for i in range(pool.spec.max_workers))


def _results_so_far(window):
    """After a function found the end of exactly-once input: the results of those
    that ran their step, in order; the others (input ended, or cancelled with the
    queue) ran none. Clears the coordinator's error."""
    results = []
    for tag, remote in list(window.pending):
        try:
            results.append((tag, remote.fetch()))
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError, *_tf.CLOSURE_ERRORS):
            pass
    window.abandon()
    return results
