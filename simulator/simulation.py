"""Wiring a `Scenario` into simpy processes and running it: `run`."""

from __future__ import annotations

import contextlib
import gc
import math

import numpy as np
import simpy

from simulator import elastic, failures
from simulator import link as link_lib
from simulator.coordinator import Coordinator, coordinator
from simulator.machine import Machine
from simulator.metrics import Metrics, Result
from simulator.network import Network
from simulator.ps import ParameterServer, place_variables, ps
from simulator.scenario import Mode, Scenario, Target
from simulator.table import predict_load
from simulator.worker import Worker, step_durations, worker

__all__ = ["Cluster", "run"]

# Independent random streams, so that e.g. enabling failures does not change step times.
_WORKER_STREAM, _FAILURE_STREAM, _ELASTIC_STREAM, _CPU_STREAM = 0, 1, 2, 3
_PS_LINK_STREAM, _WORKER_LINK_STREAM, _EMBEDDING_STREAM = 4, 5, 6


class Cluster:
    """The simulated job: environment, coordinator, ps tasks and workers.

    Args:
        scenario: what to simulate.
        record_events: keep every worker step for traces (costs memory).
    """

    def __init__(self, scenario: Scenario, record_events: bool = False):
        self.scenario = scenario
        self.env = env = simpy.Environment()
        self.metrics = Metrics(record_events)
        m = scenario.machine
        self.machine = Machine(env, m.cores, m.background) if m.cores else None
        self.coordinator = Coordinator(env, scenario.training, scenario.checkpoint, self.metrics,
                                       scenario.failures.max_restarts,
                                       self.machine if m.ps else None)
        self.coordinator.min_members = scenario.elastic.min_workers
        self.coordinator.process = env.process(coordinator(env, self.coordinator))
        self.placement = place_variables(scenario.model, scenario.ps.count)
        loads = self.placement.bytes_per_ps(scenario.ps.count)
        self.table_load = None
        table_bytes = [0.0] * len(loads)
        if scenario.table is not None:
            t = scenario.table
            self.table_load = predict_load(t.table, t.ids.chunks(), t.ids_per_step,
                                           scenario.ps.count, t.optimizer_slots,
                                           warmup_steps=t.warmup_steps, seed=scenario.seed)
            table_bytes = list(self.table_load.bytes_per_step)
        self.servers = [ParameterServer(env, i, b, scenario.ps, step_bytes=b + extra)
                        for i, (b, extra) in enumerate(zip(loads, table_bytes))]
        for server in self.servers:
            server.process = env.process(ps(env, server, self.coordinator))
        self.network = Network(scenario.network)
        n = scenario.network
        if scenario.ps.contention and n.duplex == "full":
            for i, server in enumerate(self.servers):
                server.inlink, server.outlink = link_lib.duplex(
                    env, n.bandwidth, n.duplex_efficiency, self.rng(_PS_LINK_STREAM, i))
        elif scenario.ps.contention and n.sharing == "fair":
            for server in self.servers:
                server.inlink = server.outlink = link_lib.Link(env, n.bandwidth)
        self.cpu = (simpy.Resource(env, capacity=scenario.host.cpus)
                    if scenario.host.cpus else None)
        self.running = True
        for _ in range(scenario.workers.count):
            self.add_worker()

    def rng(self, stream: int, index: int = 0) -> np.random.Generator:
        """The random generator of `(stream, index)`, derived from the scenario seed."""
        seq = np.random.SeedSequence(self.scenario.seed, spawn_key=(stream, index))
        return np.random.default_rng(seq)

    def step_overhead(self) -> float:
        """Folded ps and network seconds per step: the slowest ps task's round trip."""
        if self.scenario.ps.contention:
            return 0.0
        return max((self.network.round_trip(s.step_bytes) + s.service_time
                    for s in self.servers if s.step_bytes), default=0.0)

    def add_worker(self) -> Worker:
        """Creates a worker (at start or on an elastic join) and starts its process."""
        s = self.scenario
        index = len(self.coordinator.workers)
        slow = s.workers.count - s.stragglers.count <= index < s.workers.count
        overhead = self.step_overhead()  # with shared cores, spent off them after the work
        durations = step_durations(
            s.workers.step_time, self.rng(_WORKER_STREAM, index),
            slowdown=s.stragglers.slowdown if slow else 1.0,
            stragglers=s.stragglers, overhead=0.0 if self.machine else overhead)
        links = None
        if not math.isinf(s.network.worker_bandwidth):  # its own link: (in, out)
            links = link_lib.duplex(self.env, s.network.worker_bandwidth,
                                    s.network.duplex_efficiency,
                                    self.rng(_WORKER_LINK_STREAM, index))
        embeddings = None
        if s.workers.embedding_time is not None:
            embeddings = step_durations(s.workers.embedding_time,
                                        self.rng(_EMBEDDING_STREAM, index))
        w = Worker(index, durations, self._extra(index, links), embeddings,
                   embedding_in_step=s.training.mode is not Mode.SYNC, machine=self.machine,
                   latency=overhead if self.machine else 0.0,
                   input_delay=s.stragglers.input_delay if slow else 0.0)
        self.coordinator.workers.append(w)
        self.coordinator.join(w)
        w.process = self.env.process(worker(self.env, w, self.coordinator))
        return w

    def _extra(self, index: int, links=None):
        """The generator function a step runs after its compute delay, if any; with
        `links` (the worker's own link: into it, out of it), each read also crosses the
        first and each gradient the second, and a transfer takes as long as the slower
        of the two links it crosses at its share of each."""
        env, s = self.env, self.scenario
        parts = []
        if s.ps.contention and any(server.step_bytes for server in self.servers):
            latency = 4 * s.network.latency

            def transfer(server):
                with server.resource.request() as request:
                    yield request
                    hold = self.network.wire_time(2 * server.step_bytes) + server.service_time
                    yield env.timeout(hold)
                    server.busy += hold
                if latency:
                    yield env.timeout(latency)

            def across(link, nbytes, into_worker):
                """`link` carries `nbytes`, and so does the worker's own link if any."""
                if links is None:
                    return link.transfer(nbytes)
                own = links[0] if into_worker else links[1]
                return env.all_of([link.transfer(nbytes), own.transfer(nbytes)])

            def read(server):  # full duplex: out of the ps task
                with server.uplink.request() as request:
                    yield request
                    yield across(server.outlink, server.step_bytes, True)
                if latency:
                    yield env.timeout(latency / 2)

            def send(server):  # full duplex: into the ps task, and the apply
                with server.resource.request() as request:
                    yield request
                    yield across(server.inlink, server.step_bytes, False)
                    yield env.timeout(server.service_time)
                    server.busy += server.service_time
                if latency:
                    yield env.timeout(latency / 2)

            def shared(server, direction, apply):  # fair sharing: the bytes, then the apply
                yield across(direction, server.step_bytes, not apply)
                if apply and server.service_time:
                    with server.resource.request() as request:
                        yield request
                        yield env.timeout(server.service_time)
                        server.busy += server.service_time
                if latency:
                    yield env.timeout(latency / 2)

            def transfers():
                servers = [server for server in self.servers if server.step_bytes]
                if s.network.sharing == "fair":  # reads out of the ps tasks, then gradients in
                    yield env.all_of([env.process(shared(server, server.outlink, False))
                                      for server in servers])
                    yield env.all_of([env.process(shared(server, server.inlink, True))
                                      for server in servers])
                elif s.network.duplex == "full":  # every read before any gradient
                    yield env.all_of([env.process(read(server)) for server in servers])
                    yield env.all_of([env.process(send(server)) for server in servers])
                else:
                    yield env.all_of([env.process(transfer(server)) for server in servers])

            parts.append(transfers)
        if self.cpu is not None:
            cpu_times = step_durations(s.host.cpu_time, self.rng(_CPU_STREAM, index))

            def compute():
                with self.cpu.request() as request:
                    yield request
                    yield env.timeout(next(cpu_times))

            parts.insert(0, compute)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]

        def both():
            for part in parts:
                yield from part()

        return both

    def actors(self, target: Target) -> list:
        """The actors a random failure of `target` can hit."""
        if target is Target.WORKER:
            return [w for w in self.coordinator.workers if w.process.is_alive]
        if target is Target.PS:
            return self.servers
        return [self.coordinator]

    def actor(self, target: Target, index: int):
        """The actor `index` of `target`, or `None`."""
        group = {Target.WORKER: self.coordinator.workers, Target.PS: self.servers,
                 Target.COORDINATOR: [self.coordinator]}[target]
        return group[index] if index < len(group) else None

    def start_failures(self):
        s = self.scenario.failures
        env = self.env
        for i, (target, mtbf) in enumerate([(Target.WORKER, s.worker_mtbf),
                                            (Target.PS, s.ps_mtbf),
                                            (Target.COORDINATOR, s.coordinator_mtbf)]):
            if not math.isinf(mtbf):
                env.process(failures.random_failures(env, self, target, s,
                                                     self.rng(_FAILURE_STREAM, i)))
        if s.events:
            env.process(failures.scripted_failures(env, self, s))
        e = self.scenario.elastic
        if e.events or e.join_rate or e.leave_rate:
            env.process(elastic.membership(env, self, e, self.rng(_ELASTIC_STREAM)))

    def run(self) -> Result:
        """Runs until `training.steps` are kept, a spent restart budget ends the job,
        `training.max_time`, or a stall."""
        self.start_failures()
        env, c = self.env, self.coordinator
        limit = self.scenario.training.max_time
        ends = [c.done, c.ended] + ([] if math.isinf(limit) else [env.timeout(limit)])
        until = env.any_of(ends)
        try:
            with _collector_tuned_for_simulation():
                env.run(until=until)
        except RuntimeError:  # no events left: every worker is gone
            pass
        self.running = False
        return self._result()

    def _result(self) -> Result:
        s, m, c = self.scenario, self.metrics, self.coordinator
        finished = c.done.triggered
        elapsed = self.env.now
        completed = sum(w.completed for w in c.workers)
        ps_rows = []
        for server in self.servers:
            busy = server.busy if s.ps.contention else completed * server.service_time
            if server.inlink is not None:  # the busier direction, and the applies
                busy += max(server.inlink.busy, server.outlink.busy)
            ps_rows.append({"index": server.index, "bytes": server.nbytes,
                            "traffic_bytes": 2 * server.step_bytes * completed,
                            "utilization": busy / elapsed if elapsed > 0 else 0.0})
        return Result(
            name=s.name, mode=s.training.mode.value, seed=s.seed,
            num_workers=s.workers.count, batch_size=s.workers.batch_size,
            elapsed=elapsed, finished=finished, steps=c.version,
            row_updates=m.row_updates if s.training.mode is Mode.HYBRID else m.applied,
            worker_steps=m.applied + m.dropped + m.lost, gradients_applied=m.applied,
            gradients_dropped=m.dropped, gradients_lost=m.lost,
            rolled_back_steps=m.rolled_back_steps,
            downtime=m.downtime, ps=ps_rows, failures=list(m.failures),
            checkpoints=list(m.checkpoints), restarts=dict(c.restarts.counts),
            ended_by=m.ended_by, table=None if self.table_load is None else (
                self.table_load.as_dict()), step_times=np.asarray(m.step_times),
            staleness=np.asarray(m.staleness, dtype=np.int64),
            step_ends=np.asarray(m.step_ends),
            dropped_step_times=np.asarray(m.dropped_step_times, dtype=float),
            step_work=np.asarray(m.step_work, dtype=float), events=m.events)


@contextlib.contextmanager
def _collector_tuned_for_simulation():
    """Keeps Python's cyclic garbage collector from rescanning the live model.

    A run allocates millions of short-lived events while thousands of worker
    processes stay alive; with default settings, full collections rescan those
    processes again and again, making cost grow with workers x steps. Freezing
    what exists before the run and collecting the young generation less often
    keeps cost linear in worker-steps. Settings are restored afterwards.
    """
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def run(scenario: Scenario, *, record_events: bool = False) -> Result:
    """Simulates `scenario` and returns its `Result`.

    Args:
        scenario: a `Scenario` (see `load_scenario`).
        record_events: keep every worker step (for `to_perfetto` and
            `Result.step_events`).

    Returns:
        A `Result`; the same scenario and seed always give the same result.
    """
    return Cluster(scenario, record_events).run()
