"""Saved state never depends on the number of shards: weights, optimizer slots, exports."""

import contextlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps

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
