"""TensorFlow's `cluster_coordinator_test.py`, as kerasps users meet it.

Source: tensorflow/python/distribute/coordinator/cluster_coordinator_test.py. Each
test names the case it ports; the behaviour is asserted on `kerasps.ClusterCoordinator`
over the shared in-process cluster (2 workers, 2 ps) instead of a 5-worker one.

Deliberate differences (asserted as kerasps behaves, and said where):

* A dataset *function* given to `create_per_worker_dataset` is traced once per worker
  (TensorFlow: once), because each worker's pipeline is built with that worker's own
  `kerasps.InputContext` (docs/guide/fit-evaluate-predict.md: `input_pipeline_id` really is the
  worker's index; `kerasps.DatasetCreator`: "It runs once per worker"). A
  `tf.data.Dataset` is still traced once.
* TensorFlow schedules one closure per worker through its private tagged queues;
  kerasps has the public `ClusterCoordinator.schedule_on(worker, fn, args)`.

Skipped, with why:

* `CoordinatedClosureQueueTest` (all cases), `LimitedClosureQueueSizeBasicTest`,
  `LimitedClosureQueueErrorTest`, `ScheduleStartDelayTest`: TensorFlow's private closure
  queue and its module/environment knobs, which kerasps uses unchanged and does not
  expose.
* `testPerWorkerValue`, `testInputError`, `testErroredInputNotUsed` as written: they
  call the private `_create_per_worker_resources`; ported instead through the public
  path that creates per-worker resources, a per-worker dataset whose creation fails.
* `testVariableCaching`: `distribute_utils.cache_variable_reads` is TensorFlow-private.
* `testRepeatedIteratorCreation`'s last check and `testPerWorkerVariableCreation`'s
  device check read private attributes (`_resource_remote_value_refs`,
  `_per_worker_vars`); the rest of both is ported.
* `testBasicVariableAssignment`'s `_variable_count` is private; its values are ported.
"""

import logging
import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps

CLOSURE_INPUT_ERROR = "ClosureInputError"  # TensorFlow's; not exported under `tf.`


@tf.function
def next_element(iterator):
    return next(iterator)


def error_name(excinfo):
    return type(excinfo.value).__name__


# -- CoordinatorContextTest ------------------------------------------------------


def test_dataset_fn_shards_by_the_current_worker_index(strategy, coordinator):
    """testWorkerIndexDatasetFn: `experimental_get_current_worker_index()` in a
    `dataset_fn` is the index of the worker whose pipeline it builds."""

    def dataset_fn(context):
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        return tf.data.Dataset.range(10).shard(strategy.num_workers, index)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    @tf.function
    def total(iterator):
        result = tf.constant(0, tf.int64)
        for batch in iterator:
            result += tf.reduce_sum(batch)
        return result

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    totals = [coordinator.schedule_on(w, total, args=(iterator,)) for w in range(2)]
    coordinator.join()
    assert [int(t.fetch()) for t in totals] == [0 + 2 + 4 + 6 + 8, 1 + 3 + 5 + 7 + 9]


# -- ClusterCoordinatorTest ------------------------------------------------------


def test_there_is_one_coordinator_per_strategy(strategy, coordinator):
    """testClusterCoordinatorOnlyInitOnce."""
    assert kerasps.ClusterCoordinator(strategy) is coordinator
    assert strategy.coordinator() is coordinator


def test_fetch_returns_nested_results_as_they_were_returned(coordinator):
    """testFnReturnNestedValues and testFetchingRemoteValueStructure (skipped as flaky
    in TensorFlow; it holds here)."""
    one = tf.constant(1)

    @tf.function
    def nested():
        return one + 1, (one + 2, one + 3), [one + 4], {"v": one}

    expected = (2, (3, 4), [5], {"v": 1})
    remote = coordinator.schedule(nested)
    assert remote.fetch() == expected
    assert coordinator.fetch(remote) == expected
    several = [coordinator.schedule(nested) for _ in range(4)]
    assert coordinator.fetch(several) == [expected] * 4


