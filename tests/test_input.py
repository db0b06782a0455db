"""Input: exactly-once epochs (tf.data service), shard policies, and their bad values.

The visit count is the measure: a zero-initialised `Embedding(ROWS, 1)` trained
with SGD(lr=1) on the sum of its outputs moves an id's row by exactly -1 per
visit, so after `epochs` epochs every row reads `-epochs` if and only if every
example was read once per epoch.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.backend import _tf

ROWS, BATCH = 250, 16  # 250 = 15 full batches and a partial one of 10


def visit_counter(strategy):
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((1,), dtype="int32"),
            keras.layers.Embedding(ROWS, 1, embeddings_initializer="zeros"),
        ])
        model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_sum(p))
    return model


def visits(model):
    """How many times each id was trained on."""
    return -np.round(model.layers[0].embeddings.numpy()[:, 0]).astype(int)


def ids_dataset(rows=ROWS):
    ids = np.arange(rows, dtype="int32").reshape(-1, 1)
    return tf.data.Dataset.from_tensor_slices((ids, np.zeros(rows, "float32")))


class OutputSum(keras.metrics.Metric):
    """The sum of every output the model produced: counts each example read."""

    def __init__(self, name="total", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.cast(y_pred, self.dtype)))

    def result(self):
        return self.total


def once(dataset_fn):
    return kerasps.DatasetCreator(dataset_fn, kerasps.InputOptions(exactly_once=True))


# -- Exactly-once epochs -------------------------------------------------------
def test_exactly_once_dataset_creator_visits_every_example_once_per_epoch(strategy):
    model = visit_counter(strategy)
    history = model.fit(once(lambda context: ids_dataset().shuffle(ROWS).batch(BATCH)),
                        epochs=3, verbose=0)
    np.testing.assert_array_equal(visits(model), np.full(ROWS, 3))
    assert len(history.history["loss"]) == 3
    assert model.optimizer.iterations.numpy() == 3 * 16  # the partial batch is a step


def test_a_finite_dataset_given_to_fit_is_read_once_per_epoch(strategy):
    model = visit_counter(strategy)
    model.fit(ids_dataset().batch(BATCH), epochs=2, verbose=0)
    np.testing.assert_array_equal(visits(model), np.full(ROWS, 2))


def test_a_dataset_of_unknown_size_given_to_fit_is_read_to_its_end_each_epoch(strategy):
    model = visit_counter(strategy)
    dataset = ids_dataset().filter(lambda ids, y: ids[0] % 5 != 0).batch(BATCH)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model.fit(dataset, epochs=2, verbose=0)
    expected = np.where(np.arange(ROWS) % 5 != 0, 2, 0)
    np.testing.assert_array_equal(visits(model), expected)


def test_arrays_given_to_fit_are_read_once_per_epoch(strategy):
    model = visit_counter(strategy)
    ids = np.arange(ROWS, dtype="int32").reshape(-1, 1)
    model.fit(ids, np.zeros(ROWS), batch_size=BATCH, epochs=2, verbose=0)
    np.testing.assert_array_equal(visits(model), np.full(ROWS, 2))


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_the_workers_readers_go_when_the_call_returns_not_at_a_later_collection(
        strategy, monkeypatch, call):
    """Each pass's readers (iterators on the workers, of a tf.data service job) are freed
    when the call returns: before, the end of the input's errors kept them in reference
    cycles until a later garbage collection, which, when it ran while the next strategy
    connected to another cluster, held its constructor for up to minutes (a reader of
    the in-process service then blocks TensorFlow's closing of the old connection)."""
    import gc
    import weakref

    from kerasps.runtime.input import per_worker

    readers, new_pass = [], per_worker.PerWorkerDataset.__iter__

    def recorded(dataset):
        iterator = new_pass(dataset)
        readers.append(weakref.ref(iterator))
        return iterator

    monkeypatch.setattr(per_worker.PerWorkerDataset, "__iter__", recorded)
    model = visit_counter(strategy)
    gc.collect()
    gc.disable()
    try:
        if call == "fit":
            model.fit(once(lambda context: ids_dataset().batch(BATCH)), epochs=2, verbose=0)
        else:
            model.evaluate(ids_dataset().batch(BATCH), verbose=0)
        assert readers
        assert [reader() for reader in readers] == [None] * len(readers)
    finally:
        gc.enable()


def test_exactly_once_can_be_turned_off_for_a_dataset(strategy):
    model = visit_counter(strategy)
    data = strategy.experimental_distribute_dataset(
        ids_dataset().batch(BATCH), options=kerasps.InputOptions(exactly_once=False))
    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    # Per-worker input: each worker reads its own (sharded) batches.
    assert visits(model).sum() == 4 * BATCH


def test_exactly_once_with_steps_per_epoch_stops_the_epoch_early(strategy):
    model = visit_counter(strategy)
    model.fit(once(lambda context: ids_dataset().batch(BATCH)), epochs=2, steps_per_epoch=5,
              verbose=0)
    assert model.optimizer.iterations.numpy() == 10
    assert visits(model).max() <= 2


def test_exactly_once_with_steps_per_execution_counts_the_steps_that_ran(strategy):
    with strategy.scope():
        model = visit_counter(strategy)
        model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_sum(p),
                      steps_per_execution=4)
    model.fit(once(lambda context: ids_dataset().batch(BATCH)), epochs=2, verbose=0)
    np.testing.assert_array_equal(visits(model), np.full(ROWS, 2))
    assert model.optimizer.iterations.numpy() == 2 * 16


