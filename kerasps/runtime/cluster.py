"""Cluster resolution: in-process clusters for tests and demos, `TF_CONFIG` for real ones.

Each function returns a `tf.distribute.cluster_resolver.ClusterResolver` that
`kerasps.ParameterServerStrategy` accepts. kerasps adds no RPC layer: the
workers and ps tasks are TensorFlow's own `tf.distribute.Server`s.

    resolver = kerasps.cluster.in_process(num_workers=2, num_ps=2)
    resolver = kerasps.cluster.from_tf_config()   # reads $TF_CONFIG
    resolver = kerasps.cluster.resolve(num_workers=2, num_ps=2)  # either, by $TF_CONFIG

`resolve` lets one script run everywhere: `python train.py` trains on an in-process
cluster, `kerasps launch --workers 4 --ps 2 train.py` and Kubernetes on theirs.
`in_process` in a task of a `kerasps launch` job raises (unless
`under_launch="allow"`), and warns in any other process whose `TF_CONFIG` names a
cluster: it would train on a cluster of its own while the job's servers sit idle.

`TF_CONFIG` is the JSON document that Kubernetes TFJob and similar launchers
set on every task:

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", ...],
                 "ps": ["host2:2222", ...]},
     "task": {"type": "chief", "index": 0}}

In a pod of a JobSet (kubernetes-sigs/jobset, what `kerasps launch --emit k8s`
writes) nobody sets `TF_CONFIG`: `tf_config_from_jobset` builds it from what
JobSet gives every pod (its JobSet's name, its replicated job's name and its
job's index, through the variables of `JOBSET_ENV`) and the replica counts of
`$KERASPS_JOBSET_REPLICAS`, the same in every pod. `from_tf_config`, `task_type`
and `serve` do so when `TF_CONFIG` is not set.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings

from kerasps.policy._validation import positive_int
from kerasps.runtime import launch_env
from kerasps.runtime.servers import (  # noqa: F401 - their names here, as before the split
    CHIEF_GRPC_OPTIONS,
    GRPC_OPTIONS_ENV,
    _enable_fail_fast,
    _enable_keepalive,
    grpc_options,
    server_config,
)

__all__ = [
    "in_process",
    "from_tf_config",
    "resolve",
    "tf_config_from_jobset",
    "JOBSET_ENV",
    "JOBSET_REPLICAS_ENV",
    "JOBSET_PORT",
    "task_type",
    "serve",
    "parse_tf_config",
    "start_server",
    "server_config",
    "TASK_TYPES",
]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")

# What JobSet (v0.8 and newer) writes on every pod it creates, read through the downward API
# (`env[].valueFrom.fieldRef`): environment variable -> pod annotation.
JOBSET_ENV = {
    "KERASPS_JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "KERASPS_REPLICATED_JOB": "jobset.sigs.k8s.io/replicatedjob-name",
    "KERASPS_JOB_INDEX": "jobset.sigs.k8s.io/job-index",
    "KERASPS_REPLICATED_JOB_REPLICAS": "jobset.sigs.k8s.io/replicatedjob-replicas",
}
# The replicas of each replicated job as JSON (`{"chief": 1, "worker": 4, "ps": 2}`): the
# one thing a pod cannot read about the other replicated jobs, the same in every pod.
JOBSET_REPLICAS_ENV = "KERASPS_JOBSET_REPLICAS"
JOBSET_PORT = 2222  # every task serves on this port (TFJob's default)

# In-process servers cannot be stopped; keep them referenced for the process lifetime.
_SERVERS = []
_LOCK = threading.Lock()
_IN_PROCESS = {}  # (num_workers, num_ps) -> the ClusterSpec of `in_process` servers here
_IN_PROCESS_LOCK = threading.Lock()


def _program_name() -> str:
    """How this process's program was named to Python: `-m package.module` when it runs as
    `python -m` (or `kerasps launch -m`) does, else its script's file name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"-m {spec.name.removesuffix('.__main__')}"
    return os.path.basename(sys.argv[0])


