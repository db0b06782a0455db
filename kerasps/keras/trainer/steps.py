"""The `tf.function`s scheduled on the workers: training, test and predict steps."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from kerasps.backend import _keras
from kerasps.keras.trainer import staleness


def step_functions(model) -> dict:
    """The model's traced step functions, forgotten when `compile()` runs again.

    `compile` creates a new optimizer, loss and metrics container; functions
    traced with the old ones would keep updating them. The cache is set with
    `object.__setattr__`: Keras' `Layer.__setattr__` would store a tracked copy
    of the dict, and functions added to this one would be lost (traced again
    by every `fit`).
    """
    key = (id(model.optimizer), id(getattr(model, "_compile_loss", None)),
           id(getattr(model, "_compile_metrics", None)), model.steps_per_execution,
           getattr(model, "unrolled_steps_per_execution", 1))
    cache = getattr(model, "_kerasps_functions", None)
    if cache is None or cache.get("key") != key:
        cache = {"key": key}
        object.__setattr__(model, "_kerasps_functions", cache)
    return cache


def forget_step_functions(model):
    """Makes the next call trace the step functions again (after variables got new
    resources: traced functions hold the old ones)."""
    object.__setattr__(model, "_kerasps_functions", None)


# The key of a training function's logs packed into one tensor (see `_packed`).
PACKED_LOGS = "_kerasps_packed_logs"


def _packed(outputs, cache):
    """A step function's logs as one float64 vector, when they are all scalars.

    Each output tensor of a scheduled function is copied to the coordinator
    on its own (a transfer from the worker every function); one vector is one
    copy. `unpack` restores the dict: the values are those Keras' log
    conversion gives (`float(value)`), since a cast to float64 is exact for
    floats and rounds integers as `float` does. Other outputs are left as they are.
    """
    if not isinstance(outputs, dict) or not outputs:
        return outputs
    values = {key: tf.convert_to_tensor(value) if not isinstance(value, dict) else value
              for key, value in outputs.items()}
    if not all(isinstance(v, tf.Tensor) and v.shape.rank == 0 and (
            v.dtype.is_floating or v.dtype.is_integer or v.dtype.is_bool)
               for v in values.values()):
        return outputs
    cache["packed_keys"] = tuple(values)
    return {PACKED_LOGS: tf.stack([tf.cast(v, tf.float64) for v in values.values()])}


def unpack(model, result):
    """A fetched training function's result with its packed logs as a dict again."""
    if isinstance(result, dict) and PACKED_LOGS in result:
        keys = step_functions(model)["packed_keys"]
        return dict(zip(keys, result[PACKED_LOGS].tolist()))
    return result


def make_train_function(model, with_logs=True):
    """The function scheduled to run `steps` training steps on a worker.

    With `with_logs=False` it returns nothing: its result needs no copy to the
    coordinator and no fetch, for the steps whose logs no callback reads. The
    steps themselves (and the metric updates on the ps) are the same.
    """
    cache = step_functions(model)
    name = "train" if with_logs else "train_without_logs"
    if name in cache:
        return cache[name]
    strategy = model.distribute_strategy
    unrolled = max(1, int(getattr(model, "unrolled_steps_per_execution", 1) or 1))

    @tf.autograph.experimental.do_not_convert
    def train_function(iterator, steps: int):
        # `steps` is a Python int: one trace per value (`steps_per_execution` and an
        # epoch's remainder). A `tf.while_loop` runs Keras'
        # `model.unrolled_steps_per_execution` steps per iteration (default 1): an
        # iteration's body runs as a function of its own on the worker and on every
        # ps task, which costs more than the steps of a small model.
        def run(count, outputs=None):
            for _ in range(count):
                outputs = strategy.run(staleness.measured(model, model.train_step, cache),
                                       args=(next(iterator),))
                outputs = _keras.reduce_per_replica(outputs, strategy, reduction="auto")
            return outputs

        chunk = min(unrolled, steps)
        loops, rest = divmod(steps, chunk)
        # With logs, the last chunk runs after the loop and returns them: a loop that
        # carried them would compute them in every iteration, reading the metrics on the
        # ps tasks every step. A single chunk needs no loop.
        looped = loops - 1 if with_logs or loops == 1 else loops
        if looped:
            def body(i):
                run(chunk)
                return i + 1

            tf.while_loop(lambda i: i < looped, body, (tf.constant(0),))
        outputs = run(chunk) if looped < loops else None
        outputs = run(rest, outputs)
        return _packed(outputs, cache) if with_logs else None

    cache[name] = tf.function(train_function, reduce_retracing=True)
    return cache[name]


def make_train_to_end_function(model, with_logs=True):
    """The function scheduled to run up to `steps` training steps on a worker whose
    input may end (exactly-once input: the epoch ends with the data).

    Returns `(steps_run, worker_index, logs)`, without `logs` if not `with_logs`:
    fewer steps than asked for mean that the worker's input has ended.
    """
    cache = step_functions(model)
    name = "train_to_end" if with_logs else "train_to_end_without_logs"
    if name in cache:
        return cache[name]
    strategy = model.distribute_strategy
    counter = staleness.counter(model, cache) if staleness.measuring(model) else None

    @tf.autograph.experimental.do_not_convert
    def train_function(iterator, steps: int):
        # Each step runs inside a `tf.cond`, a function call on every ps task: `fit`
        # uses this only for the last batches of an epoch and `steps_per_execution > 1`.
        step = staleness.measured(model, model.train_step, cache)
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()

        def body(i, done, more):
            optional = iterator.get_next_as_optional()

            def run():
                strategy.run(step, args=(optional.get_value(),))
                return tf.constant(1)

            ran = tf.cond(optional.has_value(), run, lambda: tf.constant(0))
            return i + 1, done + ran, optional.has_value()

        _, done, _ = tf.while_loop(lambda i, done, more: tf.logical_and(i < steps, more),
                                   body, (tf.constant(0), tf.constant(0), tf.constant(True)))
        if not with_logs:
            return done, worker
        with tf.control_dependencies([done]):
            logs = model.get_metrics_result()
            if counter is not None:
                total, count = tf.unstack(counter.read_value())
                logs = {**logs, staleness.STALENESS: tf.math.divide_no_nan(total, count)}
            return done, worker, logs

    cache[name] = tf.function(train_function, reduce_retracing=True)
    return cache[name]


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
