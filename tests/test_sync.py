"""Synchronous training with backup workers, and staleness accounting, in a real cluster."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
import kerasps  # noqa: E402

ROWS = 64


def _batches(num_workers, seed=0):
    """One constant batch per worker; embedding ids distinct within and across them."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(ROWS)[:num_workers * 12].reshape(num_workers, 6, 2)
    x = rng.normal(size=(num_workers, 6, 3)).astype("float32")
    y = rng.normal(size=(num_workers, 6, 1)).astype("float32")
    return x, ids, y


def _model(optimizer):
    dense_in = keras.Input((3,))
    id_in = keras.Input((2,), dtype="int32")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(ROWS, 4)(id_in))
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([dense_in, embedded]))
    model = keras.Model([dense_in, id_in], keras.layers.Dense(1)(hidden))
    model.compile(optimizer, "mse")
    return model


def _train_both(strategy, optimizer, steps, x, ids, y, per_worker_stream=False):
    """Trains under `strategy` and single-process; returns both weight lists."""
    def dataset_fn(context):
        i = context.input_pipeline_id
        if per_worker_stream:  # a stream of different batches
            return tf.data.Dataset.from_tensor_slices(((x, ids), y)).repeat()
        return tf.data.Dataset.from_tensors(((x[i], ids[i]), y[i])).repeat()

    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _model(keras.optimizers.get(optimizer))
    single = _model(keras.optimizers.get(optimizer))
    single.set_weights(model.get_weights())
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=steps,
                        verbose=0)
    for step in range(steps):
        if per_worker_stream:
            k = step % len(x)
            single.train_on_batch((x[k], ids[k]), y[k])
        else:
            single.train_on_batch((np.concatenate(x), np.concatenate(ids)), np.concatenate(y))
    return model, single, history


def _assert_same(model, single):
    for a, b in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def one_worker_run():
    """In a process of its own (one process connects to one cluster)."""
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=1, num_ps=1), mode="sync")
    x, ids, y = _batches(4)
    model, single, history = _train_both(strategy, "adam", 8, x, ids, y,
                                         per_worker_stream=True)
    _assert_same(model, single)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert history.history["dropped_gradients"] == [0]
    assert "staleness" not in history.history  # no gradient is stale in sync mode
    print("ONE WORKER OK")


def test_sync_with_one_worker_is_single_process_keras():
    code = "from tests.test_sync import one_worker_run; one_worker_run()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert "ONE WORKER OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow  # the default run's longest: 35-65 s per optimizer
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_with_two_workers_is_one_step_on_the_concatenated_batch(make_strategy, optimizer):
    strategy = make_strategy(mode="sync", variable_partitioner=(
        kerasps.partitioners.FixedShardsPartitioner(2)))
    x, ids, y = _batches(2)
    model, single, _ = _train_both(strategy, optimizer, 6, x, ids, y)
    _assert_same(model, single)
    assert int(model.optimizer.iterations.numpy()) == 6  # one update per global step


def _custom_loop(strategy, model, optimizer, x, ids, y):
    """A custom training loop's pieces: the coordinator, an iterator over worker `i`'s
    constant batch `i`, and a step function that applies its gradients with `optimizer`."""
    coordinator = kerasps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda context: tf.data.Dataset.from_tensors(
            ((x[context.input_pipeline_id], ids[context.input_pipeline_id]),
             y[context.input_pipeline_id])).repeat()))

    @tf.function
    def step(iterator):
        def replica_fn(batch):
            (features, id_batch), labels = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model((features, id_batch)) - labels))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(replica_fn, args=(next(iterator),))

    return coordinator, iterator, step


def test_custom_loop_sync_steps_are_one_step_on_the_concatenated_batch(make_strategy):
    strategy = make_strategy(mode="sync")
    x, ids, y = _batches(2)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = _model("sgd")
        optimizer = keras.optimizers.SGD(0.1)
    single = _model("sgd")
    single.set_weights(model.get_weights())
    coordinator, iterator, step = _custom_loop(strategy, model, optimizer, x, ids, y)

    for _ in range(4):
        losses = coordinator.sync_step(step, args=(iterator,), optimizer=optimizer)
        assert len(losses) == 2  # one kept gradient per worker
    assert int(optimizer.iterations.numpy()) == 4
    reference = keras.optimizers.SGD(0.1)
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(
                single((np.concatenate(x), np.concatenate(ids))) - np.concatenate(y)))
        grads = tape.gradient(loss, single.trainable_variables)
        reference.apply_gradients(zip(grads, single.trainable_variables))
    _assert_same(model, single)


