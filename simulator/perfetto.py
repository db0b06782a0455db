"""Timelines in the Chrome trace event format, which Perfetto and chrome://tracing open."""

from __future__ import annotations

import json
import os

from simulator.metrics import Result

__all__ = ["trace_events", "to_perfetto"]

_WORKERS, _JOB = 1, 2  # trace "processes": one track per worker; job-level events


def trace_events(result: Result) -> list[dict]:
    """The run as a list of trace events (timestamps in microseconds).

    Each worker step is a complete (`"X"`) slice on its worker's track, named
    after its outcome (`done`, `dropped`, `lost`); failures and checkpoints
    are instant events on the job track (as is the end of a job whose restart
    budget was spent), and the global step is a counter.
    """
    if result.events is None:
        raise ValueError("Events were not recorded: pass `record_events=True` to `run`.")
    us = 1e6
    out = [
        {"ph": "M", "name": "process_name", "pid": _WORKERS, "args": {"name": "workers"}},
        {"ph": "M", "name": "process_name", "pid": _JOB, "args": {"name": "job"}},
    ]
    for index in sorted({e[0] for e in result.events}):
        out.append({"ph": "M", "name": "thread_name", "pid": _WORKERS, "tid": index,
                    "args": {"name": f"worker {index}"}})
    for worker, start, end, version, outcome in result.events:
        out.append({"ph": "X", "name": f"step ({outcome})", "cat": outcome, "pid": _WORKERS,
                    "tid": worker, "ts": start * us, "dur": (end - start) * us,
                    "args": {"version": version}})
    for time, actor, kind, rolled_back in result.failures:
        out.append({"ph": "i", "s": "p", "name": f"{actor} {kind}", "cat": "failure",
                    "pid": _JOB, "tid": 0, "ts": time * us,
                    "args": {"rolled_back_steps": rolled_back}})
    for time, step in result.checkpoints:
        out.append({"ph": "i", "s": "p", "name": "checkpoint", "cat": "checkpoint",
                    "pid": _JOB, "tid": 0, "ts": time * us, "args": {"step": step}})
    if result.ended_by is not None:
        out.append({"ph": "i", "s": "g", "name": "job ended", "cat": "failure", "pid": _JOB,
                    "tid": 0, "ts": result.ended_by["time"] * us,
                    "args": {"task": result.ended_by["task"],
                             "reason": result.ended_by["reason"]}})
    stride = max(1, len(result.step_ends) // 2000)  # keep the counter track light
    for step, time in enumerate(result.step_ends[::stride]):
        out.append({"ph": "C", "name": "global step", "pid": _JOB, "ts": float(time) * us,
                    "args": {"step": (step * stride) + 1}})
    return out


def to_perfetto(result: Result, path: str | os.PathLike) -> None:
    """Writes `result` as a Chrome/Perfetto JSON trace to `path` (open it in ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(result), "displayTimeUnit": "ms"}, f)