def test_each_iter_starts_a_dataset_function_again(strategy, coordinator):
    """testInputFunction: every `iter()` of a per-worker dataset starts over."""
    with strategy.scope():
        seen = keras.Variable(0, dtype="int64", trainable=False)

    @tf.function
    def take(iterator):
        value = next(iterator)
        seen.assign_add(value)
        return value

    per_worker = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(1, 2))
    for _ in range(2):
        assert int(coordinator.fetch(coordinator.schedule(take, args=(iter(per_worker),)))) == 1
    assert int(seen.numpy()) == 2


def test_schedule_and_join(strategy, coordinator):
    """testAsyncScheduleAndJoin: a join with nothing scheduled returns; joins repeat."""
    with strategy.scope():
        total = keras.Variable(0, dtype="int32", trainable=False)

    @tf.function
    def add_next(iterator):
        total.assign_add(next(iterator))

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensor_slices([2] * 10)))
    coordinator.join()
    assert int(total.numpy()) == 0
    for _ in range(5):
        coordinator.schedule(add_next, args=(iterator,))
    coordinator.join()
    assert int(total.numpy()) == 10
    for _ in range(5):
        coordinator.schedule(add_next, args=(iterator,))
    coordinator.join()
    coordinator.join()
    coordinator.join()
    assert coordinator.done()
    assert int(total.numpy()) == 20


@pytest.mark.parametrize("given", ["function", "dataset"])
def test_a_map_in_the_input_is_traced_once_per_pipeline_build(strategy, coordinator, given):
    """testInputFunctionWithMap. Difference (module docstring): a dataset function is
    traced once per worker, a dataset once."""
    traced = []

    def input_fn():
        def plus_ten(x):
            traced.append(x)
            return x + 10

        return tf.data.Dataset.range(0, 10).map(plus_ten)

    source = input_fn if given == "function" else input_fn()
    per_worker = coordinator.create_per_worker_dataset(source)
    assert int(coordinator.fetch(coordinator.schedule(next_element,
                                                       args=(iter(per_worker),)))) == 10
    assert len(traced) == (strategy.num_workers if given == "function" else 1)


def test_a_dataset_function_creating_variables_is_refused(coordinator):
    """testInputFunctionCreateVariables."""

    def input_fn():
        tf.Variable(0.0)
        return tf.data.Dataset.range(3)

    with pytest.raises(ValueError, match="variable"):
        coordinator.create_per_worker_dataset(input_fn)


@pytest.mark.parametrize("given", ["function", "distributed_dataset"])
def test_workers_shuffle_their_pipelines_differently(strategy, coordinator, given):
    """testDatasetsShuffledDifferently: without a seed, each worker's shuffle differs."""
    tf.random.set_seed(None)

    def input_fn():
        dataset = tf.data.Dataset.range(0, 100).shuffle(100).batch(1)
        return strategy.experimental_distribute_dataset(dataset)

    per_worker = coordinator.create_per_worker_dataset(
        input_fn if given == "function" else input_fn())

    @tf.function
    def first_twenty(iterator):
        return tf.concat([tf.reshape(next(iterator), [-1]) for _ in range(20)], axis=0)

    iterator = iter(per_worker)
    orders = [coordinator.schedule_on(w, first_twenty, args=(iterator,)) for w in range(2)]
    coordinator.join()
    first, second = (o.fetch() for o in orders)
    assert len(set(first)) == len(set(second)) == 20
    assert not np.array_equal(first, second)


def test_per_worker_variables_hold_each_workers_own_updates(strategy, coordinator):
    """testPerWorkerVariableCreation (TensorFlow's `per_worker_variable=True`)."""
    with strategy.scope():
        counter = tf.Variable([0.0], name="per_worker_counter", per_worker_variable=True)

    @tf.function
    def bump():
        counter.assign_add([1.0])
        return counter.read_value()

    for i in range(4):
        coordinator.schedule(bump)
        coordinator.join()
        assert float(sum(counter.read_all()).numpy()[0]) == i + 1
    for _ in range(4):
        coordinator.schedule(bump)
    coordinator.join()
    assert len(counter.read_all()) == strategy.num_workers
    assert float(sum(counter.read_all()).numpy()[0]) == 8


