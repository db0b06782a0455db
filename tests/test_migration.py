"""tf_keras + TF `ParameterServerStrategy` programs that must run unchanged under kerasps.

Each case is compared with the same model run directly (or with
single-process Keras 3 holding the same weights).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.params.variables import logical_variables

X = np.linspace(-1.0, 1.0, 14, dtype="float32").reshape(7, 2)
Y = (X[:, :1] > 0).astype("float32")


def unbuilt(strategy, metrics=(), batch_norm=False, steps_per_execution=1):
    """A compiled `Sequential` without an `Input`: nothing is built yet."""
    with strategy.scope():
        layers = [keras.layers.Dense(4)]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(1, activation="sigmoid"))
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.SGD(), "binary_crossentropy",
                      metrics=[m() for m in metrics], steps_per_execution=steps_per_execution)
    assert not model.built
    return model


def single_process_copy(model, metrics=()):
    """A single-process Keras model holding `model`'s whole (unsharded) weights."""
    layers = [keras.Input((2,))]
    for layer in model.layers:
        layers.append(layer.__class__.from_config(layer.get_config()))
    copy = keras.Sequential(layers)
    copy.compile(keras.optimizers.SGD(), "binary_crossentropy", metrics=[m() for m in metrics])
    for variable, value in zip(copy.weights, logical_variables(model.weights)):
        variable.assign(value.numpy())
    return copy


def direct(model, x):
    return np.asarray(model(tf.convert_to_tensor(x), training=False))


# -- predict / evaluate of a compiled but unbuilt model ------------------------------
PREDICT_INPUTS = {
    "array": lambda: dict(x=X),
    "tensor": lambda: dict(x=tf.constant(X)),
    "dataset": lambda: dict(x=tf.data.Dataset.from_tensor_slices(X).batch(3)),
    "infinite_dataset": lambda: dict(x=tf.data.Dataset.from_tensor_slices(X).repeat().batch(2),
                                     steps=2),
}


@pytest.mark.parametrize("metrics", [(), (keras.metrics.Accuracy,)], ids=["no_metrics", "metrics"])
@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batch_norm"])
@pytest.mark.parametrize("inputs", sorted(PREDICT_INPUTS))
def test_predict_before_fit_builds_the_model(strategy, inputs, batch_norm, metrics):
    model = unbuilt(strategy, metrics, batch_norm)
    kwargs = PREDICT_INPUTS[inputs]()
    predictions = model.predict(**kwargs, verbose=0)
    assert model.built
    expected_rows = 4 if inputs == "infinite_dataset" else len(X)
    expected = direct(model, np.concatenate([X, X])[:expected_rows])
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)


def test_predict_before_fit_with_a_dataset_creator_and_steps_per_execution(strategy):
    model = unbuilt(strategy, (keras.metrics.Accuracy,), steps_per_execution=3)
    creator = kerasps.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices(X).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2))
    predictions = model.predict(creator, verbose=0)
    # As in tf_keras, predict reads one pipeline: `dataset_fn(InputContext(1, 0))`.
    np.testing.assert_allclose(predictions, direct(model, X), rtol=1e-5)


@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batch_norm"])
def test_predict_on_batch_before_fit_builds_the_model(strategy, batch_norm):
    model = unbuilt(strategy, (keras.metrics.Accuracy,), batch_norm)
    predictions = model.predict_on_batch(X)
    np.testing.assert_allclose(predictions, direct(model, X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("metrics", [(), (keras.metrics.BinaryAccuracy,)],
                         ids=["no_metrics", "metrics"])
@pytest.mark.parametrize("batch_norm", [False, True], ids=["dense", "batch_norm"])
def test_evaluate_and_test_on_batch_before_fit_match_single_process_keras(
        strategy, batch_norm, metrics):
    model = unbuilt(strategy, metrics, batch_norm, steps_per_execution=2)
    logs = model.evaluate(X, Y, batch_size=2, verbose=0, return_dict=True)
    reference = single_process_copy(model, metrics)
    expected = reference.evaluate(X, Y, batch_size=2, verbose=0, return_dict=True)
    assert logs.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(logs[name], expected[name], rtol=1e-5, err_msg=name)

    fresh = unbuilt(strategy, metrics, batch_norm)
    on_batch = fresh.test_on_batch(X, Y, return_dict=True)
    expected = single_process_copy(fresh, metrics).test_on_batch(X, Y, return_dict=True)
    for name in expected:
        np.testing.assert_allclose(on_batch[name], expected[name], rtol=1e-5, err_msg=name)


# -- datasets distributed by the strategy ----------------------------------------------
def _labelled(batch=2):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch)


def test_fit_evaluate_predict_accept_experimental_distribute_dataset(strategy):
    model = unbuilt(strategy, (keras.metrics.BinaryAccuracy,))
    train = strategy.experimental_distribute_dataset(_labelled().repeat())
    history = model.fit(train, epochs=2, steps_per_epoch=3, verbose=0,
                        validation_data=strategy.experimental_distribute_dataset(_labelled()))
    assert int(model.optimizer.iterations.numpy()) == 6
    assert {"loss", "val_loss", "val_binary_accuracy"} <= set(history.history)

    # Evaluation and prediction read the distributed dataset once, like the dataset.
    logs = model.evaluate(strategy.experimental_distribute_dataset(_labelled()), verbose=0,
                          return_dict=True)
    expected = single_process_copy(model, (keras.metrics.BinaryAccuracy,)).evaluate(
        _labelled(), verbose=0, return_dict=True)
    for name in expected:
        np.testing.assert_allclose(logs[name], expected[name], rtol=1e-5, err_msg=name)
    predictions = model.predict(
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(X).batch(2)),
        verbose=0)
    np.testing.assert_allclose(predictions, direct(model, X), rtol=1e-5, atol=1e-6)


