"""The `tf.function`s scheduled on the workers: training, test and predict steps."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import staleness
from kerasps.keras.trainer.dispatch import Window


def step_functions(model) -> dict:
    """The model's traced step functions, forgotten when `compile()` runs again.

    `compile` creates a new optimizer, loss and metrics container; functions
    traced with the old ones would keep updating them. The cache is set with
    `object.__setattr__`: Keras' `Layer.__setattr__` would store a tracked copy
    of the dict, and functions added to this one would be lost (traced again
    by every `fit`).
    """
    key = (id(getattr(model, "optimizer", None)), id(getattr(model, "_compile_loss", None)),
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


def _packed(outputs, cache, keys="packed_keys"):
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
    cache[keys] = tuple(values)
    return {PACKED_LOGS: tf.stack([tf.cast(v, tf.float64) for v in values.values()])}


def unpack(model, result, keys="packed_keys"):
    """A fetched step function's result with its packed logs as a dict again (`keys`:
    where `_packed` noted their names)."""
    if isinstance(result, dict) and PACKED_LOGS in result:
        names = step_functions(model)[keys]
        return dict(zip(names, result[PACKED_LOGS].tolist()))
    return result


# The names of a test function's step count and worker among its packed outputs.
DONE, WORKER = "_kerasps_done", "_kerasps_worker"


def unpack_test_result(model, result):
    """A fetched test function's `(steps run, worker index, logs)`."""
    outputs = dict(unpack(model, result, keys="test_packed_keys"))
    return int(outputs.pop(DONE)), int(outputs.pop(WORKER)), outputs


def _unrolled(model) -> int:
    return max(1, int(getattr(model, "unrolled_steps_per_execution", 1) or 1))


def counts_as_tensor(model) -> bool:
    """True if the training functions take their step count as a tensor argument:
    with `steps_per_execution > 1` and no unrolling, every step runs in the function's
    `tf.while_loop`, so one trace serves every count (an epoch's remainder included)
    and a run of zero steps trains nothing (`prepare`)."""
    return model.steps_per_execution > 1 and _unrolled(model) == 1


def train_arguments(model, iterator, steps: int) -> tuple:
    """The arguments to schedule `make_train_function(model, ...)` with, for `steps`
    steps."""
    if not counts_as_tensor(model):
        return (iterator, steps)
    counts = step_functions(model).setdefault("counts", {})
    if steps not in counts:
        with tf.init_scope():
            counts[steps] = tf.constant(steps, tf.int32)
    return (iterator, counts[steps])


def make_train_function(model, with_logs=True):
    """The function scheduled to run `steps` training steps on a worker.

    With `with_logs=False` it returns nothing: its result needs no copy to the
    coordinator and no fetch, for the steps whose logs no callback reads. The
    steps themselves (and the metric updates on the ps) are the same. Schedule
    it with `train_arguments(model, iterator, steps)`.
    """
    cache = step_functions(model)
    name = "train" if with_logs else "train_without_logs"
    if name in cache:
        return cache[name]
    strategy = model.distribute_strategy
    unrolled = _unrolled(model)
    dynamic = counts_as_tensor(model)

    @tf.autograph.experimental.do_not_convert
    def train_function(iterator, steps):
        def run(count, outputs=None):
            for _ in range(count):
                outputs = strategy.run(staleness.measured(model, model.train_step, cache),
                                       args=(next(iterator),))
                outputs = _keras.reduce_per_replica(outputs, strategy, reduction="auto")
                # The logs' keys, known once traced (`logs_are_metrics`).
                cache["logs_keys"] = tuple(outputs) if isinstance(outputs, dict) else None
            return outputs

        def loop(count, chunk):
            def body(i):
                run(chunk)
                return i + 1

            tf.while_loop(lambda i: i < count, body, (tf.constant(0),))

        if dynamic:
            # `steps` is a tensor: every step but one returning logs runs in the loop.
            loop(steps - 1 if with_logs else steps, 1)
            return _packed(run(1), cache) if with_logs else None
        # `steps` is a Python int: one trace per value (`steps_per_execution` and an
        # epoch's remainder). A `tf.while_loop` runs Keras'
        # `model.unrolled_steps_per_execution` steps per iteration (default 1): an
        # iteration's body runs as a function of its own on the worker and on every
        # ps task, which costs more than the steps of a small model.
        chunk = min(unrolled, steps)
        loops, rest = divmod(steps, chunk)
        # With logs, the last chunk runs after the loop and returns them: a loop that
        # carried them would compute them in every iteration, reading the metrics on the
        # ps tasks every step. A single chunk needs no loop.
        looped = loops - 1 if with_logs or loops == 1 else loops
        if looped:
            loop(looped, chunk)
        outputs = run(chunk) if looped < loops else None
        outputs = run(rest, outputs)
        return _packed(outputs, cache) if with_logs else None

    cache[name] = tf.function(train_function, reduce_retracing=True)
    return cache[name]


