"""What a run measures (`Metrics`, filled in by the actors) and reports (`Result`)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os

import numpy as np

__all__ = ["Metrics", "Result", "describe"]


class Metrics:
    """Counters and samples the actors append to while the simulation runs.

    Attributes:
        executed: worker steps started (including those in flight at the end).
        applied: gradients in the model (rolled-back ones removed).
        dropped: gradients thrown away on purpose (sync backups, staleness bound).
        lost: worker steps lost to failures (interrupted or rolled back).
        step_times: duration of each completed worker step.
        staleness: staleness of each applied gradient (async).
        step_ends: time of each kept global step.
        steps_lost: global steps rolled back by failures.
        downtime: seconds the job spent recovering from ps/coordinator failures.
        failures: `(time, actor, kind, steps_lost)` tuples.
        checkpoints: `(time, step)` tuples.
        ended_by: `None`, or the task whose spent restart budget ended the job:
            `{"time", "task", "restarts", "reason"}`.
        events: `(worker, start, end, version, outcome)` per worker step, or
            `None` when not recorded.
    """

    def __init__(self, record_events: bool = False):
        self.executed = 0
        self.applied = 0
        self.dropped = 0
        self.lost = 0
        self.step_times: list[float] = []
        self.staleness: list[int] = []
        self.step_ends: list[float] = []
        self.steps_lost = 0
        self.downtime = 0.0
        self.failures: list[tuple] = []
        self.checkpoints: list[tuple] = []
        self.ended_by: dict | None = None
        self.events: list[tuple] | None = [] if record_events else None


def describe(values) -> dict:
    """Mean, standard deviation and percentiles of `values` (NaN when empty)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        nan = float("nan")
        return {"count": 0, "mean": nan, "std": nan, "p50": nan, "p90": nan, "p99": nan,
                "max": nan}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"count": int(x.size), "mean": float(x.mean()), "std": float(x.std()),
            "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max())}