def start_server(cluster_spec, task_type: str, task_index: int, num_workers=None,
                 tasks_in_process: int = 1):
    """Starts a `tf.distribute.Server` for one task of `cluster_spec` and returns it.

    `tasks_in_process`: the servers this process will run (see `server_config`).
    """
    import tensorflow as tf

    if num_workers is None:
        num_workers = len(cluster_spec.as_dict().get("worker", ()))
    server = tf.distribute.Server(
        cluster_spec,
        job_name=task_type,
        task_index=task_index,
        config=server_config(task_type, num_workers, tasks_in_process),
        protocol="grpc",
        start=True,
    )
    with _LOCK:
        _SERVERS.append(server)
    return server


_UNDER_LAUNCH = ("error", "allow")  # what `in_process` does in a task of `kerasps launch`


def in_process(num_workers: int = 2, num_ps: int = 2, *, under_launch: str = "error"):
    """Starts an in-process cluster on free loopback ports and returns its resolver.

    Every worker and ps task is a real `tf.distribute.Server` with gRPC on
    `localhost`; the calling process is the coordinator (`chief`). The servers
    live until the process exits (TensorFlow cannot stop them) and hold about
    a hundred threads each, so a later call with the same counts returns the
    cluster already running here: a notebook cell run again, or a test suite
    that asks for a cluster per test, does not pile up servers until the
    process can start no thread (TensorFlow then aborts it). A strategy made
    on a cluster another strategy used takes the cluster over, as when both
    share one resolver.

    In a task of a `kerasps launch` job (its `TF_CONFIG` set, and `$KERASPS_TASK`,
    which only the launcher sets, naming the task) it raises a `RuntimeError` and
    starts nothing: the program would train on a cluster of its own while the job's
    workers and ps tasks sit idle. Use `from_tf_config()` there, or `resolve()`
    everywhere; `under_launch="allow"` says that a cluster of its own is meant, and
    starts it. In any other process whose `TF_CONFIG` names a cluster (a Kubernetes
    TFJob's pod, a JobSet's pod, a `TF_CONFIG` you set), it warns (a `UserWarning`)
    and starts its cluster all the same.

    Args:
        num_workers: number of worker tasks, at least 1.
        num_ps: number of ps tasks, at least 1.
        under_launch: in a task of a `kerasps launch` job, `"error"` (default) raises;
            `"allow"` starts the in-process cluster there, without a word.

    Returns:
        A `tf.distribute.cluster_resolver.SimpleClusterResolver` with `rpc_layer="grpc"`.

    Raises:
        ValueError: if a count is not a positive integer, or `under_launch` is neither
            `"error"` nor `"allow"`.
        RuntimeError: in a task of a `kerasps launch` job, unless `under_launch="allow"`.
    """
    positive_int("num_workers", num_workers)
    positive_int("num_ps", num_ps)
    if under_launch not in _UNDER_LAUNCH:
        raise ValueError(
            "Invalid value for argument `under_launch`: expected 'error' or 'allow'. "
            f"Received: under_launch={under_launch!r}")
    if launch_env.launched_task() is not None and _tf_config_is_set():
        if under_launch == "error":
            raise RuntimeError(_in_process_in_a_job(num_workers, num_ps, launched=True))
    elif _tf_config_is_set():
        warnings.warn(_in_process_in_a_job(num_workers, num_ps), UserWarning, stacklevel=2)
    import tensorflow as tf

    from kerasps.runtime.ports import pick_port

    _enable_fail_fast()
    with _IN_PROCESS_LOCK:
        spec = _IN_PROCESS.get((num_workers, num_ps))
        if spec is None:
            cluster = {
                "worker": [f"localhost:{pick_port()}" for _ in range(num_workers)],
                "ps": [f"localhost:{pick_port()}" for _ in range(num_ps)],
            }
            spec = tf.train.ClusterSpec(cluster)
            for task_type in ("worker", "ps"):
                for i in range(len(cluster[task_type])):
                    start_server(spec, task_type, i, num_workers, num_workers + num_ps)
            _IN_PROCESS[(num_workers, num_ps)] = spec
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def _tf_config_is_set() -> bool:
    """Whether this process has a `TF_CONFIG`, or is a JobSet's pod (which builds one)."""
    return bool(os.environ.get("TF_CONFIG") or os.environ.get("KERASPS_JOBSET_NAME"))


