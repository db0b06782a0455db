"""Scenarios: what is simulated, as frozen dataclasses read from TOML.

A scenario file has one table per part of the system:

```toml
name = "stragglers"
seed = 0

[workers]
count = 20
batch_size = 64
step_time = { distribution = "shifted_exponential", shift = 0.05, rate = 20.0 }

[training]
mode = "sync"          # or "async", or "hybrid"
steps = 2000           # global steps (model updates)
backup_workers = 2
```

A hybrid scenario gives the embedding part of a worker step its own cost
(`workers.embedding_time`), and sync and hybrid scenarios the apply function's
(`training.apply_time`): see `WorkersSpec` and `TrainingSpec` for where each mode
spends them.

and optionally `[stragglers]`, `[ps]`, `[network]`, `[model]`, `[checkpoint]`,
`[failures]`, `[elastic]`, `[host]`, `[machine]` and `[table]` (see the `*Spec` classes for
their keys). Everything is validated when the file is loaded: unknown keys,
negative rates and impossible settings raise a `ScenarioError` naming the key
and the value received.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
import tomllib
from collections.abc import Mapping

from kerasps.policy.consistency import Mode  # pure Python, shared with kerasps
from simulator import distributions
from simulator.distributions import Distribution
from simulator.errors import ScenarioError, invalid_value
from simulator.tables import Table

__all__ = [
    "Mode",
    "Target",
    "FailureKind",
    "ElasticAction",
    "WorkersSpec",
    "StragglersSpec",
    "PsSpec",
    "NetworkSpec",
    "VariableSpec",
    "ModelSpec",
    "TrainingSpec",
    "CheckpointSpec",
    "FailureEvent",
    "FailuresSpec",
    "ElasticEvent",
    "ElasticSpec",
    "HostSpec",
    "MachineSpec",
    "DynamicTableSpec",
    "Scenario",
    "load_scenario",
    "parse_value",
]


class Target(enum.Enum):
    """Which actor a failure hits."""

    WORKER = "worker"
    PS = "ps"
    COORDINATOR = "coordinator"


class FailureKind(enum.Enum):
    CRASH = "crash"  # the actor restarts after a downtime
    LOSS = "loss"  # a worker leaves for good


class ElasticAction(enum.Enum):
    JOIN = "join"
    LEAVE = "leave"


@dataclasses.dataclass(frozen=True)
class WorkersSpec:
    """`[workers]`: the worker pool.

    Attributes:
        count: number of workers at the start.
        step_time: distribution of one step's compute time, in seconds.
        batch_size: examples per worker step (for examples/s).
        embedding_time: `None`, or the distribution of the seconds one worker step
            spends on its embedding tables' row update (the apply of its rows on the ps
            tasks), besides `step_time` (the dense part: forward, backward, the dense
            gradient). Where it is spent depends on `training.mode`, as in kerasps:
            async and hybrid: in the worker step, which applies its row update itself
            (hybrid: a late worker's too, whose dense gradient is dropped); sync: in the
            global step's apply function, which applies the row updates of the kept
            gradients one after the other (they wait in slot queues on the ps tasks
            until then), so the kept workers' drawn `embedding_time`s add up there.
            It is ps work: `[stragglers]` (a slow worker's compute) does not scale it.
    """

    count: int
    step_time: Distribution
    batch_size: int = 1
    embedding_time: Distribution | None = None


@dataclasses.dataclass(frozen=True)
class StragglersSpec:
    """`[stragglers]`: slow workers.

    Attributes:
        count: the last `count` workers are persistently slower by `slowdown`.
        slowdown: step-time multiplier of those workers.
        tail_probability: chance that any step is a straggler step.
        tail_slowdown: multiplier of a straggler step (the minimum if `tail_alpha` is set).
        tail_alpha: if set, straggler multipliers are Pareto with this shape
            and minimum `tail_slowdown` (a heavy tail).
        input_delay: seconds each batch of those `count` workers' input is held back, off
            the CPU (`kerasps.input.slowed`). A batch is prepared while its worker
            computes, from when the worker took the previous one, so such a worker
            starts a step's computation no sooner than `input_delay` after it took its
            previous batch: its steps take the longer of the two, and the wait is part of
            the step (a sync step's function waits for its batch).
    """

    count: int = 0
    slowdown: float = 1.0
    tail_probability: float = 0.0
    tail_slowdown: float = 1.0
    tail_alpha: float | None = None
    input_delay: float = 0.0


@dataclasses.dataclass(frozen=True)
class PsSpec:
    """`[ps]`: parameter-server tasks.

    Attributes:
        count: number of ps tasks.
        service_rate: bytes per second a ps task applies (updates and reads).
        contention: model each ps task as a simpy `Resource` that worker
            transfers queue for; otherwise ps and network time is a fixed
            delay folded into each step.
    """

    count: int = 1
    service_rate: float = math.inf
    contention: bool = False


@dataclasses.dataclass(frozen=True)
class NetworkSpec:
    """`[network]`: every worker-ps link.

    Attributes:
        bandwidth: bytes per second of one link.
        latency: one-way latency of one message, in seconds.
        duplex: `"half"`: with ps contention, a step's variable read and its gradient
            take turns on the ps task's link (a step holds it for both); `"full"`: the
            link carries reads (out of the ps task) and gradients (into it) at once, as a
            switched Ethernet link does, so one worker's read overlaps another's gradient.
        sharing: with ps contention, how transfers in the same direction of a ps task's
            link meet: `"queue"`: one at a time, each whole, in arrival order;
            `"fair"`: all at once, each at an equal share of the rate (processor
            sharing, as concurrent TCP flows through one bottleneck), so two equal
            transfers that start together end together, after twice the time of one.
        duplex_efficiency: with a full-duplex link, the share of its rate a direction
            keeps while the other direction carries bytes too (1: none lost), or a
            `Distribution` of such shares (`{distribution = "empirical", samples =
            [...]}`), each transfer drawing its own. Measure it by loading both
            directions with plain TCP flows (`benchmarks/network.py link --both-ways`);
            on the network bench's 100 Mbit/s `tbf` links it is 0.55-0.94, median 0.77.
        worker_bandwidth: bytes per second of each worker's own link (full duplex, with
            ps contention), which every read into the worker and every gradient out of
            it also crosses: a step's bytes from all ps tasks share it. Infinite (the
            default): the workers' links never limit.
    """

    bandwidth: float = math.inf
    latency: float = 0.0
    duplex: str = "half"
    sharing: str = "queue"
    duplex_efficiency: float | Distribution = 1.0
    worker_bandwidth: float = math.inf


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """One `[[model.variables]]` entry."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """`[model]`: variables, sharded and placed by `kerasps.placement.plan`.

    Attributes:
        variables: the model's variables in creation order.
        partitioner: `None` or a table with `kind` (`"fixed_shards"`,
            `"min_size"`, `"max_size"`) and the partitioner's arguments.
        placement: `"round_robin"` or `"greedy"`.
    """

    variables: tuple[VariableSpec, ...] = ()
    partitioner: Mapping | None = None
    placement: str = "round_robin"


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """`[training]`: the dispatch policy and the length of the run.

    Attributes:
        mode: `Mode.ASYNC`, `Mode.SYNC` or `Mode.HYBRID` (dense gradients in global
            steps as in sync mode, each worker's row update applied when its step ends,
            a late worker's included, as in async mode; see `workers.embedding_time`).
        steps: global steps (model updates) to reach.
        backup_workers: in sync and hybrid modes, gradients a step does not wait for.
        max_staleness: in async mode, gradients staler than this are dropped.
        max_time: stop after this many simulated seconds even if unfinished.
        apply_time: sync and hybrid: seconds the apply function of a global step takes
            (averaging the kept dense gradients on the ps tasks and applying the mean),
            once a step has its gradients and before the next step starts; in sync mode
            the kept row updates' `workers.embedding_time` adds to it.
        late_workers: sync and hybrid: what becomes of a worker still computing when its
            step has its gradients. `"cancel"` (sync's default: the model of Chen et al.'s
            analysis, whose closed forms the tests check): it stops and starts the next
            step with the others. `"finish"` (hybrid's only choice, and what kerasps does
            in both modes): it finishes its step, whose dense gradient is dropped, and
            joins the next step only if that step would be short of gradients without
            it, otherwise the one after. `None` in async mode.
    """

    mode: Mode = Mode.ASYNC
    steps: int = 1000
    backup_workers: int = 0
    max_staleness: int | None = None
    max_time: float = math.inf
    apply_time: float = 0.0
    late_workers: str | None = "cancel"


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """`[checkpoint]`: periodic checkpoints by the coordinator.

    Attributes:
        every: checkpoint every this many global steps (0: never).
        duration: seconds training pauses to write one.
        restore_time: seconds to restore one after a ps or coordinator failure.
    """

    every: int = 0
    duration: float = 0.0
    restore_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class FailureEvent:
    """One `[[failures.events]]` entry: a scripted failure."""

    time: float
    target: Target
    index: int = 0
    kind: FailureKind = FailureKind.CRASH
    downtime: float | None = None


@dataclasses.dataclass(frozen=True)
class FailuresSpec:
    """`[failures]`: random (exponential time to failure) and scripted failures.

    Attributes:
        worker_mtbf: mean seconds between failures of one worker.
        worker_restart_time: seconds a crashed worker is down.
        worker_loss_probability: chance that a worker failure is permanent.
        ps_mtbf: mean seconds between failures of one ps task.
        ps_restart_time: seconds a crashed ps task is down (then the job
            restores the last checkpoint).
        coordinator_mtbf: mean seconds between coordinator failures.
        coordinator_restart_time: seconds the coordinator is down.
        max_restarts: restarts allowed per worker, ps or coordinator (chief) task,
            as `kerasps launch --max-restarts`: `kerasps.policy.restarts.RestartPolicy`
            decides, and the crash after the last one ends the job
            (`Result.ended_by`). `None`: unlimited. Permanent losses do not count.
        events: scripted failures.
    """

    worker_mtbf: float = math.inf
    worker_restart_time: float = 0.0
    worker_loss_probability: float = 0.0
    ps_mtbf: float = math.inf
    ps_restart_time: float = 0.0
    coordinator_mtbf: float = math.inf
    coordinator_restart_time: float = 0.0
    max_restarts: int | None = None
    events: tuple[FailureEvent, ...] = ()


@dataclasses.dataclass(frozen=True)
class ElasticEvent:
    """One `[[elastic.events]]` entry: workers joining or leaving at `time`."""

    time: float
    action: ElasticAction
    count: int = 1


@dataclasses.dataclass(frozen=True)
class ElasticSpec:
    """`[elastic]`: a worker pool that changes while the job runs.

    Attributes:
        min_workers: training pauses while fewer workers are members.
        max_workers: joins beyond this are refused.
        join_rate: workers joining per second (Poisson).
        leave_rate: workers leaving per second (Poisson).
        events: scripted joins and leaves.
    """

    min_workers: int = 1
    max_workers: int | None = None
    join_rate: float = 0.0
    leave_rate: float = 0.0
    events: tuple[ElasticEvent, ...] = ()


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """`[host]`: workers sharing the CPUs of one machine (an in-process cluster).

    When `cpus` is set, a step is `workers.step_time` of latency (dispatch,
    RPC) plus `cpu_time` of work on a shared simpy `Resource` with `cpus`
    slots. This is the model that `simulator.calibrate` fits.
    """

    cpus: int | None = None
    cpu_time: Distribution | None = None


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """`[machine]`: the workers share the cores of one machine, each step's computation
    taking its share of them (processor sharing; `simulator.machine`).

    When `cores` is set, a worker step's `workers.step_time` (and, in async and hybrid
    modes, its `workers.embedding_time`) is seconds of work on a core of its own (a
    straggler's `slowdown` scales it), and while `n` steps compute at once each does
    `min(1, (cores - background) / n)` seconds of it per second: a step alone is not
    slowed, 4 steps on 2 idle cores take twice as long. The folded ps and network time of a
    step is spent after its computation, off the cores. Unlike `[host]` (a queue for
    a separate `host.cpu_time`, one step on a CPU at a time), nothing waits its turn.

    Attributes:
        cores: the cores (`None`: every worker has a core of its own, the default).
        background: cores that other jobs on the machine keep busy (a mean, less than
            `cores`); the steps share the rest. Linux shares the cores fairly among
            sessions or cgroups first, so another busy job keeps its share however many
            threads the job's steps run: measure what the other processes use
            (`/proc/PID/stat`), not their runnable threads.
        ps: whether the ps tasks run on the machine too (an in-process cluster): a
            global step's apply function (`training.apply_time`, and in sync mode the
            kept row updates) then computes on the cores as well. (An async step
            applies its own gradient: that is in `workers.step_time` already.)
    """

    cores: int | None = None
    background: float = 0.0
    ps: bool = False


@dataclasses.dataclass(frozen=True)
class DynamicTableSpec:
    """`[table]`: a `kerasps.layers.DynamicEmbedding` table the workers look ids up in.

    Its hit rate and churn are replayed once from the stream (`simulator.table`);
    the bytes each ps task then moves and applies per worker step are added to
    its service and wire time.

    Attributes:
        table: the table's shape and policies (`capacity`, `output_dim`,
            `num_partitions`, `min_count`, `probability`, `eviction`,
            `steps_to_live`, as the layer takes them).
        optimizer_slots: slots per row (Adagrad 1, Adam 2).
        ids_per_step: ids one worker step looks up.
        warmup_steps: steps replayed before counting (the table fills).
        ids: the stream, `[table.ids]` (`simulator.idstream.ZipfStream`'s
            `examples`, `distinct`, `window`, `exponent`, `seed`).
    """

    table: object
    ids: object
    optimizer_slots: int = 1
    ids_per_step: int = 1024
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A complete, validated scenario. Build one with `load_scenario` or `Scenario.from_dict`."""

    workers: WorkersSpec
    name: str = "scenario"
    description: str = ""
    seed: int = 0
    stragglers: StragglersSpec = StragglersSpec()
    ps: PsSpec = PsSpec()
    network: NetworkSpec = NetworkSpec()
    model: ModelSpec = ModelSpec()
    training: TrainingSpec = TrainingSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    failures: FailuresSpec = FailuresSpec()
    elastic: ElasticSpec = ElasticSpec()
    host: HostSpec = HostSpec()
    machine: MachineSpec = MachineSpec()
    table: DynamicTableSpec | None = None
    raw: Mapping = dataclasses.field(default_factory=dict, compare=False, repr=False)
    source: str | None = dataclasses.field(default=None, compare=False, repr=False)
    base_dir: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: Mapping, source: str | None = None,
                  base_dir: str | None = None) -> Scenario:
        """Validates a scenario given as nested dicts (the TOML structure)."""
        return _parse(copy.deepcopy(dict(data)), source, base_dir)

    def with_overrides(self, overrides: Mapping[str, object], *,
                       source: str | None = None) -> Scenario:
        """Returns a copy with dotted keys replaced, e.g. `{"training.backup_workers": 2}`.

        The result is validated like a file, so a bad override raises a `ScenarioError`
        naming its key; since this scenario is valid, the error blames the overrides.

        Args:
            overrides: dotted keys to their new values.
            source: what errors name as the overrides' origin (`"--set a.b=1"`); by
                default "overrides a.b=1 of <file>".
        """
        if source is None:
            listed = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            source = f"overrides {listed}" + (f" of {self.source}" if self.source else "")
        data = copy.deepcopy(dict(self.raw))
        for key, value in overrides.items():
            parts = key.split(".")
            node = data
            for part in parts[:-1]:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise invalid_value(key, value, f"`{part}` is not a table", source)
                node = child
            node[parts[-1]] = value
        return dataclasses.replace(_parse(data, source, self.base_dir), source=self.source)

    def to_toml(self) -> str:
        """The scenario as TOML text (from its raw tables)."""
        return dumps_toml(self.raw)


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Reads and validates a scenario TOML file.

    Raises:
        ScenarioError: on unknown keys, bad values or impossible settings.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ScenarioError(f"Invalid TOML in {os.path.basename(path)}: {e}") from None
    return _parse(data, os.path.basename(path), os.path.dirname(os.path.abspath(path)))