@pytest.mark.parametrize("mode, shown, hidden", [("sync", "dropped_gradients", "staleness"),
                                                  ("async", "staleness", "dropped_gradients")])
def test_progress_bar_shows_staleness_or_dropped_gradients_where_they_mean_something(
        make_strategy, capsys, mode, shown, hidden):
    strategy = make_strategy(mode=mode, **({"backup_workers": 1} if mode == "sync" else {}))
    with strategy.scope():
        model = _dense_model()
    history = model.fit(kerasps.DatasetCreator(_slow_worker_fn(0)), epochs=1,
                        steps_per_epoch=3, verbose=1)
    out = capsys.readouterr().out
    assert f"{shown}:" in out and f"{hidden}:" not in out
    assert shown in history.history and hidden not in history.history


def test_staleness_is_left_out_with_one_worker_dropped_gradients_in_async_mode():
    from kerasps.keras.trainer import staleness

    assert staleness.meaningless(sync=False, num_workers=1) == {"staleness",
                                                               "dropped_gradients"}
    assert staleness.meaningless(sync=False, num_workers=2) == {"dropped_gradients"}
    assert staleness.meaningless(sync=True, num_workers=4) == {"staleness"}
    assert staleness.meaningless(sync=True, num_workers=4, hybrid=True,
                                 backup_workers=1) == set()
    assert staleness.meaningless(sync=True, num_workers=4, hybrid=True,
                                 backup_workers=0) == {"staleness", "dropped_gradients"}


def test_sync_step_needs_a_sync_strategy(make_strategy):
    coordinator = kerasps.ClusterCoordinator(make_strategy())
    with pytest.raises(ValueError, match="mode='async'"):
        coordinator.sync_step(tf.function(lambda: 0), optimizer=keras.optimizers.SGD())


def _slow_worker_fn(seconds):
    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensors((tf.ones([4, 3]), tf.ones([4, 1]))).repeat()
        if context.input_pipeline_id == 0:
            dataset = kerasps.input.slowed(dataset, seconds)
        return dataset
    return dataset_fn


def _dense_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_backup_worker_drops_the_slow_gradients_and_the_trace_shows_them(make_strategy):
    strategy = make_strategy(mode="sync", backup_workers=1)
    with strategy.scope():
        model = _dense_model()
    recorder = kerasps.StepTraceRecorder()
    history = model.fit(kerasps.DatasetCreator(_slow_worker_fn(0.3)), epochs=1,
                        steps_per_epoch=6, verbose=0, callbacks=[recorder])
    assert int(model.optimizer.iterations.numpy()) == 6
    # Worker 0's gradients arrive after worker 1's: dropped.
    dropped = history.history["dropped_gradients"][0]
    assert dropped >= 1
    train = [e for e in recorder.events if e.kind == "train"]
    applies = [e for e in recorder.events if e.kind == "apply"]
    assert len(applies) == 6
    assert sum(e.dropped for e in train) == dropped
    # Mostly the slow worker's (the fast one's first gradient may come late: its step is
    # traced and its pipeline built while the slow one's first element is ready).
    slow, fast = (sum(e.dropped for e in train if e.worker == w) for w in (0, 1))
    assert slow > fast
    assert {e.version for e in applies} == set(range(6))
    # Evaluation is the same in both modes: every worker's batches, no update.
    loss = model.evaluate(kerasps.DatasetCreator(_slow_worker_fn(0)), steps=4, verbose=0)
    assert np.isfinite(loss)
    assert int(model.optimizer.iterations.numpy()) == 6


def test_a_step_that_waits_too_long_fails_with_a_clear_error(make_strategy):
    # The fast worker must deliver within `step_timeout` even on a loaded machine (0.2 s
    # was too short at a load average of 10); the slow one sleeps well past it.
    strategy = make_strategy(mode="sync", step_timeout=1.5)
    with strategy.scope():
        model = _dense_model()
    with pytest.raises(TimeoutError, match=r"Synchronous step 0 has 1 of the 2 gradients"):
        model.fit(kerasps.DatasetCreator(_slow_worker_fn(4.0)), epochs=1, steps_per_epoch=2,
                  verbose=0)