def test_exactly_once_in_a_custom_loop_gives_one_pass_per_iter(strategy):
    coordinator = kerasps.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(
        once(lambda context: tf.data.Dataset.range(40).batch(3)))
    assert per_worker.exactly_once

    @tf.function
    def take(iterator):
        optional = iterator.get_next_as_optional()
        return tf.cond(optional.has_value(), lambda: optional.get_value(),
                       lambda: tf.constant([-1], tf.int64))

    for _ in range(2):
        iterator, seen, ended = iter(per_worker), [], 0
        while ended < 4:  # past the end on both workers, twice
            value = coordinator.schedule(take, args=(iterator,)).fetch()
            if value[0] < 0:
                ended += 1
            else:
                seen.extend(value.tolist())
        assert sorted(seen) == list(range(40))


def test_the_end_of_the_data_does_not_cancel_a_step_that_has_read_its_batch(strategy):
    """Issue 17, defect 3 (a batch lost with no fault): when one worker found the end of
    exactly-once input, TensorFlow's coordinator cancelled the functions still running on
    the other workers, and a step that had read its batch lost it. Here the only element
    is read by a step held at a gate until the end of the data has been found elsewhere
    and `join` is called; the step must still apply it."""
    import threading
    import time

    coordinator = kerasps.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(
        once(lambda context: tf.data.Dataset.from_tensors(tf.constant(7, tf.int64))))
    with tf.device("/job:ps/replica:0/task:0"):
        gate = tf.queue.FIFOQueue(1, tf.int32, shapes=[])
        total = tf.Variable(tf.constant(0, tf.int64))

    @tf.function
    def step(iterator):
        value = next(iterator)  # on the worker, which then waits for the gate's token
        total.assign_add(value * tf.cast(gate.dequeue(), tf.int64))

    iterator = iter(per_worker)
    remotes = [coordinator.schedule(step, args=(iterator,)) for _ in range(2)]
    deadline = time.monotonic() + 120
    while not any(_tf.remote_value_ready(r) for r in remotes):  # one found the end
        assert time.monotonic() < deadline, "no worker found the end of the data"
        time.sleep(0.01)
    (held,) = [r for r in remotes if not _tf.remote_value_ready(r)]
    joining = threading.Event()

    def open_gate():
        # Once `join` has started: at once if it cancelled the held step (the defect),
        # else after a grace of 2 s (the step is waiting at the gate: nothing to see).
        joining.wait()
        until = time.monotonic() + 2
        while not _tf.remote_value_ready(held) and time.monotonic() < until:
            time.sleep(0.01)
        gate.enqueue(1)

    opener = threading.Thread(target=open_gate)
    opener.start()
    joining.set()
    with pytest.raises(tf.errors.OutOfRangeError):
        coordinator.join()
    opener.join()
    assert total.numpy() == 7, "the step that read the only element was cancelled"


def test_exactly_once_through_a_service_of_two_data_workers(strategy):
    """A service kerasps did not start (size unknown): the dispatcher splits the data
    among its data workers dynamically; each id is still read once per epoch."""
    from kerasps.runtime import data_service

    service = data_service.DataService(num_data_workers=2)
    model = visit_counter(strategy)
    options = kerasps.InputOptions(exactly_once=True, service=service.address)
    model.fit(kerasps.DatasetCreator(lambda context: ids_dataset().batch(BATCH), options),
              epochs=2, verbose=0)
    np.testing.assert_array_equal(visits(model), np.full(ROWS, 2))


