"""The public input types: `InputOptions`, `InputContext`, `DatasetCreator`, and what a
strategy's distributed dataset was made from."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from kerasps.backend import _tf

SHARD_POLICIES = ("auto", "file", "data", "off")


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How the workers share a dataset.

    ```python
    data = kerasps.DatasetCreator(
        dataset_fn, input_options=kerasps.InputOptions(exactly_once=True))
    model.fit(data, epochs=3)  # every element once per epoch, no `steps_per_epoch`
    ```

    Args:
        exactly_once: serve the dataset through TensorFlow's tf.data service
            (every worker reads from one job; see `kerasps.data_service`):
            `dataset_fn` is called once, with
            `InputContext(num_input_pipelines=1, input_pipeline_id=0)`, and
            within an epoch every element goes to exactly one worker, whichever
            asks next, so fast workers take more. An epoch ends when the data
            does (partial last batch included); `steps_per_epoch` may be
            omitted. A worker that fails loses the batches it had received
            and not yet used (see docs/guide/input.md).
            `fit` given a finite `tf.data.Dataset` or arrays and no
            `steps_per_epoch` uses it unless told otherwise; `evaluate` and
            `predict` read each batch once either way.
        shard_policy: how each worker's pipeline is cut when workers read
            their own: `"auto"` (by files when the dataset reads files,
            otherwise by data), `"file"` (each worker reads
            `1/num_workers` of the files; fewer files than workers is an
            error), `"data"` (every worker runs the whole pipeline and keeps
            every `num_workers`-th element) or `"off"` (every worker reads
            everything), with the meanings of `tf.data.experimental.AutoShardPolicy`.
            `None` (default): `"auto"` for a `tf.data.Dataset` or arrays, `"off"`
            for a `dataset_fn`, which shards its dataset itself with its
            `kerasps.InputContext`. `evaluate` and `predict` of a
            `DatasetCreator` split its one pipeline: by `"data"` (`evaluate`
            also by `"file"` or `"auto"` when asked).
        service: the address (`"grpc://host:port"`) of a running tf.data
            service dispatcher to serve `exactly_once` input through. `None`
            (default): kerasps starts a dispatcher and a data worker in the
            coordinator's process.
    """

    exactly_once: bool = False
    shard_policy: str | None = None
    service: str | None = None

    def __post_init__(self):
        if not isinstance(self.exactly_once, bool):
            raise ValueError("Invalid value for argument `exactly_once`: it must be True or "
                             f"False. Received: exactly_once={self.exactly_once!r}")
        if self.shard_policy is not None and self.shard_policy not in SHARD_POLICIES:
            raise ValueError(
                "Invalid value for argument `shard_policy`: it must be one of "
                f"{', '.join(map(repr, SHARD_POLICIES))} or None. "
                f"Received: shard_policy={self.shard_policy!r}")
        if self.exactly_once and self.shard_policy not in (None, "off"):
            raise ValueError(
                "Invalid value for argument `shard_policy`: with `exactly_once=True` the "
                "tf.data service hands out the data, no worker reads a shard of its own; "
                f"leave it None. Received: shard_policy={self.shard_policy!r}")
        if self.service is not None and not (
                isinstance(self.service, str) and "://" in self.service):
            raise ValueError(
                "Invalid value for argument `service`: it must be a tf.data service "
                "dispatcher address such as 'grpc://host:5050', or None. "
                f"Received: service={self.service!r}")
        if self.service is not None and not self.exactly_once:
            raise ValueError(
                "Invalid value for argument `service`: a tf.data service only serves "
                "`exactly_once=True` input. Received: service="
                f"{self.service!r} with exactly_once=False")


def tf_input_options(options):
    """TensorFlow's own `tf.distribute.InputOptions` out of an `options` argument, or None."""
    return options if isinstance(options, tf.distribute.InputOptions) else None


def as_input_options(options, argument="input_options"):
    """`options` as a `kerasps.InputOptions`: also accepts TensorFlow's
    `tf.distribute.InputOptions` (its device-placement fields do not apply to
    parameter-server workers) and None."""
    if options is None or isinstance(options, tf.distribute.InputOptions):
        return InputOptions()
    if isinstance(options, InputOptions):
        return options
    raise ValueError(
        f"Invalid value for argument `{argument}`: expected a `kerasps.InputOptions`, a "
        f"`tf.distribute.InputOptions` or None. Received: {argument}={options!r}")


