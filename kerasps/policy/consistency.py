"""How updates from several workers combine: async, sync with backup workers, bounded
staleness. Pure Python (no TensorFlow): the policies the trainer follows, testable alone.

* **async** (the default): every worker's gradient is applied when it arrives,
  on whatever version of the variables it was computed from. With `N`
  workers a gradient is on average about `N - 1` updates old.
* **async with `max_staleness=k`** (stale synchronous parallel): the
  coordinator holds back a new step function while it could make a running
  one's gradients more than `k` updates old; fast workers wait for the
  slow one instead of running ahead (`StalenessBound`).
* **sync with `backup_workers=b`**: every global step, the workers compute
  gradients on the same version of the variables (one each); the first
  `N - b` of them are averaged on the ps tasks and applied as one
  update, the rest are dropped and counted (`SyncStep`). Chen et al., 2016,
  "Revisiting Distributed Synchronous SGD"; TF1's `SyncReplicasOptimizer`.
* **hybrid with `backup_workers=b`**: the dense variables train as in sync
  mode, while the row updates of embedding tables are applied as each
  worker's gradient arrives, as in async mode, a late worker's included
  (`updated_on_arrival`). Embedding rows are many and each is touched by few
  examples, so their gradients rarely collide and staleness costs them
  little; the small dense network every example touches gets synchronous
  steps. Lian et al., KDD 2022, "PERSIA".
"""

from __future__ import annotations

import dataclasses
import enum

from kerasps.policy._validation import positive_int

__all__ = ["Mode", "Consistency", "StalenessBound", "SyncStep", "updated_on_arrival",
           "update_on_arrival"]


class Mode(enum.StrEnum):
    """How worker gradients become updates (the simulator's `training.mode` too)."""

    ASYNC = "async"  # every gradient is applied on arrival
    SYNC = "sync"  # a step aggregates the first `count - backup_workers` gradients
    HYBRID = "hybrid"  # dense variables as SYNC, embedding row updates as ASYNC


@dataclasses.dataclass(frozen=True)
class Consistency:
    """The strategy's `mode`, `backup_workers` and `max_staleness`, validated.

    Attributes:
        mode: `Mode.ASYNC`, `Mode.SYNC` or `Mode.HYBRID`.
        backup_workers: sync and hybrid only: gradients a global step does not
            wait for.
        max_staleness: async only: the most updates a gradient may be behind
            when it is applied (`None`: unbounded).
        measure_staleness: whether every step adds its gradient's staleness to a
            counter on a ps task, reported as `staleness` in the logs (one more
            update per step).
    """

    mode: Mode = Mode.ASYNC
    backup_workers: int = 0
    max_staleness: int | None = None
    measure_staleness: bool = True

    @classmethod
    def of(cls, mode, backup_workers, max_staleness, num_workers: int,
           measure_staleness=True) -> Consistency:
        """Validates the strategy's arguments; raises `ValueError` naming the bad one."""
        if not isinstance(measure_staleness, bool):
            raise ValueError(
                "Invalid value for argument `measure_staleness`: expected True or False. "
                f"Received: measure_staleness={measure_staleness!r}")
        try:
            mode = Mode(mode)
        except ValueError:
            raise ValueError(
                "Invalid value for argument `mode`: expected 'async', 'sync' or 'hybrid'. "
                f"Received: mode={mode!r}") from None
        backup_workers = positive_int("backup_workers", backup_workers, minimum=0)
        max_staleness = positive_int("max_staleness", max_staleness, allow_none=True,
                                     minimum=0)
        if backup_workers and mode is Mode.ASYNC:
            raise ValueError(
                "Invalid value for argument `backup_workers`: backup workers drop the "
                "slowest gradients of a synchronous step and need `mode='sync'` or "
                "`mode='hybrid'`. Received: "
                f"backup_workers={backup_workers!r} with mode={mode.value!r}")
        if backup_workers >= num_workers:
            raise ValueError(
                "Invalid value for argument `backup_workers`: it must be less than the "
                f"number of workers ({num_workers}), so that a step waits for at least one "
                f"gradient. Received: backup_workers={backup_workers!r}")
        if max_staleness is not None and mode is not Mode.ASYNC:
            raise ValueError(
                "Invalid value for argument `max_staleness`: it bounds the staleness of "
                "asynchronous steps; synchronous steps apply no stale gradient, and in hybrid "
                "mode a row update is at most the global steps its worker took behind. "
                "Received: "
                f"max_staleness={max_staleness!r} with mode={mode.value!r}")
        return cls(mode, backup_workers, max_staleness, measure_staleness)

    @property
    def sync(self) -> bool:
        """Whether the dense variables train in global steps (sync and hybrid modes)."""
        return self.mode is not Mode.ASYNC

    @property
    def hybrid(self) -> bool:
        return self.mode is Mode.HYBRID


