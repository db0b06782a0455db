"""Placement policies: which ps task holds each variable or shard.

Pure Python (no TensorFlow), shared by the strategy and by `simulator/`.

Policies:

* `"round_robin"` (default): the n-th variable or shard goes to ps task
  `n % num_ps`, as TensorFlow's `ParameterServerStrategy` does.
* `"greedy"`: each new variable or shard goes to the ps task holding the
  fewest bytes so far (ties to the lowest index), like TF1's
  `GreedyLoadBalancingStrategy` with `byte_size_load_fn`.
* a callable `(name, shape, dtype, num_ps) -> int`.

Optimizer slots and other variables created with `colocate_vars_with` are
not placed by the policy: they go next to their variable. An optimizer's
learning rate goes to the ps task the policy gave its `iterations`: every
update reads both, and they are sent there together.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Sequence

from kerasps.policy import partitioners as partitioners_lib
from kerasps.policy import tables as tables_lib
from kerasps.policy._validation import positive_int

__all__ = [
    "Placer",
    "RoundRobin",
    "Greedy",
    "CallablePlacement",
    "ShardRecord",
    "PlacementReport",
    "get_placer",
    "plan",
    "shard_count",
]


class Placer:
    """Base class of placement policies.

    `place` is called once for every variable or shard, in creation order,
    and returns a ps task index. `record` tells the policy that `nbytes`
    landed on `ps_task` (also for colocated variables it did not choose), so
    that load-aware policies see the real load.
    """

    def __init__(self, num_ps: int):
        self.num_ps = positive_int("num_ps", num_ps)
        self.loads = [0] * self.num_ps

    def choose(self, name: str, shape: tuple[int, ...], dtype, nbytes: int) -> int:
        raise NotImplementedError

    def place(self, name: str, shape: Sequence[int], dtype, nbytes: int) -> int:
        task = self.choose(name, tuple(shape), dtype, nbytes)
        self.record(task, nbytes)
        return task

    def record(self, ps_task: int, nbytes: int) -> None:
        self.loads[ps_task] += int(nbytes)


class RoundRobin(Placer):
    """The n-th placed variable goes to ps task `n % num_ps`."""

    def __init__(self, num_ps: int):
        super().__init__(num_ps)
        self._count = 0

    def choose(self, name, shape, dtype, nbytes):
        task = self._count % self.num_ps
        self._count += 1
        return task


class Greedy(Placer):
    """Each variable goes to the ps task holding the fewest bytes so far."""

    def choose(self, name, shape, dtype, nbytes):
        return min(range(self.num_ps), key=lambda i: (self.loads[i], i))


class CallablePlacement(Placer):
    """Adapts a user function `(name, shape, dtype, num_ps) -> int`."""

    def __init__(self, num_ps: int, fn: Callable):
        super().__init__(num_ps)
        self.fn = fn

    def choose(self, name, shape, dtype, nbytes):
        task = self.fn(name, shape, dtype, self.num_ps)
        if isinstance(task, bool) or not isinstance(task, numbers.Integral) or not (
            0 <= task < self.num_ps
        ):
            raise ValueError(
                f"Invalid value returned by the `placement` callable for variable "
                f"{name!r}: expected a ps task index in [0, {self.num_ps}). "
                f"Received: {task!r}"
            )
        return int(task)


_POLICIES = {"round_robin": RoundRobin, "greedy": Greedy}


def get_placer(placement, num_ps: int) -> Placer:
    """Returns a fresh `Placer` for `placement` (a name, a callable or a `Placer` class)."""
    if isinstance(placement, str):
        if placement not in _POLICIES:
            raise ValueError(
                "Invalid value for argument `placement`: expected one of "
                f"{sorted(_POLICIES)} or a callable (name, shape, dtype, num_ps) "
                f"-> int. Received: placement={placement!r}"
            )
        return _POLICIES[placement](num_ps)
    if isinstance(placement, type) and issubclass(placement, Placer):
        return placement(num_ps)
    if callable(placement):
        return CallablePlacement(num_ps, placement)
    raise ValueError(
        "Invalid value for argument `placement`: expected one of "
        f"{sorted(_POLICIES)} or a callable (name, shape, dtype, num_ps) -> int. "
        f"Received: placement={placement!r}"
    )


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """Where one variable shard lives.

    Attributes:
        name: the shard's name (`"<variable>/part_<i>"` for partitioned ones).
        variable: the name of the whole variable.
        shard: index of the shard within its variable.
        shape: the shard's shape.
        dtype: dtype name.
        bytes: size of the shard in bytes.
        ps_task: index of the ps task holding it.
    """

    name: str
    variable: str
    shard: int
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    ps_task: int


class PlacementReport(tuple):
    """A tuple of `ShardRecord`s that prints as a table, with the bytes per ps
    task and their `imbalance`.

    `num_ps`, when known, makes idle ps tasks show up in `bytes_per_ps()`.
    `tables`: `kerasps.tables.TableRecord`s of the dynamic tables (rows used,
    admitted, evicted and hit rate per ps task), printed after the shards.
    """

    def __new__(cls, records=(), num_ps: int | None = None, tables=()):
        report = super().__new__(cls, records)
        report.num_ps = num_ps
        report.tables = tuple(tables)
        return report

    def bytes_per_ps(self, num_ps: int | None = None) -> list[int]:
        num_ps = num_ps if num_ps is not None else self.num_ps
        n = max(num_ps or 0, 1 + max((r.ps_task for r in self), default=-1))
        loads = [0] * n
        for r in self:
            loads[r.ps_task] += r.bytes
        return loads

    @property
    def imbalance(self) -> float:
        """Bytes on the busiest ps task over the mean bytes per ps task.

        1.0 is a perfect balance (also for an empty report); `num_ps` is the
        worst.
        """
        loads = self.bytes_per_ps()
        total = sum(loads)
        return max(loads) * len(loads) / total if total else 1.0

    def to_dicts(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self]

    def __str__(self) -> str:
        rows = [("name", "shape", "dtype", "bytes", "ps_task")]
        rows += [(r.name, str(tuple(r.shape)), r.dtype, f"{r.bytes:,}", str(r.ps_task))
                 for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = []
        for k, row in enumerate(rows):
            lines.append("  ".join(
                cell.rjust(w) if i in (3, 4) else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        loads = self.bytes_per_ps()
        lines.append("bytes per ps task: " + ", ".join(f"ps{i}={b:,}" for i, b in enumerate(loads))
                     + f"; imbalance (max/mean): {self.imbalance:.2f}")
        if self.tables:
            lines += ["", "dynamic tables:", *tables_lib.table_lines(self.tables)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PlacementReport({len(self)} shards)"


def shard_count(partitions, shape: Sequence[int], name: str) -> int:
    """The number of shards a partitioner's answer asks for, checked.

    Args:
        partitions: what the partitioner returned for variable `name`:
            TensorFlow's format, `[k, 1, ...]` with one entry per axis, `k >= 1`
            shards along axis 0 (the only axis kerasps splits).
        shape: the variable's shape.
        name: the variable's name, for the error message.

    Returns:
        `k`, capped at the number of rows.

    Raises:
        ValueError: naming the variable and the value, if `partitions` is not
            of that form.
    """
    shape = tuple(int(d) for d in shape)
    values = list(partitions) if isinstance(partitions, (list, tuple)) else None
    if not (values is not None and len(values) == len(shape) and all(
            isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in values)
            and values[0] >= 1 and all(p == 1 for p in values[1:])):
        raise ValueError(
            f"Invalid value returned by `variable_partitioner` for variable {name!r} of "
            f"shape {shape}: expected a list of {len(shape)} integers [k, 1, ...], the "
            "number of shards k >= 1 along axis 0 and 1 for every other axis. "
            f"Received: {partitions!r}")
    return min(int(values[0]), shape[0])


def _dtype_name(dtype) -> str:
    return str(getattr(dtype, "name", dtype))


def plan(
    variables: Iterable[tuple[str, Sequence[int], object]],
    num_ps: int,
    partitioner: partitioners_lib.Partitioner | Callable | None = None,
    placement="round_robin",
) -> PlacementReport:
    """Shards and places variables the way the strategy does, without TensorFlow.

    Args:
        variables: `(name, shape, dtype)` triples in creation order.
        num_ps: number of ps tasks.
        partitioner: a partitioner or `None` for no sharding.
        placement: a placement policy (see `get_placer`).

    Returns:
        A `PlacementReport` with one record per shard.
    """
    placer = get_placer(placement, num_ps)
    records = []
    for name, shape, dtype in variables:
        shape = tuple(int(d) for d in shape)
        n = 1
        if partitioner is not None and shape:
            n = shard_count(partitioner(shape, dtype), shape, name)
        itemsize = partitioners_lib.element_bytes(dtype)
        rows = partitioners_lib.shard_sizes(shape[0], n) if shape else [None]
        for i, num_rows in enumerate(rows):
            shard_shape = shape if n == 1 else (num_rows,) + shape[1:]
            nbytes = math.prod(shard_shape) * itemsize
            shard_name = name if n == 1 else f"{name}/part_{i}"
            task = placer.place(shard_name, shard_shape, dtype, nbytes)
            records.append(ShardRecord(shard_name, name, i, shard_shape,
                                       _dtype_name(dtype), nbytes, task))
    return PlacementReport(records, num_ps=num_ps)
