"""The `x` argument of `fit`/`evaluate`/`predict` made into per-worker input pipelines."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.policy._validation import positive_int
from kerasps.runtime import input as input_lib

DEFAULT_BATCH_SIZE = 32


def is_array_like(x):
    if isinstance(x, (np.ndarray, tf.Tensor)) or tf.is_tensor(x):
        return True
    if isinstance(x, (list, tuple)) and x and all(is_array_like(e) for e in x):
        return True
    if isinstance(x, dict) and x and all(is_array_like(e) for e in x.values()):
        return True
    return False


class Source:
    """One `x` argument made into a per-worker dataset function.

    Attributes:
        dataset_fn: `(input_context) -> tf.data.Dataset` for one worker (with
            `exactly_once` options: the whole dataset, for the one context of
            a single input pipeline).
        total_batches: the number of batches over all workers if known.
        options: the `kerasps.InputOptions` (or TensorFlow's) of the input.
        creator: the user's `DatasetCreator`, whose pipelines are built once.
        once_by_default: whether `exactly_once` was chosen by kerasps, for arrays or
            a finite dataset given without a step count (no options said so).
    """

    def __init__(self, dataset_fn, total_batches=None, options=None, creator=None,
                 once_by_default=False):
        self.dataset_fn = dataset_fn
        self.total_batches = total_batches
        self.options = options
        self.creator = creator
        self.once_by_default = once_by_default

    @property
    def exactly_once(self) -> bool:
        return input_lib.as_input_options(self.options).exactly_once


def _require_none_with_batches(kind, arg, **values):
    """`y`, `sample_weight` and `batch_size` belong to arrays, not to batched inputs."""
    for name, value in values.items():
        if value is not None:
            raise ValueError(
                f"Invalid value for argument `{name}`: it must be None when `{arg}` is "
                f"a {kind} (it yields batches). Received: {name}={value!r:.100}")


def make_source(x, y, sample_weight, batch_size, shuffle, training, strategy, arg="x",
                steps=None, predicting=False):
    """`x` (and `y`, `sample_weight`) as a `Source`.

    A finite (or unknown-size) `tf.data.Dataset` or arrays given to `fit`
    without `steps` are read exactly once per epoch (`kerasps.InputOptions(exactly_once=True)`)
    unless `strategy.experimental_distribute_dataset(x, options)` says
    otherwise; for evaluation each worker reads its shard to the end (also
    once). Evaluation and prediction read one pipeline: a `DatasetCreator`'s
    `dataset_fn` is called once, with
    `InputContext(num_input_pipelines=1, input_pipeline_id=0)` (as tf_keras'
    `evaluate` and `predict` called it), so one that shards by its context and
    one that ignores it count each batch once. Like a dataset or arrays, each
    worker runs that pipeline and keeps every `num_workers`-th batch
    (`shard_policy="data"`; for evaluation also `"file"` or `"auto"` if the
    creator's options ask for them, or one tf.data service job with
    `exactly_once`); prediction puts its results back in that order.
    """
    x, distributed_options = input_lib.unwrap_distributed(x, arg)
    creator = None
    if isinstance(x, input_lib.DatasetCreator) or (
            callable(x) and not isinstance(x, tf.data.Dataset) and not is_array_like(x)):
        _require_none_with_batches("`DatasetCreator`", arg, y=y, sample_weight=sample_weight,
                                   batch_size=batch_size)
        creator = x if isinstance(x, input_lib.DatasetCreator) else input_lib.DatasetCreator(x)
        if training:
            return Source(creator, options=creator.input_options, creator=creator)
        # Evaluation and prediction read one pipeline, as tf_keras' did: per-worker
        # pipelines of a `dataset_fn` that ignores its context would each yield the same
        # batches (counted, or predicted, once per worker).
        x = input_lib.whole_dataset(strategy, creator)
        distributed_options = single_pipeline_options(creator.input_options)
        if predicting:
            creator = None  # nothing to keep: prediction rebuilds its pipelines

    if isinstance(x, tf.data.Dataset):
        _require_none_with_batches("`tf.data.Dataset`", arg, y=y, sample_weight=sample_weight,
                                   batch_size=batch_size)
        dataset = x
    elif is_array_like(x):
        batch_size = positive_int("batch_size", batch_size, allow_none=True) or DEFAULT_BATCH_SIZE
        data = tuple(v for v in (x, y, sample_weight) if v is not None)
        data = data[0] if len(data) == 1 else data
        dataset = tf.data.Dataset.from_tensor_slices(data)
        if training and shuffle:
            size = int(dataset.cardinality())
            dataset = dataset.shuffle(max(size, 1), reshuffle_each_iteration=True)
        dataset = dataset.batch(batch_size)
    else:
        raise ValueError(
            f"Invalid value for argument `{arg}`: under a kerasps strategy it must be a "
            "`kerasps.DatasetCreator`, a `tf.data.Dataset` or arrays (NumPy arrays, "
            f"tensors, or lists/dicts of them). Received: {arg}={type(x).__name__} "
            f"{x!r:.100}")

    graph = _tf.serialize_dataset(dataset)
    spec = dataset.element_spec
    cardinality = int(dataset.cardinality())
    total = cardinality if cardinality >= 0 else None
    if cardinality == tf.data.INFINITE_CARDINALITY:
        total = tf.data.INFINITE_CARDINALITY

    options = distributed_options
    by_default = options is None
    if by_default:  # a finite (or unknown-size) dataset without a step count: once
        options = input_lib.InputOptions(exactly_once=bool(
            training and steps is None and total != 0
            and total != tf.data.INFINITE_CARDINALITY))
    if predicting:
        options = input_lib.InputOptions(shard_policy="data")
    if options.exactly_once:
        return Source(lambda _: _tf.deserialize_dataset(graph, spec), total_batches=total,
                      options=options, creator=creator, once_by_default=by_default)
    policy = input_lib.resolve_shard_policy(dataset, options.shard_policy or "auto",
                                            strategy.num_workers)

    def dataset_fn(context):
        batches = _tf.deserialize_dataset(graph, spec)
        return input_lib.shard(batches, policy, context.num_input_pipelines,
                               context.input_pipeline_id)

    # Sharded here: no options for workers. An evaluated `DatasetCreator` keeps its
    # pipelines per coordinator (see `per_worker_dataset`).
    return Source(dataset_fn, total_batches=total, creator=creator)


def single_pipeline_options(options):
    """The `kerasps.InputOptions` that split the one pipeline of an evaluated
    `DatasetCreator` among the workers: `exactly_once` is kept; otherwise each
    worker keeps every `num_workers`-th batch (`"data"`) unless the creator asks
    for `"file"` or `"auto"`. `"off"` (a `dataset_fn`'s default: it shards by its
    context) would give every worker all of it, so it becomes `"data"` too.
    """
    options = input_lib.as_input_options(options)
    if options.exactly_once:
        return options
    if options.shard_policy in ("file", "auto"):
        return input_lib.InputOptions(shard_policy=options.shard_policy)
    return input_lib.InputOptions(shard_policy="data")


_TRANSFORMS = {
    "train": lambda dataset: dataset.repeat(),
    "train_once": None,  # exactly-once input: an epoch is one pass over the data
    "evaluate": None,
    "predict": lambda dataset: dataset.map(_only_inputs).enumerate(),
}


def _only_inputs(*element):
    if len(element) == 1:
        element = element[0]
    x, _, _ = _keras.unpack_x_y_sample_weight(element)
    return x


def per_worker_dataset(coordinator, source, purpose):
    """Builds the per-worker pipelines of `source` for `purpose` ("train", "evaluate",
    "predict").

    The pipelines of a `DatasetCreator` are traced once per coordinator and
    purpose and reused by later `fit`/`evaluate` calls (each call still starts
    fresh iterators); pass a new `DatasetCreator` to rebuild them. (`evaluate`
    and `predict` read a single pipeline, see `make_source`.)
    """
    cache = coordinator._dataset_cache.setdefault(source.creator, {}) if (
        source.creator is not None) else {}
    if purpose == "train" and source.exactly_once:
        purpose = "train_once"
    if purpose in cache:
        return cache[purpose]
    transform = _TRANSFORMS[purpose]

    def dataset_fn(context):
        dataset = input_lib.check_dataset(source.dataset_fn(context), source.dataset_fn)
        return transform(dataset) if transform is not None else dataset

    cache[purpose] = coordinator.create_per_worker_dataset(
        input_lib.DatasetCreator(dataset_fn, input_options=source.options))
    return cache[purpose]


def total_batches(source, coordinator):
    if source.total_batches is not None:
        return source.total_batches
    counts = input_lib.cardinalities(coordinator.strategy, source.dataset_fn)
    if any(c == tf.data.INFINITE_CARDINALITY for c in counts):
        return tf.data.INFINITE_CARDINALITY
    if any(c is None for c in counts):
        return None
    return sum(counts)


def require_finite(source, coordinator, argument):
    """Without a step count, evaluation and prediction read datasets to their end."""
    if total_batches(source, coordinator) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"Invalid value for argument `{argument}`: it is required when the dataset is "
            f"infinite (evaluation and prediction without `{argument}` read every worker's "
            f"dataset to its end). Received: {argument}=None")