def test_fit_and_evaluate_accept_distribute_datasets_from_function(strategy):
    seen = []

    def dataset_fn(input_context):
        seen.append(input_context.input_pipeline_id)
        return _labelled().shard(input_context.num_input_pipelines,
                                 input_context.input_pipeline_id)

    model = unbuilt(strategy)
    train = strategy.distribute_datasets_from_function(lambda ctx: dataset_fn(ctx).repeat())
    history = model.fit(train, epochs=1, steps_per_epoch=4, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert np.isfinite(history.history["loss"][0])
    assert {0, 1} <= set(seen)  # every worker got its own input context

    logs = model.evaluate(strategy.distribute_datasets_from_function(dataset_fn), verbose=0,
                          return_dict=True)
    expected = single_process_copy(model).evaluate(_labelled(), verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)


def test_fit_with_distributed_function_input_of_unknown_size_needs_steps_per_epoch(strategy):
    model = unbuilt(strategy)
    distributed = strategy.distribute_datasets_from_function(lambda ctx: _labelled().repeat())
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(distributed, epochs=1, verbose=0)


def test_a_distributed_dataset_from_another_strategy_is_refused_with_what_to_pass(strategy):
    model = unbuilt(strategy)
    foreign = tf.distribute.OneDeviceStrategy("/cpu:0").experimental_distribute_dataset(
        _labelled())
    with pytest.raises(ValueError, match=r"Invalid value for argument `x`.*"
                                         r"experimental_distribute_dataset.*DatasetCreator"):
        model.fit(foreign, epochs=1, steps_per_epoch=1, verbose=0)


def test_coordinator_accepts_the_strategys_distributed_dataset(strategy):
    coordinator = kerasps.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensors(
                tf.cast(ctx.input_pipeline_id, tf.int64)).repeat()))

    @tf.function
    def worker_id(iterator):
        return next(iterator)

    iterator = iter(per_worker)
    values = [coordinator.schedule(worker_id, args=(iterator,)) for _ in range(8)]
    coordinator.join()
    assert {int(v.fetch()) for v in values} <= {0, 1}


# -- partitioning independent of how a variable is created ---------------------------------
class ValueInInit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.w = keras.Variable([0.0, 1.0, 2.0, 3.0], name="w")

    def call(self, x):
        return x * tf.reduce_sum(self.w)


class ValueInBuild(keras.layers.Layer):
    def build(self, input_shape):
        self.w = keras.Variable(np.arange(4, dtype="float32").reshape(4, 1), name="w")

    def call(self, x):
        return x * tf.reduce_sum(self.w)


class AddWeight(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(4,), initializer="ones", name="w")

    def call(self, x):
        return x * tf.reduce_sum(self.w)


@pytest.mark.parametrize("layer_cls", [ValueInInit, ValueInBuild, AddWeight])
def test_variables_are_partitioned_whichever_keras_api_creates_them(strategy, layer_cls,
                                                                    tmp_path):
    with strategy.scope():
        layer = layer_cls()
        layer.build((None, 1))
    assert isinstance(layer.w, kerasps.ShardedVariable)
    assert layer.w.num_shards == 2
    assert [v.shape[0] for v in layer.trainable_weights] == [2, 2]
    assert layer.weights == layer.trainable_weights == layer.w.shards
    ps_tasks = {r.ps_task for r in strategy.placement_report() if r.variable.endswith("w")
                and r.shape[0] == 2}
    assert ps_tasks == {0, 1}

    # Saved whole, restored whole.
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), layer])
    expected = layer.w.numpy()
    path = str(tmp_path / "layer.weights.h5")
    model.save_weights(path)
    layer.w.assign(np.zeros_like(expected))
    model.load_weights(path)
    np.testing.assert_array_equal(layer.w.numpy(), expected)
