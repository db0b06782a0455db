"""`model.fit`, `evaluate` and `predict` of plain Keras models under a kerasps strategy."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.utils import progbar

import kerasps

BATCH = 8


class ExampleCount(keras.metrics.Metric):
    """Counts the examples it has seen: exact only if no worker's update is lost."""

    def __init__(self, name="examples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], self.dtype))

    def result(self):
        return self.count


def regression_fn(input_context, rows=256, repeat=True):
    """Learnable data: y = sum of the embedding ids' parity; each worker its own slice."""
    ids = tf.random.stateless_uniform((rows, 2), [7, input_context.input_pipeline_id],
                                      maxval=50, dtype=tf.int32)
    y = tf.cast(tf.reduce_sum(ids % 2, axis=1, keepdims=True), tf.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, y))
    return (dataset.repeat() if repeat else dataset).batch(BATCH)


def build(strategy, metrics=(), steps_per_execution=1, **compile_kwargs):
    with strategy.scope():
        metrics = [m() if isinstance(m, type) else m for m in metrics]
        model = keras.Sequential([
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(50, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.Adam(0.05), "mse", metrics=list(metrics),
                      steps_per_execution=steps_per_execution, **compile_kwargs)
    return model


def test_fit_trains_a_sequential_model_with_sharded_embedding(strategy):
    model = build(strategy, metrics=["mae"])
    assert isinstance(model.layers[0].embeddings, kerasps.ShardedVariable)
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=3, steps_per_epoch=20,
                        verbose=0)
    # Async mode with two workers: the mean staleness; no failure, so no failure counts.
    assert set(history.history) == {"loss", "mae", "staleness"}
    losses = history.history["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert int(model.optimizer.iterations.numpy()) == 60


def test_fit_trains_a_functional_model(strategy):
    with strategy.scope():
        ids = keras.Input((2,), dtype="int32")
        hidden = keras.layers.Dense(4)(keras.layers.Flatten()(keras.layers.Embedding(50, 3)(ids)))
        model = keras.Model(ids, keras.layers.Dense(1)(hidden))
        model.compile("sgd", "mse")
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=5,
                        verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_steps_per_execution_packs_steps_into_one_scheduled_function(strategy):
    model = build(strategy, steps_per_execution=4)
    coordinator = kerasps.ClusterCoordinator(strategy)
    coordinator.start_trace()
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=10, verbose=0)
    events = coordinator.stop_trace()
    assert len(events) == 3  # 4 + 4 + 2 steps
    assert int(model.optimizer.iterations.numpy()) == 10


def test_metrics_aggregate_every_workers_updates_exactly(strategy):
    model = build(strategy, metrics=[ExampleCount], steps_per_execution=3)
    coordinator = kerasps.ClusterCoordinator(strategy)
    coordinator.start_trace()
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=30,
                        verbose=0)
    workers = {e.worker for e in coordinator.stop_trace()}
    assert workers == {0, 1}
    assert history.history["examples"] == [30 * BATCH, 30 * BATCH]


class BatchRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begins, self.ends, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)
        self.logs.append(dict(logs))


def test_batch_level_callbacks_see_every_step_in_order(strategy):
    model = build(strategy, steps_per_execution=2)
    recorder = BatchRecorder()
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=9, verbose=0,
              callbacks=[recorder])
    assert recorder.begins == [0, 2, 4, 6, 8] * 2
    assert recorder.ends == [1, 3, 5, 7, 8] * 2
    assert all(isinstance(logs["loss"], float) for logs in recorder.logs)


def test_progress_bar_updates_during_the_epoch(strategy, monkeypatch):
    seen = []
    original = progbar.Progbar.update

    def update(self, current, values=None, finalize=None):
        seen.append((current, self.target))
        return original(self, current, values=values, finalize=finalize)

    monkeypatch.setattr(progbar.Progbar, "update", update)
    model = build(strategy)
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=6, verbose=1)
    assert [c for c, target in seen if target == 6][:6] == [1, 2, 3, 4, 5, 6]


def test_validation_data_adds_val_metrics_to_history(strategy):
    model = build(strategy, metrics=["mae"])
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=5,
                        validation_data=kerasps.DatasetCreator(regression_fn),
                        validation_steps=3, verbose=0)
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae", "staleness"}
    assert len(history.history["val_loss"]) == 2