def test_a_remote_value_is_refused_as_an_argument(coordinator):
    """testDisallowRemoteValueAsInput."""

    @tf.function
    def one():
        return 1.0

    @tf.function
    def plus_one(x):
        return x + 1.0

    with pytest.raises(ValueError, match="RemoteValue"):
        coordinator.schedule(plus_one, args=(coordinator.schedule(one),))


def test_a_python_function_is_refused(coordinator):
    """testPythonFunctionNotAllowedToSchedule."""
    with pytest.raises(TypeError, match="only accepts a `tf.function`"):
        coordinator.schedule(lambda a: tf.identity(a), args=(1,))


def test_a_dataset_made_on_the_coordinator_fails_as_an_input_error(coordinator):
    """testDatasetPartiallyCreatedOnCoordinator: a `tf.function` input capturing a
    dataset built on the coordinator cannot be copied to the workers."""
    made_here = tf.data.Dataset.range(1, 10)

    @tf.function
    def input_fn():
        return made_here.shuffle(9)

    coordinator.schedule(next_element, args=(iter(coordinator.create_per_worker_dataset(
        input_fn)),))
    with pytest.raises(Exception, match="Failed copying input tensor") as excinfo:
        coordinator.join()
    assert error_name(excinfo) == CLOSURE_INPUT_ERROR


def test_a_dataset_given_to_create_per_worker_dataset(coordinator):
    """testPassDatasetToCreatePerWorkerDataset."""
    per_worker = coordinator.create_per_worker_dataset(tf.data.Dataset.range(1, 11).batch(4))
    result = coordinator.schedule(next_element, args=(iter(per_worker),)).fetch()
    np.testing.assert_array_equal(result, [1, 2, 3, 4])


def test_one_function_reads_two_per_worker_datasets(coordinator):
    """testMultipleDatasets."""
    first = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(0, 5)))
    second = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(5, 10)))

    @tf.function
    def add(a, b):
        return next(a) + next(b)

    assert int(coordinator.schedule(add, args=(first, second)).fetch()) == 5
    third = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(0, 5)))
    assert int(coordinator.schedule(add, args=(third, second)).fetch()) >= 5


def test_iterators_can_be_created_again_and_again(coordinator):
    """testRepeatedIteratorCreation (without its private resource check)."""
    first = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(1, 100))
    second = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(1, 100))

    @tf.function
    def add(a, b):
        return next(a) + next(b)

    for _ in range(4):
        a, b = iter(first), iter(second)
        head = coordinator.schedule(add, args=(a, b))
        rest = [coordinator.schedule(add, args=(a, b)) for _ in range(4)]
        coordinator.join()
        assert int(head.fetch()) >= 2 and all(int(r.fetch()) >= 2 for r in rest)


# -- ErrorReportingTest ----------------------------------------------------------


@pytest.fixture
def functions(strategy):
    """A normal, a failing and a long (60 s) function, as in TensorFlow's
    `ErrorReportingTest`."""
    with strategy.scope():
        iteration = keras.Variable(0.0, name="iteration", trainable=False)

    @tf.function
    def normal():
        iteration.assign_add(1.0)
        return tf.reduce_mean(tf.random.uniform((2, 10)) @ tf.random.uniform((10, 2)))

    @tf.function
    def error():
        tf.debugging.assert_non_positive(tf.reduce_sum(tf.random.uniform((2, 2)) + 1.0),
                                         message="error function")
        iteration.assign_add(1.0)
        return iteration.value

    @tf.function
    def long():
        # Local work only: cancelling a loop that reads a ps variable every turn can
        # hang TensorFlow's join (1 run in 6, with TensorFlow's own strategy too).
        # Bounded, in case it is not cancelled.
        deadline = tf.timestamp() + 60.0
        spins = tf.constant(0)
        while tf.timestamp() < deadline:
            spins += 1
        return spins

    return types.SimpleNamespace(normal=normal, error=error, long=long)