def _in_process_in_a_job(num_workers: int, num_ps: int, launched: bool = False) -> str:
    """What `in_process` says in a process whose `TF_CONFIG` names a cluster (`launched`:
    a task of a `kerasps launch` job, where it raises)."""
    try:
        parsed = _read_tf_config(None)
    except ValueError:
        parsed = None
    counts = ""
    if parsed is not None:
        cluster = parsed["training_cluster"]
        counts = (f"{len(cluster.get('worker', []))} workers, "
                  f"{len(cluster.get('ps', []))} ps tasks")
    task = launch_env.launched_task()
    if task is not None:
        where = (f"{task} of a `kerasps launch` job"
                 + (f" (TF_CONFIG: {counts})" if counts else ""))
    elif parsed is not None and parsed["task_type"] is not None:
        where = (f"a process whose TF_CONFIG names a cluster (task {parsed['task_type']} "
                 f"{parsed['task_index']}; {counts})")
    else:
        where = "a process whose TF_CONFIG names a cluster"
    what = (f"kerasps.cluster.in_process() was called in {where}: it starts "
            f"{num_workers} worker(s) and {num_ps} ps task(s) of its own in this process, "
            "and the strategy trains there while the job's workers and ps tasks sit idle. "
            if not launched else
            f"kerasps.cluster.in_process() was called in {where}, so it started no "
            f"cluster: it would start {num_workers} worker(s) and {num_ps} ps task(s) of "
            "its own in this process, and the strategy would train there while the job's "
            "workers and ps tasks sit idle. ")
    return (what + "Use kerasps.cluster.from_tf_config() to train on the job's cluster, or "
            f"kerasps.cluster.resolve(num_workers={num_workers}, num_ps={num_ps}), which "
            "reads TF_CONFIG where it is set and starts an in-process cluster elsewhere."
            + (" If a cluster of its own is meant, call kerasps.cluster.in_process("
               f"num_workers={num_workers}, num_ps={num_ps}, under_launch='allow')."
               if launched else ""))


