"""Clusters of Ray actors: each worker and ps task a Ray actor, the driver the chief.

    resolver = kerasps.ray.cluster(num_workers=2, num_ps=1)
    strategy = kerasps.ParameterServerStrategy(resolver)
    ...
    resolver.shutdown()   # or `with kerasps.ray.cluster(...) as resolver:`

`cluster` connects to Ray (`ray.init(address=...)` when an address is given, the Ray this
process is already connected to, or a local Ray started for it), reserves one
placement-group bundle per task (spread over the nodes by default), picks a free port on
each bundle's node with a small Ray task in that bundle, then starts each task as a Ray
actor in its bundle (`kerasps.runtime.ray_server.TaskServer`), serving a
`tf.distribute.Server` on that port. The driver is the cluster's chief: the returned
resolver is what `kerasps.ParameterServerStrategy` trains on.

A task's actor is created with `max_restarts`: when its process dies (a SIGKILL, an out of
memory kill), Ray starts it again with the same arguments in the same bundle, so on the same
node and port, and the coordinator finds it again on its address, as it finds a task that
`kerasps launch` restarted: a worker rejoins the running `fit`; a ps task comes back
empty and `fit` restores it from its `keras.callbacks.BackupAndRestore`. When its node is
lost, Ray places the bundle on another node and restarts the actor there, on a free port of
that node: the resolver's watcher asks it where it serves, `cluster_spec()` says so from
then on, and every reconnection of the driver goes there
(`kerasps.backend._tf.follow_resolver`). Once a task's restarts are spent, Ray reports its
actor dead; the resolver's watcher then ends the job as `kerasps launch` does, with a
`kerasps.launch.TaskFailedError` in the driver's main thread.

Ray is imported only by `cluster` (`import kerasps` does not import it); without Ray,
`cluster` raises an `ImportError` naming the `kerasps[ray]` extra.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import numbers
import os
import sys
import threading
import time

import tensorflow as tf

from kerasps.policy._validation import positive_int
from kerasps.runtime import launch_env, ray_server, servers

__all__ = ["cluster", "from_environment", "RayClusterResolver", "RayTask", "PLACEMENTS",
           "MIN_RAY_VERSION", "DEFAULT_RESOURCES"]

MIN_RAY_VERSION = (2, 9)
# `placement` -> Ray's placement-group strategy.
PLACEMENTS = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK",
              "strict_pack": "STRICT_PACK"}
DEFAULT_RESOURCES = {"CPU": 1}  # what one task asks Ray for, unless told otherwise
_INSTALL = 'pip install "kerasps[ray]"'
_POLL_S = 0.05  # between two looks at a placement group or an actor being removed
WATCH_INTERVAL_S = 0.5  # between two looks at the tasks' actors, for one dead for good

_log = logging.getLogger("kerasps")


@dataclasses.dataclass(frozen=True)
class RayTask:
    """One worker or ps task of a Ray cluster, where it serves.

    Attributes:
        task_type: `"worker"` or `"ps"`.
        index: its index among the tasks of its type.
        address: `host:port` of its `tf.distribute.Server`: kept across restarts on its
            node, a new one after a restart on another node.
        node_id: the Ray node it runs on (hex).
        bundle_index: its bundle in the cluster's placement group.
    """

    task_type: str
    index: int
    address: str
    node_id: str
    bundle_index: int

    @property
    def name(self) -> str:
        """`"worker 0"`, `"ps 1"`: how kerasps names the task in its messages."""
        return f"{self.task_type} {self.index}"


def _import_ray():
    """Imports Ray, or raises an `ImportError` naming the extra, or a `RuntimeError` naming
    the version when it is older than `MIN_RAY_VERSION`."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "kerasps.ray.cluster needs Ray, which is not installed (" + str(e) + "). Install "
            f"it with kerasps' `ray` extra: {_INSTALL}") from e
    if _version(ray.__version__) < MIN_RAY_VERSION:
        wanted = ".".join(map(str, MIN_RAY_VERSION))
        raise RuntimeError(
            f"kerasps.ray.cluster needs Ray {wanted} or newer; this is Ray {ray.__version__}. "
            f"Upgrade it with {_INSTALL} (or pip install -U \"ray[default]>={wanted}\").")
    return ray


