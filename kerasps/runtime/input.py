"""The input layer: `DatasetCreator`, `InputContext` and per-worker datasets.

In parameter-server training every worker reads its own input pipeline.
`DatasetCreator(dataset_fn)` wraps a function that builds one worker's
`tf.data.Dataset`; kerasps calls it once per worker with a `kerasps.InputContext`
whose `input_pipeline_id` is that worker's index (TensorFlow passes 0 to every
worker), so `dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)`
really splits the data.

`model.fit`, `evaluate` and `predict` also accept a `tf.data.Dataset` or
arrays; they are converted as documented in `kerasps.trainer`.

`InputOptions` chooses how the data is split among the workers: each worker
reading its shard (`shard_policy`, TensorFlow's auto-shard policies), or
every element served once per epoch to whichever worker asks next through
TensorFlow's tf.data service (`exactly_once=True`, see `kerasps.data_service`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading

import tensorflow as tf

from kerasps.backend import _tf

__all__ = ["DatasetCreator", "InputContext", "InputOptions", "PerWorkerDataset",
           "worker_input_context", "slowed", "shard", "resolve_shard_policy"]

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


def shard(dataset, policy: str, num_workers: int, index: int):
    """Worker `index`'s part of `dataset` under shard policy `policy`, as
    `resolve_shard_policy` gave it (`"file"`, `"data"` or `"off"`).

    `"off"` (and a single worker) keeps the whole dataset; `"data"` keeps every
    `num_workers`-th element the pipeline yields; `"file"` is TensorFlow's
    auto-shard rewrite, which gives the worker every `num_workers`-th file.
    """
    if policy == "off" or num_workers == 1:
        return dataset
    if policy == "data":
        return dataset.shard(num_workers, index)
    return _tf.shard_files(dataset, num_workers, index)


def resolve_shard_policy(dataset, policy: str, num_workers: int) -> str:
    """The policy `shard` applies to `dataset` for `shard_policy=policy`: `"auto"`
    becomes `"file"` when the dataset reads at least `num_workers` files and
    `"data"` otherwise, as TensorFlow's AUTO does. Raises for `"file"` that
    cannot give each worker a file. Runs eagerly (it reads file names)."""
    if policy in ("off", "data") or num_workers == 1:
        return policy
    with tf.init_scope():
        files = _tf.file_count(dataset)
    if policy == "auto":
        return "file" if files is not None and files >= num_workers else "data"
    if files is None:
        raise ValueError(
            "Invalid value for argument `shard_policy`: 'file' shards by the files a "
            "dataset reads, and this one reads none that can be counted (use 'data' or "
            f"'auto'). Received: shard_policy='file' for {dataset!r:.200}")
    if files < num_workers:
        raise ValueError(
            f"Invalid value for argument `shard_policy`: 'file' gives each of the "
            f"{num_workers} workers whole files, and the dataset reads {files} file(s): "
            f"{num_workers - files} worker(s) would get no data. Use more files, 'data' "
            "or 'auto'. Received: shard_policy='file'")
    return "file"


def check_dataset(dataset, dataset_fn):
    if not isinstance(dataset, tf.data.Dataset):
        name = getattr(dataset_fn, "__name__", repr(dataset_fn))
        raise ValueError(
            f"Invalid value returned by `dataset_fn` {name!r}: expected a "
            f"`tf.data.Dataset`. Received: {type(dataset).__name__} {dataset!r:.200}"
        )
    return dataset


# -- Per-worker input contexts -------------------------------------------------
_building = threading.local()


@dataclasses.dataclass
class DatasetInfo:
    """What tracing the workers' pipelines revealed.

    Attributes:
        element_spec: the spec of one element of a worker's `tf.data.Dataset`.
    """

    element_spec: object = None


@contextlib.contextmanager
def worker_input_context(context: InputContext, info: DatasetInfo | None = None):
    """While active, `strategy.distribute_datasets_from_function` passes `context`."""
    previous = getattr(_building, "state", None)
    _building.state = (context, info)
    try:
        yield
    finally:
        _building.state = previous


def current_worker_input_context():
    state = getattr(_building, "state", None)
    return None if state is None else state[0]


def _worker_context(strategy, worker_index) -> InputContext:
    return InputContext(
        num_input_pipelines=strategy.num_workers,
        input_pipeline_id=worker_index,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )


def cardinalities(strategy, dataset_fn) -> list:
    """Per worker, the number of elements `dataset_fn(input_context)` yields.

    `tf.data.INFINITE_CARDINALITY` (-1) marks an endless pipeline and `None`
    one whose size TensorFlow cannot tell without reading it. The function is
    called eagerly on the coordinator, once per worker; no data is read.
    """
    result = []
    with tf.init_scope():
        for i in range(strategy.num_workers):
            dataset = check_dataset(dataset_fn(_worker_context(strategy, i)), dataset_fn)
            n = int(dataset.cardinality())
            result.append(None if n == tf.data.UNKNOWN_CARDINALITY else n)
    return result


def whole_dataset(strategy, dataset_fn):
    """`dataset_fn`'s dataset for one input pipeline that feeds every worker
    (`exactly_once` input), built eagerly on the coordinator."""
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=strategy.num_replicas_in_sync)
    with tf.init_scope():
        return check_dataset(dataset_fn(context), dataset_fn)


def _takes_argument(fn) -> bool:
    fn = getattr(fn, "python_function", fn)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


class PerWorkerDataset:
    """One input pipeline per worker, built from a dataset function or a dataset.

    Pass `iter(per_worker_dataset)` to `ClusterCoordinator.schedule`; each
    scheduled function receives the iterator of the worker that runs it.

    Args:
        strategy: the `kerasps.ParameterServerStrategy`.
        coordinator: its TensorFlow `ClusterCoordinator`.
        dataset_fn: a `DatasetCreator`, a callable `(input_context) -> Dataset`,
            a no-argument callable returning a dataset (possibly calling
            `strategy.distribute_datasets_from_function`, as in TensorFlow's
            tutorial), or a `tf.data.Dataset` (every worker reads all of it).
    """

    def __init__(self, strategy, coordinator, dataset_fn, input_options=None):
        self._strategy = strategy
        self._coordinator = coordinator
        self.info = DatasetInfo()
        self._served = None
        dataset_fn, distributed_options = unwrap_distributed(dataset_fn, "dataset_fn")
        if isinstance(dataset_fn, DatasetCreator):
            input_options = input_options or dataset_fn.input_options
        input_options = input_options or distributed_options
        self.options = options = as_input_options(input_options)
        tf_options = tf_input_options(input_options)
        policy, workers = options.shard_policy or "off", strategy.num_workers
        if isinstance(dataset_fn, tf.data.Dataset):
            dataset = dataset_fn
            if options.exactly_once:
                self._serve(dataset)
                return
            policy = resolve_shard_policy(dataset, policy, workers)
            graph = _tf.serialize_dataset(dataset)
            spec = dataset.element_spec

            def dataset_fn():
                context = current_worker_input_context()
                return shard(_tf.deserialize_dataset(graph, spec), policy,
                             context.num_input_pipelines, context.input_pipeline_id)
        if not callable(dataset_fn):
            raise ValueError(
                "Invalid value for argument `dataset_fn`: expected a "
                "`kerasps.DatasetCreator`, a callable or a `tf.data.Dataset`. "
                f"Received: dataset_fn={dataset_fn!r}"
            )
        python_fn = getattr(dataset_fn, "python_function", dataset_fn)
        if _takes_argument(python_fn):
            if options.exactly_once:
                self._serve(whole_dataset(strategy, python_fn))
                return
            if policy in ("auto", "file") and workers > 1:  # count the files it reads
                with tf.init_scope():
                    policy = resolve_shard_policy(check_dataset(
                        python_fn(_worker_context(strategy, 0)), python_fn), policy, workers)

            def user_fn(context, dataset_fn=python_fn):
                dataset = check_dataset(dataset_fn(context), dataset_fn)
                return shard(dataset, policy, context.num_input_pipelines,
                             context.input_pipeline_id)

            def python_fn():
                return strategy.distribute_datasets_from_function(user_fn, tf_options)
        elif options.exactly_once:
            raise ValueError(
                "Invalid value for argument `dataset_fn`: with `exactly_once=True` it must "
                "take a `kerasps.InputContext` (it is called once, for the whole dataset). "
                f"Received: dataset_fn={dataset_fn!r}")

        self._functions = [self._trace(python_fn, i) for i in range(workers)]

    def _serve(self, dataset):
        from kerasps.runtime import data_service

        self._served = data_service.serve(self._strategy, self.options, dataset)
        self.info.element_spec = dataset.element_spec

    @property
    def exactly_once(self) -> bool:
        """True if the workers share one tf.data service job per `iter()` (an epoch)."""
        return self._served is not None

    def _trace(self, python_fn, worker_index):
        context = _worker_context(self._strategy, worker_index)

        def no_variables(next_creator, **kwargs):
            raise ValueError(
                "Invalid `dataset_fn`: it creates a variable "
                f"({kwargs.get('name')!r}); dataset functions run on every worker "
                "and must not create variables. Create lookup layers and their "
                "state outside `dataset_fn`.")

        with worker_input_context(context, self.info), tf.variable_creator_scope(no_variables):
            function = tf.function(python_fn).get_concrete_function()
        return function

    def _worker_functions(self, call):
        if not tf.executing_eagerly():
            raise RuntimeError(
                f"`{call}` of a per-worker dataset must be called eagerly, on the "
                "coordinator, not inside a `tf.function`.")
        return self._functions if self._served is None else [
            self._trace(self._served.epoch(), 0)] * self._strategy.num_workers

    def build(self):
        """Creates each worker's dataset, without an iterator, as TensorFlow's
        `PerWorkerDataset.build()` does.

        ```python
        @tf.function
        def first(dataset):
            return next(iter(dataset))

        datasets = coordinator.create_per_worker_dataset(dataset_fn).build()
        coordinator.schedule(first, args=(datasets,))
        ```

        Returns:
            Per-worker values for `schedule`: each scheduled function receives
            the dataset of the worker that runs it (a `tf.data.Dataset`, or for
            a dataset function the distributed dataset TensorFlow's `build()`
            gives), to iterate there (every `iter()` inside the function starts
            that dataset again). With
            `exactly_once`, every `build()` starts a new pass over the data (a
            tf.data service job) that the workers share.
        """
        remote_datasets = []
        for worker, function in zip(_tf.workers(self._coordinator),
                                    self._worker_functions("build()")):
            remote = worker.create_resource(lambda f=function: f())
            remote._type_spec = tf.type_spec_from_value(function.structured_outputs)
            remote_datasets.append(remote)
        return _tf.PerWorkerValues(tuple(remote_datasets))

    def __iter__(self):
        """Each worker's iterator, as per-worker values for `schedule`.

        With `exactly_once`, every `iter()` starts a new pass over the data
        (a tf.data service job) that the workers share.
        """
        functions = self._worker_functions("iter()")
        remote_iterators = []
        for worker, function in zip(_tf.workers(self._coordinator), functions):
            remote = worker.create_resource(lambda f=function: iter(f()))
            remote._type_spec = _tf.get_iterator_spec(self._strategy, function.structured_outputs)
            remote_iterators.append(remote)
        return _tf.PerWorkerDistributedIterator(tuple(remote_iterators))

    def persistent_iterator(self):
        """One per-worker iterator kept for this dataset's lifetime.

        Training uses it so that later `fit` calls continue the stream instead of
        rebuilding iterators: TensorFlow frees an iterator's functions on every
        worker, which waits behind the steps running there (seconds per `fit`).
        """
        if getattr(self, "_persistent_iterator", None) is None:
            self._persistent_iterator = iter(self)
        return self._persistent_iterator

    def renew_persistent_iterator(self):
        """Replaces the persistent iterators by new ones (every worker's pipeline
        starts again) and returns them."""
        self._persistent_iterator = None
        return self.persistent_iterator()

    @property
    def element_spec(self):
        if self._served is not None:
            return self._served.element_spec
        return self._functions[0].structured_outputs.element_spec


def record_dataset_info(dataset):
    """Called while tracing a worker's pipeline: remembers its element spec."""
    state = getattr(_building, "state", None)
    if state is None or state[1] is None:
        return
    state[1].element_spec = dataset.element_spec