def updated_on_arrival(mode: Mode, row_update: bool, override: bool | None = None) -> bool:
    """Whether a variable's gradient updates it as soon as it arrives (asynchronously)
    rather than in a global step.

    Args:
        mode: the strategy's mode.
        row_update: whether the variable's gradient is a row update (an embedding
            table: `tf.IndexedSlices`, or a shard of a sharded table).
        override: `True` or `False` set for the variable or its layer
            (`kerasps.consistency.update_on_arrival`); `None`: by `row_update`.
    """
    if mode is Mode.ASYNC:
        return True
    if mode is Mode.SYNC:
        return False
    return row_update if override is None else override


class StalenessBound:
    """Admission of step functions so that no applied gradient is more than `k` updates old.

    The staleness of a gradient is the number of updates applied between the
    read of the variables it was computed from and its own update. While a
    function is unfinished, the updates that can land during it are those of
    the functions unfinished when it was scheduled plus those scheduled after
    it: `exposure`. A function of `steps` steps is admitted only if it keeps
    every unfinished function's exposure, and its own, at most `k`. A single
    function is always admitted, so the bound never deadlocks; `k = 0`
    runs one function at a time.
    """

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self._exposure = {}  # token -> updates that may land while it runs
        self._steps = {}  # token -> its steps

    def admits(self, steps: int) -> bool:
        if not self._exposure:
            return True
        own = sum(self._steps.values())
        return own <= self.max_staleness and all(
            exposure + steps <= self.max_staleness for exposure in self._exposure.values())

    def scheduled(self, token, steps: int):
        for other in self._exposure:
            self._exposure[other] += steps
        self._exposure[token] = sum(self._steps.values())
        self._steps[token] = steps

    def running(self) -> list:
        """The tokens of the functions counted as unfinished."""
        return list(self._exposure)

    def finished(self, token):
        self._exposure.pop(token, None)
        self._steps.pop(token, None)


class SyncStep:
    """One synchronous global step: which gradients it waits for, keeps and drops.

    Every function computing a gradient for the step writes it to a slot of
    its own; the step keeps the first `needed` to arrive and drops the rest.

    Args:
        version: the global step (the variables' version the gradients use).
        needed: `num_workers - backup_workers`.
    """

    def __init__(self, version: int, needed: int):
        self.version = version
        self.needed = needed
        self.kept: list[int] = []  # slots, in order of arrival
        self.pending: set[int] = set()  # slots still computing
        self.dropped = 0

    def started(self, slot: int):
        self.pending.add(slot)

    def arrived(self, slot: int) -> bool:
        """The gradient in `slot` arrived; returns whether the step keeps it."""
        self.pending.discard(slot)
        if self.complete:
            self.dropped += 1
            return False
        self.kept.append(slot)
        return True

    @property
    def complete(self) -> bool:
        return len(self.kept) >= self.needed

    def finish(self) -> int:
        """The step is applied: the gradients still computing for it are dropped.

        Returns their number (counted in `dropped` too).
        """
        late = len(self.pending)
        self.dropped += late
        self.pending = set()
        return late


# The attribute `update_on_arrival` sets on a variable.
ON_ARRIVAL = "_kerasps_on_arrival"


def update_on_arrival(target, on_arrival: bool = True):
    """In hybrid mode, makes `target` (a Keras layer, or one of its variables) update
    its variables as each worker's gradient arrives (`True`) or in global steps
    (`False`), whatever the form of its gradient.

    By default a variable whose gradient is a row update (an embedding table)
    updates on arrival and every other variable in global steps. Other modes
    ignore the setting. (It sets an attribute on each variable, which the
    trainer reads when it traces the step; no TensorFlow here.)

    Args:
        target: a `keras.layers.Layer` (all its trainable variables) or a variable.
        on_arrival: `True` or `False`.

    Returns:
        `target`.
    """
    if not isinstance(on_arrival, bool):
        raise ValueError("Invalid value for argument `on_arrival`: expected True or False. "
                         f"Received: on_arrival={on_arrival!r}")
    variables = getattr(target, "trainable_weights", None)
    if variables is None:
        if not hasattr(target, "assign"):
            raise ValueError("Invalid value for argument `target`: expected a Keras layer or "
                             f"variable. Received: target={target!r:.200}")
        variables = [target]
    for variable in variables:
        object.__setattr__(variable, ON_ARRIVAL, on_arrival)
    return target