def test_sync_mode_refuses_exactly_once_input(make_strategy):
    strategy = make_strategy(mode="sync")
    model = visit_counter(strategy)
    with pytest.raises(ValueError, match=r"exactly-once input.*mode='sync'"):
        model.fit(once(lambda context: ids_dataset().batch(BATCH)), epochs=1, verbose=0)


# -- evaluate and predict ---------------------------------------------------------
def regression_model(strategy=None):
    scope = strategy.scope() if strategy is not None else keras.name_scope("plain")
    with scope:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=["mae", OutputSum()])
    return model


def features(rows=103):
    rng = np.random.default_rng(3)
    return rng.normal(size=(rows, 3)).astype("float32"), rng.normal(size=(rows, 1)).astype(
        "float32")


def twin(strategy):
    """A kerasps model and a single-process Keras model with the same weights."""
    model, plain = regression_model(strategy), regression_model()
    plain.set_weights(model.get_weights())
    return model, plain


@pytest.mark.parametrize("how", ["arrays", "dataset", "exactly_once_dataset", "creator",
                                 "creator_ignoring_context", "creator_sharding_by_context"])
def test_evaluate_counts_every_example_once_and_matches_keras(strategy, how):
    model, plain = twin(strategy)
    x, y = features()
    expected = plain.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    data = {
        "arrays": lambda: dict(x=x, y=y, batch_size=10),
        "dataset": lambda: dict(x=dataset),
        "exactly_once_dataset": lambda: dict(x=strategy.experimental_distribute_dataset(
            dataset, options=kerasps.InputOptions(exactly_once=True))),
        "creator": lambda: dict(x=once(lambda context: dataset)),
        "creator_ignoring_context": lambda: dict(x=kerasps.DatasetCreator(
            lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(10))),
        "creator_sharding_by_context": lambda: dict(x=kerasps.DatasetCreator(
            lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(10).shard(
                context.num_input_pipelines, context.input_pipeline_id))),
    }[how]()
    result = model.evaluate(verbose=0, return_dict=True, **data)
    for name in ("loss", "mae", "total"):
        assert result[name] == pytest.approx(expected[name], rel=1e-5), name


def predict_inputs(strategy, x):
    """Every kind of `x` for `predict`, each holding the batches of 10 rows of `x` in order."""
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(10)

    def sharding_fn(context):  # what a training `dataset_fn` does
        return tf.data.Dataset.from_tensor_slices(x).shard(
            context.num_input_pipelines, context.input_pipeline_id).batch(10)

    def ignoring_fn(context):  # the common case for prediction input
        return tf.data.Dataset.from_tensor_slices(x).batch(10)

    return {
        "arrays": dict(x=x, batch_size=10),
        "dataset": dict(x=dataset),
        "infinite_dataset": dict(x=dataset.repeat()),
        "distributed_dataset": dict(x=strategy.experimental_distribute_dataset(dataset)),
        "creator_sharding_by_context": dict(x=kerasps.DatasetCreator(sharding_fn)),
        "creator_ignoring_context": dict(x=kerasps.DatasetCreator(ignoring_fn)),
        "infinite_creator": dict(x=kerasps.DatasetCreator(
            lambda context: ignoring_fn(context).repeat())),
        "callable": dict(x=ignoring_fn),
        "distributed_function": dict(x=strategy.distribute_datasets_from_function(ignoring_fn)),
        "exactly_once_creator": dict(x=once(ignoring_fn)),
    }


PREDICT_INPUTS = ["arrays", "dataset", "infinite_dataset", "distributed_dataset",
                  "creator_sharding_by_context", "creator_ignoring_context", "infinite_creator",
                  "callable", "distributed_function", "exactly_once_creator"]


@pytest.mark.parametrize("steps", [None, 3, 4, 20])
@pytest.mark.parametrize("how", PREDICT_INPUTS)
def test_predict_returns_the_first_batches_once_each_in_order(strategy, how, steps):
    model, plain = twin(strategy)
    x, _ = features()  # 103 rows: 11 batches of 10, the last one of 3
    data = predict_inputs(strategy, x)[how]
    if how.startswith("infinite") and steps is None:
        with pytest.raises(ValueError, match=r"argument `steps`.*infinite"):
            model.predict(verbose=0, **data)
        return
    outputs = model.predict(verbose=0, steps=steps, **data)
    batches = [x[i:i + 10] for i in range(0, len(x), 10)]
    if how.startswith("infinite"):
        batches = batches * 2
    expected = np.concatenate(batches[:steps])  # the first `steps` batches, in order
    # Duplicated, missing or reordered batches change the rows compared.
    np.testing.assert_allclose(outputs, plain.predict(expected, verbose=0), rtol=1e-5,
                               atol=1e-6)


