"""`kerasps.cluster`: the public names of `kerasps.runtime.cluster`, where they live."""

from kerasps.runtime.cluster import (
    JOBSET_ENV,
    JOBSET_PORT,
    JOBSET_REPLICAS_ENV,
    TASK_TYPES,
    from_tf_config,
    in_process,
    parse_tf_config,
    resolve,
    serve,
    server_config,
    start_server,
    task_type,
    tf_config_from_jobset,
)

__all__ = ["in_process", "from_tf_config", "resolve", "tf_config_from_jobset", "JOBSET_ENV",
           "JOBSET_REPLICAS_ENV", "JOBSET_PORT", "task_type", "serve", "parse_tf_config",
           "start_server", "server_config", "TASK_TYPES"]
