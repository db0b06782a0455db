"""The functions `fit` schedules on the workers: traced once, logs only where read."""

import keras
import pytest
import tensorflow as tf

import kerasps
from tests.test_fit import ExampleCount

BATCH = 8


def regression_fn(input_context):
    ids = tf.random.stateless_uniform((64, 2), [3, input_context.input_pipeline_id],
                                      maxval=50, dtype=tf.int32)
    y = tf.cast(tf.reduce_sum(ids % 2, axis=1, keepdims=True), tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(BATCH)


class TraceCounting(keras.Sequential):
    """Counts how often `train_step` is traced (its Python body runs only then)."""

    traces = 0

    def train_step(self, data):
        type(self).traces += 1
        return super().train_step(data)


class ConstantLogs(keras.Sequential):
    """A custom `train_step` whose logs are not the model's metrics."""

    def train_step(self, data):
        super().train_step(data)
        return {"answer": tf.constant(42.0)}


def build(strategy, model_class=keras.Sequential, steps_per_execution=1):
    with strategy.scope():
        model = model_class([
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(50, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.Adam(0.05), "mse", metrics=[ExampleCount()],
                      steps_per_execution=steps_per_execution)
    return model


def test_a_later_fit_reuses_the_traced_training_functions(strategy):
    model = build(strategy, TraceCounting)
    data = kerasps.DatasetCreator(regression_fn)
    before = TraceCounting.traces
    # The step's logs are the metrics': every function of a fit whose batch logs no
    # callback reads is the one without logs.
    model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
    assert TraceCounting.traces - before == 1
    model.fit(data, epochs=1, steps_per_epoch=6, verbose=0)
    model.fit(data, epochs=2, steps_per_epoch=6, verbose=0)
    assert TraceCounting.traces - before == 1
    # A callback reading batch logs reads the metrics: the same function runs.
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[BatchLogs()])
    assert TraceCounting.traces - before == 1


@pytest.fixture
def executions(monkeypatch):
    """Every scheduled function's run, as (worker, concrete function name), in order."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    runs = []
    execute_on = cluster_coordinator.Closure.execute_on

    def recorded(closure, worker):
        if type(closure) is cluster_coordinator.Closure:
            runs.append((worker.worker_index, closure._concrete_function.name))
        return execute_on(closure, worker)

    monkeypatch.setattr(cluster_coordinator.Closure, "execute_on", recorded)
    return runs


class LoopRuns(keras.callbacks.Callback):
    """Marks where the training loop starts in `executions`."""

    def __init__(self, runs):
        super().__init__()
        self.runs = runs

    def on_train_begin(self, logs=None):
        self.begin = len(self.runs)


@pytest.mark.parametrize("spe", [3, 10])
def test_a_second_short_fit_runs_no_function_new_to_its_worker_in_its_loop(strategy, executions,
                                                                          spe):
    # A worker instantiates a function the first time it runs it (as long as tracing
    # it). A 2-execution fit ran only functions returning logs; the next fit's function
    # without logs was then new to each worker inside its first steps (measured: 100
    # steps at spe 10 ran 1.45x slower after a 20-step fit than after a 60-step one).
    model = build(strategy, TraceCounting, steps_per_execution=spe)
    data = kerasps.DatasetCreator(regression_fn)
    model.fit(data, epochs=1, steps_per_epoch=2 * spe, verbose=0)
    ran_before = set(executions)
    loop = LoopRuns(executions)
    traced = TraceCounting.traces
    history = model.fit(data, epochs=1, steps_per_epoch=10 * spe + 1, verbose=0,
                        callbacks=[loop])
    assert set(executions[loop.begin:]) <= ran_before
    assert TraceCounting.traces == traced  # the remainder of 1 step too
    assert history.history["examples"] == [(10 * spe + 1) * BATCH]
    assert int(model.optimizer.iterations.numpy()) == 12 * spe + 1


def test_epoch_logs_come_from_the_last_step_when_no_callback_reads_batch_logs(strategy):
    model = build(strategy, ConstantLogs, steps_per_execution=2)
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=9,
                        verbose=0)
    assert history.history["answer"] == [42.0, 42.0]
    assert int(model.optimizer.iterations.numpy()) == 18


def test_metrics_are_exact_when_no_callback_reads_batch_logs(strategy):
    model = build(strategy, steps_per_execution=3)
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=20,
                        verbose=0)
    assert history.history["examples"] == [20 * BATCH, 20 * BATCH]


def test_unrolled_steps_per_execution_unrolls_the_step_loop(strategy):
    # Three functions without logs run 10 steps: 4, 4 and the last 2. Unrolled, the
    # function of each count traces `train_step` once per step it runs.
    model = build(strategy, TraceCounting, steps_per_execution=4)
    model.unrolled_steps_per_execution = 4
    before = TraceCounting.traces
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=10,
                        verbose=0)
    assert TraceCounting.traces - before == 4 + 2
    assert history.history["examples"] == [10 * BATCH]
    assert int(model.optimizer.iterations.numpy()) == 10


def test_a_partly_unrolled_step_loop_runs_every_step_once(strategy):
    model = build(strategy, steps_per_execution=4)
    model.unrolled_steps_per_execution = 3  # 4 steps: one loop iteration of 3, then 1
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=10,
                        verbose=0)
    assert history.history["examples"] == [10 * BATCH]
    assert int(model.optimizer.iterations.numpy()) == 10


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


class VectorLogs(keras.Sequential):
    """A custom `train_step` with a log that is not a scalar."""

    def train_step(self, data):
        super().train_step(data)
        return {"answer": tf.constant(42.0), "pair": tf.constant([1.0, 2.0])}


class MoreLogs(keras.Sequential):
    """A custom `train_step` whose logs hold the metrics and one more value."""

    def train_step(self, data):
        return {**super().train_step(data), "answer": tf.constant(42.0)}


def test_logs_come_back_as_one_tensor_with_the_values_keras_logs_hold(strategy):
    # Each output of a scheduled function is a copy from the worker of its own.
    model = build(strategy, MoreLogs, steps_per_execution=2)
    from kerasps.keras.trainer import steps

    callback = BatchLogs()
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=4, verbose=0,
              callbacks=[callback])
    (function,) = [f for name, f in steps.step_functions(model).items() if name == "train"]
    (concrete,) = function._list_all_concrete_functions()
    assert len(concrete.outputs) == 1
    # Each function's logs read the shared metric after its own 2 steps; the other
    # worker's steps may or may not have landed by then.
    assert len(callback.logs) == 2
    assert all(log["examples"] in (2.0 * BATCH, 3.0 * BATCH, 4.0 * BATCH)
               for log in callback.logs)
    for log in callback.logs:
        assert set(log) == {"loss", "examples", "answer", "staleness"}  # async, two workers
        assert all(type(value) in (float, int) for value in log.values())


@pytest.mark.parametrize("spe", [1, 4])
def test_batch_callbacks_read_the_metrics_not_each_functions_result(strategy, results_read,
                                                                    spe):
    # Keras' `train_step` returns its metrics' results: the logs a batch callback (the
    # progress bar, `BackupAndRestore`) receives are read from the metrics. Each result
    # read from a worker used to cost its CPU and keep ~3 KB there for good (soak: the
    # workers grew 10 MiB per 10,000 steps under `BackupAndRestore(save_freq=50)`).
    model = build(strategy, steps_per_execution=spe)
    callback = BatchLogs()
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=2,
                        steps_per_epoch=8 * spe, verbose=0, callbacks=[callback])
    assert results_read == []
    assert len(callback.logs) == 16
    for log in callback.logs:
        assert set(log) == {"loss", "examples", "staleness"}  # async, two workers
        assert 0 < log["examples"] <= 8 * spe * BATCH
    assert history.history["examples"] == [8 * spe * BATCH] * 2  # exact at epoch ends


def test_batch_logs_are_read_at_most_once_per_interval(strategy, monkeypatch):
    from kerasps.keras.trainer import epochs

    model = build(strategy)
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=2, verbose=0)
    reads = []  # after tracing, which calls it too
    read = model.get_metrics_result

    def counted():
        reads.append(1)
        return read()

    monkeypatch.setattr(model, "get_metrics_result", counted)
    monkeypatch.setattr(epochs, "BATCH_LOGS_INTERVAL_S", 3600.0)
    callback = BatchLogs()
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=10, verbose=0,
              callbacks=[callback])
    assert len(reads) == 2 * 2  # each epoch's first batch, and its end
    for epoch in (callback.logs[:10], callback.logs[10:]):
        assert all(log == epoch[0] for log in epoch), epoch  # the first read, repeated

    monkeypatch.setattr(epochs, "BATCH_LOGS_INTERVAL_S", 0.0)
    callback, reads[:] = BatchLogs(), []
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=10, verbose=0,
              callbacks=[callback])
    assert len(reads) == 10 + 1
    seen = [log["examples"] for log in callback.logs]
    assert seen == sorted(seen) and seen[-1] <= 10 * BATCH


def test_logs_that_are_not_scalars_come_back_as_they_are(strategy):
    model = build(strategy, VectorLogs)
    callback = BatchLogs()
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=2, verbose=0,
              callbacks=[callback])
    assert callback.logs[-1]["answer"] == 42.0
    assert list(callback.logs[-1]["pair"]) == [1.0, 2.0]


def test_the_network_benchs_warm_up_traces_every_function_its_timed_fit_runs(strategy):
    # `benchmarks/network.py` warmed up with 2 executions (both return logs) and timed
    # a `fit` that then traced the function without logs and sent it to each worker.
    from benchmarks import network

    model = build(strategy, TraceCounting, steps_per_execution=3)
    data = kerasps.DatasetCreator(regression_fn)
    model.fit(data, epochs=1, steps_per_epoch=network.warmup_steps(3, minimum=6), verbose=0)
    traced = TraceCounting.traces
    model.fit(data, epochs=1, steps_per_epoch=30, verbose=0)
    assert TraceCounting.traces == traced


CYCLE = 8  # distinct batches, one pass of them per execution of `steps_per_execution=8`


def cycle_fn(input_context):
    """The same 8 distinct batches, in the same order, on every worker."""
    x = tf.random.stateless_uniform((CYCLE * BATCH, 3), [5, 6])
    y = tf.cast(tf.random.stateless_uniform((CYCLE * BATCH, 1), [7, 8]) > 0.5, tf.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()


def test_the_epochs_metrics_of_a_step_loop_are_keras_metrics_of_its_steps(strategy):
    # Weights stay fixed (learning rate 0) and every execution is one pass over the
    # same 8 batches, whichever worker runs it: the epoch's metrics are those of those
    # 8 batches, as Keras computes them (the loss tracker's `Mean`, AUC's confusion
    # counts updated as `v.assign(v + delta)`, an accuracy, an example count).
    def model():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])

    def compiled(m, **kwargs):
        m.compile(keras.optimizers.SGD(0.0), "binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.BinaryAccuracy(name="acc"),
                           ExampleCount()], **kwargs)
        return m

    with strategy.scope():
        distributed = compiled(model(), steps_per_execution=CYCLE)
    history = distributed.fit(kerasps.DatasetCreator(cycle_fn), epochs=1,
                              steps_per_epoch=4 * CYCLE, verbose=0)
    local = compiled(model())
    local.set_weights(distributed.get_weights())
    expected = local.evaluate(cycle_fn(None).take(CYCLE), return_dict=True, verbose=0)
    assert history.history["examples"] == [4 * CYCLE * BATCH]
    for name in ("loss", "auc", "acc"):
        assert abs(history.history[name][0] - expected[name]) < 1e-5, (name, history.history,
                                                                        expected)


class ScriptedCoordinator:
    """Stands in for `kerasps.ClusterCoordinator`: each traced `fit` ran the executions
    that `script` gives it, as {worker: executions}."""

    num_workers = 2

    def __init__(self, script):
        self.script = list(script)

    def start_trace(self):
        pass

    def stop_trace(self):
        from kerasps.policy.trace import StepEvent

        ran = self.script.pop(0)
        return [StepEvent(worker=w, step=0, start=0.0, end=1.0)
                for w, count in ran.items() for _ in range(count)]


class RecordedFits:
    distribute_strategy = None

    def __init__(self):
        self.fits = []

    def fit(self, data, **kwargs):
        self.fits.append(kwargs)


def test_the_network_benchs_warm_up_runs_each_function_on_every_worker(monkeypatch):
    # A worker sends its part of a function to the ps tasks the first time it runs it
    # (~45 KB each): the bench counted one in Adam's timed `fit`, when the warm-up's
    # executions without logs had all run on the other worker.
    from benchmarks import network

    coordinator = ScriptedCoordinator([{0: 6}, {0: 3, 1: 3},  # with a batch callback
                                       {0: 5, 1: 1}, {0: 2, 1: 4}, {0: 3, 1: 3}])
    monkeypatch.setattr(kerasps, "ClusterCoordinator", lambda strategy: coordinator)
    model = RecordedFits()
    network.warm_up(model, data=None, spe=10, minimum=20)
    assert [bool(fit["callbacks"]) for fit in model.fits] == [True, True, False, False, False]
    assert {fit["steps_per_epoch"] for fit in model.fits} == {60}  # 3 executions per worker
    assert not coordinator.script

    coordinator.script = [{0: 1, 1: 1}] + [{0: 6}] * 5
    with pytest.raises(RuntimeError, match="fewer than 3 executions"):
        network.warm_up(RecordedFits(), data=None, spe=10, minimum=20)


def constant_fn(input_context):
    """Every batch the same: the metrics do not depend on which worker ran which step."""
    ids = tf.constant([[1, 2]] * BATCH, tf.int32)
    return tf.data.Dataset.from_tensors((ids, tf.ones((BATCH, 1)))).repeat()


@pytest.mark.parametrize("spe", [1, 4])
def test_an_evaluation_of_known_steps_reads_the_metrics_once_not_each_result(
        strategy, results_read, spe):
    # An evaluation of `steps` steps that no callback watches batch by batch (`fit`'s
    # validation pass with `validation_steps`, as in the soak) copied each function's
    # result from its worker, ~3 KB kept there for good each time (docs/figures.md,
    # soak); its metrics are read on the ps tasks once at its end instead.
    model = build(strategy, steps_per_execution=spe)
    data = kerasps.DatasetCreator(constant_fn)
    quiet = model.evaluate(data, steps=4 * spe, verbose=0, return_dict=True)
    assert results_read == []
    watcher = BatchLogs()
    watcher.on_test_batch_end = watcher.on_train_batch_end  # a test batch's logs
    watched = model.evaluate(data, steps=4 * spe, verbose=0, callbacks=[watcher],
                             return_dict=True)
    assert len(results_read) == 4 and len(watcher.logs) == 4  # one per function
    assert quiet.keys() == watched.keys()
    for name in quiet:
        assert quiet[name] == pytest.approx(watched[name]), name
    # `fit`'s progress bar shows no validation batch: its validation reads no result.
    results_read.clear()
    model.fit(data, epochs=1, steps_per_epoch=2 * spe, validation_data=data,
              validation_steps=2 * spe, verbose=1)
    assert results_read == []