def test_join_raises_the_error(coordinator, functions):
    """testJoinRaiseError."""
    for _ in range(3):
        coordinator.schedule(functions.normal)
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError, match="error function"):
        coordinator.join()


def schedule_until_it_raises(coordinator, function, seconds=60.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        coordinator.schedule(function)


def test_schedule_raises_the_error(coordinator, functions):
    """testScheduleRaiseError."""
    for _ in range(3):
        coordinator.schedule(functions.normal)
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        schedule_until_it_raises(coordinator, functions.normal)


def test_schedule_raises_once_for_many_failures(coordinator, functions):
    """testScheduleRaiseErrorWithMultipleFailure: after the error is raised, a join
    does not raise the failures of the other failing functions."""
    for _ in range(3):
        coordinator.schedule(functions.normal)
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        schedule_until_it_raises(coordinator, functions.error)
    coordinator.join()


def test_an_error_is_cleared_once_raised(coordinator, functions):
    """testErrorWillbeCleared."""
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    for _ in range(3):
        coordinator.schedule(functions.normal)
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    coordinator.schedule(functions.normal)
    coordinator.join()


def test_the_failed_functions_result_raises_its_error(coordinator, functions):
    """testRemoteValueReturnError (skipped in TensorFlow's open-source run; it holds
    here): `fetch` raises the error, the next `join` raises it too, once."""
    result = coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        result.fetch()
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    coordinator.join()


def failing_pipeline(context):
    """A dataset function whose pipeline fails when a worker creates it."""
    draw = tf.random.uniform(())
    with tf.control_dependencies([tf.debugging.assert_less(draw, -1.0,
                                                           message="no pipeline")]):
        size = tf.cast(draw, tf.int64) + 5
    return tf.data.Dataset.range(size)


def test_a_failed_per_worker_input_fails_its_function_with_an_input_error(coordinator):
    """testInputError, through a per-worker dataset whose creation fails."""
    failed = iter(coordinator.create_per_worker_dataset(
        kerasps.DatasetCreator(failing_pipeline)))
    result = coordinator.schedule(next_element, args=(failed,))
    with pytest.raises(Exception, match="no pipeline") as excinfo:
        coordinator.join()
    assert error_name(excinfo) == CLOSURE_INPUT_ERROR
    with pytest.raises(Exception) as excinfo:
        result.fetch()
    assert error_name(excinfo) == CLOSURE_INPUT_ERROR


def test_a_failed_per_worker_input_that_is_not_used_harms_nothing(coordinator):
    """testErroredInputNotUsed."""
    good = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(5)))
    iter(coordinator.create_per_worker_dataset(kerasps.DatasetCreator(failing_pipeline)))
    result = coordinator.schedule(next_element, args=(good,))
    coordinator.join()
    assert int(result.fetch()) == 0


def test_an_error_cancels_a_long_running_function(coordinator, functions):
    """testCancellation: the long function (running or queued) is cancelled, and the
    coordinator works afterwards."""
    for _ in range(3):
        coordinator.schedule(functions.normal)
    long = coordinator.schedule(functions.long)
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    with pytest.raises(tf.errors.CancelledError):
        long.fetch()
    for _ in range(3):
        coordinator.schedule(functions.normal)
    coordinator.join()


def test_an_iterator_still_works_after_a_cancellation(coordinator, functions):
    """testResourceCanStillbeUsedAfterCancellation."""
    iterator = iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(0, 5)))
    coordinator.schedule(next_element, args=(iterator,))
    coordinator.schedule(functions.error)
    with pytest.raises(tf.errors.InvalidArgumentError):
        coordinator.join()
    result = coordinator.schedule(next_element, args=(iterator,))
    coordinator.join()
    assert 0 <= int(result.fetch()) < 5


