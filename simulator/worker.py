"""Workers: their step times and the `worker` process.

One simulated step costs one simpy event in the common case: step times are
drawn in NumPy batches, and the ps and network time of a step is folded into
its delay (unless `ps.contention`, `[host]` or `[machine]` ask for shared resources).
"""

from __future__ import annotations

import numpy as np
import simpy

from simulator.distributions import Distribution
from simulator.failures import Cancel, Crash, Leave
from simulator.scenario import StragglersSpec

__all__ = ["Worker", "step_durations", "worker"]

_BATCH = 512


def step_durations(dist: Distribution, rng: np.random.Generator, *, slowdown: float = 1.0,
                   stragglers: StragglersSpec = StragglersSpec(), overhead: float = 0.0):
    """Yields step times forever: `dist` times `slowdown`, straggler tail, plus `overhead`.

    Args:
        dist: the compute-time distribution.
        rng: this worker's random generator.
        slowdown: persistent multiplier (a slow machine).
        stragglers: `tail_probability` of a step being slowed by `tail_slowdown`
            (Pareto-distributed above it if `tail_alpha` is set).
        overhead: fixed seconds added to every step (folded ps and network time).
    """
    p = stragglers.tail_probability
    while True:
        x = dist.sample(rng, _BATCH)
        if slowdown != 1.0:
            x = x * slowdown
        if p > 0:
            hit = rng.random(_BATCH) < p
            k = int(hit.sum())
            if k:
                factor = np.full(k, stragglers.tail_slowdown)
                if stragglers.tail_alpha is not None:
                    factor *= 1.0 + rng.pareto(stragglers.tail_alpha, k)
                x[hit] *= factor
        if overhead:
            x = x + overhead
        yield from x.tolist()


class Worker:
    """State of one worker task.

    Attributes:
        index: worker index (joiners get new indices).
        durations: iterator of this worker's step times.
        up: `False` while crashed, and after it left or was lost.
        in_flight: `True` while it computes a step.
        pushed: version of its last gradient in sync mode (`None` after a rollback).
        completed: steps it finished.
        extra: `None`, or a generator function run after the compute delay
            (ps transfers under contention, the shared CPU of `[host]`).
        embeddings: `None`, or an iterator of the seconds of its steps' row updates
            (`workers.embedding_time`).
        embedding_in_step: whether a row update's seconds are part of the worker step
            (async and hybrid) rather than of the global step's apply (sync).
        embedding_seconds: the row update's seconds of its latest step.
        version: the global step its latest step read.
        missed: sync and hybrid with late workers finishing: the global step that was
            current when its latest gradient came too late for its own (`None` if it
            never did).
        machine: `None`, or the `Machine` whose cores its steps compute on (`[machine]`);
            its drawn step times are then seconds of work there.
        latency: with `machine`: seconds a step spends after its computation, off the
            cores (folded ps and network time).
        input_delay: seconds each of its batches is held back (`stragglers.input_delay`).
        input_ready: when its next batch is ready.
        job: the done event of its computation in progress on `machine`, or `None`.
    """

    def __init__(self, index: int, durations, extra=None, embeddings=None,
                 embedding_in_step: bool = True, machine=None, latency: float = 0.0,
                 input_delay: float = 0.0):
        self.index = index
        self.durations = durations
        self.extra = extra
        self.embeddings = embeddings
        self.embedding_in_step = embedding_in_step
        self.embedding_seconds = 0.0
        self.version = None
        self.missed = None
        self.machine = machine
        self.latency = latency
        self.input_delay = input_delay
        self.input_ready = 0.0
        self.job = None
        self.up = True
        self.in_flight = False
        self.pushed = None
        self.completed = 0
        self.process: simpy.Process | None = None


def worker(env: simpy.Environment, w: Worker, coordinator):
    """The worker's process: read variables, compute, push the gradient, repeat.

    Interrupts: `Cancel` (sync step done without it), `Abort` (the job
    failed), `Crash` (down for its restart delay if the restart policy
    allows, else the job ends; or gone for good, and the job goes on without
    it), `Leave` (elastic).
    """
    c = coordinator
    policy = c.policy
    metrics = c.metrics
    step_times = metrics.step_times
    events = metrics.events
    durations = w.durations
    while True:
        try:
            while c.gate is not None:
                yield c.gate
            wait = policy.start(w)
            if wait is not None:
                yield wait
                continue
            version = w.version = c.version
            w.in_flight = True
            metrics.executed += 1
            start = env.now
            drawn = next(durations)
            if w.embeddings is not None:
                w.embedding_seconds = next(w.embeddings)
                if w.embedding_in_step:
                    drawn += w.embedding_seconds
            if w.input_delay:  # its batch, prepared since it took the previous one
                if w.input_ready > env.now:
                    yield env.timeout(w.input_ready - env.now)
                w.input_ready = env.now + w.input_delay
            if w.machine is None:
                yield env.timeout(drawn)
            else:
                w.job = w.machine.compute(drawn)
                yield w.job
                w.job = None
                if w.latency:
                    yield env.timeout(w.latency)
            if w.extra is not None:
                yield from w.extra()
            w.in_flight = False
            step_times.append(env.now - start)
            w.completed += 1
            if events is not None:
                events.append((w.index, start, env.now, version, "done"))
            wait = policy.push(w, version)
            if wait is not None:
                yield wait
        except simpy.Interrupt as interrupt:
            cause = interrupt.cause
            if w.job is not None:  # its computation stops taking a share of the cores
                w.machine.cancel(w.job)
                w.job = None
            if w.in_flight:
                w.in_flight = False
                policy.lost(w)
                outcome = "dropped" if isinstance(cause, Cancel) else "lost"
                if outcome == "dropped":
                    metrics.dropped += 1
                    # Its time is the drawn one, unless queueing, shared cores or a held
                    # back batch add to it.
                    if w.extra is None and w.machine is None and not w.input_delay:
                        metrics.dropped_step_times.append(drawn)
                else:
                    metrics.lost += 1
                if events is not None:
                    events.append((w.index, start, env.now, version, outcome))
            if isinstance(cause, Leave):
                w.up = False
                c.leave(w)
                return
            if isinstance(cause, Crash):
                w.up = False
                kind = "loss" if cause.permanent else "crash"
                metrics.failures.append((env.now, f"worker:{w.index}", kind, 0))
                if cause.permanent:
                    c.leave(w)
                    return
                if not c.restart("worker", w.index):
                    return
                yield env.timeout(cause.downtime)
                w.up = True
