"""Scheduling step functions on the workers and delivering their results in order."""

from __future__ import annotations

import collections

from kerasps import _keras, _tf

# Scheduled functions kept in flight per worker: one running, one queued.
STEPS_IN_FLIGHT_PER_WORKER = 2


class Window:
    """Schedules functions with a bounded number in flight; delivers results in order."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.capacity = STEPS_IN_FLIGHT_PER_WORKER * coordinator.num_workers
        self.pending = collections.deque()

    def schedule(self, function, args, tag):
        self.pending.append((tag, self.coordinator.schedule(function, args=args)))

    def ready(self):
        """Yields `(tag, result)` for results that arrived, oldest first, blocking
        on the oldest while the window is full."""
        while self.pending and (len(self.pending) >= self.capacity
                                or _tf.remote_value_ready(self.pending[0][1])):
            tag, remote = self.pending.popleft()
            yield tag, remote.fetch()

    def drain(self):
        """Waits for everything scheduled; yields the remaining results in order."""
        self.coordinator.join()
        while self.pending:
            tag, remote = self.pending.popleft()
            yield tag, remote.fetch()

    def abandon(self):
        """After an error: wait for every function still running, drop the results.

        `join` raises the first error without waiting; functions still running
        may fail after it (a lost ps fails every one), and each such error
        would otherwise come out of the next `schedule`.
        """
        self.pending.clear()
        for _ in range(self.capacity + 1):
            try:
                self.coordinator.join()
                return
            except Exception:  # noqa: BLE001 - the first error is already being raised
                continue


def to_logs(values):
    return _keras.pythonify_logs(values) if isinstance(values, dict) else values
