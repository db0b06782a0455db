"""The input layer (`kerasps.input`): `DatasetCreator`, `InputContext` and per-worker datasets.

In parameter-server training every worker reads its own input pipeline.
`DatasetCreator(dataset_fn)` wraps a function that builds one worker's
`tf.data.Dataset`; kerasps calls it once per worker with a `kerasps.InputContext`
whose `input_pipeline_id` is that worker's index (TensorFlow passes 0 to every
worker), so `dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)`
really splits the data.

`model.fit`, `evaluate` and `predict` also accept a `tf.data.Dataset` or
arrays; they are converted as documented in `kerasps.keras.trainer`.

`InputOptions` chooses how the data is split among the workers: each worker
reading its shard (`shard_policy`, TensorFlow's auto-shard policies), or
every element served once per epoch to whichever worker asks next through
TensorFlow's tf.data service (`exactly_once=True`, see `kerasps.data_service`).

The module is split by job: the public types (`options`), shard-policy arithmetic
(`sharding`), dataset inspection and worker input contexts (`inspection`), the
per-worker dataset runtime (`per_worker`); this package re-exports them.
"""

from kerasps.runtime.input.inspection import DatasetInfo as DatasetInfo
from kerasps.runtime.input.inspection import cardinalities as cardinalities
from kerasps.runtime.input.inspection import (
    current_worker_input_context as current_worker_input_context,
)
from kerasps.runtime.input.inspection import record_dataset_info as record_dataset_info
from kerasps.runtime.input.inspection import whole_dataset as whole_dataset
from kerasps.runtime.input.inspection import worker_input_context
from kerasps.runtime.input.options import SHARD_POLICIES as SHARD_POLICIES
from kerasps.runtime.input.options import DatasetCreator, InputContext, InputOptions, slowed
from kerasps.runtime.input.options import DistributedInput as DistributedInput
from kerasps.runtime.input.options import as_input_options as as_input_options
from kerasps.runtime.input.options import check_dataset as check_dataset
from kerasps.runtime.input.options import tf_input_options as tf_input_options
from kerasps.runtime.input.options import unwrap_distributed as unwrap_distributed
from kerasps.runtime.input.per_worker import PerWorkerDataset
from kerasps.runtime.input.sharding import resolve_shard_policy, shard

__all__ = ["DatasetCreator", "InputContext", "InputOptions", "PerWorkerDataset",
           "worker_input_context", "slowed", "shard", "resolve_shard_policy"]