class InputContext(tf.distribute.InputContext):
    """What a `dataset_fn` knows about the worker it builds input for.

    Attributes:
        num_input_pipelines: the number of workers, i.e. of input pipelines.
        input_pipeline_id: this worker's index, in `[0, num_input_pipelines)`.
        num_replicas_in_sync: replicas per worker (GPUs per worker, or 1).

    `get_per_replica_batch_size(global_batch_size)` divides a worker's batch
    among its replicas (its GPUs).
    """

    def get_per_replica_batch_size(self, global_batch_size):
        per_replica = super().get_per_replica_batch_size(global_batch_size)
        if per_replica < 1:
            raise ValueError(
                "Invalid value for argument `global_batch_size`: each of the "
                f"{self.num_replicas_in_sync} replica(s) would get a batch of "
                f"{per_replica}; it must be at least 1. "
                f"Received: global_batch_size={global_batch_size!r}")
        return per_replica

    def __str__(self):
        return repr(self)

    def __repr__(self):
        return (f"kerasps.InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class DatasetCreator:
    """Builds each worker's input pipeline from `dataset_fn(input_context)`.

    ```python
    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(64)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.shuffle(1024).batch(batch_size).prefetch(2)

    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=100)
    ```

    Args:
        dataset_fn: a callable taking a `kerasps.InputContext` and returning
            a `tf.data.Dataset`. For training it runs once per worker when the
            input is first used; `evaluate` and `predict` call it once, on the
            coordinator, with `InputContext(num_input_pipelines=1,
            input_pipeline_id=0)`, and each worker keeps every
            `num_workers`-th batch of that one pipeline, so each batch is
            counted once whether or not `dataset_fn` shards by its context.
            It must not create variables.
        input_options: a `kerasps.InputOptions` (`exactly_once`,
            `shard_policy`), or TensorFlow's `tf.distribute.InputOptions`, whose
            device-placement fields do not apply to parameter-server workers.
    """

    def __init__(self, dataset_fn, input_options=None):
        if not callable(dataset_fn):
            raise ValueError(
                "Invalid value for argument `dataset_fn`: expected a callable "
                "taking a `kerasps.InputContext` and returning a `tf.data.Dataset`. "
                f"Received: dataset_fn={dataset_fn!r}"
            )
        as_input_options(input_options)
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context):
        dataset = self.dataset_fn(input_context)
        return check_dataset(dataset, self.dataset_fn)

    def __repr__(self):
        return f"kerasps.DatasetCreator({getattr(self.dataset_fn, '__name__', self.dataset_fn)!r})"


@dataclasses.dataclass(frozen=True)
class DistributedInput:
    """What a kerasps strategy's distributed dataset was made from.

    Exactly one field is set: `dataset` for
    `strategy.experimental_distribute_dataset(dataset)`, `creator` for
    `strategy.distribute_datasets_from_function(dataset_fn, options)`.
    """

    dataset: tf.data.Dataset | None = None
    creator: DatasetCreator | None = None
    options: InputOptions | None = None


def unwrap_distributed(x, argument="x"):
    """`(input, options)`: the `tf.data.Dataset` or `DatasetCreator` behind a
    distributed dataset, and the `kerasps.InputOptions` it was distributed with.

    Anything that is not a distributed dataset is returned unchanged, with
    options None. A
    distributed dataset that no kerasps strategy made cannot be read again
    per worker: the error says what to pass instead.
    """
    if not isinstance(x, tf.distribute.DistributedDataset):
        return x, None
    source = getattr(x, "_kerasps_input", None)
    if source is None:
        raise ValueError(
            f"Invalid value for argument `{argument}`: a distributed dataset made by "
            "another strategy cannot be read by kerasps workers. Pass the dataset itself, "
            "the result of `kerasps.ParameterServerStrategy.experimental_distribute_dataset"
            "` or `distribute_datasets_from_function` of the model's strategy, or a "
            f"`kerasps.DatasetCreator`. Received: {argument}={type(x).__name__} {x!r:.100}")
    if source.dataset is not None:
        return source.dataset, source.options
    return source.creator, None


def slowed(dataset, seconds: float):
    """`dataset` with every element held back `seconds`: a straggler for experiments.

    ```python
    def dataset_fn(context):
        dataset = make_dataset(context)
        if context.input_pipeline_id == 0:  # worker 0 is the slow one
            dataset = kerasps.input.slowed(dataset, 0.05)
        return dataset
    ```

    The delay is spent off the CPU on the worker, before the step can start.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError("Invalid value for argument `seconds`: it must be a number >= 0. "
                         f"Received: seconds={seconds!r}")
    return _tf.sleep_dataset(dataset, seconds) if seconds else dataset


def check_dataset(dataset, dataset_fn):
    if not isinstance(dataset, tf.data.Dataset):
        name = getattr(dataset_fn, "__name__", repr(dataset_fn))
        raise ValueError(
            f"Invalid value returned by `dataset_fn` {name!r}: expected a "
            f"`tf.data.Dataset`. Received: {type(dataset).__name__} {dataset!r:.200}"
        )
    return dataset
