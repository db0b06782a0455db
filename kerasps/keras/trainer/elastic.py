"""Watching the worker pool during `fit`: membership changes, and holding below `min_workers`.

A thread polls every declared worker (`kerasps.backend._tf.task_alive`: a TCP connection
to its port, which never touches the eager context that TensorFlow's failure
handler reconnects meanwhile) and feeds `kerasps.membership.Membership`; `fit` logs each change
("worker 2 joined: 3 of 4 workers running"), records the running count per
epoch in the History (`workers`), and before scheduling a step waits while
fewer than the strategy's `min_workers` run, failing with
`kerasps.membership.TooFewWorkersError` after `min_workers_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from kerasps.policy.membership import Membership

_log = logging.getLogger("kerasps")

POLL_INTERVAL = 0.5  # seconds between two polls of the pool


class Watcher:
    """Polls the pool of a coordinator's workers in a thread while it is `running()`."""

    def __init__(self, coordinator, spec):
        self._coordinator = coordinator
        self.membership = Membership(spec, time.monotonic())
        self._condition = threading.Condition()
        self._stop = threading.Event()
        self._thread = None

    @contextlib.contextmanager
    def running(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="kerasps-membership",
                                        daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def _poll(self):
        while not self._stop.is_set():
            alive = self._coordinator.running_workers()
            with self._condition:
                changes = self.membership.observe(alive, time.monotonic())
                self._condition.notify_all()
            for change in changes:
                _log.warning("%s", change)
            self._stop.wait(POLL_INTERVAL)

    @property
    def running_workers(self) -> int:
        return len(self.membership.running)

    def wait_for_quorum(self):
        """Returns once at least `min_workers` workers run; raises `TooFewWorkersError`
        after the pool's timeout below it."""
        with self._condition:
            if self.membership.has_quorum:
                return
            spec = self.membership.spec
            _log.warning("Holding training: %d of the %d workers needed (min_workers) are "
                         "running; waiting up to %gs for more.", self.running_workers,
                         spec.min_workers, spec.timeout)
            while not self.membership.has_quorum:
                self.membership.check(time.monotonic())
                self._condition.wait(POLL_INTERVAL)
        _log.warning("Resuming training: %d workers running.", self.running_workers)


def watcher(coordinator) -> Watcher:
    """The coordinator's watcher, made once with its strategy's pool bounds."""
    existing = getattr(coordinator, "_kerasps_watcher", None)
    if existing is None:
        existing = Watcher(coordinator, coordinator.strategy.pool)
        coordinator._kerasps_watcher = existing
    return existing
