"""`kerasps.input`: the public names of `kerasps.runtime.input`, where they live."""

from kerasps.runtime.input import (
    DatasetCreator,
    InputContext,
    InputOptions,
    PerWorkerDataset,
    resolve_shard_policy,
    shard,
    slowed,
    worker_input_context,
)

__all__ = ["DatasetCreator", "InputContext", "InputOptions", "PerWorkerDataset",
           "worker_input_context", "slowed", "shard", "resolve_shard_policy"]