def logs_are_metrics(model) -> bool:
    """True if the logs of the model's training step are its metrics' results (Keras'
    `train_step`): the epoch's logs are then read from the metrics, and no step needs
    to return its own. Known once a training function is traced."""
    cache = step_functions(model)
    if "logs_are_metrics" not in cache:
        keys = cache.get("logs_keys")
        cache["logs_are_metrics"] = keys is not None and (
            set(keys) - {staleness.STALENESS} == set(model.get_metrics_result()))
    return cache["logs_are_metrics"]


def prepare(coordinator, model, iterator) -> bool:
    """Before a `fit`'s first step: traces the function its steps run without logs, and
    instantiates it on every worker that has not run it yet.

    A worker instantiates a function the first time it runs it (it optimizes its
    graph and sends its parts to the ps tasks: about as long as tracing it), so a
    `fit` whose first function without logs ran on a worker that had not run it
    paid that inside its first steps (a short `fit`, all of whose functions return
    logs, then a longer one). Where the step count is a tensor
    (`counts_as_tensor`), a run of zero steps instantiates it and trains nothing.
    A worker that does not answer, or a run that fails, is left for the first
    step (which then meets the same failure, and `fit`'s recovery with it).

    Returns:
        `logs_are_metrics(model)`.
    """
    function = make_train_function(model, with_logs=False)
    _tf.trace_for_workers(coordinator.strategy, function,
                          train_arguments(model, iterator, model.steps_per_execution))
    if counts_as_tensor(model):
        warm = step_functions(model).setdefault("warm_workers", set())
        runs = [(worker, coordinator.schedule_on(
                    worker, function, train_arguments(model, iterator, 0)))
                for worker in coordinator.running_workers() if worker not in warm]
        for _, remote in runs:
            coordinator.untraced(remote)
        try:
            coordinator.join()
            warm.update(worker for worker, _ in runs)
        except (tf.errors.OpError, *_tf.CLOSURE_ERRORS):
            Window(coordinator).abandon()  # and the errors of the other runs
    return logs_are_metrics(model)


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


def make_test_function(model, results=True):
    """The model's test function: runs up to `steps` test steps on a worker's iterator.

    With `results`, it returns the steps it ran, the worker's index and the metrics'
    results (one packed tensor); without, nothing: where the caller knows how many steps
    to run and no callback reads a batch's logs, the metrics are read on the ps tasks
    once at the end, and no result is copied from the worker (each copy keeps a few
    kilobytes there for good, docs/limitations.md).
    """
    cache = step_functions(model)
    key = "test" if results else "test_without_results"
    if key in cache:
        return cache[key]
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
        if not results:
            return None
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        # One tensor where the metrics are scalars: each tensor of a result is read
        # from the worker on its own, and TensorFlow keeps a few kilobytes on the
        # worker per read (docs/limitations.md).
        return _packed({DONE: done, WORKER: worker, **model.get_metrics_result()}, cache,
                       keys="test_packed_keys")

    cache[key] = tf.function(test_function, reduce_retracing=True)
    return cache[key]


def make_predict_function(model, empty_outputs):
    """The model's predict function for outputs shaped as `empty_outputs` (one per
    output structure, kept with the other step functions).

    Kept, not traced per call: every new function that reads an iterator on a
    worker in TensorFlow's inter-op threads leaves a thread there for good (each
    `IteratorGetNext`-like kernel owns a `BackgroundWorker` thread, and the
    worker keeps the kernels of a function the coordinator removed), so a
    `predict` per call in a long process (a notebook, a test suite) piled up one
    thread per worker per call, besides tracing and sending the function again.
    """
    cache = step_functions(model)
    key = ("predict", tuple((tuple(t.shape), t.dtype.name)
                            for t in tree.flatten(empty_outputs)))
    if key not in cache:
        cache[key] = _predict_function(model, empty_outputs)
    return cache[key]


def _predict_function(model, empty_outputs):
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
