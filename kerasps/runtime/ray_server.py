"""What runs inside the Ray actors of `kerasps.ray.cluster`: one task's `tf.distribute.Server`.

Each worker and ps task of a Ray cluster is one Ray actor, in a process of its own, whose
constructor starts the task's server on the address the driver chose for it (`pick_address`
ran in the same placement-group bundle, so on the same node). Ray runs the constructor again,
with the same arguments, when it restarts the actor after its process died: on the same
node, the task comes back on its address, where the coordinator finds it again, as a task
that `kerasps launch` restarted. On another node (its node was lost, and Ray placed its
bundle again elsewhere), it serves on a free port of that node: a new address, which the
driver asks for (`TaskServer.address`) and reconnects to. A port another process took
between the pick and the server's start (an outgoing connection may be given it: the kernel
hands out the ports it just freed) is given up for another free port of the node, a new
address the driver learns the same way.

Importing this module imports neither Ray nor TensorFlow: an actor hides the GPUs from
TensorFlow (a ps task) before TensorFlow is imported in its process.
"""

from __future__ import annotations

import os

__all__ = ["TaskServer", "pick_address", "threads_for"]

# Ports tried, the first included, before a task whose ports are all taken fails.
PORT_TRIES = 5


def pick_address() -> dict:
    """A free port on this node, with the node's address and id (a Ray task's body)."""
    import ray

    from kerasps.runtime.ports import pick_port

    return {"ip": ray.util.get_node_ip_address(), "port": pick_port(),
            "node_id": ray.get_runtime_context().get_node_id()}


def _served_here(cluster: dict, task_type: str, index: int, node_id: str) -> dict:
    """`cluster` with the task at a free port of this node when Ray restarted it on a node
    other than `node_id` (the one its address was picked on); else `cluster`."""
    import ray

    if ray.get_runtime_context().get_node_id() == node_id:
        return cluster
    here = pick_address()
    return _moved(cluster, task_type, index, f"{here['ip']}:{here['port']}")


def _moved(cluster: dict, task_type: str, index: int, address: str) -> dict:
    """A copy of `cluster` with the task at `address`."""
    moved = {kind: list(addresses) for kind, addresses in cluster.items()}
    moved[task_type][index] = address
    return moved


def threads_for(cpus: float, num_workers: int) -> tuple[int, int]:
    """The `(intra_op, inter_op)` thread counts of a task given `cpus` CPUs by Ray.

    Intra-op: the CPUs (at least 1). Inter-op: as many, but never fewer than
    `num_workers + 1` (`kerasps.cluster.server_config`: fewer deadlock a worker whose
    closures' ops wait on each other).
    """
    intra = max(1, int(cpus))
    return intra, max(intra, num_workers + 1)


def _name_output(name: str):
    """Names this actor's output `name` in the lines Ray forwards to the driver from here on
    (`(worker 0 pid=N) ...`). Ray does so with the actor's `repr` once its constructor has
    returned; a line the constructor prints would be named for the class."""
    import sys

    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME as prefix
    except ImportError:  # pragma: no cover - another Ray's layout
        prefix = ":actor_name:"
    for stream in (sys.stdout, sys.stderr):
        print(f"{prefix}{name}", file=stream, flush=True)


def _start_server(tf, cluster: dict, task_type: str, index: int, config):
    """Starts the task's `tf.distribute.Server` at its address in `cluster`, or, when another
    process holds that port, at another free port of the same host (up to `PORT_TRIES`
    ports). Returns the server and the address it serves at."""
    from kerasps.runtime.ports import pick_port

    for tries in range(1, PORT_TRIES + 1):
        address = cluster[task_type][index]
        try:
            server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=task_type,
                                          task_index=index, config=config, protocol="grpc",
                                          start=True)
            return server, address
        except tf.errors.UnknownError as e:  # TensorFlow's words for a port it cannot bind
            if "Could not start gRPC server" not in str(e) or tries == PORT_TRIES:
                raise
        host = address.rpartition(":")[0]
        cluster = _moved(cluster, task_type, index, f"{host}:{pick_port()}")
        print(f"kerasps: {task_type} {index} could not serve at {address} (another process "
              f"took the port); serving at {cluster[task_type][index]} instead.", flush=True)


class TaskServer:
    """A worker or ps task: its server runs from construction to the end of the process.

    Args:
        cluster: task type -> addresses, the whole cluster (`chief`, `worker`, `ps`).
        task_type: `"worker"` or `"ps"`.
        index: the task's index among its type.
        cpus: the CPUs Ray gave the actor; TensorFlow's thread pools follow them.
        hide_gpus: set `CUDA_VISIBLE_DEVICES=""` before TensorFlow is imported (ps tasks:
            Ray leaves the variable alone for an actor given no GPU).
        announce: print where the task serves once its server started, as `kerasps serve`
            does.
        node_id: the Ray node the driver picked its address on; restarted on another node,
            the task serves at a new address there (`None`: at its address).

    Attributes:
        address: `host:port` the task serves at: its address in `cluster`, unless it moved
            to another node or another process took that port first (the driver reads it
            with `info`).

    Its `repr` is the task's name (`worker 0`): Ray prefixes the lines it forwards from the
    actor to the driver with it (`(worker 0 pid=4242) ...`).
    """

    def __init__(self, cluster: dict, task_type: str, index: int, cpus: float,
                 hide_gpus: bool, announce: bool = False, node_id: str | None = None):
        self.task_type, self.index = task_type, index
        if node_id is not None:
            cluster = _served_here(cluster, task_type, index, node_id)
        _name_output(repr(self))
        if hide_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # Imports the package first (`kerasps/__init__.py` quiets TensorFlow's start-up lines).
        from kerasps.runtime import servers

        servers._enable_fail_fast()
        import tensorflow as tf

        num_workers = len(cluster["worker"])
        config = servers.server_config(task_type, num_workers)
        intra, inter = threads_for(cpus, num_workers)
        config.intra_op_parallelism_threads = intra
        config.inter_op_parallelism_threads = inter
        self.threads = (intra, inter)
        self.server, self.address = _start_server(tf, cluster, task_type, index, config)
        self.gpus = len(tf.config.list_physical_devices("GPU"))
        if announce:
            print(f"kerasps serve: {task_type} {index} serving at {self.address}", flush=True)

    def __repr__(self):
        return f"{self.task_type} {self.index}"

    def info(self) -> dict:
        """The task's process id, node id, address, GPUs seen by TensorFlow and thread
        counts."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "address": self.address,
                "gpus": self.gpus, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "intra_op_threads": self.threads[0], "inter_op_threads": self.threads[1]}
