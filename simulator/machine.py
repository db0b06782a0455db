"""A machine whose cores the computations on it share (`[machine]`): processor sharing,
as an operating system's scheduler gives every runnable thread an equal share of the
cores."""

from __future__ import annotations

import simpy

__all__ = ["Machine", "machine"]

# Seconds of work left below which a computation counts as done (float rounding).
_EPSILON = 1e-12


class Machine:
    """`cores` cores, less the `background` cores other jobs keep busy, shared equally by
    the computations in progress on them.

    A computation is seconds of work, the time it takes on a core of its own. While `n`
    are in progress each does `min(1, (cores - background) / n)` seconds of work per
    second: as long as they fit on the free cores nothing is slowed, beyond that the
    free cores are split evenly. A computation that starts, ends or is cancelled changes
    the others' rate at once. Its process is `machine`.

    Other jobs take a share of the cores that does not grow with the job's computations:
    Linux shares the cores fairly among sessions (autogroups) or cgroups before it
    shares them among their threads, so another busy job keeps its share, whatever
    the number of threads of either.

    Attributes:
        cores: the cores.
        background: cores other jobs keep busy (a mean; less than `cores`).
        jobs: the computations in progress, their done event to the work they have left.
        arrivals: computations started since the machine last advanced `jobs` (they join
            `jobs` from that instant).
        cancelled: computations to drop when the machine next advances `jobs`.
        busy: core-seconds of work done.
        process: the `machine` process.
    """

    def __init__(self, env: simpy.Environment, cores: int, background: float = 0.0):
        self.env = env
        self.cores = cores
        self.background = background
        self.jobs: dict[simpy.Event, float] = {}
        self.arrivals: dict[simpy.Event, float] = {}
        self.cancelled: set[simpy.Event] = set()
        self.busy = 0.0
        self.changed = env.event()
        self.process = env.process(machine(env, self))

    def rate(self, computations: int) -> float:
        """Seconds of work per second each of `computations` in progress does."""
        return min(1.0, (self.cores - self.background) / computations)

    def compute(self, seconds: float) -> simpy.Event:
        """Starts `seconds` of work; returns the event that fires once it is done."""
        done = self.env.event()
        if seconds <= 0:
            done.succeed()
            return done
        self.arrivals[done] = float(seconds)
        _wake(self)
        return done

    def cancel(self, done: simpy.Event) -> None:
        """Stops the computation of `done` (its worker was interrupted); `done` never fires."""
        if self.arrivals.pop(done, None) is None and done in self.jobs:
            self.cancelled.add(done)
            _wake(self)


def _wake(m: Machine) -> None:
    if not m.changed.triggered:
        m.changed.succeed()


def machine(env: simpy.Environment, m: Machine):
    """The machine's process: advances every computation in progress at its share of the
    cores (`Machine.rate`) and fires a computation's event when its work is done.

    It wakes when the next computation would end at the current share, or when the
    share changes: a computation starts or is cancelled.
    """
    jobs = m.jobs
    while True:
        if m.arrivals:
            jobs.update(m.arrivals)
            m.arrivals.clear()
        if not jobs:
            yield m.changed
            m.changed = env.event()
            continue
        start = env.now
        rate = m.rate(len(jobs))
        first = min(jobs, key=jobs.get)
        next_end = env.timeout(jobs[first] / rate)
        yield next_end | m.changed
        work = (env.now - start) * rate
        m.busy += work * len(jobs)
        for done, left in list(jobs.items()):
            if done in m.cancelled:
                del jobs[done]
            elif left - work <= _EPSILON or (next_end.processed and done is first):
                del jobs[done]
                done.succeed()
            else:
                jobs[done] = left - work
        m.cancelled.clear()
        if m.changed.triggered:
            m.changed = env.event()