# -- ShardedVariableTest ---------------------------------------------------------

IDS = [0, 3, 4]
TABLE = np.arange(10, dtype="float32").reshape((5, 2)) + 1


def graph_op_counts(function):
    ops = [op.type for op in function.get_concrete_function().graph.get_operations()]
    return ops.count("ResourceGather"), ops.count("ReadVariableOp")


@pytest.fixture
def table(shards):
    strategy = shards(3)
    with strategy.scope():
        variable = keras.Variable(TABLE)
    assert isinstance(variable, kerasps.ShardedVariable) and variable.num_shards == 3
    return variable, kerasps.ClusterCoordinator(strategy)


def test_a_row_lookup_gathers_on_each_shard(table):
    """testEmbeddingLookup, for the lookup Keras 3 layers use (`ops.take(table, ids,
    axis=0)`): one gather per shard, and the table is never read whole."""
    variable, coordinator = table

    @tf.function
    def lookup():
        return keras.ops.take(variable, tf.constant(IDS), axis=0)

    assert graph_op_counts(lookup) == (3, 0)
    np.testing.assert_array_equal(coordinator.schedule(lookup).fetch(), TABLE[IDS])


def test_tf_nn_embedding_lookup_of_a_sharded_variable_returns_its_rows(table):
    """testEmbeddingLookup's `embedding_lookup_v2` values."""
    variable, coordinator = table

    @tf.function
    def lookup():
        return tf.nn.embedding_lookup(variable, tf.constant(IDS))

    np.testing.assert_array_equal(coordinator.schedule(lookup).fetch(), TABLE[IDS])


def test_tf_nn_embedding_lookup_of_a_sharded_variable_gathers_on_each_shard(table):
    """testEmbeddingLookup's graph check, for `tf.nn.embedding_lookup`."""
    variable, _ = table

    @tf.function
    def lookup():
        return tf.nn.embedding_lookup(variable, tf.constant(IDS))

    assert graph_op_counts(lookup) == (3, 0)


@pytest.mark.parametrize("kind", ["sparse", "safe_sparse"])
def test_sparse_embedding_lookups_of_a_sharded_variable(table, kind):
    """testEmbeddingLookup's sparse and safe sparse lookups."""
    variable, coordinator = table
    indices = [[0, 0], [0, 1], [1, 0], [2, 2]]

    @tf.function
    def sparse():
        ids = tf.sparse.SparseTensor(indices, [0, 3, 4, 1], [3, 3])
        return tf.nn.embedding_lookup_sparse(variable, ids, None)

    @tf.function
    def safe_sparse():
        ids = tf.sparse.SparseTensor(indices, [0, -1, 4, 1], [3, 3])
        weights = tf.sparse.SparseTensor(indices, [1.0, 1.0, -1.0, 1.0], [3, 3])
        return tf.nn.safe_embedding_lookup_sparse(variable, ids, weights)

    function = {"sparse": sparse, "safe_sparse": safe_sparse}[kind]
    expected = {"sparse": [[4.0, 5.0], [9.0, 10.0], [3.0, 4.0]],
                "safe_sparse": [[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]}[kind]
    assert graph_op_counts(function) == (3, 0)  # a gather on each shard
    np.testing.assert_allclose(coordinator.schedule(function).fetch(), expected)


# -- StrategyIntegrationTest -----------------------------------------------------


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_strategy_run_outside_schedule_warns(strategy, coordinator):
    """testRunNotUsedWithClusterCoordinatorSchedule."""
    with strategy.scope():
        offset = keras.Variable(1, dtype="int64", trainable=False)

    def replica_fn(x):
        return x + offset.value, x - offset.value

    @tf.function
    def worker_fn(iterator):
        return strategy.run(replica_fn, args=(next(iterator),))

    handler = Messages()
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        strategy.run(replica_fn, args=(tf.constant(1, tf.int64),))
        warned = list(handler.messages)
        handler.messages.clear()
        per_worker = coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(1, 3))
        result = coordinator.schedule(worker_fn, args=(iter(per_worker),))
        assert tuple(int(v) for v in result.fetch()) == (2, 0)
    finally:
        logger.removeHandler(handler)
    assert any("without using `ClusterCoordinator.schedule`" in m for m in warned)
    assert not any("without using `ClusterCoordinator.schedule`" in m
                   for m in handler.messages)


