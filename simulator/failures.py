"""Failures: the causes carried by `simpy.Interrupt`s and the processes that inject them.

Every failure is an interrupt of an actor's process (`worker`, `ps`,
`coordinator`); the `cause` says what happened. Injectors are processes too:
`random_failures` draws exponential times to failure from an MTBF, and
`scripted_failures` replays `[[failures.events]]`. Whether a crashed worker,
ps task or coordinator (the chief) comes back is decided by `kerasps launch`'s
own restart policy (`Restarts`).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import simpy

from kerasps.policy.restarts import Action, Decision, RestartPolicy  # pure Python, no TensorFlow
from simulator.scenario import FailureKind, FailuresSpec, Target

__all__ = ["Crash", "Abort", "Cancel", "Leave", "Restarts", "random_failures",
           "scripted_failures"]

# What a simulated crash looks like to the restart policy: a process killed by SIGKILL.
CRASH_EXIT_CODE = -9


@dataclasses.dataclass(frozen=True)
class Crash:
    """The actor fails and comes back after `downtime` seconds, or never if `permanent`."""

    downtime: float
    permanent: bool = False


@dataclasses.dataclass(frozen=True)
class Abort:
    """A worker's in-flight step is lost because the job failed (`reason` names the actor)."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Cancel:
    """A sync step completed without this worker's gradient (a backup worker's work)."""


@dataclasses.dataclass(frozen=True)
class Leave:
    """The worker leaves the elastic pool."""


class Restarts:
    """The restarts of every simulated task (worker, ps, chief), decided by
    `kerasps.policy.restarts`.

    Each crash asks `kerasps.policy.restarts.RestartPolicy.decide`, as the restart
    agent of `kerasps launch` does when a process exits: the task restarts
    on its budget, or the job ends.

    Args:
        max_restarts: restarts allowed per task (`failures.max_restarts`);
            `None`: unlimited.

    Attributes:
        counts: restarts so far, by task name (`"worker:1"`, `"ps:0"`, `"chief:0"`).
    """

    def __init__(self, max_restarts: int | None):
        self.policy = RestartPolicy(sys.maxsize if max_restarts is None else max_restarts)
        self.counts: dict[str, int] = {}

    def decide(self, task_type: str, index: int) -> Decision:
        """What happens to task `task_type:index`, which just crashed; counts a restart."""
        name = f"{task_type}:{index}"
        restarts = self.counts.get(name, 0)
        decision = self.policy.decide(task_type, index, CRASH_EXIT_CODE, restarts)
        if decision.action is Action.RESTART:
            self.counts[name] = restarts + 1
        return decision


def random_failures(env: simpy.Environment, cluster, target: Target, spec: FailuresSpec,
                    rng: np.random.Generator):
    """Fails random actors of `target` at exponential intervals.

    Each actor fails after an exponential time with mean its MTBF, counted
    only while it is up. With `n` actors this is a Poisson process of rate
    `n / mtbf` thinned to the actors that are up (exact for memoryless
    failures).
    """
    mtbf, downtime = {
        Target.WORKER: (spec.worker_mtbf, spec.worker_restart_time),
        Target.PS: (spec.ps_mtbf, spec.ps_restart_time),
        Target.COORDINATOR: (spec.coordinator_mtbf, spec.coordinator_restart_time),
    }[target]
    while True:
        actors = cluster.actors(target)
        if not actors:
            return
        yield env.timeout(rng.exponential(mtbf / len(actors)))
        actors = cluster.actors(target)
        if not actors:
            return
        actor = actors[int(rng.integers(len(actors)))]
        if actor.up and cluster.running:
            permanent = target is Target.WORKER and rng.random() < spec.worker_loss_probability
            actor.process.interrupt(Crash(downtime, permanent))


def scripted_failures(env: simpy.Environment, cluster, spec: FailuresSpec):
    """Replays the scripted `spec.events` in time order."""
    defaults = {Target.WORKER: spec.worker_restart_time, Target.PS: spec.ps_restart_time,
                Target.COORDINATOR: spec.coordinator_restart_time}
    for event in spec.events:
        yield env.timeout(max(0.0, event.time - env.now))
        actor = cluster.actor(event.target, event.index)
        if actor is None or not actor.up or not cluster.running:
            continue
        downtime = defaults[event.target] if event.downtime is None else event.downtime
        actor.process.interrupt(Crash(downtime, event.kind is FailureKind.LOSS))