def test_model_checkpoint_saves_weights_that_reload(strategy, tmp_path):
    model = build(strategy)
    path = str(tmp_path / "model.weights.h5")
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=2, steps_per_epoch=5, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True,
                                                         save_freq=4)])
    assert os.path.exists(path)
    model.save_weights(path)
    restored = build(strategy)
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    for saved, loaded in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy())  # slots, per shard
    ids = np.array([[1, 2], [3, 40]], dtype="int32")
    np.testing.assert_allclose(restored.predict(ids, verbose=0), model.predict(ids, verbose=0),
                               rtol=1e-6)


class FailAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("preempted")


def test_backup_and_restore_resumes_an_interrupted_fit(strategy, tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = build(strategy)
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(kerasps.DatasetCreator(regression_fn), epochs=4, steps_per_epoch=5,
                  verbose=0, callbacks=[backup, FailAtEpoch(2)])
    weights = [w.numpy() for w in model.weights]

    resumed = build(strategy)
    epochs_run = []
    history = resumed.fit(
        kerasps.DatasetCreator(regression_fn), epochs=4, steps_per_epoch=5, verbose=0,
        callbacks=[backup, keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])
    assert epochs_run == [2, 3]
    assert len(history.history["loss"]) == 2
    assert int(resumed.optimizer.iterations.numpy()) == 20
    del weights


class FinishScheduledSteps(keras.callbacks.Callback):
    """At the end of batch `batch`, waits for every step scheduled so far (the steps after
    `batch` included, whose results have not been delivered yet) and records how many
    the ps tasks have applied."""

    def __init__(self, batch):
        super().__init__()
        self.batch, self.applied = batch, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            kerasps.ClusterCoordinator(self.model.distribute_strategy).join()
            self.applied = int(self.model.optimizer.iterations.numpy())


class FailAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("preempted")


def test_a_resumed_fit_does_not_repeat_the_steps_its_backup_holds(strategy, tmp_path):
    """Issue 17 (chief restarts): a backup written after step 10 also holds the steps the
    ps tasks had applied ahead of the delivered results; resuming from step 10 applied
    them twice (at-least-once, up to the dispatch window's backlog per kill)."""
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=10)
    model = build(strategy)
    ahead = FinishScheduledSteps(batch=9)
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=20,
                  verbose=0, callbacks=[ahead, backup, FailAtBatch(14)])
    assert ahead.applied > 10  # the backup holds steps scheduled after the 10th

    resumed = build(strategy)
    batches = []
    resumed.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=20,
                verbose=0, callbacks=[backup, keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda batch, logs: batches.append(batch))])
    assert batches[0] == ahead.applied  # goes on after the last step the backup holds
    assert int(resumed.optimizer.iterations.numpy()) == 20


def test_tensorboard_writes_event_files(strategy, tmp_path):
    model = build(strategy)
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=3, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(tmp_path / "logs"))])
    files = os.listdir(tmp_path / "logs" / "train")
    assert any(f.startswith("events.out.tfevents") for f in files)


def test_early_stopping_ends_training(strategy):
    model = build(strategy)
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0)
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=10, steps_per_epoch=3,
                        verbose=0, callbacks=[stop])
    assert len(history.history["loss"]) == 2


def test_recompiling_uses_the_new_optimizer(strategy):
    model = build(strategy)
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=3, verbose=0)
    first = model.optimizer
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.01), "mae")
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=4,
                        verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert int(first.iterations.numpy()) == 3
    assert np.isfinite(history.history["loss"][0])


def test_a_dataset_creator_builds_its_worker_pipelines_once(strategy):
    calls = []

    def counted_fn(context):
        calls.append(context.input_pipeline_id)
        return regression_fn(context)

    creator = kerasps.DatasetCreator(counted_fn)
    model = build(strategy)
    model.fit(creator, epochs=1, steps_per_epoch=2, verbose=0)
    assert sorted(calls) == [0, 1]  # traced once per worker
    model.fit(creator, epochs=1, steps_per_epoch=2, verbose=0)
    assert sorted(calls) == [0, 1]  # reused, with fresh iterators
    model.fit(kerasps.DatasetCreator(counted_fn), epochs=1, steps_per_epoch=2, verbose=0)
    assert sorted(calls) == [0, 0, 1, 1]  # a new DatasetCreator rebuilds
    assert int(model.optimizer.iterations.numpy()) == 6


