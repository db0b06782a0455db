"""tf_keras' evaluation tests for parameter-server training, on kerasps.

Sources (keras-team/tf-keras): tf_keras/distribute/parameter_server_evaluation_test.py and
tf_keras/distribute/parameter_server_exact_evaluation_test.py. Each test names the case it
ports. Their worker kills (workers 0 and 1 killed and restarted during the evaluation) need
processes that can die: those parts are in `test_evaluation_under_worker_failures.py`
(marked `slow`); here the same evaluations run on the shared in-process cluster.

Deliberate differences, asserted as kerasps behaves:

* Exact evaluation is the default and has no switch: `evaluate` without `steps` reads each
  element of finite input once (docs/guide/fit-evaluate-predict.md), where tf_keras needs
  `compile(pss_evaluation_shards=...)` (which Keras 3 does not have). So the `use_auto`
  axis of `testDistributedModelEvaluation` has nothing to vary.
* Metrics live on the ps tasks and every worker updates them atomically
  (docs/guide/fit-evaluate-predict.md), so the kerasps way to aggregate a custom loop's evaluation
  is one metric created under `strategy.scope()`; tf_keras clones a metric per closure and adds up
  their weights. Both are asserted exact.
* A `DatasetCreator`'s `dataset_fn` shards with its `InputContext` (docs/guide/input.md, "Shard
  policies": the default for a `dataset_fn` is `"off"`, "which shards with its
  InputContext"); tf_keras' exact evaluation ignores the context and shards by closure.
  The tf_keras form (context ignored) is ported as an expected failure, see its test.

Skipped, with why:

* `testPassMetricToTfFunction`: a composite-tensor `Mean` prototype defined by the test
  itself on TensorFlow internals (`TypeSpec`, `VariableSpec`), not a tf_keras feature.
* `testModelAddMetricErrors`: `Layer.add_metric` and `pss_evaluation_shards` do not exist
  in Keras 3.
* `testTrainingWithVariablesCreatedInFunction`'s premise (tf_keras creating string
  metrics lazily inside a `tf.function`): Keras 3 builds compiled metrics before the first
  step; its assertion (string metrics aggregate every update) is ported.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps


class ExampleCount(keras.metrics.Metric):
    """Examples seen: exact only if every batch is counted once."""

    def __init__(self, name="examples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_pred)[0], self.dtype))

    def result(self):
        return self.count * 1.0


class CustomAccuracy(keras.metrics.Metric):
    """The source's custom metric: matches over elements, in two weights."""

    def __init__(self, name="custom_acc", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_weight(name="total", initializer="zeros")
        self.count = self.add_weight(name="count", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        matches = tf.cast(tf.equal(tf.cast(y_true, tf.float32), tf.cast(y_pred, tf.float32)),
                          tf.float32)
        self.count.assign_add(tf.reduce_sum(matches))
        self.total.assign_add(tf.cast(tf.size(y_true), tf.float32))

    def result(self):
        return self.count / self.total

    def reset_state(self):
        self.total.assign(0.0)
        self.count.assign(0.0)


class AlwaysTrue(keras.Model):
    """The source's `BinaryModel`: predicts 1 for every (non-negative) input."""

    def call(self, x, training=False):
        return tf.cast(x >= 0, tf.float32)


# The source's binary dataset, smaller: shard s (the batches whose index is s modulo
# SHARDS) holds s true labels, so the accuracy of always predicting 1 is known.
BATCH, SHARDS, BATCHES_PER_SHARD = 8, 8, 4
EXAMPLES = BATCH * SHARDS * BATCHES_PER_SHARD
ACCURACY = sum(range(SHARDS)) / EXAMPLES


def binary_labels():
    y = np.zeros(EXAMPLES)
    for shard in range(SHARDS):
        trues = shard
        for batch in np.where(np.arange(EXAMPLES // BATCH) % SHARDS == shard)[0]:
            n = min(trues, BATCH)
            y[batch * BATCH:(batch + 1) * BATCH] = np.r_[np.ones(n), np.zeros(BATCH - n)]
            trues -= n
    return y


def binary_dataset(input_context=None):
    x = np.arange(EXAMPLES)
    return tf.data.Dataset.from_tensor_slices((x, binary_labels())).batch(BATCH)


def compile_always_true(strategy=None):
    def make():
        model = AlwaysTrue()
        model.compile(loss="mae", metrics=[keras.metrics.Accuracy(), CustomAccuracy(),
                                           ExampleCount()])
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


EXPECTED = {"accuracy": ACCURACY, "custom_acc": ACCURACY, "loss": 1 - ACCURACY,
            "examples": EXAMPLES}


def test_the_ground_truth_of_single_process_keras():
    """testDistributedModelEvaluation's local evaluation, which the others must match."""
    logs = compile_always_true().evaluate(binary_dataset(), verbose=0, return_dict=True)
    assert logs == pytest.approx(EXPECTED)


def sharded_by_context(input_context):
    return binary_dataset().shard(input_context.num_input_pipelines,
                                  input_context.input_pipeline_id)


def evaluation_input(strategy, kind):
    if kind == "dataset":
        return binary_dataset()
    if kind == "distributed_dataset":
        return strategy.experimental_distribute_dataset(binary_dataset())
    if kind == "dataset_creator":
        return kerasps.DatasetCreator(sharded_by_context)
    assert kind == "exactly_once_dataset_creator"
    return kerasps.DatasetCreator(binary_dataset, kerasps.InputOptions(exactly_once=True))


KINDS = ["dataset", "distributed_dataset", "dataset_creator", "exactly_once_dataset_creator"]


@pytest.mark.parametrize("where", ["evaluate", "fit_validation"])
@pytest.mark.parametrize("kind", KINDS)
def test_distributed_evaluation_is_exact(strategy, kind, where):
    """testDistributedModelEvaluation (both metrics at once; `use_auto` has no
    counterpart, module docstring), without the worker kills."""
    model = compile_always_true(strategy)
    if where == "evaluate":
        model.fit(evaluation_input(strategy, kind), steps_per_epoch=1, verbose=0)
        logs = model.evaluate(evaluation_input(strategy, kind), verbose=0, return_dict=True)
    else:
        history = model.fit(evaluation_input(strategy, kind), steps_per_epoch=1, verbose=0,
                            validation_data=evaluation_input(strategy, kind))
        logs = {name[len("val_"):]: values[-1] for name, values in history.history.items()
                if name.startswith("val_")}
    assert logs == pytest.approx(EXPECTED)


def test_evaluate_of_a_dataset_creator_that_ignores_its_context_counts_each_example_once(
        strategy):
    """testDistributedModelEvaluation's `dataset_creator` input as tf_keras writes it."""
    model = compile_always_true(strategy)
    logs = model.evaluate(kerasps.DatasetCreator(binary_dataset), verbose=0, return_dict=True)
    assert logs == pytest.approx(EXPECTED)


def test_evaluate_of_an_endless_dataset_needs_steps(strategy):
    """testModelInfiniteDatasetErrors."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(loss="mse")
    endless = tf.data.Dataset.range(10).map(lambda i: (tf.cast([i], tf.float32),) * 2).repeat()
    with pytest.raises(ValueError, match=r"`steps`.*infinite"):
        model.evaluate(endless.batch(2), verbose=0)


class Identity(keras.Model):
    def call(self, x, training=False):
        return x


def test_string_metrics_aggregate_every_update(strategy):
    """testTrainingWithVariablesCreatedInFunction's assertion: metrics given by name,
    updated by two batches (on two workers), give the accuracy of all six predictions.
    (Keras 3 asks for a loss to evaluate.)"""
    with strategy.scope():
        model = Identity()
        model.compile(loss="mse", metrics=["accuracy"])
    predictions = tf.constant([[0.0], [0.0], [1.0], [0.0], [1.0], [1.0]])
    batches = tf.data.Dataset.from_tensor_slices((predictions, tf.zeros((6, 1)))).batch(3)
    assert model.evaluate(batches, verbose=0, return_dict=True)["accuracy"] == 0.5


def test_a_ps_metric_updated_from_scheduled_functions(strategy):
    """testTrainingWithVariablesCreatedInFunction, in a custom loop: one metric under the
    strategy, updated by two scheduled functions."""
    with strategy.scope():
        accuracy = keras.metrics.BinaryAccuracy()
    coordinator = kerasps.ClusterCoordinator(strategy)

    @tf.function
    def update(y_true, y_pred):
        accuracy.update_state(y_true, y_pred)

    zeros = tf.zeros((3, 1))
    coordinator.schedule(update, args=(zeros, tf.constant([[0.0], [0.0], [1.0]])))
    coordinator.schedule(update, args=(zeros, tf.constant([[0.0], [1.0], [1.0]])))
    coordinator.join()
    assert float(accuracy.result()) == 0.5


TOTAL_SHARDS = 128


def test_evaluation_scheduled_by_shard(strategy):
    """testModelEvaluatePrototype, without the worker kills: 128 scheduled functions,
    each evaluating one shard of `range(1024)`; their results average to the mean, and a
    `Mean` metric on the ps updated by all of them holds it too."""
    with strategy.scope():
        mean = keras.metrics.Mean()
    coordinator = kerasps.ClusterCoordinator(strategy)

    @tf.function
    def evaluate_shard(total_shards, shard_id):
        total = tf.constant(0, tf.int64)
        count = tf.constant(0, tf.int64)
        for value in tf.data.Dataset.range(1024).shard(total_shards, shard_id):
            mean.update_state(tf.cast(value, tf.float32))
            total += value
            count += 1
        return tf.cast(total, tf.float64) / tf.cast(count, tf.float64)

    shards = tf.constant(TOTAL_SHARDS, tf.int64)
    results = [coordinator.schedule(evaluate_shard, args=(shards, tf.constant(i, tf.int64)))
               for i in range(TOTAL_SHARDS)]
    values = [r.fetch() for r in results]
    assert sum(values) / len(values) == 511.5
    assert float(mean.result()) == 511.5
    assert float(mean.count.numpy()) == 1024


def test_auc_and_mae_over_shards_are_exact(strategy):
    """testDistributedMetrics, without the worker kills: `AUC` and `MeanAbsoluteError`
    updated over 100 scheduled shards (of batches of 8, the source's are of 1) match
    single-process Keras. The regression test of the lost updates it found is
    `test_split_metric_accumulators_keep_every_workers_updates`."""
    y_true = np.concatenate((np.zeros(512), np.ones(512))).astype("float32")
    y_pred = np.concatenate((np.linspace(0, 1, 512), np.linspace(0, 1, 512))).astype("float32")
    with strategy.scope():
        metrics = [keras.metrics.AUC(), keras.metrics.MeanAbsoluteError()]
    coordinator = kerasps.ClusterCoordinator(strategy)

    @tf.function
    def evaluate_shard(total_shards, shard_id):
        pairs = tf.data.Dataset.from_tensor_slices((y_true, y_pred)).batch(8)
        for labels, predictions in pairs.shard(total_shards, shard_id):
            for metric in metrics:
                metric.update_state(labels, predictions)

    shards = tf.constant(100, tf.int64)
    for i in range(100):
        coordinator.schedule(evaluate_shard, args=(shards, tf.constant(i, tf.int64)))
    coordinator.join()

    reference = [keras.metrics.AUC(), keras.metrics.MeanAbsoluteError()]
    for metric in reference:
        metric.update_state(y_true, y_pred)
    assert float(metrics[0].result()) == pytest.approx(0.5, abs=1e-5)
    assert float(metrics[1].result()) == pytest.approx(0.5, abs=1e-5)
    for metric, expected in zip(metrics, reference):
        assert float(metric.result()) == pytest.approx(float(expected.result()), abs=1e-5)


N_CLASSES = 5


class ModuloClass(keras.Model):
    """The source's `MulticlassModel`: the class of `x` is `x mod 5`, one-hot."""

    def call(self, x, training=False):
        return tf.one_hot(tf.math.floormod(tf.cast(x, tf.int64), N_CLASSES), N_CLASSES)


def multiclass_dataset():
    batch = N_CLASSES * 2
    x = np.arange(batch * 8 * 4)
    y = np.mod(x, N_CLASSES)
    y[y == 0] = 1
    weights = np.random.default_rng(0).uniform(size=len(x))
    return tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(batch)


def compile_modulo_class(strategy=None):
    def make():
        model = ModuloClass()
        model.compile(loss="sparse_categorical_crossentropy",
                      metrics=[keras.metrics.SparseCategoricalAccuracy(),
                               keras.metrics.SparseCategoricalCrossentropy()],
                      weighted_metrics=[keras.metrics.SparseCategoricalCrossentropy(
                          name="weighted_crossentropy")])
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def test_weighted_multiclass_evaluation_matches_single_process_keras(strategy):
    """testDistributedMulticlassWeightedEvaluation."""
    expected = compile_modulo_class().evaluate(multiclass_dataset(), verbose=0,
                                               return_dict=True)
    assert expected["sparse_categorical_accuracy"] == pytest.approx(4 / 5)
    model = compile_modulo_class(strategy)
    model.fit(multiclass_dataset(), steps_per_epoch=1, verbose=0)
    logs = model.evaluate(multiclass_dataset(), verbose=0, return_dict=True)
    assert logs == pytest.approx(expected, rel=1e-4)


def test_split_metric_accumulators_keep_every_workers_updates(strategy):
    """Regression test (found by `test_auc_and_mae_over_shards_are_exact`): the
    accumulators of `AUC`, `Precision` and `FalsePositives` have 2+ rows, so the
    `strategy` fixture's partitioner splits them into shards; `evaluate` on both workers
    must still count every batch, as single-process Keras does. Before the fix, Keras'
    `v.assign(v + delta)` on the shards lost concurrent updates (false positives
    [373, 228, 138] instead of [409, 256, 154])."""
    y_true = np.concatenate((np.zeros(512), np.ones(512))).astype("float32")[:, None]
    y_pred = np.concatenate((np.linspace(0, 1, 512),) * 2).astype("float32")[:, None]
    batches = tf.data.Dataset.from_tensor_slices((y_pred, y_true)).batch(16)

    def compile_identity():
        false_positives = keras.metrics.FalsePositives([0.2, 0.5, 0.7], name="false_positives")
        model = Identity()
        model.compile(loss="mse", metrics=[
            keras.metrics.AUC(name="auc"), keras.metrics.Precision([0.3, 0.6], name="precision"),
            false_positives])
        return model, false_positives

    expected = compile_identity()[0].evaluate(batches, verbose=0, return_dict=True)
    with strategy.scope():
        model, false_positives = compile_identity()
    assert len(false_positives.variables) == 2  # its one accumulator, in two shards
    logs = model.evaluate(batches, verbose=0, return_dict=True)
    np.testing.assert_array_equal(logs["false_positives"], expected["false_positives"])
    np.testing.assert_allclose(logs["precision"], expected["precision"], rtol=1e-6)
    assert logs["auc"] == pytest.approx(expected["auc"], abs=1e-6)
