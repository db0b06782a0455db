"""Scheduling step functions on the workers and delivering their results in order."""

from __future__ import annotations

import collections
import logging
import time

import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.runtime import launch_env

# Scheduled functions kept in flight per worker: one running, one queued.
STEPS_IN_FLIGHT_PER_WORKER = 2
# Seconds without any scheduled function finishing after which the window says what it
# waits for (and again after as many more), until the strategy's `step_timeout`.
STALL_REPORT_S = 30.0

_log = logging.getLogger("kerasps")


class Window:
    """Schedules functions with a bounded number unfinished; delivers results in order.

    At most `capacity` scheduled functions are unfinished (running or queued)
    at a time. Results are delivered in scheduling order, so a function held
    up on a failed worker (TensorFlow runs it again elsewhere once the failure
    is seen) holds back the delivery of the results after it, but not the
    scheduling of new functions on the workers that are alive.
    """

    # Undelivered results kept behind one unfinished function, per unit of capacity.
    BACKLOG_PER_SLOT = 64

    def __init__(self, coordinator, bound=None, steps=1):
        self.coordinator = coordinator
        self.capacity = STEPS_IN_FLIGHT_PER_WORKER * coordinator.num_workers
        self.pending = collections.deque()
        # A `kerasps.consistency.StalenessBound` (its tokens: the remote values of the
        # functions it counts), and the steps of the next function.
        self.bound, self.steps = bound, steps
        self.timeout = coordinator.strategy.step_timeout
        self._stalled_since = None  # start of the current wait with no function finishing
        self._reported = 0  # stall reports since then

    def schedule(self, function, args, tag, steps=1, worker=None):
        """Schedules `function(*args)` (on worker `worker` if given, as
        `ClusterCoordinator.schedule_on` does); `tag` comes back with its result."""
        remote = (self.coordinator.schedule(function, args=args) if worker is None
                  else self.coordinator.schedule_on(worker, function, args))
        self.pending.append((tag, remote))
        if self.bound is not None:
            self._unfinished()  # forget the functions that finished
            self.bound.scheduled(remote, steps)

    def _unfinished(self):
        if self.bound is not None:
            for remote in self.bound.running():
                if _tf.remote_value_ready(remote):
                    self.bound.finished(remote)
        return [remote for _, remote in self.pending if not _tf.remote_value_ready(remote)]

    def _admits(self):
        return self.bound is None or self.bound.admits(self.steps)

    def ready(self):
        """Yields `(tag, result)` for the results that arrived, oldest first; returns
        once fewer than `capacity` functions are unfinished."""
        while self.pending:
            if _tf.remote_value_ready(self.pending[0][1]):
                tag, remote = self.pending.popleft()
                yield tag, remote.fetch()
                continue
            unfinished = self._unfinished()
            if len(unfinished) < self.capacity and self._admits() and (
                    len(self.pending) < self.BACKLOG_PER_SLOT * self.capacity):
                self._stalled_since = None
                return
            # Full: wait for any unfinished function to finish (the oldest may be
            # stuck on a failed worker while the others go on).
            self._wait(unfinished)

    def _wait(self, unfinished):
        """Waits up to a second for any of `unfinished` to finish.

        A wait with no function finishing is reported every `STALL_REPORT_S`
        seconds (how many wait, which workers do not answer) and ends with a
        `TimeoutError` after the strategy's `step_timeout`: no `fit`, `evaluate`
        or `predict` waits without a word, or for ever.
        """
        if self._stalled_since is None:
            self._stalled_since, self._reported = time.monotonic(), 0
        count = len(unfinished)
        _tf.wait_for_any(unfinished, timeout=1.0)
        if len(self._unfinished()) < count:
            self._stalled_since = None
            return
        waited = time.monotonic() - self._stalled_since
        if waited < STALL_REPORT_S * (self._reported + 1) and waited < self.timeout:
            return
        self._reported += 1
        workers = self.coordinator.silent_workers()
        if waited >= self.timeout:
            raise TimeoutError(
                f"No scheduled function has finished for {waited:.0f} s (`step_timeout` of "
                f"the strategy); {count} still wait to run or finish. Workers that do not "
                f"answer: {workers}.")
        _log.warning("No scheduled function has finished for %.0f s; %d still wait to run "
                     "or finish (workers that do not answer: %s). Giving up after %g s "
                     "(`step_timeout` of the strategy).", waited, count, workers, self.timeout)

    def drain(self):
        """Waits for everything scheduled; yields the remaining results in order."""
        self._stalled_since = None
        while unfinished := self._unfinished():
            self._wait(unfinished)
        self.coordinator.join()  # raises the first error
        while self.pending:
            tag, remote = self.pending.popleft()
            yield tag, remote.fetch()

    def abandon(self, timeout: float = 600.0):
        """After an error: wait for every function still running, drop the results.

        `join` raises the first error without waiting; functions still running
        may fail after it (a lost ps fails every one), and each such error
        would otherwise come out of the next `schedule`. Joins until one
        returns cleanly (or `timeout` seconds pass).
        """
        self.pending.clear()
        if launch_env.job_failed():  # a task is gone for good: nothing to wait for
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.coordinator.join()
                return
            except (tf.errors.OpError, *_tf.CLOSURE_ERRORS):
                continue  # another function's error; anything else (a signal) goes up


# The hooks that receive a batch's logs, by phase.
_BATCH_LOG_HOOKS = {"train": ("on_train_batch_end", "on_batch_end"),
                    "test": ("on_test_batch_end",)}


def reads_batch_logs(callbacks, phase="train") -> bool:
    """True if a callback may read the logs of a `phase` batch (`"train"`: of
    `on_train_batch_end`, `"test"`: of `on_test_batch_end`).

    Keras marks the no-op hooks of `keras.callbacks.Callback` with
    `_is_default`; a callback overriding `on_train_batch_end` or its alias
    `on_batch_end` (the progress bar does), or `on_test_batch_end`, reads them,
    except the progress bar of a `fit` for test batches (Keras' shows the validation's
    logs at the epoch's end only). A `CallbackList` subclass may do anything, so it
    counts as reading them.
    """
    if type(callbacks) is not _keras.CallbackList:
        return True
    return any(not getattr(getattr(callback, hook), "_is_default", False)
               for callback in callbacks.callbacks
               if not (phase == "test" and _keras.is_progress_bar_of_a_fit(callback))
               for hook in _BATCH_LOG_HOOKS[phase])


def to_logs(values):
    return _keras.pythonify_logs(values) if isinstance(values, dict) else values
