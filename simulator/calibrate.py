"""Calibration: fit a step-time model to a kerasps trace and predict other worker counts.

Two models, chosen by whether the workers of the traced run shared CPUs:

* **Dedicated workers** (`cpus=None`, a real cluster: one machine per
  worker). Workers do not slow each other down; a worker's cycle is its step
  time plus the coordinator's gap before its next step, and throughput is
  `W / E[cycle]`. Step times are fitted with a shifted exponential
  (maximum likelihood: `shift = min`, `rate = 1 / (mean - min)`).

* **Shared CPU** (`cpus=C`, an in-process cluster on one machine). Each step
  function needs `cpu_time` seconds of CPU on a machine with `C` cores that
  all workers share, and a worker also spends `latency` seconds per step
  function off the CPU: the coordinator's gap between its steps (measured in
  the trace) plus a fixed off-CPU time (RPC waits). This is a closed
  queueing network: `W` workers circulate between a delay (`latency`) and a
  `C`-server station (`cpu_time`), solved exactly by mean-value analysis
  (MVA). With few workers throughput grows as `W / (latency + cpu_time)`;
  past saturation it stays at `C / cpu_time` while each step gets slower, as
  in an in-process run. `cpu_time` is chosen so that the MVA reproduces the
  measured throughput. One trace cannot tell CPU time from off-CPU time, so
  the fixed off-CPU time is 0 unless given (right for a CPU-bound run, i.e.
  a trace with at least `C` workers); traces at two or more worker counts
  fit it by least squares.

`predict_throughput(model, W)` then runs the simulator on `model.scenario(W)`
(or evaluates the MVA directly with `method="mva"`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import numpy as np

from simulator.distributions import ShiftedExponential
from simulator.scenario import Mode, Scenario

# A Kolmogorov-Smirnov distance above this between the step times and their fit is a poor
# fit (any simulated distribution differs from the data by that much somewhere).
POOR_FIT_KS = 0.1

__all__ = ["StepTimeFit", "CalibratedModel", "calibrate", "predict_throughput", "mva_throughput",
           "predict_sync_step_time", "predict_goodput", "synthetic_trace"]


@dataclasses.dataclass(frozen=True)
class StepTimeFit:
    """Fit of one worker's (or the pooled) step times.

    Attributes:
        worker: worker index, or `None` for all workers pooled.
        count: steps fitted.
        mean: mean step time (seconds per step function).
        shift: shifted-exponential shift (the minimum).
        rate: shifted-exponential rate of the part above the shift.
        ks: Kolmogorov-Smirnov distance between the data and the fit.
    """

    worker: int | None
    count: int
    mean: float
    shift: float
    rate: float
    ks: float

    @property
    def distribution(self) -> ShiftedExponential:
        return ShiftedExponential(self.shift, self.rate)


def _fit(worker, durations: np.ndarray) -> StepTimeFit:
    x = np.sort(durations)
    shift = float(x[0])
    excess = max(float(x.mean()) - shift, 1e-12)
    rate = 1.0 / excess
    cdf = 1.0 - np.exp(-rate * (x - shift))
    n = x.size
    ks = float(max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n)))
    return StepTimeFit(worker, int(n), float(x.mean()), shift, rate, ks)


def mva_throughput(num_workers: int, cpus: float, cpu_time: float, latency: float) -> float:
    """Exact throughput of the closed network: `num_workers` customers, a delay
    `latency`, and a station of `cpus` exponential servers with mean `cpu_time`.

    Load-dependent mean-value analysis (service rate `min(j, cpus) / cpu_time`
    with `j` customers present).
    """
    p = np.array([1.0])  # p[j] = P(j customers at the CPU) with n - 1 in the network
    throughput = 0.0
    for n in range(1, num_workers + 1):
        j = np.arange(1, n + 1)
        rate = np.minimum(j, cpus) / cpu_time
        response = float(np.sum(j / rate * p[:n]))
        throughput = n / (latency + response)
        tail = throughput / rate * p[:n]
        p = np.concatenate([[max(0.0, 1.0 - tail.sum())], tail])
    return throughput


@dataclasses.dataclass(frozen=True)
class CalibratedModel:
    """A step-time model fitted to a trace (see the module docstring).

    Attributes:
        num_workers: workers in the traced run.
        steps_per_second: measured train steps per second.
        steps_per_function: mean train steps per step function (`steps_per_execution`).
        gap: mean seconds between a worker's step end and its next start.
        pooled: fit of all step times.
        per_worker: fit of each worker's step times.
        cpus: step functions the shared CPU runs at once (cores // cores per
            step), or `None` for dedicated workers.
        cpu_time: seconds of exclusive CPU per step function (shared-CPU model).
        latency: seconds per step function off the CPU (shared-CPU model).
    """

    num_workers: int
    steps_per_second: float
    steps_per_function: float
    gap: float
    pooled: StepTimeFit
    per_worker: tuple[StepTimeFit, ...]
    cpus: int | None = None
    cpu_time: float | None = None
    latency: float | None = None

    def scenario(self, num_workers: int | None = None, *, mode: Mode | str = "async",
                 steps: int | None = None, seed: int = 0, elastic: dict | None = None,
                 max_time: float | None = None) -> Scenario:
        """A scenario simulating the traced system with `num_workers` workers (and an
        `[elastic]` table, `elastic`, of joins and leaves; `max_time` seconds at most)."""
        w = num_workers or self.num_workers
        steps = steps or max(2000, 300 * w)
        data = {"name": "calibrated", "seed": seed,
                "description": f"calibrated from a trace of {self.num_workers} workers",
                "training": {"mode": Mode(mode).value, "steps": steps}}
        if elastic is not None:
            data["elastic"] = elastic
        if max_time is not None:
            data["training"]["max_time"] = max_time
        if self.cpus is None:
            step_time = ShiftedExponential(self.pooled.shift + self.gap, self.pooled.rate)
            data["workers"] = {"count": w, "step_time": step_time.to_dict()}
        else:
            data["workers"] = {"count": w, "step_time": {"distribution": "constant",
                                                         "value": self.latency}}
            data["host"] = {"cpus": self.cpus, "cpu_time": {"distribution": "exponential",
                                                            "rate": 1.0 / self.cpu_time}}
        return Scenario.from_dict(data)

    def report(self) -> str:
        """A readable summary of the fit."""
        p = self.pooled
        lines = [
            f"trace: {self.num_workers} workers, {p.count} step functions, "
            f"{self.steps_per_second:.3f} steps/s measured",
            f"pooled step time: mean {p.mean:.6f} s; shifted exponential shift "
            f"{p.shift:.6f} s, rate {p.rate:.3f}/s (KS distance {p.ks:.3f})",
            f"coordinator gap between a worker's steps: {self.gap:.6f} s",
        ]
        if p.ks > POOR_FIT_KS:
            lines.insert(2, f"warning: poor fit (KS distance {p.ks:.3f} > {POOR_FIT_KS}): the "
                            "step times are not a shifted exponential; simulated step times, "
                            "their tail above all, will differ from the measured ones")
        for f in self.per_worker:
            lines.append(f"  worker {f.worker}: {f.count} steps, mean {f.mean:.6f} s, "
                         f"shift {f.shift:.6f} s, rate {f.rate:.3f}/s (KS {f.ks:.3f})")
        if self.cpus is None:
            lines.append("model: dedicated workers (throughput = W / mean cycle)")
        else:
            lines.append(f"model: shared CPU, {self.cpus} step(s) at a time, cpu_time "
                         f"{self.cpu_time:.6f} s, latency {self.latency:.6f} s per step "
                         f"function (saturates at {self.cpus / self.cpu_time:.3f} "
                         "functions/s)")
        return "\n".join(lines)


def _as_traces(trace) -> list[list]:
    from kerasps.policy.trace import StepEvent, read_trace

    if isinstance(trace, (str, os.PathLike)):
        return [read_trace(trace)]
    trace = list(trace)
    if trace and not isinstance(trace[0], StepEvent):
        return [t for item in trace for t in _as_traces(item)]
    return [trace]


@dataclasses.dataclass(frozen=True)
class _TraceStats:
    workers: int
    throughput: float  # step functions per second, summed over workers
    gap: float
    steps_per_function: float
    by_worker: dict


def _stats(events: list) -> _TraceStats:
    train = [e for e in events if e.kind == "train"]
    if not train:
        raise ValueError("Invalid trace: it has no train steps. Received: 0 train events")
    by_worker: dict[int, list] = {}
    for e in train:
        by_worker.setdefault(e.worker, []).append(e)
    gaps, throughput = [], 0.0
    for steps in by_worker.values():
        steps.sort(key=lambda e: e.start)
        gaps += [max(0.0, b.start - a.end) for a, b in zip(steps, steps[1:], strict=False)]
        span = steps[-1].end - steps[0].start
        throughput += len(steps) / span if span > 0 else 0.0
    return _TraceStats(len(by_worker), throughput, float(np.mean(gaps)) if gaps else 0.0,
                       float(np.mean([e.steps for e in train])), by_worker)


def calibrate(trace, *, cpus: int | str | None = None, latency: float | None = None,
              cores_per_step: int | str = 1) -> CalibratedModel:
    """Fits a `CalibratedModel` to the train steps of one or more traces.

    Args:
        trace: a trace: a path to a trace CSV or a list of
            `kerasps.trace.StepEvent` (from `kerasps.trace.read_trace`); or a
            list of traces of the same system at different worker counts.
        cpus: `None` if every worker had its own machine; else the number of
            cores the workers shared (an in-process run), or `"auto"` for
            this machine's `os.cpu_count()`.
        latency: shared-CPU model only: fixed seconds per step function off
            the CPU, besides the measured coordinator gap. By default it is
            fitted when traces at several worker counts are given, and 0 for
            one trace (every second inside a step is then CPU work, which is
            right for a CPU-bound in-process run).
        cores_per_step: shared-CPU model only: how many cores one step function
            can use at once; `"all"` for every shared core. TensorFlow runs a
            step's ops on intra-op threads, so an in-process kerasps run is
            usually best described by `"all"`: the CPU is then one server that
            the running steps share, and one worker alone already uses the
            whole machine.

    Returns:
        A `CalibratedModel`; step-time fits come from the first trace.

    Raises:
        ValueError: if a trace has no train steps or an argument is invalid.
    """
    stats = [_stats(t) for t in _as_traces(trace)]
    if cpus == "auto":
        cpus = os.cpu_count() or 1
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
        raise ValueError("Invalid value for argument `cpus`: it must be a positive integer, "
                         f'"auto" or None. Received: cpus={cpus!r}')
    if cpus is not None:
        if cores_per_step == "all":
            cores_per_step = cpus
        if isinstance(cores_per_step, bool) or not isinstance(cores_per_step, int) or (
                cores_per_step < 1):
            raise ValueError("Invalid value for argument `cores_per_step`: it must be a "
                             f'positive integer or "all". Received: cores_per_step='
                             f"{cores_per_step!r}")
        # Steps using k cores each: a station of cpus // k servers, each step
        # holding one server for its (faster) service time.
        cpus = max(1, cpus // min(cores_per_step, cpus))
    if latency is not None and not latency >= 0:
        raise ValueError("Invalid value for argument `latency`: it must not be negative. "
                         f"Received: latency={latency!r}")
    first = stats[0]
    durations = np.array([e.duration for steps in first.by_worker.values() for e in steps])
    model = CalibratedModel(
        num_workers=first.workers,
        steps_per_second=first.throughput * first.steps_per_function,
        steps_per_function=first.steps_per_function, gap=first.gap,
        pooled=_fit(None, durations),
        per_worker=tuple(_fit(w, np.array([e.duration for e in steps]))
                         for w, steps in sorted(first.by_worker.items())))
    if cpus is None:
        return model
    gap = float(np.mean([s.gap for s in stats]))
    if latency is None and len({s.workers for s in stats}) > 1:
        latency, cpu_time = _fit_latency(stats, cpus, gap)
    else:
        latency = latency or 0.0
        cpu_time = _solve_cpu_time(first.workers, cpus, gap + latency, first.throughput)
    return dataclasses.replace(model, cpus=cpus, cpu_time=cpu_time, latency=gap + latency)


def _fit_latency(stats: list[_TraceStats], cpus: int, gap: float) -> tuple[float, float]:
    """Least squares (on log throughput) over a grid of latencies; `cpu_time` per latency
    is the geometric mean of the values that match each trace exactly."""
    longest_cycle = min(s.workers / s.throughput for s in stats)
    best = None
    for latency in np.concatenate([[0.0], np.geomspace(1e-4, 1.0, 60) * longest_cycle]):
        solved = [_solve_cpu_time(s.workers, cpus, gap + latency, s.throughput) for s in stats]
        cpu_time = float(np.exp(np.mean(np.log(solved))))
        error = sum((math.log(mva_throughput(s.workers, cpus, cpu_time, gap + latency))
                     - math.log(s.throughput)) ** 2 for s in stats)
        if best is None or error < best[0]:
            best = (error, float(latency), cpu_time)
    return best[1], best[2]


def _solve_cpu_time(workers: int, cpus: int, latency: float, throughput: float) -> float:
    """The `cpu_time` at which the MVA throughput equals the measured one (bisection)."""
    low, high = 1e-12, workers / throughput  # at `high` one cycle is all CPU: too slow
    for _ in range(60):
        mid = math.sqrt(low * high)
        if mva_throughput(workers, cpus, mid, latency) > throughput:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


def predict_throughput(model: CalibratedModel, num_workers: int, *, mode: Mode | str = "async",
                       method: str = "simulate", steps: int | None = None,
                       seed: int = 0) -> float:
    """Predicted train steps per second of the traced system with `num_workers` workers.

    Args:
        model: from `calibrate`.
        num_workers: the worker count to predict.
        mode: `"async"` (what kerasps's coordinator does) or `"sync"`.
        method: `"simulate"` runs the simulator on `model.scenario(...)`;
            `"mva"` evaluates the closed form (async only).
        steps: simulated step functions (default: enough for about 1%).
        seed: simulation seed.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError("Invalid value for argument `num_workers`: it must be a positive "
                         f"integer. Received: num_workers={num_workers!r}")
    if method == "mva":
        if Mode(mode) is not Mode.ASYNC:
            raise ValueError('Invalid value for argument `method`: "mva" only models async '
                             f"training. Received: method={method!r}, mode={mode!r}")
        if model.cpus is None:
            x = num_workers / (model.pooled.mean + model.gap)
        else:
            x = mva_throughput(num_workers, model.cpus, model.cpu_time, model.latency)
        return x * model.steps_per_function
    if method != "simulate":
        raise ValueError('Invalid value for argument `method`: expected "simulate" or "mva". '
                         f"Received: method={method!r}")
    from simulator.simulation import run

    result = run(model.scenario(num_workers, mode=mode, steps=steps, seed=seed))
    return result.steps_per_second * model.steps_per_function


def predict_elastic_throughput(trace, *, workers: int, events, duration: float,
                               cpus: int | str | None = "auto", cores_per_step="all",
                               seed: int = 0) -> list[float]:
    """Predicted train steps per second in each phase of an elastic run.

    The simulator is calibrated on `trace` (the run's first phase, `workers`
    workers) and replays the run's membership script with its elastic model.

    Args:
        trace: a trace of the first phase (see `calibrate`).
        workers: workers in the first phase.
        events: `(time, change)` pairs: `change` workers join (> 0) or leave
            (< 0) `time` seconds after the start, in time order.
        duration: seconds to simulate (the end of the last phase).
        cpus: as for `calibrate` (workers sharing this machine by default).
        cores_per_step: as for `calibrate`.
        seed: simulation seed.

    Returns:
        Steps per second between consecutive boundaries `0, t1, ..., duration`.
    """
    from simulator.simulation import run

    model = calibrate(trace, cpus=cpus, cores_per_step=cores_per_step)
    peak = workers + max(itertools.accumulate(change for _, change in events), default=0)
    elastic = {"max_workers": max(workers, peak), "events": [
        {"time": float(time), "action": "join" if change > 0 else "leave", "count": abs(change)}
        for time, change in events]}
    result = run(model.scenario(workers, steps=10**9, seed=seed, elastic=elastic,
                                max_time=duration))
    bounds = [0.0] + [float(time) for time, _ in events] + [float(duration)]
    ends = np.asarray(result.step_ends)
    return [float(((ends > lo) & (ends <= hi)).sum()) / (hi - lo) * model.steps_per_function
            for lo, hi in zip(bounds, bounds[1:])]


def predict_sync_step_time(trace, *, num_workers: int, backup_workers: int = 0,
                           straggler_delay: float = 0.0, steps: int = 2000,
                           seed: int = 0) -> float:
    """Predicted seconds per global step of a traced kerasps sync run, with one worker's
    input held back `straggler_delay` seconds per batch (`kerasps.input.slowed`).

    Calibrated on the run's own trace (`kerasps.StepTraceRecorder` of a sync
    `fit`): a worker's cycle is the duration of one of its kept gradient
    functions plus the step's overhead (the measured time per global step,
    from one `apply` function's end to the next, less the mean gradient time),
    as empirical samples. A delay in the input pipeline is spent while the
    worker's previous step runs (the next batch is prepared ahead), so the
    straggler's cycle is the longer of its cycle and the delay: its slowdown
    is `max(cycle, delay) / cycle`, not `(cycle + delay) / cycle`.

    Args:
        trace: the events of a sync run, or a path to its CSV trace.
        num_workers: workers in the predicted run.
        backup_workers: the predicted run's `backup_workers`.
        straggler_delay: seconds per batch held back on one worker (0: none).
        steps: simulated global steps.
        seed: simulation seed.
    """
    from simulator.simulation import run

    (events,) = _as_traces(trace)
    gradients = [e.duration for e in events if e.kind == "train" and not e.dropped
                 and e.version >= 0]
    applies = sorted(e.end for e in events if e.kind == "apply")
    if not gradients or len(applies) < 2:
        raise ValueError("Invalid value for argument `trace`: expected the trace of a sync "
                         "`fit` (gradient functions with a `version` and `apply` functions). "
                         f"Received {len(events)} events, {len(applies)} of kind 'apply'.")
    step_time = float(np.median(np.diff(applies)))
    overhead = max(0.0, step_time - float(np.mean(gradients)))
    cycles = [g + overhead for g in gradients]
    data = {"name": "calibrated sync", "seed": seed,
            "training": {"mode": "sync", "steps": steps, "backup_workers": backup_workers},
            "workers": {"count": num_workers, "step_time": {"distribution": "empirical",
                                                            "samples": cycles}}}
    if straggler_delay:
        cycle = float(np.mean(cycles))
        data["stragglers"] = {"count": 1, "slowdown": max(cycle, straggler_delay) / cycle}
    return run(Scenario.from_dict(data)).step_time


_KILLED = {"worker": "worker", "ps": "ps", "chief": "coordinator"}


def predict_goodput(recovery_times: dict, kill_schedule, fault_free_wall: float, *,
                    training_time: float, steps: int, workers: int = 2, ps: int = 1,
                    checkpoint_every: int = 0, seed: int = 0) -> float:
    """Predicted goodput of a job whose processes are killed on a schedule: its wall
    time without faults over the wall time the simulator predicts with them.

    The fault-free job is a start-up (`fault_free_wall - training_time`: processes,
    connection, shut-down), then `steps` asynchronous steps at its measured rate, made
    by `workers` workers at `workers * training_time / steps` seconds a step each.
    Each kill takes its actor out for its kind's recovery time: a killed worker loses
    its step in flight and works again after `recovery_times["worker"]` while the
    others go on; a killed ps task or chief stops training, which goes back to the
    last backup (every `checkpoint_every` steps) and resumes after the recovery time,
    running the steps since the backup again (the simulator's coordinator and ps
    failures, `Coordinator.job_failure`).

    Args:
        recovery_times: seconds from a kill to its actor's first step, by kind:
            `"worker"`, `"ps"` and `"chief"` (for a ps task or the chief, to the first
            step after the backup was restored: the steps run again are simulated).
        kill_schedule: `(time, kind, index)` triples: seconds since training started,
            `"worker"`, `"ps"` or `"chief"`, and the task's index.
        fault_free_wall: seconds the job takes without faults, start-up included.
        training_time: seconds of training in the fault-free job (first to last step).
        steps: steps the job trains.
        workers: the job's workers.
        ps: the job's ps tasks.
        checkpoint_every: steps between backups (0: none, a kill goes back to the start).
        seed: simulation seed.

    Returns:
        `fault_free_wall` over the predicted wall time under the kills.
    """
    from simulator.simulation import run

    if not 0 < training_time <= fault_free_wall:
        raise ValueError("Invalid value for argument `training_time`: expected seconds in "
                         f"(0, fault_free_wall={fault_free_wall!r}]. Received: "
                         f"training_time={training_time!r}")
    missing = {kind for _, kind, _ in kill_schedule} - set(recovery_times)
    unknown = {kind for _, kind, _ in kill_schedule} - set(_KILLED)
    if unknown or missing:
        raise ValueError(
            "Invalid value for argument `kill_schedule`: every kill needs a kind among "
            f"{sorted(_KILLED)} with a recovery time (recovery_times has "
            f"{sorted(recovery_times)}). Received: kinds {sorted(unknown | missing)}")
    events = [{"time": float(t), "target": _KILLED[kind], "index": int(index),
               "downtime": float(recovery_times[kind])} for t, kind, index in kill_schedule]
    data = {"name": "kill schedule", "seed": seed,
            "training": {"mode": "async", "steps": int(steps)},
            "workers": {"count": workers, "step_time": {
                "distribution": "constant", "value": workers * training_time / steps}},
            "ps": {"count": ps}, "checkpoint": {"every": checkpoint_every},
            "failures": {"events": events}}
    result = run(Scenario.from_dict(data))
    if not result.finished:
        raise RuntimeError(f"The simulated job did not finish: {result.ended_by}")
    return fault_free_wall / (fault_free_wall - training_time + result.elapsed)


def synthetic_trace(num_workers: int, steps_per_worker: int, shift: float, rate: float,
                    seed: int = 0) -> list:
    """A trace of dedicated workers with shifted-exponential step times (for tests and demos)."""
    from kerasps.policy.trace import StepEvent

    rng = np.random.default_rng(seed)
    events = []
    for w in range(num_workers):
        t = 0.0
        for d in shift + rng.exponential(1.0 / rate, steps_per_worker):
            events.append((t, w, t + d))
            t += d
    events.sort()
    return [StepEvent(worker=w, step=i, start=s, end=e) for i, (s, w, e) in enumerate(events)]