def test_initial_epoch_skips_earlier_epochs(strategy):
    model = build(strategy)
    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=3, initial_epoch=2,
                        steps_per_epoch=2, verbose=0)
    assert history.epoch == [2]


def test_evaluate_visits_each_element_of_finite_datasets_once(strategy):
    model = build(strategy, metrics=[ExampleCount], steps_per_execution=3)
    contexts = []

    def finite_fn(context):  # one pipeline: called once, with InputContext(1, 0)
        contexts.append((context.num_input_pipelines, context.input_pipeline_id))
        return regression_fn(context, rows=88, repeat=False).shard(
            context.num_input_pipelines, context.input_pipeline_id)

    logs = model.evaluate(kerasps.DatasetCreator(finite_fn), verbose=0, return_dict=True)
    assert logs["examples"] == 88
    assert set(contexts) == {(1, 0)}
    assert set(logs) == {"loss", "examples"}
    flat = model.evaluate(kerasps.DatasetCreator(finite_fn), steps=4, verbose=0)
    assert flat[1] == 4 * BATCH


class FailsWorker(keras.callbacks.Callback):
    """Reports worker 1 failed (as TensorFlow's coordinator does, through
    `observe_worker_failures`) at the first batch of the first `passes` passes."""

    def __init__(self, monkeypatch, passes):
        super().__init__()
        self.observers, self.passes, self.begins, self.batches = [], passes, 0, []
        from kerasps.backend import _tf

        def observe(observer):
            self.observers.append(observer)
            return lambda: self.observers.remove(observer)

        monkeypatch.setattr(_tf, "observe_worker_failures", observe)

    def on_test_begin(self, logs=None):
        self.begins += 1

    def on_test_batch_end(self, batch, logs=None):
        if batch == 0:
            self.batches.append([])
            if len(self.batches) <= self.passes:
                for notify in self.observers:
                    notify(1)
        self.batches[-1].append(batch)


def test_evaluate_reads_one_tensor_of_each_scheduled_function(strategy):
    """TensorFlow keeps a few kilobytes on a worker for every tensor the chief reads from
    it (docs/limitations.md): an evaluation's functions return their step count, worker
    and metrics as one tensor, read at once (they were 2 + one per metric)."""
    from tensorflow.python.util import nest

    from kerasps.backend import _tf

    model = build(strategy, metrics=["mae", ExampleCount])
    model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=2, verbose=0)
    read = []
    remove = _tf.observe_closures(
        lambda worker, start, end, remote: read.append(len(nest.flatten(remote._values))))
    try:
        logs = model.evaluate(kerasps.DatasetCreator(regression_fn), steps=6, verbose=0,
                              return_dict=True)
    finally:
        remove()
    assert read and set(read) == {1}, read
    assert logs["examples"] == 6 * BATCH and set(logs) == {"loss", "mae", "examples"}


def test_evaluate_starts_over_when_a_worker_fails_during_it(strategy, monkeypatch, caplog):
    # A worker that comes back reads its share again from the start (296 examples of 256
    # were counted in tests/conformance/test_evaluation_under_worker_failures.py).
    model = build(strategy, metrics=[ExampleCount])
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((40, 2), "int32"), np.ones((40, 1), "float32"))).batch(4)
    failing = FailsWorker(monkeypatch, passes=1)
    with caplog.at_level("WARNING", logger="kerasps"):
        logs = model.evaluate(data, verbose=0, return_dict=True, callbacks=[failing])
    assert logs["examples"] == 40
    assert [len(batches) for batches in failing.batches] == [10, 10]
    assert failing.begins == 1
    assert "Evaluation starts over: workers [1] failed" in caplog.text
    # With `steps`, a fixed number of batches: nothing to start over.
    failing = FailsWorker(monkeypatch, passes=1)
    model.evaluate(data.repeat(), steps=6, verbose=0, callbacks=[failing])
    assert [len(batches) for batches in failing.batches] == [6]