def parse_value(text: str):
    """Parses a command-line value as TOML (`3`, `0.5`, `true`, `"x"`), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_PARTITIONERS = {
    "fixed_shards": ("FixedShardsPartitioner", ("num_shards",)),
    "min_size": ("MinSizePartitioner", ("min_shard_bytes", "max_shards", "bytes_per_string")),
    "max_size": ("MaxSizePartitioner", ("max_shard_bytes", "max_shards", "bytes_per_string")),
}


def _duplex_efficiency(n: Table):
    """`network.duplex_efficiency`: a number in (0, 1], or a constant or empirical
    distribution of them."""
    if not isinstance(n.raw("duplex_efficiency", 1.0), dict):
        return n.number("duplex_efficiency", 1.0, positive=True, maximum=1.0)
    dist = distributions.from_table(n.table("duplex_efficiency"))
    values = (dist.value,) if isinstance(dist, distributions.Constant) else getattr(
        dist, "samples", ())
    if not values or not all(0 < v <= 1 for v in values):
        raise n.error("duplex_efficiency", n.raw("duplex_efficiency"),
                      "expected a number in (0, 1], or a constant or empirical "
                      "distribution of such numbers")
    return dist


def _embedding_time(w: Table, base_dir: str | None) -> Distribution | None:
    """`workers.embedding_time`: seconds (a number) or a distribution table; `None` if
    absent or 0."""
    if not w.has("embedding_time"):
        return None
    if isinstance(w.raw("embedding_time"), dict):
        return distributions.from_table(w.table("embedding_time"), base_dir)
    seconds = w.number("embedding_time", non_negative=True)
    return distributions.Constant(seconds) if seconds else None


def _parse(data: dict, source: str | None, base_dir: str | None) -> Scenario:
    top = Table(data, "", source)
    name = top.string("name", "scenario")
    description = top.string("description", "")
    seed = top.integer("seed", 0, minimum=0)

    w = top.table("workers")
    step_time = distributions.from_table(w.table("step_time"), base_dir)
    workers = WorkersSpec(count=w.integer("count", minimum=1), step_time=step_time,
                          batch_size=w.integer("batch_size", 1, minimum=1),
                          embedding_time=_embedding_time(w, base_dir))
    w.finish()

    s = top.table("stragglers", {})
    stragglers = StragglersSpec(
        count=s.integer("count", 0, minimum=0),
        slowdown=s.number("slowdown", 1.0, positive=True),
        tail_probability=s.number("tail_probability", 0.0, non_negative=True, maximum=1.0),
        tail_slowdown=s.number("tail_slowdown", 1.0, positive=True),
        tail_alpha=s.number("tail_alpha", None, positive=True),
        input_delay=s.number("input_delay", 0.0, non_negative=True),
    )
    if stragglers.count > workers.count:
        raise s.error("count", stragglers.count,
                      f"there are only {workers.count} workers (`workers.count`)")
    if stragglers.input_delay and not stragglers.count:
        raise s.error("input_delay", stragglers.input_delay,
                      "it delays the input of the `stragglers.count` slow workers, and "
                      "there are none; set `stragglers.count`")
    s.finish()

    p = top.table("ps", {})
    ps = PsSpec(count=p.integer("count", 1, minimum=1),
                service_rate=p.number("service_rate", math.inf, positive=True, allow_inf=True),
                contention=p.boolean("contention", False))
    p.finish()

    n = top.table("network", {})
    network = NetworkSpec(bandwidth=n.number("bandwidth", math.inf, positive=True,
                                             allow_inf=True),
                          latency=n.number("latency", 0.0, non_negative=True),
                          duplex=n.string("duplex", "half"),
                          sharing=n.string("sharing", "queue"),
                          duplex_efficiency=_duplex_efficiency(n),
                          worker_bandwidth=n.number("worker_bandwidth", math.inf, positive=True,
                                                    allow_inf=True))
    if network.duplex not in ("half", "full"):
        raise n.error("duplex", network.duplex, "expected one of ['half', 'full']")
    if network.sharing not in ("queue", "fair"):
        raise n.error("sharing", network.sharing, "expected one of ['fair', 'queue']")
    if network.duplex_efficiency != 1.0 and network.duplex != "full":
        raise n.error("duplex_efficiency", n.raw("duplex_efficiency"),
                      "a half-duplex link never carries both directions at once; "
                      "set `network.duplex = \"full\"`")
    if not math.isinf(network.worker_bandwidth) and (network.duplex != "full"
                                                     or not ps.contention):
        raise n.error("worker_bandwidth", network.worker_bandwidth,
                      "the workers' links are modelled with full-duplex ps links under "
                      "contention; set `network.duplex = \"full\"` and "
                      "`ps.contention = true`")
    n.finish()

    model = _parse_model(top.table("model", {}), ps.count)
    training = _parse_training(top.table("training", {}), workers.count)

    c = top.table("checkpoint", {})
    checkpoint = CheckpointSpec(every=c.integer("every", 0, minimum=0),
                                duration=c.number("duration", 0.0, non_negative=True),
                                restore_time=c.number("restore_time", 0.0, non_negative=True))
    c.finish()

    failures = _parse_failures(top.table("failures", {}), workers.count, ps.count)
    elastic = _parse_elastic(top.table("elastic", {}), workers.count, training)

    h = top.table("host", {})
    host = HostSpec(cpus=h.integer("cpus", None, minimum=1),
                    cpu_time=(distributions.from_table(h.table("cpu_time"), base_dir)
                              if h.has("cpu_time") else None))
    if (host.cpus is None) != (host.cpu_time is None):
        missing = "cpu_time" if host.cpu_time is None else "cpus"
        raise invalid_value(f"host.{missing}", None,
                            "`host.cpus` and `host.cpu_time` must be given together", source)
    h.finish()
    machine = _parse_machine(top.table("machine", {}), host, training)
    table = _parse_table(top.table("table")) if top.has("table") else None
    top.finish()
    return Scenario(workers=workers, name=name, description=description, seed=seed,
                    stragglers=stragglers, ps=ps, network=network, model=model,
                    training=training, checkpoint=checkpoint, failures=failures,
                    elastic=elastic, host=host, machine=machine, table=table, raw=data,
                    source=source,
                    base_dir=base_dir)


def _parse_machine(t: Table, host: HostSpec, training: TrainingSpec) -> MachineSpec:
    spec = MachineSpec(cores=t.integer("cores", None, minimum=1),
                       background=t.number("background", 0.0, non_negative=True),
                       ps=t.boolean("ps", False))
    if spec.cores is not None and spec.background >= spec.cores:
        raise t.error("background", spec.background,
                      f"other jobs must leave some of the {spec.cores} cores "
                      "(`machine.cores`) to the workers")
    if spec.cores is None:
        for name in ("background", "ps"):
            if t.has(name):
                raise t.error(name, t.raw(name), "it describes the shared cores of "
                              "`machine.cores`, which is not set")
    elif host.cpus is not None:
        raise t.error("cores", spec.cores,
                      "`[host]` already shares a CPU among the workers (a queue for "
                      "`host.cpu_time`); give one of `[host]` and `[machine]`")
    t.finish()
    return spec


def _parse_table(t: Table) -> DynamicTableSpec:
    from kerasps.policy import tables  # pure Python, no TensorFlow
    from simulator.idstream import ZipfStream

    def checked(make, table, names):
        try:
            return make()
        except ValueError as error:  # "Invalid value for argument `x`...": name the key
            message = str(error)
            name = next((n for n in names if f"`{n}`" in message), names[0])
            raise table.error(name, table.data.get(name), message.split(": ", 1)[-1].split(
                ". Received", 1)[0]) from None

    args = {name: t.raw(name) for name in ("capacity", "output_dim")}
    for name in ("num_partitions", "min_count", "probability", "eviction", "steps_to_live"):
        if t.has(name):
            args[name] = t.raw(name)
    spec = checked(lambda: tables.TableSpec(**args), t, list(args))
    ids = t.table("ids")
    stream_args = {name: ids.raw(name) for name in ("examples", "distinct", "window")}
    for name in ("exponent", "seed", "chunk"):
        if ids.has(name):
            stream_args[name] = ids.raw(name)
    stream = checked(lambda: ZipfStream(**stream_args), ids, list(stream_args))
    ids.finish()
    workload = DynamicTableSpec(table=spec, ids=stream,
                         optimizer_slots=t.integer("optimizer_slots", 1, minimum=0),
                         ids_per_step=t.integer("ids_per_step", 1024, minimum=1),
                         warmup_steps=t.integer("warmup_steps", 0, minimum=0))
    if workload.warmup_steps * workload.ids_per_step >= stream.examples:
        raise t.error("warmup_steps", workload.warmup_steps,
                      f"the stream (`table.ids.examples` = {stream.examples}) must outlast it")
    t.finish()
    return workload


def _parse_model(t: Table, num_ps: int) -> ModelSpec:
    variables = []
    for v in t.tables("variables"):
        shape = v.raw("shape")
        if not isinstance(shape, list) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise v.error("shape", shape, "it must be a list of non-negative integers")
        dtype = v.string("dtype", "float32")
        from kerasps.policy import partitioners  # pure Python, no TensorFlow

        try:
            partitioners.element_bytes(dtype)
        except ValueError:
            raise v.error("dtype", dtype, "unknown dtype") from None
        variables.append(VariableSpec(v.string("name"), tuple(shape), dtype))
        v.finish()
    partitioner = None
    if t.has("partitioner"):
        pt = t.table("partitioner")
        kind = pt.string("kind")
        if kind not in _PARTITIONERS:
            raise pt.error("kind", kind, f"expected one of {sorted(_PARTITIONERS)}")
        args = {}
        for arg in _PARTITIONERS[kind][1]:
            value = pt.integer(arg, None, minimum=1)
            if value is not None:
                args[arg] = value
        if kind in ("fixed_shards", "max_size") and len(args) == 0:
            required = _PARTITIONERS[kind][1][0]
            raise pt.error(required, None, "this key is required")
        pt.finish()
        partitioner = {"kind": kind, **args}
    placement = t.string("placement", "round_robin")
    if placement not in ("round_robin", "greedy"):
        raise t.error("placement", placement, "expected one of ['greedy', 'round_robin']")
    t.finish()
    return ModelSpec(tuple(variables), partitioner, placement)


def _parse_training(t: Table, num_workers: int) -> TrainingSpec:
    training = TrainingSpec(
        mode=t.choice("mode", Mode, Mode.ASYNC),
        steps=t.integer("steps", 1000, minimum=1),
        backup_workers=t.integer("backup_workers", 0, minimum=0),
        max_staleness=t.integer("max_staleness", None, minimum=0),
        max_time=t.number("max_time", math.inf, positive=True, allow_inf=True),
        apply_time=t.number("apply_time", 0.0, non_negative=True),
    )
    mode = training.mode
    late = t.string("late_workers", None)
    if late is not None and mode is Mode.ASYNC:
        raise t.error("late_workers", late, "no worker is late in async mode: every "
                      'gradient is applied; it needs `training.mode = "sync"` or `"hybrid"`')
    if late is not None and late not in ("cancel", "finish"):
        raise t.error("late_workers", late, "expected one of ['cancel', 'finish']")
    if late == "cancel" and mode is Mode.HYBRID:
        raise t.error("late_workers", late, "in hybrid mode a late worker's row update is "
                      'applied, so it finishes its step (kerasps does); use "finish"')
    default = {Mode.ASYNC: None, Mode.SYNC: "cancel", Mode.HYBRID: "finish"}[mode]
    training = dataclasses.replace(training, late_workers=late or default)
    if training.backup_workers and training.mode is Mode.ASYNC:
        raise t.error("backup_workers", training.backup_workers,
                      'backup workers need `training.mode = "sync"` or `"hybrid"`')
    if training.apply_time and training.mode is Mode.ASYNC:
        raise t.error("apply_time", training.apply_time,
                      "an async step applies its own gradient (its cost is in "
                      '`workers.step_time`); apply functions need `training.mode = "sync"` '
                      'or `"hybrid"`')
    if training.backup_workers >= num_workers:
        raise t.error("backup_workers", training.backup_workers,
                      f"it must be less than `workers.count` ({num_workers}), since a step "
                      "aggregates `workers.count - backup_workers` gradients")
    if training.max_staleness is not None and training.mode is Mode.HYBRID:
        raise t.error("max_staleness", training.max_staleness,
                      "in hybrid mode a row update is at most the global steps its worker "
                      "took behind, and kerasps rejects a bound there; it needs "
                      '`training.mode = "async"`')
    if training.max_staleness is not None and training.mode is not Mode.ASYNC:
        raise t.error("max_staleness", training.max_staleness,
                      'a staleness bound needs `training.mode = "async"`')
    t.finish()
    return training


def _parse_failures(t: Table, num_workers: int, num_ps: int) -> FailuresSpec:
    events = []
    for e in t.tables("events"):
        target = e.choice("target", Target)
        index = e.integer("index", 0, minimum=0)
        limit = {Target.WORKER: num_workers, Target.PS: num_ps, Target.COORDINATOR: 1}[target]
        if index >= limit:
            raise e.error("index", index, f"there are only {limit} {target.value} actors")
        kind = e.choice("kind", FailureKind, FailureKind.CRASH)
        if kind is FailureKind.LOSS and target is not Target.WORKER:
            raise e.error("kind", kind.value, "only workers can be lost for good")
        events.append(FailureEvent(e.number("time", non_negative=True), target, index, kind,
                                   e.number("downtime", None, non_negative=True)))
        e.finish()
    spec = FailuresSpec(
        worker_mtbf=t.number("worker_mtbf", math.inf, positive=True, allow_inf=True),
        worker_restart_time=t.number("worker_restart_time", 0.0, non_negative=True),
        worker_loss_probability=t.number("worker_loss_probability", 0.0, non_negative=True,
                                         maximum=1.0),
        ps_mtbf=t.number("ps_mtbf", math.inf, positive=True, allow_inf=True),
        ps_restart_time=t.number("ps_restart_time", 0.0, non_negative=True),
        coordinator_mtbf=t.number("coordinator_mtbf", math.inf, positive=True, allow_inf=True),
        coordinator_restart_time=t.number("coordinator_restart_time", 0.0, non_negative=True),
        max_restarts=t.integer("max_restarts", None, minimum=0),
        events=tuple(sorted(events, key=lambda e: e.time)),
    )
    t.finish()
    return spec


def _parse_elastic(t: Table, num_workers: int, training: TrainingSpec) -> ElasticSpec:
    events = []
    for e in t.tables("events"):
        events.append(ElasticEvent(e.number("time", non_negative=True),
                                   e.choice("action", ElasticAction),
                                   e.integer("count", 1, minimum=1)))
        e.finish()
    spec = ElasticSpec(
        min_workers=t.integer("min_workers", 1, minimum=1),
        max_workers=t.integer("max_workers", None, minimum=1),
        join_rate=t.number("join_rate", 0.0, non_negative=True),
        leave_rate=t.number("leave_rate", 0.0, non_negative=True),
        events=tuple(sorted(events, key=lambda e: e.time)),
    )
    if spec.min_workers > num_workers:
        raise t.error("min_workers", spec.min_workers,
                      f"it must not exceed `workers.count` ({num_workers})")
    if spec.max_workers is not None and spec.max_workers < num_workers:
        raise t.error("max_workers", spec.max_workers,
                      f"it must be at least `workers.count` ({num_workers})")
    if training.backup_workers and spec.min_workers <= training.backup_workers and (
            spec.leave_rate or any(e.action is ElasticAction.LEAVE for e in spec.events)):
        raise t.error("min_workers", spec.min_workers,
                      "it must exceed `training.backup_workers` when workers can leave")
    t.finish()
    return spec


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def dumps_toml(data: Mapping, _prefix: str = "") -> str:
    """Writes nested dicts as TOML (enough for scenarios; no dependency needed)."""
    lines, tables, arrays = [], [], []
    for key, value in data.items():
        if isinstance(value, Mapping) and not _is_inline(key, value):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in tables:
        name = f"{_prefix}{key}"
        out += f"\n[{name}]\n" + dumps_toml(value, name + ".")
    for key, items in arrays:
        name = f"{_prefix}{key}"
        for item in items:
            out += f"\n[[{name}]]\n" + dumps_toml(item, name + ".")
    return out


def _is_inline(key: str, value: Mapping) -> bool:
    return key in ("step_time", "cpu_time") or "distribution" in value
