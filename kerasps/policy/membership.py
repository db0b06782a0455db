"""The elastic worker pool: which declared workers are running, and when to give up.

A parameter-server job declares `max_workers` worker addresses (in
`TF_CONFIG`, or by `kerasps launch --workers MIN:MAX`); any of them may be
absent while the job runs. TensorFlow's coordinator already treats an
absent worker like a failed one (its functions run elsewhere, it is used
again when it answers); this module decides what the job makes of the pool:

* `Membership.observe(alive)` turns the set of workers that answer into
  `Change`s (joined, left) for the logs;
* below `min_workers` the job holds training, and `Membership.check` raises
  `TooFewWorkersError` once it has been below for `timeout` seconds.

Pure Python (no TensorFlow): `kerasps.keras.trainer.elastic` polls the real
cluster with it, and `simulator` can replay the same decisions.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from kerasps.policy._validation import positive_int

__all__ = ["PoolSpec", "WorkerState", "Change", "Membership", "TooFewWorkersError",
           "parse_workers"]


class TooFewWorkersError(RuntimeError):
    """Fewer than `min_workers` workers answered for longer than the timeout."""


class WorkerState(enum.StrEnum):
    RUNNING = "running"  # answers: takes steps
    ABSENT = "absent"  # declared, does not answer (not started, left, or failed)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """The pool's bounds.

    Attributes:
        max_workers: declared worker addresses (tasks `0 .. max_workers - 1`).
        min_workers: fewer running workers hold training.
        timeout: seconds below `min_workers` before the job fails.
    """

    max_workers: int
    min_workers: int = 1
    timeout: float = 600.0

    def __post_init__(self):
        positive_int("max_workers", self.max_workers)
        positive_int("min_workers", self.min_workers)
        if self.min_workers > self.max_workers:
            raise ValueError(
                "Invalid value for argument `min_workers`: it must be at most the number "
                f"of declared workers ({self.max_workers}). "
                f"Received: min_workers={self.min_workers}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or (
                not self.timeout > 0 or math.isnan(self.timeout)):
            raise ValueError("Invalid value for argument `min_workers_timeout`: it must be a "
                             f"number of seconds > 0. Received: timeout={self.timeout!r}")


def parse_workers(text) -> tuple[int, int]:
    """`(min, max)` from `"N"` (a fixed pool: `(N, N)`) or `"MIN:MAX"`."""
    value = str(text).strip()
    parts = value.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(parts) not in (1, 2) or len(numbers) != len(parts) or min(numbers) < 1:
        raise ValueError("Invalid value for argument `workers`: expected a count N or a range "
                         f"MIN:MAX of positive integers. Received: workers={text!r}")
    low, high = (numbers[0], numbers[0]) if len(numbers) == 1 else numbers
    if low > high:
        raise ValueError(f"Invalid value for argument `workers`: MIN ({low}) is greater than "
                         f"MAX ({high}). Received: workers={text!r}")
    return low, high


@dataclasses.dataclass(frozen=True)
class Change:
    """Worker `worker` started answering (`RUNNING`) or stopped (`ABSENT`)."""

    worker: int
    state: WorkerState
    running: int
    max_workers: int
    time: float

    def __str__(self):
        verb = "joined" if self.state is WorkerState.RUNNING else "left"
        return (f"worker {self.worker} {verb}: {self.running} of {self.max_workers} workers "
                "running")


class Membership:
    """What the job knows of its pool, updated by `observe`.

    Args:
        spec: the pool's bounds.
        now: the time the job starts (every declared worker answered then:
            TensorFlow's coordinator connects to each one).
    """

    def __init__(self, spec: PoolSpec, now: float = 0.0):
        self.spec = spec
        self.running = frozenset(range(spec.max_workers))
        self.changes: list[Change] = []
        self._below_since = None

    def observe(self, alive, now: float) -> list[Change]:
        """Records which workers answer now; returns the changes since the last call."""
        alive = frozenset(int(i) for i in alive if 0 <= int(i) < self.spec.max_workers)
        changes = [Change(i, WorkerState.RUNNING if i in alive else WorkerState.ABSENT,
                          len(alive), self.spec.max_workers, now)
                   for i in sorted(alive ^ self.running)]
        self.running = alive
        self.changes.extend(changes)
        if self.has_quorum:
            self._below_since = None
        elif self._below_since is None:
            self._below_since = now
        return changes

    @property
    def has_quorum(self) -> bool:
        """True while at least `min_workers` workers run."""
        return len(self.running) >= self.spec.min_workers

    def check(self, now: float):
        """Raises `TooFewWorkersError` once the pool has been below `min_workers` for
        longer than the timeout."""
        if self._below_since is not None and now - self._below_since > self.spec.timeout:
            absent = sorted(set(range(self.spec.max_workers)) - self.running)
            raise TooFewWorkersError(
                f"Only {len(self.running)} of {self.spec.max_workers} workers have answered for "
                f"{now - self._below_since:.0f}s, fewer than min_workers="
                f"{self.spec.min_workers} (workers not answering: {absent}); gave up after "
                f"min_workers_timeout={self.spec.timeout:g}s.")
