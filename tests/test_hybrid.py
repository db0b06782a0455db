"""Hybrid training: embedding rows updated on arrival, dense variables in global steps."""

import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
import kerasps  # noqa: E402
from kerasps.policy.consistency import Consistency, Mode, updated_on_arrival  # noqa: E402
from tests.test_sync import (  # noqa: E402
    _assert_same,
    _batches,
    _custom_loop,
    _model,
    _train_both,
)


def _fit(strategy, make_optimizer, steps, x, ids, y, on_arrival=None):
    """Trains `_model` under `strategy` on worker `i`'s constant batch `i`; returns the
    model, a single-process copy of its initial weights, and the History."""
    def dataset_fn(context):
        i = context.input_pipeline_id
        return tf.data.Dataset.from_tensors(((x[i], ids[i]), y[i])).repeat()

    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _model(make_optimizer())
    if on_arrival is not None:
        for layer in model.layers:
            if isinstance(layer, keras.layers.Embedding):
                kerasps.consistency.update_on_arrival(layer, on_arrival)
    single = _model(make_optimizer())
    single.set_weights(model.get_weights())
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=steps,
                        verbose=0)
    return model, single, history


def _reference_steps(single, steps, x, ids, y, embedding_scale):
    """Single-process SGD steps on the concatenated batch, the embedding table's gradient
    multiplied by `embedding_scale`."""
    optimizer = single.optimizer
    for _ in range(steps):
        with tf.GradientTape() as tape:
            predictions = single((np.concatenate(x), np.concatenate(ids)))
            loss = tf.reduce_mean(keras.losses.mean_squared_error(np.concatenate(y),
                                                                  predictions))
        variables = single.trainable_variables
        grads = tape.gradient(loss, variables)
        grads = [tf.convert_to_tensor(g) * embedding_scale if "embedding" in v.path else g
                 for g, v in zip(grads, variables)]
        optimizer.apply_gradients(zip(grads, variables))


def test_policy_updates_row_updates_on_arrival_only_in_hybrid_mode():
    assert updated_on_arrival(Mode.ASYNC, row_update=False)
    assert not updated_on_arrival(Mode.SYNC, row_update=True)
    assert updated_on_arrival(Mode.HYBRID, row_update=True)
    assert not updated_on_arrival(Mode.HYBRID, row_update=False)
    assert updated_on_arrival(Mode.HYBRID, row_update=False, override=True)
    assert not updated_on_arrival(Mode.HYBRID, row_update=True, override=False)
    hybrid = Consistency.of("hybrid", 1, None, num_workers=3)
    assert hybrid.sync and hybrid.hybrid and hybrid.backup_workers == 1


def test_hybrid_applies_each_workers_row_update_whole_and_averages_the_dense_ones(
        make_strategy):
    # Worker i trains on batch i; the ids of the two batches are distinct. Each global
    # step, each worker's row update is applied as it arrives (the gradient of its own
    # batch: twice its share of the concatenated batch's), and the dense variables take
    # the mean of the two workers' gradients, once.
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    model, single, history = _fit(strategy, lambda: keras.optimizers.SGD(0.05), 5, x, ids, y)
    _reference_steps(single, 5, x, ids, y, embedding_scale=2.0)
    _assert_same(model, single)
    assert int(model.optimizer.iterations.numpy()) == 5  # global steps
    # Without backup workers both counts could only be 0: the logs leave them out.
    assert "dropped_gradients" not in history.history and "staleness" not in history.history


def test_a_layer_set_to_global_steps_trains_as_in_sync_mode(make_strategy):
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    model, single, _ = _fit(strategy, lambda: keras.optimizers.SGD(0.05), 4, x, ids, y,
                            on_arrival=False)
    _reference_steps(single, 4, x, ids, y, embedding_scale=1.0)  # sync: the mean
    _assert_same(model, single)


def test_a_late_workers_row_update_is_applied_and_its_dense_gradient_dropped(make_strategy):
    strategy = make_strategy(mode="hybrid", backup_workers=1)
    x, ids, y = _batches(2)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    table = next(layer for layer in model.layers if isinstance(layer, keras.layers.Embedding))
    before = np.array(table.embeddings.numpy())
    slow_ids = ids[0].ravel()  # worker 0's input is slowed: its gradients arrive late

    def dataset_fn(context):
        i = context.input_pipeline_id
        dataset = tf.data.Dataset.from_tensors(((x[i], ids[i]), y[i])).repeat()
        return kerasps.input.slowed(dataset, 0.3) if i == 0 else dataset

    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=4,
                        verbose=0)
    assert history.history["dropped_gradients"][0] >= 1  # the slow worker's dense gradients
    assert "staleness" in history.history  # of the row updates, in global steps
    moved = np.abs(np.array(table.embeddings.numpy()) - before).sum(axis=1)
    assert (moved[slow_ids] > 0).all()  # its row updates were applied all the same