def _version(text: str) -> tuple:
    """`"2.60.0"` -> `(2, 60)`; `"3.0.0.dev0"` -> `(3, 0)`."""
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _resources(name: str, value, gpus: bool) -> dict:
    """Validates a task's Ray resources (`{"CPU": 2, "GPU": 1, "memory": bytes, custom...}`,
    as a placement-group bundle names them) and returns them with the defaults."""
    if value is None:
        return dict(DEFAULT_RESOURCES)
    if not isinstance(value, dict) or not value or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
            and v >= 0 for k, v in value.items()):
        raise ValueError(
            f"Invalid value for argument `{name}`: expected a dict of Ray resource names to "
            f'non-negative numbers, e.g. {{"CPU": 2, "GPU": 1}}. Received: {name}={value!r}')
    lower = {k.lower() for k in value}
    if lower & {"num_cpus", "num_gpus", "cpus", "gpus"}:
        raise ValueError(
            f"Invalid value for argument `{name}`: name resources as Ray's placement groups "
            f'do ("CPU", "GPU", "memory", custom names), not as `ray.remote` arguments. '
            f"Received: {name}={value!r}")
    if not gpus and value.get("GPU", 0):
        raise ValueError(
            f"Invalid value for argument `{name}`: a ps task holds variables in host memory "
            f"and asks Ray for no GPU. Received: {name}={value!r}")
    if not any(value.values()):
        raise ValueError(
            f"Invalid value for argument `{name}`: a task must ask Ray for some resource "
            f"(a placement-group bundle cannot be empty). Received: {name}={value!r}")
    return dict(value)