def test_evaluate_raises_rather_than_count_twice_when_workers_keep_failing(strategy,
                                                                          monkeypatch):
    model = build(strategy, metrics=[ExampleCount])
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((16, 2), "int32"), np.ones((16, 1), "float32"))).batch(4)
    failing = FailsWorker(monkeypatch, passes=99)
    with pytest.raises(RuntimeError, match=r"workers \[1\] failed during each of its 3 "):
        model.evaluate(data, verbose=0, callbacks=[failing])
    assert len(failing.batches) == 3


def test_predict_returns_outputs_in_input_order(make_strategy):
    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(np.ones((1, 1), "float32"))
    x = np.arange(50, dtype="float32").reshape(-1, 1)
    np.testing.assert_array_equal(model.predict(x, batch_size=4, verbose=0), x)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(3)
    np.testing.assert_array_equal(model.predict(dataset, verbose=0), x)
    # With `steps`, the first `steps` batches (batch `k` runs on worker `k % 2`).
    np.testing.assert_array_equal(model.predict(x, batch_size=4, steps=3, verbose=0), x[:12])


def test_arrays_are_converted_to_a_sharded_dataset(strategy):
    model = build(strategy, metrics=[ExampleCount])
    x = np.random.default_rng(0).integers(0, 50, size=(40, 2)).astype("int32")
    y = (x % 2).sum(axis=1, keepdims=True).astype("float32")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert history.history["examples"] == [40, 40]  # 5 steps of 8 per epoch
    assert model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)["examples"] == 40


def test_on_batch_methods_run_one_step_on_a_worker(strategy):
    model = build(strategy)
    x = np.array([[1, 2], [3, 4]], dtype="int32")
    y = np.array([[1.0], [0.0]], dtype="float32")
    loss = model.train_on_batch(x, y)
    assert np.isfinite(loss)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert set(model.test_on_batch(x, y, return_dict=True)) == {"loss"}
    assert model.predict_on_batch(x).shape == (2, 1)


# -- bad inputs -------------------------------------------------------------------------
def test_missing_steps_per_epoch_with_infinite_dataset_is_an_error(strategy):
    model = build(strategy)
    with pytest.raises(ValueError, match=r"argument `steps_per_epoch`.*infinite.*"
                                         r"Received: steps_per_epoch=None"):
        model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, verbose=0)


def test_metric_created_outside_the_scope_is_rejected(strategy):
    model = build(strategy, metrics=[ExampleCount()])
    with pytest.raises(ValueError, match=r"metric: the variable 'examples/count' was created "
                                         r"outside `strategy.scope\(\)`"):
        model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=1, verbose=0)


def test_evaluating_or_predicting_an_infinite_dataset_needs_steps(strategy):
    model = build(strategy)
    with pytest.raises(ValueError, match=r"argument `steps`.*infinite.*Received: steps=None"):
        model.evaluate(kerasps.DatasetCreator(regression_fn), verbose=0)
    with pytest.raises(ValueError, match=r"argument `steps`.*infinite.*Received: steps=None"):
        model.predict(kerasps.DatasetCreator(regression_fn), verbose=0)
    with pytest.raises(ValueError, match=r"`validation_steps`.*Received: validation_steps=None"):
        model.fit(kerasps.DatasetCreator(regression_fn), steps_per_epoch=1, verbose=0,
                  validation_data=kerasps.DatasetCreator(regression_fn))


@pytest.mark.parametrize("x", ["data.csv", iter([1, 2]), 3.5])
def test_unsupported_x_is_rejected_with_its_type(strategy, x):
    model = build(strategy)
    with pytest.raises(ValueError, match=r"Invalid value for argument `x`.*Received: x="):
        model.fit(x, epochs=1, steps_per_epoch=1, verbose=0)


def test_dataset_creator_with_y_is_rejected(strategy):
    model = build(strategy)
    with pytest.raises(ValueError, match=r"argument `y`.*Received: y="):
        model.fit(kerasps.DatasetCreator(regression_fn), np.ones((4, 1)), steps_per_epoch=1)


