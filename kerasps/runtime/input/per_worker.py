"""The per-worker dataset runtime: one input pipeline per worker, or one tf.data service
job that the workers share."""

from __future__ import annotations

import weakref

import tensorflow as tf

from kerasps.backend import _tf
from kerasps.runtime.input.inspection import (
    DatasetInfo,
    _takes_argument,
    _worker_context,
    current_worker_input_context,
    whole_dataset,
    worker_input_context,
)
from kerasps.runtime.input.options import (
    DatasetCreator,
    as_input_options,
    check_dataset,
    tf_input_options,
    unwrap_distributed,
)
from kerasps.runtime.input.sharding import resolve_shard_policy, shard


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
        if getattr(self, "_persistent_iterator", None) is None or self.reading:
            # A call that read it ended by an error (or Ctrl-C), which may have left a
            # worker's iterator cancelled for good (`restart_persistent_iterators`).
            self._persistent_iterator = iter(self)
            _PERSISTENT.add(self)
        return self._persistent_iterator

    # True while a call (`fit`) reads the persistent iterator; it sets it back when it
    # ends normally.
    reading = False

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


# The datasets whose persistent iterators `restart_persistent_iterators` starts again.
_PERSISTENT = weakref.WeakSet()


def restart_persistent_iterators(tf_coordinator):
    """Starts every worker's pipeline of each persistent iterator on `tf_coordinator`'s
    workers again, in place: whoever holds the iterator keeps it and reads the new
    pipelines (those functions scheduled from now on).

    A scheduled function that fails or is cancelled while its `next(iterator)` waits
    for an element leaves that worker's iterator cancelled for good: TensorFlow's
    `IteratorGetNext` passes the function's cancellation on to the iterator itself
    (`IteratorResource::GetNext`), and the prefetch at the top of the worker's
    per-device pipeline (`OwnedMultiDeviceIterator`) then reports the end of the
    sequence on every later read, although the input is repeated. A lost ps task
    fails or cancels every function in flight, so `fit` calls this once it goes on
    after one (as TensorFlow rebuilds a restarted worker's pipelines).
    """
    for dataset in list(_PERSISTENT):
        iterator = getattr(dataset, "_persistent_iterator", None)
        if iterator is not None and dataset._coordinator is tf_coordinator:
            _tf.rebuild_per_worker_resources(tf_coordinator, iterator)