def _actor_options(resources: dict) -> dict:
    """A bundle's resources as the options of the actor that fills it."""
    options = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    if resources.get("memory"):
        options["memory"] = resources["memory"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def _is_placement_group(value) -> bool:
    """Whether `value` is a Ray `PlacementGroup` (without importing Ray: a program that made
    one imported it)."""
    module = sys.modules.get("ray.util.placement_group")
    return module is not None and isinstance(value, module.PlacementGroup)


# A Ray that `cluster` started (its own `ray.init`) and the clusters using it: the last one
# shut down stops it, so that a program that never started Ray itself is left with none.
_STARTED = {"ray": False, "users": 0}
_STARTED_LOCK = threading.Lock()


def _release_started_ray(ray, user: bool):
    """One cluster (`user`) or a failed start no longer needs the Ray `cluster` started:
    stops it when no cluster uses it."""
    with _STARTED_LOCK:
        if user:
            _STARTED["users"] -= 1
        if _STARTED["ray"] and _STARTED["users"] <= 0:
            _STARTED.update(ray=False, users=0)
            if ray.is_initialized():
                ray.shutdown()


def _chief_address(ip: str) -> str:
    """A free port of the driver for its chief server. A new one for each cluster: the
    servers of a cluster this process connected to before keep their ports."""
    from kerasps.runtime.ports import pick_port

    return f"{ip}:{pick_port()}"


class RayClusterResolver(tf.distribute.cluster_resolver.SimpleClusterResolver):
    """The resolver of a cluster of Ray actors (`kerasps.ray.cluster`): the driver is its
    `chief`, each worker and ps task an actor. Shut it down with `shutdown()`, or use it as
    a context manager; the process's exit shuts it down too.

    A thread watches the tasks' actors. When Ray restarted one on another node (its node
    was lost), the task serves at a new address there: `cluster_spec()` and `tasks` give
    the new one from then on, and kerasps reconnects to it (a ps task is restored from
    the backup inside `fit`; a worker rejoins the pool). When Ray reports one dead for good
    (its `max_restarts` spent), `kerasps.launch.TaskFailedError` naming the task, its node
    and the restarts used is raised in the main thread (the running `fit` ends with it), as
    when a task's restart budget is spent under `kerasps launch`; a program whose main
    thread cannot take a signal handler gets the reason on stderr and in `failure`.

    Attributes:
        tasks: a `RayTask` per worker and ps task, workers first, where each serves now.
        placement_group: the Ray placement group holding the tasks.
        max_restarts: the restarts Ray allows each task's actor (`-1`: no limit).
        failure: why the job failed (a task's actor dead for good), or `None`.
    """

    # Its tasks move: kerasps' connections follow `cluster_spec()` (`_tf.follow_resolver`).
    tasks_move = True

    def __init__(self, cluster_spec, tasks, actors, placement_group, owns_placement_group,
                 uses_started_ray=False, max_restarts=3):
        super().__init__(cluster_spec, task_type="chief", task_id=0, rpc_layer="grpc")
        self.tasks = tuple(tasks)
        self._spec = cluster_spec.as_dict()
        self.placement_group = placement_group
        self.max_restarts = max_restarts
        self.failure = None
        self._actors = dict(actors)
        self._owns_placement_group = owns_placement_group
        self._uses_started_ray = uses_started_ray
        self._lock = threading.Lock()
        self._closed = False
        self._watching = threading.Event()
        atexit.register(self.shutdown)
        # SIGTERM (from `fail_chief`) raises `TaskFailedError` in the main thread; Ray's
        # own handler (`ray.init`'s) still ends the driver on any other SIGTERM.
        launch_env.install_chief_handler(anywhere=True)
        self._watcher = threading.Thread(target=self._watch, name="kerasps-ray-watcher",
                                         daemon=True)
        self._watcher.start()

    def cluster_spec(self) -> tf.train.ClusterSpec:
        """The cluster, each task at the address it serves at now."""
        with self._lock:
            return tf.train.ClusterSpec(self._spec)

    def _watch(self):
        """Looks at the tasks' actors every `WATCH_INTERVAL_S` until `shutdown`: a task Ray
        restarted is asked where it serves (`_follow`); the first one Ray reports dead for
        good (its `max_restarts` spent) ends the job, as a task whose restart budget is
        spent ends a `kerasps launch` job (`_fail`)."""
        import ray

        keys = {self._actors[task.task_type, task.index]._actor_id.hex():
                (task.task_type, task.index) for task in self.tasks}
        restarts = dict.fromkeys(keys, 0)
        while not self._watching.wait(WATCH_INTERVAL_S):
            for actor_id, key in keys.items():
                if self._closed or not ray.is_initialized():
                    return
                try:
                    info = ray._private.state.actors(actor_id=actor_id)
                except Exception:  # noqa: BLE001 - Ray going away; looked at again
                    continue
                if not info:
                    continue
                if info.get("State") == "DEAD" and not self._closed:
                    self._fail(_death(self._task(*key), info, self.max_restarts))
                    return
                if info.get("State") == "ALIVE" and info.get("NumRestarts", 0) > restarts[
                        actor_id] and self._follow(ray, key):
                    restarts[actor_id] = info.get("NumRestarts", 0)

    def _task(self, task_type: str, index: int) -> RayTask:
        return next(t for t in self.tasks if (t.task_type, t.index) == (task_type, index))

    def _follow(self, ray, key) -> bool:
        """Asks a restarted task's actor where it serves; a task on another node serves at
        a new address, which `cluster_spec()` and `tasks` give from then on. Returns whether
        the actor answered."""
        try:
            info = ray.get(self._actors[key].info.remote(), timeout=WATCH_INTERVAL_S * 10)
        except Exception:  # noqa: BLE001 - restarting again, or Ray going away
            return False
        task = self._task(*key)
        if info["address"] != task.address:
            with self._lock:
                self._spec[task.task_type][task.index] = info["address"]
                self.tasks = tuple(
                    dataclasses.replace(t, address=info["address"], node_id=info["node_id"])
                    if t is task else t for t in self.tasks)
            where = "on another Ray node" if info["node_id"] != task.node_id else "on its node"
            _log.warning("%s restarted %s (%s): it serves at %s now (was %s on node %s).",
                         task.name, where, info["node_id"][:8], info["address"], task.address,
                         task.node_id[:8])
        return True

    def _fail(self, reason: str):
        """Ends the running `fit` (or whatever the main thread does) with
        `kerasps.launch.TaskFailedError` naming `reason`, as `kerasps launch` does."""
        self.failure = reason
        if not launch_env.fail_chief(reason):  # not the main thread's handler: say it
            print(f"kerasps.ray: the job failed: {reason}. The cluster cannot train any "
                  "more; shut it down.", file=sys.stderr, flush=True)

    def _key(self, task_type: str, index: int):
        key = (task_type, index)
        if key not in self._actors:
            raise ValueError(
                "Invalid value for arguments `task_type` and `index`: this cluster has "
                f"{sorted(self._actors)}. Received: task_type={task_type!r}, index={index!r}")
        return key

    def actor(self, task_type: str, index: int):
        """The Ray actor handle of task `task_type` `index`."""
        return self._actors[self._key(task_type, index)]

    def info(self, task_type: str, index: int, timeout_s: float = 300.0) -> dict:
        """What the task's actor says of itself: `pid`, `node_id`, `gpus` (TensorFlow's
        GPUs there), `cuda_visible_devices`, `intra_op_threads`, `inter_op_threads`.
        Waits for an actor Ray is restarting."""
        import ray

        return ray.get(self.actor(task_type, index).info.remote(), timeout=timeout_s)

    def pid(self, task_type: str, index: int, timeout_s: float = 300.0) -> int:
        """The process id of the task's actor (a new one after a restart)."""
        return self.info(task_type, index, timeout_s)["pid"]

    def shutdown(self, timeout_s: float = 30.0):
        """Kills every task's actor (no restart) and removes the placement group kerasps
        made; returns once Ray reports the actors dead (or after `timeout_s`). Idempotent.
        Where `cluster` connected this process to Ray (no `ray.init` of the program's own
        before it), the last of its clusters shut down disconnects it, and a local Ray it
        started for the program stops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._watching.set()
        atexit.unregister(self.shutdown)
        import ray

        if ray.is_initialized():  # else Ray is gone, and the actors and group with it
            _remove(ray, list(self._actors.values()),
                    self.placement_group if self._owns_placement_group else None, timeout_s)
        if self._uses_started_ray:
            _release_started_ray(ray, user=True)

    @property
    def closed(self) -> bool:
        """Whether `shutdown` ran."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    def __repr__(self):
        counts = {kind: sum(t.task_type == kind for t in self.tasks) for kind in ("worker", "ps")}
        nodes = len({t.node_id for t in self.tasks})
        return (f"<RayClusterResolver {counts['worker']} workers, {counts['ps']} ps on {nodes} "
                f"node(s){' (shut down)' if self._closed else ''}>")


def _remove(ray, actors, placement_group, timeout_s: float):
    """Kills `actors` and removes `placement_group`, then waits (up to `timeout_s`) for Ray to
    report the actors dead: their processes, and so their ports, are gone."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor already gone
            pass
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 - removed already
            pass
    ids = [actor._actor_id.hex() for actor in actors]
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        ids = [i for i in ids if _actor_state(ray, i) not in ("DEAD", None)]
        if ids:
            time.sleep(_POLL_S)


def _actor_state(ray, actor_id: str):
    """The state Ray's control store holds for an actor (`"ALIVE"`, `"DEAD"` ...), or None."""
    try:
        return ray._private.state.actors(actor_id=actor_id).get("State")
    except Exception:  # noqa: BLE001 - no such actor, or an older Ray's table
        return None


def cluster(num_workers: int = 2, num_ps: int = 1, *, worker_resources: dict | None = None,
            ps_resources: dict | None = None, placement="spread", address: str | None = None,
            max_restarts: int = 3, placement_timeout_s: float = 60.0,
            start_timeout_s: float = 300.0, init_kwargs: dict | None = None,
            announce: bool = False):
    """Starts the worker and ps tasks as Ray actors and returns their cluster's resolver.

    Each task is one Ray actor (a process) serving a `tf.distribute.Server` on a free
    port of its node; the calling process (the Ray driver) is the chief:

        with kerasps.ray.cluster(num_workers=4, num_ps=2,
                                 worker_resources={"CPU": 4, "GPU": 1}) as resolver:
            strategy = kerasps.ParameterServerStrategy(resolver)
            ...

    A worker asks Ray for `worker_resources` and TensorFlow there sees the GPUs Ray gave it;
    a ps task asks for `ps_resources` and sees no GPU. TensorFlow's thread pools in a task
    follow the CPUs it asked for (intra-op: the CPUs; inter-op: at least `num_workers + 1`).

    Args:
        num_workers: worker tasks, at least 1.
        num_ps: ps tasks, at least 1.
        worker_resources: what each worker asks Ray for, named as a placement-group bundle
            names resources: `{"CPU": 4, "GPU": 1}`, `"memory"` in bytes, custom resources
            by their names. Default `{"CPU": 1}`.
        ps_resources: the same for each ps task (no `"GPU"`). Default `{"CPU": 1}`.
        placement: how the tasks' bundles go on the nodes: `"spread"` (default: over as many
            nodes as can hold them), `"strict_spread"` (one task per node, or an error),
            `"pack"`, `"strict_pack"`, or a Ray `PlacementGroup` of your own with
            `num_workers + num_ps` bundles (workers' bundles first, then the ps tasks'),
            each task asking for its bundle's resources (give no `worker_resources` or
            `ps_resources` then); `shutdown` leaves the group in place.
        address: the Ray cluster to connect to (`ray.init(address=...)`: `"auto"` for the
            one `ray start` started on this machine, `"ray://host:10001"`, `"host:6379"`).
            `None`: the Ray this process is connected to, else `$RAY_ADDRESS`'s (a Ray Job's
            driver), else a local Ray started for this program. Ignored when this process
            is connected to Ray already.
        max_restarts: how many times Ray restarts a task whose process died (on its
            address); `-1`: without limit. One more death ends the job, as under
            `kerasps launch`: `kerasps.launch.TaskFailedError` is raised in the driver's
            main thread (in the running `fit`), naming the task, its node and the
            restarts used.
        placement_timeout_s: seconds to wait for Ray to place the tasks (and pick a port on
            each one's node) before raising.
        start_timeout_s: seconds to wait for every task's server to start.
        init_kwargs: more arguments of `ray.init`, when `cluster` calls it
            (`{"num_cpus": 8}`, `{"runtime_env": {...}}`).
        announce: each task prints where it serves when its server starts (again after a
            restart), as `kerasps serve` does; Ray forwards the line to the driver.

    Returns:
        A `RayClusterResolver` (a `tf.distribute.cluster_resolver.SimpleClusterResolver`,
        task `chief` 0, `rpc_layer="grpc"`).

    Raises:
        ImportError: if Ray is not installed (`pip install "kerasps[ray]"`).
        kerasps.launch.TaskFailedError: later, in the main thread, when a task's actor is
            dead for good (see `max_restarts`).
        RuntimeError: if Ray is older than `MIN_RAY_VERSION`; if Ray cannot place the tasks
            within `placement_timeout_s` (the message names what was asked and what the
            cluster has; nothing is left behind); if a task's server did not start.
        ValueError: if an argument is invalid (before Ray is touched).
    """
    num_workers = positive_int("num_workers", num_workers)
    num_ps = positive_int("num_ps", num_ps)
    own_group = _is_placement_group(placement)
    if own_group and (worker_resources is not None or ps_resources is not None):
        raise ValueError(
            "Invalid value for argument `worker_resources` or `ps_resources`: with a "
            "placement group of your own, each task asks for its bundle's resources; give "
            f"none. Received: worker_resources={worker_resources!r}, "
            f"ps_resources={ps_resources!r}")
    worker_resources = _resources("worker_resources", worker_resources, gpus=True)
    ps_resources = _resources("ps_resources", ps_resources, gpus=False)
    if not own_group and placement not in PLACEMENTS:
        raise ValueError(
            f"Invalid value for argument `placement`: expected one of {list(PLACEMENTS)} or a "
            f"Ray `PlacementGroup`. Received: placement={placement!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(
            "Invalid value for argument `max_restarts`: expected an integer >= 0, or -1 "
            f"(no limit). Received: max_restarts={max_restarts!r}")
    for name, value in (("placement_timeout_s", placement_timeout_s),
                        ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0:
            raise ValueError(f"Invalid value for argument `{name}`: expected a positive number "
                             f"of seconds. Received: {name}={value!r}")
    if init_kwargs is not None and not isinstance(init_kwargs, dict):
        raise ValueError("Invalid value for argument `init_kwargs`: expected a dict of "
                         f"`ray.init` arguments. Received: init_kwargs={init_kwargs!r}")
    ray = _import_ray()
    if own_group and len(placement.bundle_specs) != num_workers + num_ps:
        raise ValueError(
            "Invalid value for argument `placement`: the placement group has "
            f"{len(placement.bundle_specs)} bundles for {num_workers} workers and {num_ps} ps "
            f"tasks (one bundle per task, workers first). Received: placement={placement!r}")
    started = _connect(ray, address, init_kwargs)

    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    kinds = [("worker", i, worker_resources) for i in range(num_workers)] + [
        ("ps", i, ps_resources) for i in range(num_ps)]
    if own_group:  # each task fills its bundle
        kinds = [(kind, index, dict(bundle))
                 for (kind, index, _), bundle in zip(kinds, placement.bundle_specs)]
    group = placement if own_group else ray.util.placement_group(
        [resources for _, _, resources in kinds], strategy=PLACEMENTS[placement],
        name=f"kerasps-{num_workers}w{num_ps}ps")
    actors = {}
    try:
        _wait_placed(ray, group, kinds, placement, placement_timeout_s)

        def in_bundle(i):
            return PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i,
                placement_group_capture_child_tasks=False)

        places = _pick_addresses(ray, in_bundle, len(kinds), placement_timeout_s)
        spec = {"chief": [_chief_address(ray.util.get_node_ip_address())],
                "worker": [f"{p['ip']}:{p['port']}" for p in places[:num_workers]],
                "ps": [f"{p['ip']}:{p['port']}" for p in places[num_workers:]]}
        task_class = ray.remote(ray_server.TaskServer)
        for i, (kind, index, resources) in enumerate(kinds):
            actors[kind, index] = task_class.options(
                **_actor_options(resources), max_restarts=max_restarts, max_task_retries=0,
                scheduling_strategy=in_bundle(i),
                name=None).remote(spec, kind, index, resources.get("CPU", 0),
                                  hide_gpus=not resources.get("GPU", 0), announce=announce,
                                  node_id=places[i]["node_id"])
        started_at = _wait_started(ray, actors, start_timeout_s)
    except BaseException:
        _remove(ray, list(actors.values()), None if own_group else group, 30.0)
        if started:
            _release_started_ray(ray, user=False)
        raise
    servers._enable_fail_fast()
    servers._enable_keepalive()
    # A task whose picked port another process took first serves at another one.
    for (kind, index), info in started_at.items():
        spec[kind][index] = info["address"]
    tasks = [RayTask(kind, index, spec[kind][index], places[i]["node_id"], i)
             for i, (kind, index, _) in enumerate(kinds)]
    with _STARTED_LOCK:
        uses_started_ray = _STARTED["ray"]
        _STARTED["users"] += uses_started_ray
    return RayClusterResolver(tf.train.ClusterSpec(spec), tasks, actors, group,
                              owns_placement_group=not own_group,
                              uses_started_ray=uses_started_ray, max_restarts=max_restarts)


def _death(task: RayTask, info: dict, max_restarts: int) -> str:
    """Why the job ends: `task`'s actor is dead for good (Ray's actor table `info`)."""
    node = (info.get("Address") or {}).get("NodeID") or task.node_id
    restarts = info.get("NumRestarts", 0)
    budget = "no limit" if max_restarts < 0 else f"max_restarts={max_restarts}"
    reason = (f"{task.name} (Ray actor at {task.address} on node {node[:8]}) died and its "
              f"restart budget is spent ({restarts} restart{'s' * (restarts != 1)} of "
              f"{budget})")
    cause = _cause(info.get("DeathCause"))
    return f"{reason}: {cause}" if cause else reason


def _cause(death_cause) -> str:
    """The first sentence of Ray's reason for an actor's death, or ""."""
    try:
        context = getattr(death_cause, death_cause.WhichOneof("context"))
        message = str(context.error_message).strip()
    except Exception:  # noqa: BLE001 - no cause, or another Ray's message
        return ""
    first = message.split(". ")[0].rstrip(".")
    return first if len(first) <= 200 else first[:197] + "..."


def from_environment():
    """The cluster of `kerasps launch --engine ray` (`kerasps.cluster.resolve()` calls it):
    `cluster` with the job's counts, restart budget, worker resources and Ray address, read
    from `$KERASPS_RAY_JOB`; each task says where it serves.

    Raises:
        ValueError: if `$KERASPS_RAY_JOB` is not set or not the launcher's JSON.
    """
    import json

    text = os.environ.get(launch_env.RAY_JOB_ENV)
    try:
        job = json.loads(text or "")
        kwargs = {key: job[key] for key in ("num_workers", "num_ps", "max_restarts", "address")}
    except (ValueError, TypeError, KeyError):
        raise ValueError(
            f"Invalid value for `{launch_env.RAY_JOB_ENV}`: expected the JSON that `kerasps "
            "launch --engine ray` sets (num_workers, num_ps, max_restarts, address). "
            f"Received: {launch_env.RAY_JOB_ENV}={text!r}") from None
    return cluster(**kwargs, worker_resources=job.get("worker_resources"), announce=True)


def _connect(ray, address, init_kwargs):
    """Connects this process to Ray, unless it is: to `address`; without one, to
    `$RAY_ADDRESS`'s cluster (a Ray Job's driver), else to a local Ray started for it
    (`address="local"`: never to a cluster an earlier program left recorded on this
    machine, which may be gone). Returns whether it called `ray.init`."""
    if ray.is_initialized():
        return False
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    ray.init(address=address, **(init_kwargs or {}))
    with _STARTED_LOCK:
        _STARTED.update(ray=True, users=0)
    return True


def _describe(kinds) -> str:
    counts = {}
    for kind, _, resources in kinds:
        key = (kind, tuple(sorted(resources.items())))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {kind} task(s) of {dict(resources)}"
                     for (kind, resources), n in counts.items())


