"""How a process of the job talks gRPC and how its server is sized: what every way of
starting a task shares (`kerasps.runtime.cluster`'s in-process clusters, `TF_CONFIG` tasks
and chiefs, `kerasps.runtime.ray_cluster`'s Ray actors and driver). `kerasps.runtime.cluster`
re-exports these names.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import multiprocessing
import os

__all__ = ["CHIEF_GRPC_OPTIONS", "GRPC_OPTIONS_ENV", "grpc_options", "server_config"]


def _enable_fail_fast():
    # Lets the coordinator see worker and ps failures instead of retrying forever.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")


# The gRPC channel arguments TensorFlow gives every channel of a process, read once, when
# it creates the process's first channel (`CreateDefaultChannelArguments`).
GRPC_OPTIONS_ENV = "TF_GRPC_DEFAULT_OPTIONS"
# The chief's keepalive: while an RPC is in flight on a connection, a ping every second;
# no answer within 2 s closes the connection and fails its RPCs with UNAVAILABLE, as a
# killed task's refused connection does. Without it, a task cut off the network (its
# process alive, the TCP connection open) held a step's RPC until the link came back.
# The peer's HTTP/2 layer answers pings while the task computes, so a long step is no
# dead link. But a gRPC server ends a connection pinged more than twice within 5 minutes
# of no sending of its own ("too_many_pings": its `min_recv_ping_interval_without_data_ms`
# and `max_ping_strikes`, which TensorFlow's servers do not expose), failing the RPCs on
# it as a dead link would. So the chief sends no ping on an idle connection (no
# `keepalive_permit_without_calls`) and one ping, not gRPC's default of 2, after each of
# its own sends (`max_pings_without_data`): with 2, a worker busy for seconds with one
# long execution (steps_per_execution=10 on a slow link) while the chief sent it other
# messages ended the connection, and the steps it had run ran again
# (`test_long_executions_after_short_ones_run_every_step_once`). One answered ping is
# enough to find a dead link. A user's `TF_GRPC_DEFAULT_OPTIONS` keeps its values
# (`grpc_options`).
CHIEF_GRPC_OPTIONS = {
    "grpc.keepalive_time_ms": "1000",
    "grpc.keepalive_timeout_ms": "2000",
    "grpc.http2.max_pings_without_data": "1",
}


def grpc_options(options: dict, current: str | None = None) -> str:
    """`TF_GRPC_DEFAULT_OPTIONS`'s text (`name=value,name=value`) with `options` added to
    `current`: a name `current` sets keeps its value there."""
    entries = [entry for entry in (current or "").split(",") if entry.strip()]
    named = {entry.split("=", 1)[0].strip() for entry in entries}
    entries += [f"{name}={value}" for name, value in options.items() if name not in named]
    return ",".join(entries)


def _enable_keepalive():
    # The chief's channels only: a worker's keepalive would fail its steps during a ps
    # task's link cut, where waiting for the link keeps every step (the ps kept its state).
    os.environ[GRPC_OPTIONS_ENV] = grpc_options(CHIEF_GRPC_OPTIONS,
                                                os.environ.get(GRPC_OPTIONS_ENV))


def server_config(task_type: str, num_workers: int, tasks_in_process: int = 1):
    """Returns the `ConfigProto` a worker or ps server needs on a small machine.

    A worker runs one step function per scheduled closure and, with
    asynchronous dispatch, several closures' ops wait on each other; with
    fewer inter-op threads than `num_workers + 1` an in-process cluster on a
    2-core machine deadlocks (TF's own tutorial raises the count for workers).

    TensorFlow runs the ops of every server of a process on one inter-op pool,
    sized by the first server started (`ComputePool`): the `tasks_in_process`
    servers of an in-process cluster share it, so it gets the threads each
    would have alone. Sized for one task, every thread was held by workers'
    handlers waiting for a ps task's answer that needed a free one.
    """
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    threads = max(multiprocessing.cpu_count(), num_workers + 1)
    config.inter_op_parallelism_threads = threads * tasks_in_process
    return config
