"""The `tf.function`s scheduled on the workers: training, test and predict steps."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from kerasps import _keras


def step_functions(model) -> dict:
    """The model's traced step functions, forgotten when `compile()` runs again.

    `compile` creates a new optimizer, loss and metrics container; functions
    traced with the old ones would keep updating them.
    """
    key = (id(model.optimizer), id(getattr(model, "_compile_loss", None)),
           id(getattr(model, "_compile_metrics", None)), model.steps_per_execution)
    cache = getattr(model, "_kerasps_functions", None)
    if cache is None or cache.get("key") != key:
        cache = model._kerasps_functions = {"key": key}
    return cache


def forget_step_functions(model):
    """Makes the next call trace the step functions again (after variables got new
    resources: traced functions hold the old ones)."""
    model._kerasps_functions = None


def make_train_function(model):
    cache = step_functions(model)
    if "train" in cache:
        return cache["train"]
    strategy = model.distribute_strategy

    def one_step(data):
        outputs = strategy.run(model.train_step, args=(data,))
        return _keras.reduce_per_replica(outputs, strategy, reduction="auto")

    @tf.autograph.experimental.do_not_convert
    def train_function(iterator, steps: int):
        # `steps` is a Python int: one trace per value (`steps_per_execution` and an
        # epoch's remainder), and a single step needs no loop.
        outputs = one_step(next(iterator))
        if steps == 1:
            return outputs

        def body(i, outputs):
            return i + 1, one_step(next(iterator))

        _, outputs = tf.while_loop(lambda i, _: i < steps, body, (tf.constant(1), outputs))
        return outputs

    cache["train"] = tf.function(train_function, reduce_retracing=True)
    return cache["train"]


def make_test_function(model):
    cache = step_functions(model)
    if "test" in cache:
        return cache["test"]
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def test_function(iterator, steps):
        def body(i, done, more):
            optional = iterator.get_next_as_optional()

            def run():
                strategy.run(model.test_step, args=(optional.get_value(),))
                return tf.constant(1)

            ran = tf.cond(optional.has_value(), run, lambda: tf.constant(0))
            return i + 1, done + ran, optional.has_value()

        _, done, _ = tf.while_loop(lambda i, done, more: tf.logical_and(i < steps, more),
                                   body, (tf.constant(0), tf.constant(0), tf.constant(True)))
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return done, worker, model.get_metrics_result()

    cache["test"] = tf.function(test_function, reduce_retracing=True)
    return cache["test"]


def make_predict_function(model, empty_outputs):
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def predict_function(iterator):
        optional = iterator.get_next_as_optional()

        def run():
            index, data = optional.get_value()
            outputs = strategy.run(model.predict_step, args=(data,))
            outputs = _keras.reduce_per_replica(outputs, strategy, reduction="concat")
            return tf.cast(index, tf.int64), outputs

        def empty():
            return tf.constant(-1, tf.int64), tree.map_structure(tf.identity, empty_outputs)

        index, outputs = tf.cond(optional.has_value(), run, empty)
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return index, worker, outputs

    return tf.function(predict_function, reduce_retracing=True)
