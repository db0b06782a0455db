"""Per-step traces of a training run: the format kerasps writes and the simulator reads.

A trace is a CSV file with a header and one row per executed step function:

    worker,step,start,end
    0,0,0.000000,0.012345
    1,1,0.000101,0.013002

`worker` is the index of the worker task that ran the step, `step` the
coordinator's sequence number of the scheduled function, `start` and `end`
seconds since the start of the run, measured on the coordinator. Optional
columns may follow: `steps` (train steps packed in the function,
`steps_per_execution`), `kind` (`"train"`, `"eval"`, `"predict"`, and in
sync mode `"apply"` for the function that averages a global step's
gradients and updates the variables), `version` (sync: the global step a
gradient was computed for; -1 otherwise), `dropped` (1 for a gradient a
sync step did not use) and `staleness` (async: updates that landed while the
function ran, as the coordinator saw them; empty where unknown).

Pure Python (no TensorFlow), so that `simulator` can read traces.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import os

__all__ = ["StepEvent", "write_trace", "read_trace", "with_staleness"]


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """One step function executed by one worker."""

    worker: int
    step: int
    start: float
    end: float
    steps: int = 1
    kind: str = "train"
    version: int = -1
    dropped: bool = False
    staleness: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


_FIELDS = [f.name for f in dataclasses.fields(StepEvent)]


def write_trace(path: str | os.PathLike, events) -> None:
    """Writes `events` (an iterable of `StepEvent`) to a CSV file at `path`."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_FIELDS)
        for e in events:
            writer.writerow([e.worker, e.step, f"{e.start:.6f}", f"{e.end:.6f}", e.steps, e.kind,
                             e.version, int(e.dropped),
                             "" if e.staleness is None else f"{e.staleness:g}"])


def read_trace(path: str | os.PathLike) -> list[StepEvent]:
    """Reads a trace written by `write_trace`; raises `ValueError` on a malformed file."""
    events = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"worker", "step", "start", "end"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(
                f"Invalid trace file {os.fspath(path)!r}: missing columns "
                f"{sorted(missing)}. Received header: {reader.fieldnames!r}"
            )
        for lineno, row in enumerate(reader, start=2):
            try:
                event = StepEvent(
                    worker=int(row["worker"]),
                    step=int(row["step"]),
                    start=float(row["start"]),
                    end=float(row["end"]),
                    steps=int(row.get("steps") or 1),
                    kind=row.get("kind") or "train",
                    version=int(row.get("version") or -1),
                    dropped=bool(int(row.get("dropped") or 0)),
                    staleness=float(row["staleness"]) if row.get("staleness") else None,
                )
            except (TypeError, ValueError):
                raise ValueError(
                    f"Invalid trace file {os.fspath(path)!r}, line {lineno}: "
                    f"Received: {row!r}"
                ) from None
            if event.end < event.start:
                raise ValueError(
                    f"Invalid trace file {os.fspath(path)!r}, line {lineno}: "
                    f"`end` is before `start`. Received: {row!r}"
                )
            events.append(event)
    return events


def with_staleness(events) -> list[StepEvent]:
    """`events` (train functions of an async run) with `staleness` filled in: per
    function, the training steps of other functions that ended while it ran (an
    upper bound on the updates its steps saw, from the coordinator's clock)."""
    train = sorted((e for e in events if e.kind == "train"), key=lambda e: e.end)
    ends = [e.end for e in train]
    cumulative = [0]
    for e in train:
        cumulative.append(cumulative[-1] + e.steps)
    out = []
    for e in events:
        if e.kind != "train" or e.staleness is not None or e.version >= 0:
            out.append(e)
            continue
        first, last = bisect.bisect_right(ends, e.start), bisect.bisect_left(ends, e.end)
        out.append(dataclasses.replace(e, staleness=float(cumulative[last] - cumulative[first])))
    return out