def test_scheduled_functions_update_ps_variables(strategy, coordinator):
    """testBasicVariableAssignment."""
    with strategy.scope():
        up = keras.Variable(0.0, trainable=False)
        down = keras.Variable(1.0, trainable=False)

    @tf.function
    def step():
        up.assign_add(0.1)
        down.assign_sub(0.2)
        return up.value / down.value

    assert coordinator.fetch(coordinator.schedule(step)) == pytest.approx(0.125)
    assert float(up.numpy()) == pytest.approx(0.1)
    assert float(down.numpy()) == pytest.approx(0.8)


@pytest.mark.parametrize("first_replica_counter", [False, True])
def test_run_and_reduce_in_a_scheduled_function(strategy, coordinator, first_replica_counter):
    """testRunAndReduce and testRunAndReduceWithAssignAdd: scheduled inside and outside
    the scope; `replica_fn` runs in a replica context."""
    assert not tf.distribute.in_cross_replica_context()
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        assert tf.distribute.in_cross_replica_context()
        offset = keras.Variable(1.0, trainable=False)
        counter = keras.Variable(0.0, trainable=False, aggregation="only_first_replica")
    contexts = []

    @tf.function
    def worker_fn(x):
        def replica_fn(x):
            contexts.append(tf.distribute.in_cross_replica_context())
            if first_replica_counter:
                counter.assign_add(x)
            return x + offset.value, x - offset.value

        result = strategy.run(replica_fn, args=(x,))
        return strategy.reduce("SUM", result, axis=None)

    expected = (4.0 * replicas, 2.0 * replicas)
    with strategy.scope():
        inside = coordinator.schedule(worker_fn, args=(tf.constant(3.0),))
        assert isinstance(inside, kerasps.RemoteValue)
        assert inside.fetch() == expected
    assert coordinator.schedule(worker_fn, args=(tf.constant(3.0),)).fetch() == expected
    assert contexts and not any(contexts)
    assert float(counter.numpy()) == (6.0 if first_replica_counter else 0.0)


def test_a_sum_aggregated_variable_assigned_in_replicas(strategy, coordinator):
    """testVariableAggregation."""
    with strategy.scope():
        total = keras.Variable(1.0, trainable=False, aggregation="sum")

    @tf.function
    def worker_fn():
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            total.assign(tf.cast(replica + 1, total.dtype))

        strategy.run(replica_fn)

    total.assign(0.0)
    coordinator.schedule(worker_fn)
    coordinator.join()
    replicas = strategy.num_replicas_in_sync
    assert float(total.numpy()) == sum(range(1, replicas + 1))


def distributed(strategy, how):
    def dataset_fn(_=None):  # each worker makes its own (see the input-error test above)
        return tf.data.Dataset.range(1, 11).batch(4)

    if how == "from_function":
        return strategy.distribute_datasets_from_function(dataset_fn)
    return strategy.experimental_distribute_dataset(dataset_fn())


@pytest.mark.parametrize("how", ["from_function", "from_dataset"])
@pytest.mark.parametrize("where", ["inside_the_dataset_function", "passed_directly"])
def test_distributed_datasets_as_per_worker_input(strategy, coordinator, how, where):
    """testDistributedDatasetInsidePerWorkerDatasetFn and
    testPassDistributedDatasetToCreatePerWorkerDataset."""
    source = (lambda: distributed(strategy, how)) if where.startswith("inside") else (
        distributed(strategy, how))

    @tf.function
    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    result = coordinator.schedule(worker_fn, args=(iter(coordinator.create_per_worker_dataset(
        source)),)).fetch()
    expected = np.split(np.arange(1, 5), strategy.num_replicas_in_sync)
    assert len(result) == len(expected)
    for got, want in zip(result, expected):
        np.testing.assert_array_equal(got, want)