def one_worker_run():
    """In a process of its own (one process connects to one cluster)."""
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=1, num_ps=1), mode="hybrid")
    x, ids, y = _batches(4)
    model, single, history = _train_both(strategy, "adam", 8, x, ids, y,
                                         per_worker_stream=True)
    _assert_same(model, single)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert "dropped_gradients" not in history.history  # no backup worker: nothing dropped
    assert "staleness" not in history.history  # one worker: nothing is stale
    print("ONE WORKER OK")


def test_hybrid_with_one_worker_is_single_process_keras():
    code = "from tests.test_hybrid import one_worker_run; one_worker_run()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert "ONE WORKER OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="hybrid", max_staleness=2), "max_staleness=2 with mode='hybrid'"),
    (dict(mode="hybrid", backup_workers=2), "backup_workers=2"),
    (dict(mode="bulk"), "expected 'async', 'sync' or 'hybrid'"),
])
def test_bad_hybrid_arguments_are_rejected_early(make_strategy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(**kwargs)


def test_an_optimizer_rule_spanning_a_whole_step_is_rejected_in_hybrid_mode(make_strategy):
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    with pytest.raises(ValueError, match=r"`global_clipnorm` of the optimizer.*"
                                         r"Received: global_clipnorm=1\.0"):
        _fit(strategy, lambda: keras.optimizers.SGD(0.05, global_clipnorm=1.0), 2, x, ids, y)


def test_update_on_arrival_rejects_what_is_not_a_layer_or_variable():
    with pytest.raises(ValueError, match=r"Invalid value for argument `target`.*'table'"):
        kerasps.consistency.update_on_arrival("table")
    with pytest.raises(ValueError, match=r"on_arrival='yes'"):
        kerasps.consistency.update_on_arrival(keras.layers.Dense(2), "yes")


def test_custom_loop_sync_steps_apply_row_updates_on_arrival_in_hybrid_mode(make_strategy):
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = _model("sgd")
        optimizer = keras.optimizers.SGD(0.05)
    single = _model(keras.optimizers.SGD(0.05))
    single.set_weights(model.get_weights())
    coordinator, iterator, step = _custom_loop(strategy, model, optimizer, x, ids, y)

    for _ in range(4):
        assert len(coordinator.sync_step(step, args=(iterator,), optimizer=optimizer)) == 2
    assert int(optimizer.iterations.numpy()) == 4  # global steps
    _reference_steps(single, 4, x, ids, y, embedding_scale=2.0)
    _assert_same(model, single)


def test_fit_on_arrays_in_hybrid_mode_says_what_this_call_can_do(make_strategy):
    # Arrays without `steps_per_epoch` are read exactly once, which hybrid mode cannot
    # do. The error used to advise `kerasps.InputOptions(exactly_once=False)`, which
    # arrays cannot take; `steps_per_epoch` is what this call can add, and it trains.
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    x, ids, y = np.concatenate(x), np.concatenate(ids), np.concatenate(y)
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(ValueError, match=r"Invalid value for argument `x`") as raised:
        model.fit((x, ids), y, batch_size=4, epochs=1, verbose=0)
    message = str(raised.value)
    assert "InputOptions" not in message, message
    assert "`steps_per_epoch`" in message and "Received: x=tuple" in message, message
    history = model.fit((x, ids), y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert "loss" in history.history


def test_an_exactly_once_dataset_creator_in_hybrid_mode_is_told_to_change_its_options(
        make_strategy):
    strategy = make_strategy(mode="hybrid")
    with strategy.scope():
        model = _model(keras.optimizers.SGD(0.05))
    x, ids, y = _batches(1)
    creator = kerasps.DatasetCreator(
        lambda context: tf.data.Dataset.from_tensors(((x[0], ids[0]), y[0])),
        input_options=kerasps.InputOptions(exactly_once=True))
    with pytest.raises(ValueError, match=r"Invalid value for argument `x`") as raised:
        model.fit(creator, epochs=1, steps_per_epoch=2, verbose=0)
    message = str(raised.value)
    assert ("`kerasps.DatasetCreator` with "
            "`input_options=kerasps.InputOptions(exactly_once=False)`") in message, message


def test_hybrid_without_backup_workers_logs_no_count_that_can_only_be_0(make_strategy):
    # Every worker's gradient of a global step is awaited before it is applied: no dense
    # gradient is dropped and no row update is applied after a global step it did not
    # see. Both keys used to be in every epoch's logs, as 0.
    strategy = make_strategy(mode="hybrid")
    x, ids, y = _batches(2)
    _, _, history = _fit(strategy, lambda: keras.optimizers.SGD(0.05), 3, x, ids, y)
    assert "dropped_gradients" not in history.history
    assert "staleness" not in history.history
    assert "loss" in history.history