def test_dataset_fn_returning_something_else_is_named_in_the_error(strategy):
    model = build(strategy)
    creator = kerasps.DatasetCreator(lambda context: [1, 2, 3])
    with pytest.raises(ValueError, match=r"`dataset_fn`.*expected a `tf.data.Dataset`. "
                                         r"Received: list"):
        model.fit(creator, epochs=1, steps_per_epoch=1, verbose=0)


@pytest.mark.parametrize("argument, value", [("epochs", 0), ("steps_per_epoch", -1),
                                             ("steps_per_epoch", 2.5),
                                             ("validation_freq", 0)])
def test_bad_counts_are_rejected(strategy, argument, value):
    model = build(strategy)
    with pytest.raises(ValueError, match=rf"argument `{argument}`.*Received: {argument}="):
        model.fit(kerasps.DatasetCreator(regression_fn), **{"steps_per_epoch": 1, argument: value})


def test_run_eagerly_is_rejected_with_an_explanation(strategy):
    model = build(strategy, run_eagerly=True)
    with pytest.raises(ValueError, match=r"`run_eagerly`.*Received: run_eagerly=True"):
        model.fit(kerasps.DatasetCreator(regression_fn), epochs=1, steps_per_epoch=1)


def test_bad_dataset_creator_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"argument `dataset_fn`.*Received: dataset_fn=42"):
        kerasps.DatasetCreator(42)
    with pytest.raises(ValueError, match=r"argument `input_options`.*Received: input_options="):
        kerasps.DatasetCreator(regression_fn, input_options={"prefetch": True})


def test_training_input_that_ends_on_a_later_pass_is_an_error_not_a_short_fit(strategy, tmp_path):
    """Training input is repeated; a pass that yields nothing (here the file emptied
    while training) is rebuilt once, then reported: `fit` never ends short quietly."""
    data = tmp_path / "rows.csv"
    data.write_text("".join(f"{i % 50},{i % 50},1\n" for i in range(16)))

    def dataset_fn(context):
        lines = tf.data.TextLineDataset(str(data))
        columns = lines.map(lambda line: tf.io.decode_csv(line, [0, 0, 0.0]))
        return columns.map(lambda a, b, y: (tf.stack([a, b]), [y])).batch(4)

    model = build(strategy)
    emptied = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch == 3 and data.write_text(""))
    with pytest.raises(RuntimeError, match=r"training input ended at epoch 1 step \d+, and "
                                           r"again after every worker's input pipeline was "
                                           r"rebuilt"):
        model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=200,
                  verbose=0, callbacks=[emptied])


def test_a_failure_count_enters_the_history_when_it_first_departs_from_zero():
    from kerasps.keras.trainer.training import _record

    history = keras.callbacks.History()
    history.on_train_begin()
    for epoch, count in enumerate([0, 0, 3, 0]):
        _record(history, "reexecuted_steps", count, 0)
        _record(history, "workers", 2, 2)  # the full pool every epoch: never recorded
        history.epoch.append(epoch)  # as `History.on_epoch_end` does
        if epoch < 2:
            assert "reexecuted_steps" not in history.history
    assert history.history["reexecuted_steps"] == [0, 0, 3, 0]  # one entry per epoch
    assert "workers" not in history.history


def test_a_step_applied_late_between_epochs_counts_as_run_twice(strategy):
    """A worker cut off mid-step (its link down, its process alive) can apply its step
    after the step ran again elsewhere: seconds later, between two epochs. Simulated by
    a callback that adds the late step to the counter every applied step increments at
    the end of epoch 1: the count of steps run twice still accounts for every applied
    step. (Before, each epoch counted from its own start: 301 steps applied, 0 reported
    twice, under the network bench's 5 s worker link cut.)"""
    model = build(strategy)

    def late_application(epoch, logs):
        if epoch == 0:
            model.optimizer.iterations.assign_add(1)

    history = model.fit(kerasps.DatasetCreator(regression_fn), epochs=3, steps_per_epoch=10,
                        verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                            on_epoch_end=late_application)])
    assert int(model.optimizer.iterations.numpy()) == 31
    assert history.history["reexecuted_steps"] == [0, 1, 0]