def parse_tf_config(text: str) -> dict:
    """Parses and validates a `TF_CONFIG` document.

    Returns:
        A dict with keys `cluster` (task type -> list of addresses), `task_type`
        (or `None`) and `task_index` (or `None`).

    Raises:
        ValueError: naming the offending field and the value received.
    """
    try:
        config = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"Invalid value for `TF_CONFIG`: not valid JSON ({e}). Received: "
            f"TF_CONFIG={text!r}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"Invalid value for `TF_CONFIG`: expected a JSON object. Received: "
            f"TF_CONFIG={text!r}"
        )
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            "Invalid value for `TF_CONFIG`: the field `cluster` is missing or "
            f"empty. Received: cluster={cluster!r}"
        )
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise ValueError(
                f"Invalid value for `TF_CONFIG`: unknown task type {task_type!r} "
                f"in `cluster`; expected one of {list(TASK_TYPES)}. Received: "
                f"cluster={cluster!r}"
            )
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(
                f"Invalid value for `TF_CONFIG` field `cluster.{task_type}`: "
                f"expected a non-empty list of 'host:port' strings. Received: "
                f"cluster.{task_type}={addresses!r}"
            )
        for address in addresses:
            if not isinstance(address, str) or ":" not in address:
                raise ValueError(
                    f"Invalid value for `TF_CONFIG` field `cluster.{task_type}`: "
                    f"every address must be a 'host:port' string. Received: "
                    f"{address!r} in cluster.{task_type}={addresses!r}"
                )
    if "ps" not in cluster:
        raise ValueError(
            "Invalid value for `TF_CONFIG` field `cluster`: parameter-server "
            f"training needs at least one `ps` task. Received: cluster={cluster!r}"
        )
    if "worker" not in cluster:
        raise ValueError(
            "Invalid value for `TF_CONFIG` field `cluster`: parameter-server "
            f"training needs at least one `worker` task. Received: cluster={cluster!r}"
        )
    if len(cluster.get("chief", [])) > 1:
        raise ValueError(
            "Invalid value for `TF_CONFIG` field `cluster.chief`: there can be "
            f"only one chief. Received: cluster.chief={cluster['chief']!r}"
        )

    task = config.get("task", {})
    if not isinstance(task, dict):
        raise ValueError(
            f"Invalid value for `TF_CONFIG` field `task`: expected an object. "
            f"Received: task={task!r}"
        )
    task_type = task.get("type")
    task_index = task.get("index")
    if task_type is not None:
        if task_type not in TASK_TYPES:
            raise ValueError(
                f"Invalid value for `TF_CONFIG` field `task.type`: expected one "
                f"of {list(TASK_TYPES)}. Received: task.type={task_type!r}"
            )
        if task_index is None:
            task_index = 0
        if isinstance(task_index, bool) or not isinstance(task_index, int):
            raise ValueError(
                "Invalid value for `TF_CONFIG` field `task.index`: expected an "
                f"integer. Received: task.index={task_index!r}"
            )
        # The evaluator runs beside the training cluster and may be absent from it.
        size = len(cluster.get(task_type, [])) if task_type != "evaluator" else max(
            1, len(cluster.get("evaluator", [])))
        if not 0 <= task_index < size:
            raise ValueError(
                "Invalid value for `TF_CONFIG` field `task.index`: out of range "
                f"for task type {task_type!r} with {size} task(s). Received: "
                f"task.index={task_index!r}"
            )
    elif task_index is not None:
        raise ValueError(
            "Invalid value for `TF_CONFIG` field `task`: `index` given without "
            f"`type`. Received: task={task!r}"
        )
    return {"cluster": cluster, "task_type": task_type, "task_index": task_index}


def _jobset_value(environ, name: str, what: str) -> str:
    value = environ.get(name)
    if not value:
        raise ValueError(
            f"Invalid value for `{name}`: a JobSet pod needs it ({what}). Received: "
            f"{name}={value!r}")
    return value


def _jobset_int(environ, name: str, what: str) -> int:
    text = _jobset_value(environ, name, what)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"Invalid value for `{name}`: expected an integer ({what}). "
                         f"Received: {name}={text!r}") from None