def _wait_placed(ray, group, kinds, placement, timeout_s):
    """Waits for Ray to place `group`'s bundles, or raises a `RuntimeError` naming what was
    asked and what the cluster has (the caller removes the group)."""
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return
    how = placement if isinstance(placement, str) else "your placement group"
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    raise RuntimeError(
        f"Ray could not place the tasks within placement_timeout_s={timeout_s}: asked for "
        f"{_describe(kinds)} with placement={how!r} ({PLACEMENTS.get(how, 'bundles')}); "
        f"the cluster has {_summary(ray.cluster_resources())} in all, "
        f"{_summary(ray.available_resources())} available, on {len(nodes)} node(s): "
        f"{[_summary(n) for n in nodes]}. Ask for less (`worker_resources`, `ps_resources`, "
        "fewer tasks), another `placement`, or add nodes.")


def _summary(resources: dict) -> dict:
    """A resources dict without Ray's per-node and per-group entries."""
    return {k: v for k, v in sorted(resources.items())
            if not k.startswith("node:") and "_group_" not in k and k != "bundle"
            and not k.startswith("accelerator_type")}


def _pick_addresses(ray, in_bundle, count, timeout_s) -> list:
    """A free port on each bundle's node, picked by a Ray task in the bundle (with the
    node's address and id), two tasks of one node never on one port."""
    pick = ray.remote(num_cpus=0, max_retries=0)(ray_server.pick_address)
    places, again = [None] * count, list(range(count))
    deadline = time.monotonic() + timeout_s
    for _ in range(10):
        refs = {i: pick.options(scheduling_strategy=in_bundle(i)).remote() for i in again}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                            timeout=max(0.0, deadline - time.monotonic()))
        if len(ready) < len(refs):
            raise RuntimeError(
                f"Ray placed the tasks but did not run the task picking their ports within "
                f"placement_timeout_s={timeout_s}: the cluster may be short of worker "
                "processes; try a longer placement_timeout_s.")
        for i, ref in refs.items():
            places[i] = ray.get(ref)
        # `pick_port`'s claims hold per machine and temp directory: two tasks of one node
        # whose processes see other temp directories may still draw one port.
        seen, again = set(), []
        for i, place in enumerate(places):
            key = (place["node_id"], place["port"])
            if key in seen:
                again.append(i)
            seen.add(key)
        if not again:
            break
    return places


def _wait_started(ray, actors, timeout_s) -> dict:
    """Waits for every actor's server to start, or raises naming the tasks that did not.
    Returns each task's `TaskServer.info` (where it serves), by `(task_type, index)`."""
    refs = {actor.info.remote(): key for key, actor in actors.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    infos = {}
    for ref in ready:
        try:
            infos[refs[ref]] = ray.get(ref)
        except Exception as e:
            raise RuntimeError(f"The server of {refs[ref][0]} {refs[ref][1]} did not start on "
                               f"its Ray actor: {e}") from e
    if pending:
        names = ", ".join(f"{kind} {index}" for kind, index in sorted(refs[r] for r in pending))
        raise RuntimeError(f"The servers of {names} did not start within "
                           f"start_timeout_s={timeout_s} on their Ray actors.")
    return infos