@dataclasses.dataclass
class Result:
    """The outcome of one simulated run.

    Attributes:
        name: scenario name.
        mode: `"async"` or `"sync"`.
        seed: the seed that reproduces it.
        num_workers: workers at the start.
        batch_size: examples per worker step.
        elapsed: simulated seconds until the last kept step (or the stop).
        finished: whether `training.steps` was reached.
        steps: global steps (model updates) kept.
        worker_steps: worker steps executed to an outcome: applied, dropped or
            lost (steps still in flight when the run stops are not counted).
        gradients_applied: gradients in the final model.
        gradients_dropped: gradients thrown away by the policy.
        gradients_lost: worker steps lost to failures.
        steps_lost: global steps rolled back by failures.
        downtime: seconds spent recovering from job failures.
        ps: one dict per ps task: `index`, `bytes`, `traffic_bytes`, `utilization`.
        failures: `(time, actor, kind, steps_lost)` tuples.
        checkpoints: `(time, step)` tuples.
        restarts: restarts of each worker and ps task that was restarted
            (`{"worker:1": 2}`).
        ended_by: `None`, or why the job ended early as `kerasps launch` would
            end it: `{"time", "task", "restarts", "reason"}` of the worker or ps
            task that crashed once more than `failures.max_restarts` allows.
        step_times: worker step durations (NumPy array).
        staleness: staleness of applied gradients (NumPy array, async).
        step_ends: time of each kept global step (NumPy array).
        events: per worker step `(worker, start, end, version, outcome)`, if recorded.
        table: with `[table]`, the dynamic table's replay (`simulator.table.TableLoad`:
            hit rate, rows admitted and evicted per step, bytes per ps task per step).
    """

    name: str
    mode: str
    seed: int
    num_workers: int
    batch_size: int
    elapsed: float
    finished: bool
    steps: int
    worker_steps: int
    gradients_applied: int
    gradients_dropped: int
    gradients_lost: int
    steps_lost: int
    downtime: float
    ps: list
    failures: list
    checkpoints: list
    restarts: dict
    ended_by: dict | None
    step_times: np.ndarray = dataclasses.field(repr=False)
    staleness: np.ndarray = dataclasses.field(repr=False)
    step_ends: np.ndarray = dataclasses.field(repr=False)
    events: list | None = dataclasses.field(default=None, repr=False)
    table: dict | None = None

    @property
    def steps_per_second(self) -> float:
        """Kept global steps per simulated second."""
        return self.steps / self.elapsed if self.elapsed > 0 else float("nan")

    @property
    def examples_per_second(self) -> float:
        """Examples in applied gradients per simulated second."""
        if self.elapsed <= 0:
            return float("nan")
        return self.gradients_applied * self.batch_size / self.elapsed

    @property
    def goodput(self) -> float:
        """Useful worker steps (gradients in the final model) / executed worker steps."""
        return self.gradients_applied / self.worker_steps if self.worker_steps else float("nan")

    @property
    def step_time(self) -> float:
        """Mean time between global steps."""
        return self.elapsed / self.steps if self.steps else float("nan")

    @property
    def mean_staleness(self) -> float:
        return float(self.staleness.mean()) if self.staleness.size else float("nan")

    def summary(self) -> dict:
        """The headline numbers as a JSON-ready dict."""
        intervals = np.diff(self.step_ends, prepend=0.0) if self.step_ends.size else []
        return {
            "name": self.name,
            "mode": self.mode,
            "seed": self.seed,
            "num_workers": self.num_workers,
            "finished": self.finished,
            "elapsed": self.elapsed,
            "steps": self.steps,
            "steps_per_second": self.steps_per_second,
            "examples_per_second": self.examples_per_second,
            "step_time": self.step_time,
            "worker_steps": self.worker_steps,
            "gradients_applied": self.gradients_applied,
            "gradients_dropped": self.gradients_dropped,
            "gradients_lost": self.gradients_lost,
            "goodput": self.goodput,
            "steps_lost": self.steps_lost,
            "downtime": self.downtime,
            "num_failures": len(self.failures),
            "num_checkpoints": len(self.checkpoints),
            "restarts": dict(self.restarts),
            "ended_by": self.ended_by,
            "worker_step_time": describe(self.step_times),
            "global_step_interval": describe(intervals),
            "staleness": describe(self.staleness),
            "ps": self.ps,
            **({} if self.table is None else {"table": self.table}),
        }

    def flat_summary(self) -> dict:
        """`summary()` flattened to one level (`staleness.mean`, `ps.0.utilization`...)."""
        flat = {}

        def walk(prefix, value):
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    walk(f"{prefix}.{i}", {k: x for k, x in v.items() if k != "index"}
                         if isinstance(v, dict) else v)
            else:
                flat[prefix] = value

        walk("", self.summary())
        return flat

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The summary, failures and checkpoints as JSON; written to `path` if given."""
        data = {**self.summary(), "failures": [list(f) for f in self.failures],
                "checkpoints": [list(c) for c in self.checkpoints]}
        text = json.dumps(_finite(data), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The flat summary as a one-row CSV; written to `path` if given."""
        return rows_to_csv([self.flat_summary()], path)

    def step_events(self):
        """Completed worker steps as `kerasps.trace.StepEvent`s (needs recorded events)."""
        from kerasps.trace import StepEvent

        if self.events is None:
            raise ValueError("Events were not recorded: pass `record_events=True` to `run`.")
        done = sorted((e for e in self.events if e[4] == "done"), key=lambda e: e[1])
        return [StepEvent(worker=w, step=i, start=s, end=e)
                for i, (w, s, e, _, _) in enumerate(done)]

    def __str__(self) -> str:
        s = self.summary()
        lines = [
            f"{s['name']} ({s['mode']}, {s['num_workers']} workers, seed {s['seed']})",
            f"  simulated time     {s['elapsed']:.3f} s"
            + ("" if s["finished"] else "  (stopped before training.steps)"),
            f"  steps              {s['steps']:,}  ({s['steps_per_second']:.3f} steps/s, "
            f"{s['examples_per_second']:.1f} examples/s)",
            f"  worker steps       {s['worker_steps']:,}  (applied {s['gradients_applied']:,}, "
            f"dropped {s['gradients_dropped']:,}, lost {s['gradients_lost']:,})",
            f"  goodput            {s['goodput']:.3f}",
            f"  worker step time   mean {s['worker_step_time']['mean']:.4f} s, "
            f"p99 {s['worker_step_time']['p99']:.4f} s",
        ]
        if self.staleness.size:
            lines.append(f"  staleness          mean {s['staleness']['mean']:.2f}, "
                         f"p99 {s['staleness']['p99']:.0f}")
        if self.failures or self.checkpoints:
            lines.append(f"  failures           {len(self.failures)} "
                         f"({s['steps_lost']:,} steps lost, {s['downtime']:.1f} s down), "
                         f"{len(self.checkpoints)} checkpoints")
        if self.restarts:
            lines.append("  restarts           " + ", ".join(
                f"{task} {n}" for task, n in sorted(self.restarts.items())))
        if self.ended_by is not None:
            lines.append(f"  job ended          at {self.ended_by['time']:.3f} s: "
                         f"{self.ended_by['reason']}")
        if self.table is not None:
            t = self.table
            lines.append(f"  dynamic table      hit rate {t['hit_rate']:.3f}, per worker step "
                         f"{t['unique_per_step']:.0f} distinct ids, {t['admitted_per_step']:.1f} "
                         f"admitted, {t['evicted_per_step']:.1f} evicted")
        for p in self.ps:
            table = (f", table {self.table['bytes_per_step'][p['index']]:,.0f} bytes/step"
                     if self.table is not None else "")
            lines.append(f"  ps{p['index']}                {p['bytes']:,} bytes{table}, "
                         f"utilization {p['utilization']:.3f}")
        return "\n".join(lines)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def rows_to_csv(rows: list[dict], path: str | os.PathLike | None = None) -> str:
    """Writes dicts as CSV rows (columns: union of keys, in first-seen order)."""
    columns = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", newline="") as f:
            f.write(text)
    return text