def test_distribute_datasets_from_function_gets_an_input_context(strategy, coordinator):
    """testDistributeDatasetsFromFunction."""
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return tf.data.Dataset.range(1, 11).batch(1)

    @tf.function
    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn))
    result = coordinator.schedule(worker_fn, args=(iter(per_worker),)).fetch()
    assert [list(r) for r in result] == [[1 + i] for i in range(strategy.num_replicas_in_sync)]
    assert contexts and all(isinstance(c, tf.distribute.InputContext) for c in contexts)


def test_schedule_with_a_distributed_dataset_reduces_replica_values(strategy, coordinator):
    """testAsyncScheduleWithDistributedDataset."""
    with strategy.scope():
        total = keras.Variable([0.0], trainable=False)

    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices([2.0]).repeat().batch(
            strategy.num_replicas_in_sync)
        return strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def worker_fn(iterator):
        total.assign_add(strategy.reduce("MEAN", next(iterator), axis=None))

    iterator = iter(coordinator.create_per_worker_dataset(input_fn))
    coordinator.join()
    np.testing.assert_array_equal(total.numpy(), [0.0])
    for expected in (10.0, 20.0):
        for _ in range(5):
            coordinator.schedule(worker_fn, args=(iterator,))
        coordinator.join()
        coordinator.join()
        assert coordinator.done()
        np.testing.assert_array_equal(total.numpy(), [expected])


def test_a_map_in_a_distributed_dataset_function(strategy, coordinator):
    """testInputFunctionWithMapWithDistributedDataset. Difference (module docstring):
    traced once per worker."""
    traced = []

    def input_fn():
        def plus_ten(x):
            traced.append(x)
            return x + 10

        dataset = tf.data.Dataset.range(0, 10).batch(strategy.num_replicas_in_sync).map(
            plus_ten)
        return strategy.experimental_distribute_dataset(dataset)

    result = coordinator.schedule(next_element, args=(iter(coordinator.create_per_worker_dataset(
        input_fn)),)).fetch()
    np.testing.assert_array_equal(np.ravel(result), np.arange(10, 10 +
                                                              strategy.num_replicas_in_sync))
    assert len(traced) == strategy.num_workers


def test_per_worker_dataset_element_spec(coordinator, strategy):
    """testPerWorkerDistributeDatasetsElementSpec (one replica per worker here)."""
    dataset = tf.data.Dataset.from_tensor_slices([1, 2])
    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(
            lambda _: tf.data.Dataset.from_tensor_slices([1, 2])))
    assert strategy.num_replicas_in_sync == 1
    assert per_worker.element_spec == dataset.element_spec
    assert coordinator.create_per_worker_dataset(dataset).element_spec == dataset.element_spec


def test_per_worker_iterators_have_a_type_spec_to_trace_with(strategy, coordinator):
    """testPerWorkerDistributedIteratorTypeSpec: a function can be traced for the
    per-worker iterator before scheduling, and scheduling builds no pipeline again.
    Difference (module docstring): the dataset function ran once per worker."""
    calls = []

    def per_worker_dataset_fn():
        calls.append(1)
        return strategy.distribute_datasets_from_function(lambda _: tf.data.Dataset.range(1, 2))

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    next_element.get_concrete_function(iterator)
    assert int(coordinator.schedule(next_element, args=(iterator,)).fetch()) == 1
    assert len(calls) == strategy.num_workers


def test_per_worker_dataset_build_gives_each_worker_its_dataset(coordinator):
    """testPerWorkerDatasetBuild."""

    @tf.function
    def first(dataset):
        return next(iter(dataset))

    dataset = tf.data.Dataset.from_tensor_slices([1, 2])
    built = coordinator.create_per_worker_dataset(dataset).build()
    result = coordinator.schedule(first, args=(built,))
    coordinator.join()
    assert int(result.fetch()) == 1