def tf_config_from_jobset(environ=None) -> str | None:
    """The `TF_CONFIG` of this pod of a JobSet, or `None` outside one.

    Every task of the job is one Job of one pod, in the replicated job named after
    its task type (`chief`, `worker`, `ps`, `evaluator`); task `worker 3` is the pod
    of Job 3 of `worker`, reached at `<jobset>-worker-3-0.<jobset>:2222` through the
    JobSet's headless Service (the JobSet's default subdomain, its name). The pod
    learns its JobSet's name, its replicated job and its job index from the JobSet's
    annotations (`JOBSET_ENV`), and the replica counts from `$KERASPS_JOBSET_REPLICAS`,
    so one pod template serves every pod of a replicated job.

    Args:
        environ: the environment to read; defaults to `os.environ`.

    Returns:
        The JSON text, or `None` when `$KERASPS_JOBSET_NAME` is not set.

    Raises:
        ValueError: naming the variable and its value, when one is missing or
            malformed, or the counts disagree with the JobSet's.
    """
    environ = os.environ if environ is None else environ
    if not environ.get("KERASPS_JOBSET_NAME"):
        return None
    name = _jobset_value(environ, "KERASPS_JOBSET_NAME", "the JobSet's name")
    task_type = _jobset_value(environ, "KERASPS_REPLICATED_JOB", "the replicated job's name")
    index = _jobset_int(environ, "KERASPS_JOB_INDEX", "the job's index in its replicated job")
    text = _jobset_value(environ, JOBSET_REPLICAS_ENV, "the replicas of each replicated job")
    try:
        replicas = json.loads(text)
    except json.JSONDecodeError:
        replicas = None
    if not isinstance(replicas, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for n in replicas.values()):
        raise ValueError(
            f"Invalid value for `{JOBSET_REPLICAS_ENV}`: expected a JSON object of replica "
            f'counts, e.g. {{"chief": 1, "worker": 2, "ps": 1}}. Received: '
            f"{JOBSET_REPLICAS_ENV}={text!r}")
    if task_type not in replicas:
        raise ValueError(
            f"Invalid value for `KERASPS_REPLICATED_JOB`: this pod's replicated job is not "
            f"among those of `{JOBSET_REPLICAS_ENV}` ({sorted(replicas)}). Received: "
            f"KERASPS_REPLICATED_JOB={task_type!r}")
    own = environ.get("KERASPS_REPLICATED_JOB_REPLICAS")
    if own is not None and own != str(replicas[task_type]):
        raise ValueError(
            f"Invalid value for `{JOBSET_REPLICAS_ENV}`: the JobSet runs {own} `{task_type}` "
            f"job(s) but it declares {replicas[task_type]}; change both together. Received: "
            f"{JOBSET_REPLICAS_ENV}={text!r}")
    completion = environ.get("JOB_COMPLETION_INDEX", "0")
    if completion != "0":
        raise ValueError(
            "Invalid value for `JOB_COMPLETION_INDEX`: every task is a Job of one pod "
            "(`completions: 1`). Received: JOB_COMPLETION_INDEX=" + repr(completion))
    cluster = {
        kind: [f"{name}-{kind}-{i}-0.{name}:{JOBSET_PORT}" for i in range(replicas[kind])]
        for kind in ("chief", "worker", "ps") if replicas.get(kind)}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def _read_tf_config(tf_config: str | None) -> dict:
    """Parses `tf_config`, or when it is `None` the `TF_CONFIG` environment variable or, in a
    JobSet's pod, the one `tf_config_from_jobset` builds."""
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG") or tf_config_from_jobset()
        if not tf_config:
            raise ValueError(
                "Invalid value for `TF_CONFIG`: the environment variable is not "
                f"set or empty, and this is no JobSet pod (`KERASPS_JOBSET_NAME` is not "
                f"set). Received: TF_CONFIG={os.environ.get('TF_CONFIG')!r}"
            )
    parsed = parse_tf_config(tf_config)
    # The evaluator runs beside the training cluster, not in it.
    parsed["training_cluster"] = {k: v for k, v in parsed["cluster"].items() if k != "evaluator"}
    return parsed


def from_tf_config(tf_config: str | None = None):
    """Returns a resolver for the cluster described by `TF_CONFIG`.

    Args:
        tf_config: the JSON text; defaults to the `TF_CONFIG` environment variable or,
            in a JobSet's pod, the one `tf_config_from_jobset` builds.

    Returns:
        A `tf.distribute.cluster_resolver.SimpleClusterResolver` with the task's
        type and index, using gRPC.

    Raises:
        ValueError: if `TF_CONFIG` is missing or malformed (the message names
            the field and the value received).
    """
    parsed = _read_tf_config(tf_config)
    import tensorflow as tf

    _enable_fail_fast()
    if parsed["task_type"] not in ("worker", "ps"):
        _enable_keepalive()
    launch_env.install_chief_handler()
    launch_env.name_process(detail=" ".join([_program_name(), *sys.argv[1:]]))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(parsed["training_cluster"]),
        task_type=parsed["task_type"],
        task_id=parsed["task_index"],
        rpc_layer="grpc",
    )


