"""What a run measures (`Metrics`, filled in by the actors) and reports (`Result`)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os

import numpy as np

__all__ = ["Metrics", "Result", "describe", "metric_names"]


class Metrics:
    """Counters and samples the actors append to while the simulation runs.

    Attributes:
        executed: worker steps started (including those in flight at the end).
        applied: gradients in the model (rolled-back ones removed).
        dropped: gradients thrown away on purpose (sync backups, staleness bound).
        lost: worker steps lost to failures (interrupted or rolled back).
        step_times: duration of each completed worker step.
        dropped_step_times: the drawn duration of each step that backup workers made a
            worker drop (cancelled in flight), when it is known: steps that queue for ps
            tasks or a shared CPU have none.
        staleness: staleness of each applied gradient (async), or of each row update
            in global steps (hybrid).
        row_updates: hybrid: worker row updates applied (a late worker's included).
        step_ends: time of each kept global step.
        step_work: for each kept global step, the seconds it took: since the previous
            global step, or since training resumed after a checkpoint pause or a recovery.
        rolled_back_steps: global steps rolled back by failures.
        downtime: seconds the job spent recovering from ps/coordinator failures.
        failures: `(time, actor, kind, rolled_back_steps)` tuples.
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
        self.dropped_step_times: list[float] = []
        self.staleness: list[int] = []
        self.row_updates = 0
        self.step_ends: list[float] = []
        self.step_work: list[float] = []
        self.rolled_back_steps = 0
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
        mode: `"async"`, `"sync"` or `"hybrid"`.
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
        gradients_lost: worker steps lost to failures (interrupted in flight, or
            rolled back with the global steps they were in).
        rolled_back_steps: global steps rolled back by failures (to the last checkpoint).
        downtime: seconds spent recovering from job failures.
        ps: one dict per ps task: `index`, `bytes`, `traffic_bytes`, `utilization`.
        failures: `(time, actor, kind, rolled_back_steps)` tuples.
        checkpoints: `(time, step)` tuples.
        restarts: restarts of each worker and ps task that was restarted
            (`{"worker:1": 2}`).
        ended_by: `None`, or why the job ended early as `kerasps launch` would
            end it: `{"time", "task", "restarts", "reason"}` of the worker or ps
            task that crashed once more than `failures.max_restarts` allows.
        step_times: durations of completed worker steps (NumPy array).
        dropped_step_times: drawn durations of the steps backup workers made others
            drop, where known (NumPy array; see `Metrics`).
        staleness: staleness of applied gradients (NumPy array, async), or of the
            row updates in global steps (hybrid).
        row_updates: worker row updates in the embedding tables: the gradients applied
            (async, sync), or every worker step that ended (hybrid, whose late workers'
            row updates are applied while their dense gradients are dropped).
        step_ends: time of each kept global step (NumPy array).
        step_work: seconds each kept global step took, pauses excluded (NumPy array).
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
    rolled_back_steps: int
    downtime: float
    ps: list
    failures: list
    checkpoints: list
    restarts: dict
    ended_by: dict | None
    step_times: np.ndarray = dataclasses.field(repr=False)
    staleness: np.ndarray = dataclasses.field(repr=False)
    step_ends: np.ndarray = dataclasses.field(repr=False)
    dropped_step_times: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0), repr=False)
    step_work: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0), repr=False)
    events: list | None = dataclasses.field(default=None, repr=False)
    table: dict | None = None
    row_updates: int = 0

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
        """Share of the wall time spent on global steps that count: the seconds the kept
        steps took (`step_work`) over `elapsed`. Checkpoint pauses, recoveries, waits for
        too few workers and steps rolled back by failures are the rest."""
        return float(self.step_work.sum()) / self.elapsed if self.elapsed > 0 else float("nan")

    @property
    def applied_fraction(self) -> float:
        """Worker steps whose gradients are in the final model / worker steps executed
        (the rest were dropped on purpose or lost to failures)."""
        return self.gradients_applied / self.worker_steps if self.worker_steps else float("nan")

    @property
    def worker_step_times(self) -> np.ndarray:
        """Durations of the completed worker steps and of the steps backup workers made
        others drop (at their drawn durations, where known)."""
        return np.concatenate([self.step_times, self.dropped_step_times])

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
            "row_updates": self.row_updates,
            "goodput": self.goodput,
            "applied_fraction": self.applied_fraction,
            "rolled_back_steps": self.rolled_back_steps,
            "downtime": self.downtime,
            "num_failures": len(self.failures),
            "num_checkpoints": len(self.checkpoints),
            "restarts": dict(self.restarts),
            "ended_by": self.ended_by,
            "worker_step_time": {**describe(self.worker_step_times),
                                 "dropped": int(self.dropped_step_times.size)},
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
        from kerasps.policy.trace import StepEvent

        if self.events is None:
            raise ValueError("Events were not recorded: pass `record_events=True` to `run`.")
        done = sorted((e for e in self.events if e[4] == "done"), key=lambda e: e[1])
        return [StepEvent(worker=w, step=i, start=s, end=e)
                for i, (w, s, e, _, _) in enumerate(done)]

    def __str__(self) -> str:
        s = self.summary()
        step_time, interval = s["worker_step_time"], s["global_step_interval"]

        def line(label, text):
            return f"  {label:<21}{text}"

        lines = [
            f"{s['name']} ({s['mode']}, {s['num_workers']} workers, seed {s['seed']})",
            line("simulated time", f"{s['elapsed']:.3f} s"
                 + ("" if s["finished"] else "  (stopped before training.steps)")),
            line("steps", f"{s['steps']:,}  ({s['steps_per_second']:.3f} steps/s, "
                          f"{s['examples_per_second']:.1f} examples/s)"),
            line("goodput", f"{s['goodput']:.3f}  (share of the time spent on steps kept)"),
            line("worker steps", f"{s['worker_steps']:,}  (applied {s['gradients_applied']:,}, "
                                 f"dropped {s['gradients_dropped']:,}, lost "
                                 f"{s['gradients_lost']:,}; applied fraction "
                                 f"{s['applied_fraction']:.3f})"),
            line("worker step time", f"mean {step_time['mean']:.4f} s, p50 "
                                     f"{step_time['p50']:.4f} s, p99 {step_time['p99']:.4f} s"
                 + self._step_time_note()),
            line("global step interval", f"p50 {interval['p50']:.4f} s, p99 "
                                         f"{interval['p99']:.4f} s"),
        ]
        if self.mode == "hybrid":
            lines.append(line("row updates", f"{s['row_updates']:,}  (applied on arrival, "
                                             "late workers' included)"))
        if self.staleness.size:
            lines.append(line("staleness", f"mean {s['staleness']['mean']:.2f}, "
                                           f"p99 {s['staleness']['p99']:.0f}"))
        if self.failures or self.checkpoints:
            lines.append(line("failures", f"{len(self.failures)} "
                                          f"({s['rolled_back_steps']:,} global steps rolled "
                                          f"back, {s['downtime']:.1f} s down), "
                                          f"{len(self.checkpoints)} checkpoints"))
        if self.restarts:
            lines.append(line("restarts", ", ".join(
                f"{task} {n}" for task, n in sorted(self.restarts.items()))))
        if self.ended_by is not None:
            lines.append(line("job ended", f"at {self.ended_by['time']:.3f} s: "
                                           f"{self.ended_by['reason']}"))
        if self.table is not None:
            t = self.table
            lines.append(line("dynamic table", f"hit rate {t['hit_rate']:.3f}, per worker step "
                                               f"{t['unique_per_step']:.0f} distinct ids, "
                                               f"{t['admitted_per_step']:.1f} admitted, "
                                               f"{t['evicted_per_step']:.1f} evicted"))
        if self.models_ps or self.table is not None:
            for p in self.ps:
                table = (f", table {self.table['bytes_per_step'][p['index']]:,.0f} bytes/step"
                         if self.table is not None else "")
                lines.append(line(f"ps{p['index']}", f"{p['bytes']:,} bytes{table}, "
                                                     f"utilization {p['utilization']:.3f}"))
        return "\n".join(lines)

    def _step_time_note(self) -> str:
        if self.mode != "sync" or not self.gradients_dropped:
            return ""
        if self.dropped_step_times.size:
            return (f"  (incl. {self.dropped_step_times.size:,} steps dropped by backup "
                    "workers, at their drawn times)")
        return (f"  (completed steps only: the {self.gradients_dropped:,} steps dropped by "
                "backup workers queued for ps tasks or CPUs, their times are unknown)")

    @property
    def models_ps(self) -> bool:
        """Whether the scenario puts anything on its ps tasks (bytes or service time)."""
        return any(p["bytes"] or p["utilization"] for p in self.ps)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def metric_names(num_ps: int = 1) -> list[str]:
    """The numeric keys of `Result.flat_summary()` (what sweeps can plot), for `num_ps`
    ps tasks."""
    empty = Result(name="", mode="async", seed=0, num_workers=1, batch_size=1, elapsed=0.0,
                   finished=False, steps=0, worker_steps=0, gradients_applied=0,
                   gradients_dropped=0, gradients_lost=0, rolled_back_steps=0, downtime=0.0,
                   ps=[{"index": i, "bytes": 0, "traffic_bytes": 0, "utilization": 0.0}
                       for i in range(num_ps)],
                   failures=[], checkpoints=[], restarts={}, ended_by=None,
                   step_times=np.zeros(0), staleness=np.zeros(0, dtype=np.int64),
                   step_ends=np.zeros(0))
    return [k for k, v in empty.flat_summary().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seed"]


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
