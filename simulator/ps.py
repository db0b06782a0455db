"""Parameter-server tasks: the bytes placed on each, its service time, its process."""

from __future__ import annotations

import math

import simpy

from kerasps.policy import partitioners as partitioners_lib
from kerasps.policy import placement as placement_lib
from simulator.scenario import ModelSpec, PsSpec

__all__ = ["ParameterServer", "place_variables", "ps"]


def place_variables(model: ModelSpec, num_ps: int) -> placement_lib.PlacementReport:
    """Shards and places `model.variables` with kerasps's own placement code."""
    partitioner = None
    if model.partitioner is not None:
        args = dict(model.partitioner)
        kind = args.pop("kind")
        cls = {"fixed_shards": partitioners_lib.FixedShardsPartitioner,
               "min_size": partitioners_lib.MinSizePartitioner,
               "max_size": partitioners_lib.MaxSizePartitioner}[kind]
        partitioner = cls(**args)
    variables = [(v.name, v.shape, v.dtype) for v in model.variables]
    return placement_lib.plan(variables, num_ps, partitioner, model.placement)


class ParameterServer:
    """State of one ps task.

    Attributes:
        index: task index.
        nbytes: bytes of variable shards placed on it.
        step_bytes: bytes it reads and applies per worker step: `nbytes`, plus
            its part of a dynamic table's traffic (`[table]`; the table's rows
            move only as the batch touches them).
        service_time: seconds it spends on one worker step (apply the
            gradient, serve the read); with contention, this plus the wire
            time is how long a step holds `resource`.
        resource: a capacity-1 simpy `Resource` when ps contention is modelled: the
            task's link (with a full-duplex `[network]`, the turn of its inbound
            direction: a gradient, then its apply).
        uplink: with contention, the turn of the outbound direction of a full-duplex
            link (a read at a time, with `sharing = "queue"`).
        inlink: with contention and a full-duplex link or `sharing = "fair"`, the `Link`
            that carries its inbound bytes (gradients); `None` otherwise.
        outlink: likewise its outbound bytes (reads): `inlink` itself when the link is
            half duplex.
        up: `False` while it is down after a crash.
        busy: seconds spent serving (contention mode only; otherwise derived).
    """

    def __init__(self, env: simpy.Environment, index: int, nbytes: int, spec: PsSpec,
                 step_bytes: float | None = None):
        self.index = index
        self.nbytes = nbytes
        self.step_bytes = nbytes if step_bytes is None else step_bytes
        self.service_time = (0.0 if math.isinf(spec.service_rate)
                             else self.step_bytes / spec.service_rate)
        self.resource = simpy.Resource(env, capacity=1) if spec.contention else None
        self.uplink = simpy.Resource(env, capacity=1) if spec.contention else None
        self.inlink = self.outlink = None  # set by the cluster (`simulator.link`)
        self.up = True
        self.busy = 0.0
        self.process: simpy.Process | None = None


def ps(env: simpy.Environment, server: ParameterServer, coordinator):
    """The ps task's process: idle until a failure interrupts it.

    A crash takes the task down for the downtime carried by the interrupt;
    the job loses every in-flight step and rolls back to the last checkpoint
    (see `Coordinator.job_failure`), then restores it once the task is back.
    A crash beyond the task's restart budget ends the job instead.
    """
    while True:
        try:
            yield env.event()  # serving is done by workers holding `server.resource`
        except simpy.Interrupt as interrupt:
            server.up = False
            actor = f"ps:{server.index}"
            if not coordinator.restart("ps", server.index):
                coordinator.metrics.failures.append((env.now, actor, "crash", 0))
                return
            yield from coordinator.job_failure(actor, interrupt.cause)
            server.up = True
