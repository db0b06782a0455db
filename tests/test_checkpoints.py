"""Saved state never depends on the number of shards: weights, optimizer slots, exports."""

import contextlib
import gc
import re
import subprocess
import sys
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.params.variables import logical_variables

BATCHES = [
    (np.array([[0, 8], [4, 5], [3, 3], [7, 1]], dtype="int32"),
     np.array([[1.0], [0.0], [0.5], [2.0]], dtype="float32")),
    (np.array([[2, 6], [8, 8], [0, 4], [5, 2]], dtype="int32"),
     np.array([[0.2], [1.5], [-1.0], [0.3]], dtype="float32")),
]
MORE_BATCHES = [
    (np.array([[6, 7], [1, 2], [3, 0], [8, 4]], dtype="int32"),
     np.array([[0.7], [0.1], [1.2], [-0.4]], dtype="float32")),
    BATCHES[0],
]


def build(rows=9, units=1):
    """The same names everywhere, so optimizer slots are named alike in every layout."""
    model = keras.Sequential([
        keras.Input((2,), dtype="int32"),
        keras.layers.Embedding(rows, 3, name="embedding"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(units, name="dense"),
    ], name="model")
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def build_under(strategy=None, **kwargs):
    """A compiled model with its optimizer built, under `strategy` or in one process."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(**kwargs)
        model.optimizer.build(model.trainable_variables)
    return model


def two_shards(make_strategy):
    return make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))


def three_shards(make_strategy):
    return make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3))


def whole_weights(model):
    """Each layer variable as one array (shards concatenated), by path."""
    layers = {"embedding": ["embeddings"], "dense": ["kernel", "bias"]}
    return {f"{layer}/{attr}": np.asarray(getattr(model.get_layer(layer), attr).numpy())
            for layer, attrs in layers.items() for attr in attrs}


def whole_slots(optimizer):
    """The optimizer's variables as whole arrays, in order: per-shard slots
    (`<variable>_part_<i>_<slot>`) are concatenated in shard order."""
    parts = {}
    for variable in optimizer.variables:
        match = re.fullmatch(r"(.*)_part_(\d+)(_.*)", variable.name)
        key, index = ((match[1] + match[3], int(match[2])) if match else (variable.name, 0))
        parts.setdefault(key, {})[index] = np.asarray(variable.numpy())
    return [(key, np.concatenate([p[i] for i in sorted(p)]) if p[0].ndim else p[0])
            for key, p in parts.items()]


def train(model, batches):
    for ids, labels in batches:
        model.train_on_batch(ids, labels)


def assert_same_state(actual, expected):
    expected_weights, actual_weights = whole_weights(expected), whole_weights(actual)
    for path, value in expected_weights.items():
        np.testing.assert_allclose(actual_weights[path], value, rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    expected_slots, actual_slots = whole_slots(expected.optimizer), whole_slots(actual.optimizer)
    assert len(actual_slots) == len(expected_slots)
    for (name, actual_value), (_, value) in zip(actual_slots, expected_slots):
        np.testing.assert_allclose(actual_value, value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.fixture
def trained(make_strategy):
    """A model trained under 2 shards."""
    model = build_under(two_shards(make_strategy))
    train(model, BATCHES)
    return model


def restore(kind, source, target, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    if kind == "weights.h5":
        path = str(tmp_path / "model.weights.h5")
        source.save_weights(path)
        target.load_weights(path)
    else:
        checkpoint = tf.train.Checkpoint(model=source, optimizer=source.optimizer)
        path = checkpoint.save(str(tmp_path / "ckpt"))
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).restore(
            path).assert_existing_objects_matched()


@pytest.mark.parametrize("kind", ["weights.h5", "tf.train.Checkpoint"])
def test_adam_state_trained_on_2_shards_restores_exactly_into_3_shards(
        trained, make_strategy, tmp_path, kind):
    target = build_under(three_shards(make_strategy))
    assert target.get_layer("embedding").embeddings.num_shards == 3
    restore(kind, trained, target, tmp_path)
    assert_same_state(target, trained)
    assert int(target.optimizer.iterations.numpy()) == len(BATCHES)

    # Training goes on as if nothing had happened.
    train(target, MORE_BATCHES)
    train(trained, MORE_BATCHES)
    assert_same_state(target, trained)


@pytest.mark.parametrize("kind", ["weights.h5", "tf.train.Checkpoint"])
def test_adam_state_moves_between_sharded_and_single_process_models(
        trained, make_strategy, tmp_path, kind):
    single = build_under()
    restore(kind, trained, single, tmp_path / "to_single")
    assert_same_state(single, trained)

    back = build_under(three_shards(make_strategy))
    restore(kind, single, back, tmp_path / "back")
    assert_same_state(back, trained)
    train(back, MORE_BATCHES)
    train(trained, MORE_BATCHES)
    assert_same_state(back, trained)


def test_keras_file_of_a_sharded_model_loads_into_other_layouts(trained, make_strategy, tmp_path):
    path = str(tmp_path / "model.keras")
    trained.save(path)
    with three_shards(make_strategy).scope():
        target = keras.saving.load_model(path)
    assert target.get_layer("embedding").embeddings.num_shards == 3
    assert_same_state(target, trained)
    assert_same_state(keras.saving.load_model(path), trained)
    train(target, MORE_BATCHES)
    train(trained, MORE_BATCHES)
    assert_same_state(target, trained)


def test_saved_optimizer_state_lists_whole_variables(trained, tmp_path):
    single = build_under()
    trained.save_weights(str(tmp_path / "sharded.weights.h5"))
    single.save_weights(str(tmp_path / "single.weights.h5"))

    def shapes(path):
        import h5py

        with h5py.File(path) as f:
            group = f["optimizer/vars"]
            return [group[str(i)].shape for i in range(len(group))]

    assert shapes(tmp_path / "sharded.weights.h5") == shapes(tmp_path / "single.weights.h5")


# -- models saved before any training ----------------------------------------------------
def _dense_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="dense")],
                            name="model")


def _embedding_model():
    return keras.Sequential([
        keras.Input((2,), dtype="int32"),
        keras.layers.Embedding(9, 4, name="embedding"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(1, name="dense"),
    ], name="model")


LAYER_MODELS = {"dense": _dense_model, "embedding": _embedding_model}


def _batches(layer):
    rng = np.random.default_rng(7)
    if layer == "dense":
        return [(rng.normal(size=(4, 6)).astype("float32"),
                 rng.normal(size=(4, 3)).astype("float32")) for _ in range(2)]
    # No id twice in a batch: Keras' Adam squares a repeated row's gradient per
    # occurrence, a sharded table sums the occurrences first (docs/limitations.md).
    return [(rng.permutation(9)[:8].reshape(4, 2).astype("int32"),
             rng.normal(size=(4, 1)).astype("float32")) for _ in range(2)]


def _partitioner(kind, num_shards):
    if kind == "fixed":
        return kerasps.partitioners.FixedShardsPartitioner(num_shards)
    # 16-byte shards, at most `num_shards`: a Dense bias of 3 floats stays whole.
    return kerasps.partitioners.MinSizePartitioner(min_shard_bytes=16, max_shards=num_shards)


def _scope(make_strategy, num_shards, kind):
    """A function entering the scope of a strategy sharding into `num_shards`, or
    no scope (single process)."""
    if num_shards is None:
        return contextlib.nullcontext
    return make_strategy(variable_partitioner=_partitioner(kind, num_shards)).scope


def _most_shards(model):
    return max(getattr(v, "num_shards", 1) for v in logical_variables(model.weights))


def _assert_same_variables(actual, expected):
    """Whole weights and whole optimizer variables (slots of shards concatenated) agree."""
    expected_weights = [np.asarray(v.numpy()) for v in logical_variables(expected.weights)]
    actual_weights = [np.asarray(v.numpy()) for v in logical_variables(actual.weights)]
    assert len(actual_weights) == len(expected_weights)
    for actual_value, value in zip(actual_weights, expected_weights):
        np.testing.assert_allclose(actual_value, value, rtol=1e-5, atol=1e-6)
    expected_slots, actual_slots = whole_slots(expected.optimizer), whole_slots(actual.optimizer)
    assert len(actual_slots) == len(expected_slots)
    for (_, actual_value), (name, value) in zip(actual_slots, expected_slots):
        np.testing.assert_allclose(actual_value, value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("partitioner", ["fixed", "min_size"])
@pytest.mark.parametrize("layer", sorted(LAYER_MODELS))
@pytest.mark.parametrize("source, target", [(2, 2), (2, 3), (3, 2), (None, 2), (None, 3)],
                         ids=["2to2", "2to3", "3to2", "unsharded_to_2", "unsharded_to_3"])
def test_a_model_saved_before_training_loads_into_any_layout(
        make_strategy, tmp_path, source, target, layer, partitioner):
    with _scope(make_strategy, source, partitioner)():
        model = LAYER_MODELS[layer]()
        model.compile("adam", "mse")
    never_trained = str(tmp_path / "never_trained.keras")
    model.save(never_trained)  # its optimizer holds its iteration and learning rate only
    target_scope = _scope(make_strategy, target, partitioner)
    with target_scope():
        loaded = keras.saving.load_model(never_trained)
    assert _most_shards(loaded) == target
    assert int(loaded.optimizer.iterations.numpy()) == 0
    assert all(not np.any(value) for name, value in whole_slots(loaded.optimizer)
               if name.endswith(("momentum", "velocity")))
    # It trains on as single-process Keras does, loading the same file.
    plain = keras.saving.load_model(never_trained)
    _assert_same_variables(loaded, plain)
    batches = _batches(layer)
    train(loaded, batches)
    train(plain, batches)
    _assert_same_variables(loaded, plain)

    # Saved after training, the slots are in the file and restore exactly.
    train(model, batches)
    trained = str(tmp_path / "trained.keras")
    model.save(trained)
    with target_scope():
        restored = keras.saving.load_model(trained)
    assert _most_shards(restored) == target
    assert int(restored.optimizer.iterations.numpy()) == len(batches)
    _assert_same_variables(restored, model)


@pytest.mark.parametrize("layer", sorted(LAYER_MODELS))
def test_a_never_trained_keras_file_loads_under_the_scope_and_fits(make_strategy, tmp_path,
                                                                   layer):
    model = LAYER_MODELS[layer]()
    model.compile("adam", "mse")
    path = str(tmp_path / "model.keras")
    model.save(path)
    strategy = three_shards(make_strategy)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    x, y = (np.concatenate(parts) for parts in zip(*_batches(layer)))
    history = loaded.fit(x, y, batch_size=2, epochs=2, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 2 * len(x) // 2
    assert np.isfinite(history.history["loss"]).all()
    assert any(np.any(value) for _, value in whole_slots(loaded.optimizer)[2:])


# -- restores that cannot be exact ---------------------------------------------------------
def snapshot(model):
    return [w.copy() for w in model.get_weights()], [v for _, v in whole_slots(model.optimizer)]


def assert_unchanged(model, before):
    weights, slots = snapshot(model)
    for actual, expected in zip(weights + slots, before[0] + before[1]):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("file", ["model.weights.h5", "model.keras"])
def test_weights_of_another_shape_raise_naming_the_variable_and_leave_the_model_alone(
        trained, make_strategy, tmp_path, file):
    path = str(tmp_path / file)
    trained.save(path) if file.endswith(".keras") else trained.save_weights(path)
    target = build_under(three_shards(make_strategy), units=2)  # dense/kernel is (6, 2)
    train(target, BATCHES[:1])
    before = snapshot(target)
    with pytest.raises(ValueError) as excinfo:
        target.load_weights(path)
    message = str(excinfo.value)
    assert "dense/kernel" in message
    assert "(6, 2)" in message and "(6, 1)" in message
    assert_unchanged(target, before)  # the embedding, loaded first, too


def test_optimizer_state_that_does_not_line_up_raises_and_changes_nothing(
        trained, make_strategy, tmp_path):
    path = str(tmp_path / "model.weights.h5")
    trained.save_weights(path)
    with three_shards(make_strategy).scope():
        target = build()
        target.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        target.optimizer.build(target.trainable_variables)
    train(target, BATCHES[:1])
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"optimizer 'sgd.*' does not line up.*8"):
        target.load_weights(path)
    assert_unchanged(target, before)


def test_optimizer_state_of_another_unbuilt_optimizer_raises_naming_what_differs(
        make_strategy, tmp_path):
    # A learning-rate schedule is no variable: this file holds the iteration only.
    single = build()
    single.compile(keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=10, decay_rate=0.9)), "mse")
    path = str(tmp_path / "model.weights.h5")
    single.save_weights(path)
    target = build_under(three_shards(make_strategy))
    train(target, BATCHES[:1])
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"optimizer 'adam\w*' does not line up with it: it has "
                                         r"8 variables \(2 before it was built\), the file "
                                         r"holds 1\."):
        target.load_weights(path)
    assert_unchanged(target, before)
    assert int(target.optimizer.iterations.numpy()) == 1


def test_checkpoint_of_another_shape_raises_naming_the_variable(trained, make_strategy,
                                                                 tmp_path):
    path = tf.train.Checkpoint(model=trained).save(str(tmp_path / "ckpt"))
    target = build_under(three_shards(make_strategy), rows=12)
    # Restored inside a function (the model lives on several ps tasks), the
    # shape is known when the function runs: TensorFlow's runtime error.
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match=r"model/embedding/embeddings") as excinfo:
        tf.train.Checkpoint(model=target).restore(path)
    assert "(12, 3)" in str(excinfo.value) and "[9 3]" in str(excinfo.value)


def test_restoring_into_an_unbuilt_sharded_optimizer_asks_to_build_it_first(
        trained, make_strategy, tmp_path):
    path = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer).save(
        str(tmp_path / "ckpt"))
    strategy = three_shards(make_strategy)
    with strategy.scope():
        target = build()
    tf.train.Checkpoint(model=target, optimizer=target.optimizer).restore(path)
    with strategy.scope(), pytest.raises(ValueError, match=r"Build the optimizer before"):
        target.optimizer.build(target.trainable_variables)


# -- get_weights / set_weights -------------------------------------------------------------
def test_get_and_set_weights_move_whole_variables_between_layouts(trained, make_strategy):
    weights = trained.get_weights()
    single = build()
    assert [w.shape for w in weights] == [w.shape for w in single.get_weights()]
    single.set_weights(weights)
    target = build_under(three_shards(make_strategy))
    target.set_weights(single.get_weights())
    for model in (single, target):
        for actual, expected in zip(model.get_weights(), weights):
            np.testing.assert_array_equal(actual, expected)
    # Optimizers still see shards.
    assert len(target.trainable_variables) == 3 + 3 + 1


def test_set_weights_of_the_wrong_shape_raises_before_assigning_anything(trained):
    before = trained.get_weights()
    bad = [w + 1 for w in before[:-1]] + [np.zeros((2,), "float32")]
    with pytest.raises(ValueError, match=r"model/dense/bias.*\(1,\).*\(2,\)"):
        trained.set_weights(bad)
    with pytest.raises(ValueError, match=r"length 2.*expecting 3 weights"):
        trained.set_weights(before[:2])
    for actual, expected in zip(trained.get_weights(), before):
        np.testing.assert_array_equal(actual, expected)


# -- export for serving ---------------------------------------------------------------------
SERVE = """
import sys
import numpy as np
import keras
import tensorflow as tf

ids = np.load(sys.argv[1])
exported = tf.saved_model.load(sys.argv[2])
served = exported.serve(tf.constant(ids)).numpy()
loaded = keras.saving.load_model(sys.argv[3]).predict(ids, verbose=0)
assert not [m for m in sys.modules if m.startswith("kerasps")]
np.save(sys.argv[4], np.stack([served, loaded]))
print(sorted(tuple(v.shape) for v in exported.variables))
"""


def test_export_and_keras_file_of_a_sharded_model_serve_without_kerasps(trained, tmp_path):
    ids = np.concatenate([ids for ids, _ in BATCHES + MORE_BATCHES])
    expected = trained.predict(ids, verbose=0)
    trained.export(str(tmp_path / "saved_model"), verbose=False)
    trained.save(str(tmp_path / "model.keras"))
    np.save(tmp_path / "ids.npy", ids)
    # A clean interpreter that never imports kerasps, outside any strategy.
    result = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path / "ids.npy"), str(tmp_path / "saved_model"),
         str(tmp_path / "model.keras"), str(tmp_path / "out.npy")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Whole variables, not one per shard.
    assert result.stdout.strip().splitlines()[-1] == str(sorted(w.shape for w in
                                                                trained.get_weights()))
    served, loaded = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded, expected, rtol=1e-5, atol=1e-6)


# -- Saving many times ---------------------------------------------------------------------

def ps_variables(strategy):
    """What the ps tasks hold: the placement report's (name, ps task) pairs, and the live
    `tf.Variable`s of this process that sit on a ps task."""
    gc.collect()
    live = {id(variable): weakref.ref(variable) for variable in gc.get_objects()
            if isinstance(variable, tf.Variable) and "/job:ps/" in getattr(variable, "device", "")}
    return sorted((r.name, r.ps_task) for r in strategy.placement_report()), live


@pytest.mark.slow  # the default run's longest: 100 saves: ~60 s
def test_the_ps_tasks_hold_the_same_variables_after_the_100th_save_as_after_the_first(
        make_strategy, tmp_path):
    """Every save and load of a backup or checkpoint walks the model's saveables; none may
    leave a variable on a ps task. Keras made a reference `Optimizer(1.0)` in each walk (its
    cache of the attributes to skip never hit), whose `iteration` and `learning_rate`
    landed on a ps task under the strategy: `optimizer_N/...` grew by two per save."""
    strategy = two_shards(make_strategy)
    model = build_under(strategy)
    ids, labels = BATCHES[0]

    def dataset_fn(_):
        return tf.data.Dataset.from_tensors((ids, labels)).repeat()

    def fit(steps, epochs=1):
        model.fit(kerasps.DatasetCreator(dataset_fn), epochs=epochs, steps_per_epoch=steps,
                  verbose=0, callbacks=[
                      keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1),
                      keras.callbacks.ModelCheckpoint(str(tmp_path / "{epoch}.weights.h5"),
                                                      save_weights_only=True)])

    fit(steps=1)
    after_first = ps_variables(strategy)
    fit(steps=25, epochs=4)  # 100 backups, 4 checkpoints, a restore at the start
    model.load_weights(str(tmp_path / "4.weights.h5"))
    after_many = ps_variables(strategy)
    assert after_many[0] == after_first[0]
    assert not [name for name, _ in after_many[0] if name.startswith("optimizer_")]
    made_since = [ref().name for key, ref in after_many[1].items()
                  if key not in after_first[1] or after_first[1][key]() is not ref()]
    assert not made_since