def _slow_loss(seconds):
    """Mean squared error computed `seconds` after the step read the weights: while one
    worker's step waits here, the other's can update them."""
    def loss(y_true, y_pred):
        pause = tf.py_function(lambda: time.sleep(seconds) or 0.0, [], tf.float32)
        pause = tf.ensure_shape(pause, [])
        return keras.losses.mean_squared_error(y_true, y_pred) + 0.0 * pause
    return loss


def test_async_logs_report_staleness_and_max_staleness_bounds_it(make_strategy):
    results = {}
    for bound in (None, 0):
        strategy = make_strategy(max_staleness=bound)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", _slow_loss(0.05))
        history = model.fit(kerasps.DatasetCreator(_slow_worker_fn(0)), epochs=2,
                            steps_per_epoch=12, verbose=0)
        assert len(history.history["staleness"]) == 2
        assert "dropped_gradients" not in history.history  # async: every gradient applies
        results[bound] = max(history.history["staleness"])
    assert results[None] > 0  # the fast worker updates while the slow one computes
    assert results[0] == 0.0  # one function at a time: nothing lands in between


def test_measure_staleness_false_drops_the_counter_and_its_log(make_strategy):
    from kerasps.keras.trainer.steps import step_functions

    strategy = make_strategy(measure_staleness=False)
    assert not strategy.measure_staleness
    with strategy.scope():
        model = _dense_model()
    batches = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(dict(logs)))
    history = model.fit(kerasps.DatasetCreator(_slow_worker_fn(0.02)), epochs=2,
                        steps_per_epoch=6, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 12
    assert "staleness" not in history.history and len(history.history["loss"]) == 2
    assert len(batches) == 12 and all("staleness" not in logs for logs in batches)
    assert "staleness" not in step_functions(model)  # no counter was made for the steps


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="sync", backup_workers=2), "backup_workers=2"),
    (dict(backup_workers=1), "need `mode='sync'`"),
    (dict(mode="sync", max_staleness=1), "max_staleness=1 with mode='sync'"),
    (dict(max_staleness=-2), "max_staleness=-2"),
    (dict(mode="sync", step_timeout=0), "step_timeout=0"),
    (dict(measure_staleness="no"), "measure_staleness='no'"),
])
def test_strategy_refuses_bad_consistency_arguments(make_strategy, kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        make_strategy(**kwargs)


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_a_batch_callback_in_sync_mode_reads_the_metrics_not_every_steps_logs(make_strategy,
                                                                               results_read,
                                                                               mode):
    # Each result copied from a worker keeps ~3 KB there for good (TensorFlow's kernel
    # cache): with a batch callback (the bar, `BackupAndRestore(save_freq=N)`), every
    # worker's gradient function returned its logs at every global step.
    strategy = make_strategy(mode=mode)
    with strategy.scope():
        model = _dense_model()
    batches = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(dict(logs)))
    history = model.fit(kerasps.DatasetCreator(_slow_worker_fn(0.0)), epochs=2,
                        steps_per_epoch=8, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 16
    # The global steps' updates return nothing. The gradient functions return logs at
    # each epoch's first and last global steps only, one result per worker each: 4 steps.
    assert len(results_read) == 4 * strategy.num_workers, len(results_read)
    assert len(batches) == 16 and all("loss" in logs for logs in batches)
    assert len(history.history["loss"]) == 2


def test_an_update_returning_nothing_has_run_when_its_fetch_returns(strategy):
    # A global step's update returns nothing (a result copied from a worker keeps ~3 KB
    # there for good), so nothing read proves it ran: the next step must still see it.
    coordinator = kerasps.ClusterCoordinator(strategy)
    with strategy.scope():
        total = tf.Variable(0, dtype=tf.int64)  # on a ps task

    @tf.function
    def count(n):  # a few hundred ms on the worker, then one write to the ps task
        done = tf.constant(0, tf.int64)
        for _ in tf.range(n):
            done += 1
        total.assign(done)

    remote = coordinator.schedule(count, args=(tf.constant(300_000, tf.int64),))
    assert remote.fetch() is None
    assert int(total.numpy()) == 300_000