def test_predict_calls_a_dataset_fn_once_for_a_single_pipeline(strategy):
    model, plain = twin(strategy)
    x, _ = features()
    contexts = []

    def dataset_fn(context):
        contexts.append((context.num_input_pipelines, context.input_pipeline_id))
        return tf.data.Dataset.from_tensor_slices(x).shard(
            context.num_input_pipelines, context.input_pipeline_id).batch(10)

    outputs = model.predict(kerasps.DatasetCreator(dataset_fn), verbose=0)
    np.testing.assert_allclose(outputs, plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert set(contexts) == {(1, 0)}


# -- Shard policies ------------------------------------------------------------------
@pytest.fixture
def record_files(tmp_path):
    """Four TFRecord files of 25 ids each (ids 0..99)."""
    paths = []
    for f in range(4):
        path = str(tmp_path / f"ids-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(25 * f, 25 * f + 25):
                writer.write(tf.io.serialize_tensor(tf.constant([i], tf.int32)).numpy())
        paths.append(path)
    return paths


def parse(record):
    ids = tf.ensure_shape(tf.io.parse_tensor(record, tf.int32), [1])
    return ids, tf.zeros(())


def files_dataset(paths):
    return tf.data.Dataset.from_tensor_slices(paths).interleave(
        tf.data.TFRecordDataset, cycle_length=1).map(parse).batch(BATCH)


def evaluate_visits(strategy, x):
    """Ids an evaluation reads, counted by a model whose output is 1 at the id read."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int32"),
                                  keras.layers.Embedding(ROWS, 1, embeddings_initializer="ones"),
                                  keras.layers.Flatten()])
        model.compile("sgd", loss=lambda y, p: tf.reduce_sum(p),
                      metrics=[OutputSum()])
    return model.evaluate(x, verbose=0, return_dict=True)["total"]


@pytest.mark.parametrize("policy, reads", [("file", 100), ("data", 100), ("auto", 100),
                                           ("off", 200)])
def test_shard_policies_of_a_dataset(strategy, record_files, policy, reads):
    data = strategy.experimental_distribute_dataset(
        files_dataset(record_files), options=kerasps.InputOptions(shard_policy=policy))
    assert evaluate_visits(strategy, data) == reads  # "off": both workers read everything


def test_shard_policy_file_of_an_evaluated_dataset_creator_splits_its_files(
        strategy, record_files):
    seen = []

    def dataset_fn(context):
        seen.append((context.num_input_pipelines, context.input_pipeline_id))
        return files_dataset(record_files)

    data = kerasps.DatasetCreator(dataset_fn, kerasps.InputOptions(shard_policy="file"))
    # Evaluation reads one pipeline, its files split among the workers: each id once.
    assert evaluate_visits(strategy, data) == 100
    assert set(seen) == {(1, 0)}


def test_shard_policy_file_with_fewer_files_than_workers_names_both_counts(
        strategy, record_files):
    model = visit_counter(strategy)
    data = strategy.experimental_distribute_dataset(
        files_dataset(record_files[:1]), options=kerasps.InputOptions(shard_policy="file"))
    with pytest.raises(ValueError, match=r"each of the 2 workers.*reads 1 file"):
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)


def test_shard_policy_file_of_a_dataset_without_files_is_refused(strategy):
    data = strategy.experimental_distribute_dataset(
        ids_dataset().batch(BATCH), options=kerasps.InputOptions(shard_policy="file"))
    with pytest.raises(ValueError, match=r"'file' shards by the files.*reads none"):
        visit_counter(strategy).evaluate(data, verbose=0)


def test_auto_falls_back_to_data_with_fewer_files_than_workers(strategy, record_files):
    data = strategy.experimental_distribute_dataset(files_dataset(record_files[:1]))
    assert evaluate_visits(strategy, data) == 25


# -- Bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(shard_policy="files"), r"argument `shard_policy`.*Received: shard_policy='files'"),
    (dict(shard_policy=2), r"argument `shard_policy`.*Received: shard_policy=2"),
    (dict(exactly_once="yes"), r"argument `exactly_once`.*Received: exactly_once='yes'"),
    (dict(exactly_once=True, shard_policy="file"), r"`shard_policy`: with `exactly_once=True`"),
    (dict(exactly_once=True, service="localhost:5050"), r"argument `service`.*'localhost:5050'"),
    (dict(service="grpc://localhost:5050"), r"argument `service`.*exactly_once=False"),
])
def test_input_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kerasps.InputOptions(**kwargs)


def test_a_per_replica_batch_size_of_zero_is_refused(strategy):
    def dataset_fn(context):
        return ids_dataset().batch(context.get_per_replica_batch_size(0))

    with pytest.raises(ValueError, match=r"argument `global_batch_size`.*Received: "
                                         r"global_batch_size=0"):
        visit_counter(strategy).fit(kerasps.DatasetCreator(dataset_fn), epochs=1,
                                    steps_per_epoch=2, verbose=0)


@pytest.mark.parametrize("options", [None, kerasps.InputOptions(exactly_once=True)])
def test_a_dataset_fn_that_returns_no_dataset_is_refused(strategy, options):
    data = kerasps.DatasetCreator(lambda context: [1, 2, 3], options)
    with pytest.raises(ValueError, match=r"returned by `dataset_fn`.*Received: list"):
        visit_counter(strategy).fit(data, epochs=1, steps_per_epoch=2, verbose=0)


def test_input_options_of_another_type_are_refused(strategy):
    with pytest.raises(ValueError, match=r"argument `options`.*Received: options="):
        strategy.experimental_distribute_dataset(ids_dataset(), options={"exactly_once": True})


def test_the_data_service_runs_in_the_coordinator_process():
    from kerasps.runtime import data_service

    service = data_service.DataService.in_process()
    assert service is data_service.DataService.in_process()
    assert service.address.startswith("grpc://localhost:")



VISITS_UNDER_LOAD = """
import sys
import keras, numpy as np, tensorflow as tf, kerasps

ROWS, BATCH, EPOCHS = 4096, 64, 3
strategy = kerasps.ParameterServerStrategy(
    kerasps.cluster.in_process(num_workers=4, num_ps=2),
    variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
with strategy.scope():
    model = keras.Sequential([keras.Input((1,), dtype="int32"),
                              keras.layers.Embedding(ROWS, 1, embeddings_initializer="zeros")])
    model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_sum(p))
ids = np.arange(ROWS, dtype="int32").reshape(-1, 1)
dataset = tf.data.Dataset.from_tensor_slices((ids, np.zeros(ROWS, "float32"))).batch(BATCH)
for run in range(int(sys.argv[1])):
    model.layers[0].embeddings.assign(np.zeros((ROWS, 1), "float32"))
    model.fit(dataset, epochs=EPOCHS, verbose=0)  # exactly once, the default
    visits = -np.round(model.layers[0].embeddings.numpy()[:, 0]).astype(int)
    print("RUN", run, int((visits < EPOCHS).sum()), int((visits > EPOCHS).sum()), flush=True)
"""


RUNS_UNDER_LOAD = 40


@pytest.mark.stress
def test_exactly_once_epochs_lose_nothing_under_cpu_load():
    """Issue 17, defect 3, as it was seen: a finite dataset given to `fit` on a loaded
    machine missed a batch. 60 runs of 3 epochs on 4 workers with both cores busy missed
    a batch in 3 runs before the fix (in about 1 epoch in 60); these 40 runs would show
    it 87 times in 100."""
    import multiprocessing
    import subprocess
    import sys

    burners = [multiprocessing.Process(target=_burn, daemon=True)
               for _ in range(os.cpu_count() or 2)]
    for burner in burners:
        burner.start()
    try:
        result = subprocess.run([sys.executable, "-c", VISITS_UNDER_LOAD, str(RUNS_UNDER_LOAD)],
                                capture_output=True, text=True, timeout=1800,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    finally:
        for burner in burners:
            burner.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RUN")]
    assert len(runs) == RUNS_UNDER_LOAD
    bad = [(run, missed, repeated) for run, missed, repeated in runs
           if (missed, repeated) != ("0", "0")]
    assert not bad, f"(run, ids missed, ids seen too often): {bad}"


def _burn():
    while True:
        pass