def resolve(num_workers: int = 2, num_ps: int = 2):
    """Returns the resolver of the cluster this program trains on, wherever it runs:
    `from_tf_config()` where `TF_CONFIG` is set (`kerasps launch`, a Kubernetes TFJob,
    a JobSet's pod), a `kerasps.ray.cluster` of Ray actors under
    `kerasps launch --engine ray` (the job's counts and Ray address, from
    `$KERASPS_RAY_JOB`), `in_process(num_workers, num_ps)` elsewhere.

    One script then runs as it is on a laptop and on a cluster, as a PyTorch script's
    `init_process_group()` reads what torchrun sets:

        strategy = kerasps.ParameterServerStrategy(
            kerasps.cluster.resolve(num_workers=2, num_ps=2))

    `python train.py` trains on 2 workers and 2 ps tasks in its own process;
    `kerasps launch --workers 4 --ps 2 train.py` on the 4 workers and 2 ps tasks the
    launcher started: where `TF_CONFIG` is set, it decides the cluster, and the counts
    given here are not used.

    Args:
        num_workers: worker tasks of the in-process cluster, at least 1.
        num_ps: ps tasks of the in-process cluster, at least 1.

    Returns:
        A `tf.distribute.cluster_resolver.SimpleClusterResolver`, as `from_tf_config` or
        `in_process` returns it, or a `kerasps.ray.RayClusterResolver`.

    Raises:
        ValueError: if a count is not a positive integer, or `TF_CONFIG` is malformed.
    """
    positive_int("num_workers", num_workers)
    positive_int("num_ps", num_ps)
    if os.environ.get(launch_env.RAY_JOB_ENV):
        from kerasps.runtime import ray_cluster

        return ray_cluster.from_environment()
    if _tf_config_is_set():
        return from_tf_config()
    return in_process(num_workers, num_ps)


def task_type(tf_config: str | None = None) -> str | None:
    """Returns this process's task type in `TF_CONFIG`, so that one script can play every part:

        if kerasps.cluster.task_type() == "evaluator":
            kerasps.SidecarEvaluator(model, data, checkpoint_dir).run()
        else:
            strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
            ...

    Args:
        tf_config: the JSON text; defaults to the `TF_CONFIG` environment variable.

    Returns:
        `"chief"`, `"worker"`, `"ps"` or `"evaluator"`; `None` when `TF_CONFIG` is not
        set (or names no task) and this is no JobSet pod.

    Raises:
        ValueError: if `TF_CONFIG` is malformed.
    """
    if tf_config is None and not os.environ.get("TF_CONFIG") and not os.environ.get(
            "KERASPS_JOBSET_NAME"):
        return None
    return _read_tf_config(tf_config)["task_type"]


def serve(tf_config: str | None = None):
    """Runs this process's worker or ps task of the `TF_CONFIG` cluster; never returns.

    This is what a worker or ps container runs (`kerasps serve`); the chief
    runs the training program with `kerasps.cluster.from_tf_config()`.

    Raises:
        ValueError: if `TF_CONFIG` is malformed or its task is not a worker or ps.
    """
    parsed = _read_tf_config(tf_config)
    task_type = parsed["task_type"]
    if task_type not in ("worker", "ps"):
        raise ValueError(
            "Invalid value for `TF_CONFIG` field `task.type`: `kerasps serve` runs "
            f"worker and ps tasks; run the training program on the {task_type!r} task. "
            f"Received: task.type={task_type!r}"
        )
    import tensorflow as tf

    launch_env.name_process(f"{task_type} {parsed['task_index']}")
    _enable_fail_fast()
    server = start_server(tf.train.ClusterSpec(parsed["training_cluster"]), task_type,
                          parsed["task_index"])
    print(f"kerasps serve: {task_type} {parsed['task_index']} serving at "
          f"{parsed['training_cluster'][task_type][parsed['task_index']]}", flush=True)
    server.join()
