"""`model.fit`, `evaluate` and `predict` for Keras models built under a kerasps strategy.

Keras' own TensorFlow trainer runs each step with `strategy.run` on the
coordinator; under parameter-server training steps must instead be scheduled
on the workers. These functions replace `fit`, `evaluate`, `predict` and the
`*_on_batch` methods for models whose strategy is a
`kerasps.ParameterServerStrategy` (the dispatch lives in `kerasps._keras`);
every other model keeps Keras' code.

How a `fit` runs:

* Each worker builds its own input pipeline (see `kerasps.input`) once per
  `DatasetCreator` and keeps one iterator over it; training input is
  repeated, so an epoch is `steps_per_epoch` steps taken by whichever workers
  are free, and a later `fit` with the same `DatasetCreator` continues the
  stream where the previous one stopped.
* A scheduled function runs `steps_per_execution` training steps on a worker.
  The coordinator keeps a bounded number of functions in flight
  (`STEPS_IN_FLIGHT_PER_WORKER` per worker) and, as results arrive, calls
  `on_train_batch_end` in step order with the running metrics: batch-level
  callbacks and a live progress bar work, at most a window behind the workers.
  `on_train_batch_begin` is called when a step is scheduled.
* Metrics live on the ps tasks and every worker updates them, so epoch logs,
  read on the coordinator after the epoch's steps finish, aggregate all
  workers exactly.

Inputs accepted for `x`:

* `kerasps.DatasetCreator` (or a callable taking an `InputContext`);
* a batched `tf.data.Dataset`: worker `i` reads the batches `k` with
  `k % num_workers == i`; `steps_per_epoch` defaults to its cardinality;
* arrays (NumPy, tensors, or dicts/lists of them) with `y`, `sample_weight`
  and `batch_size` (default 32): converted to such a dataset; `fit`
  shuffles them each epoch unless `shuffle=False`;
* what the strategy's own `experimental_distribute_dataset(dataset)` and
  `distribute_datasets_from_function(fn, options)` return (code ported from
  tf_keras): read as `dataset` and as `DatasetCreator(fn, options)`.

A compiled model need not be built first: `fit`, `evaluate` and the
`*_on_batch` methods build it with its loss and metrics, `predict` and
`predict_on_batch` build its layers only (there are no targets).

`evaluate` and `predict` without `steps` run until every worker's dataset is
exhausted, visiting each element once; `predict` returns outputs in input
order (for a `DatasetCreator`, in the order of the workers' batches
interleaved: batch `j` of worker `i` is batch `j * num_workers + i`).
"""

from __future__ import annotations

import collections
import logging
import warnings

import numpy as np
import tensorflow as tf
from keras import tree

from kerasps import _keras, _tf, failures
from kerasps import input as input_lib
from kerasps._validation import positive_int

__all__ = ["fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
           "predict_on_batch", "uses_kerasps", "STEPS_IN_FLIGHT_PER_WORKER"]

# Scheduled functions kept in flight per worker: one running, one queued.
STEPS_IN_FLIGHT_PER_WORKER = 2
DEFAULT_BATCH_SIZE = 32


def uses_kerasps(model) -> bool:
    """True if `model` was built under a `kerasps.ParameterServerStrategy` scope."""
    strategy = getattr(model, "_distribute_strategy", None)
    return bool(getattr(strategy, "_is_kerasps", False))


# -- input ------------------------------------------------------------------------
def _is_array_like(x):
    if isinstance(x, (np.ndarray, tf.Tensor)) or tf.is_tensor(x):
        return True
    if isinstance(x, (list, tuple)) and x and all(_is_array_like(e) for e in x):
        return True
    if isinstance(x, dict) and x and all(_is_array_like(e) for e in x.values()):
        return True
    return False


class _Source:
    """One `x` argument made into a per-worker dataset function.

    Attributes:
        dataset_fn: `(input_context) -> tf.data.Dataset` for one worker.
        total_batches: the number of batches over all workers if known.
        options: `tf.distribute.InputOptions` of a `DatasetCreator`.
        creator: the user's `DatasetCreator`, whose pipelines are built once.
    """

    def __init__(self, dataset_fn, total_batches=None, options=None, creator=None):
        self.dataset_fn = dataset_fn
        self.total_batches = total_batches
        self.options = options
        self.creator = creator


def _require_none_with_batches(kind, arg, **values):
    """`y`, `sample_weight` and `batch_size` belong to arrays, not to batched inputs."""
    for name, value in values.items():
        if value is not None:
            raise ValueError(
                f"Invalid value for argument `{name}`: it must be None when `{arg}` is "
                f"a {kind} (it yields batches). Received: {name}={value!r:.100}")


def _make_source(x, y, sample_weight, batch_size, shuffle, training, arg="x"):
    x = input_lib.unwrap_distributed(x, arg)
    if isinstance(x, input_lib.DatasetCreator) or (
            callable(x) and not isinstance(x, tf.data.Dataset) and not _is_array_like(x)):
        _require_none_with_batches("`DatasetCreator`", arg, y=y, sample_weight=sample_weight,
                                   batch_size=batch_size)
        creator = x if isinstance(x, input_lib.DatasetCreator) else input_lib.DatasetCreator(x)
        return _Source(creator, options=creator.input_options, creator=creator)

    if isinstance(x, tf.data.Dataset):
        _require_none_with_batches("`tf.data.Dataset`", arg, y=y, sample_weight=sample_weight,
                                   batch_size=batch_size)
        dataset = x
    elif _is_array_like(x):
        batch_size = positive_int("batch_size", batch_size, allow_none=True) or DEFAULT_BATCH_SIZE
        data = tuple(v for v in (x, y, sample_weight) if v is not None)
        data = data[0] if len(data) == 1 else data
        dataset = tf.data.Dataset.from_tensor_slices(data)
        if training and shuffle:
            size = int(dataset.cardinality())
            dataset = dataset.shuffle(max(size, 1), reshuffle_each_iteration=True)
        dataset = dataset.batch(batch_size)
    else:
        raise ValueError(
            f"Invalid value for argument `{arg}`: under a kerasps strategy it must be a "
            "`kerasps.DatasetCreator`, a `tf.data.Dataset` or arrays (NumPy arrays, "
            f"tensors, or lists/dicts of them). Received: {arg}={type(x).__name__} "
            f"{x!r:.100}")

    graph = _tf.serialize_dataset(dataset)
    spec = dataset.element_spec
    cardinality = int(dataset.cardinality())

    def dataset_fn(context):
        batches = _tf.deserialize_dataset(graph, spec)
        return batches.shard(context.num_input_pipelines, context.input_pipeline_id)

    total = cardinality if cardinality >= 0 else None
    if cardinality == tf.data.INFINITE_CARDINALITY:
        total = tf.data.INFINITE_CARDINALITY
    return _Source(dataset_fn, total_batches=total)


_TRANSFORMS = {
    "train": lambda dataset: dataset.repeat(),
    "evaluate": None,
    "predict": lambda dataset: dataset.map(_only_inputs).enumerate(),
}


def _only_inputs(*element):
    if len(element) == 1:
        element = element[0]
    x, _, _ = _keras.unpack_x_y_sample_weight(element)
    return x


def _per_worker_dataset(coordinator, source, purpose):
    """Builds the per-worker pipelines of `source` for `purpose` ("train", "evaluate",
    "predict").

    The pipelines of a `DatasetCreator` are traced once per coordinator and
    purpose and reused by later `fit`/`evaluate`/`predict` calls (each call
    still starts fresh iterators); pass a new `DatasetCreator` to rebuild them.
    """
    cache = coordinator._dataset_cache.setdefault(source.creator, {}) if (
        source.creator is not None) else {}
    if purpose in cache:
        return cache[purpose]
    transform = _TRANSFORMS[purpose]

    def dataset_fn(context):
        dataset = input_lib.check_dataset(source.dataset_fn(context), source.dataset_fn)
        return transform(dataset) if transform is not None else dataset

    cache[purpose] = coordinator.create_per_worker_dataset(
        input_lib.DatasetCreator(dataset_fn, input_options=source.options))
    return cache[purpose]


def _total_batches(source, coordinator):
    if source.total_batches is not None:
        return source.total_batches
    counts = input_lib.cardinalities(coordinator.strategy, source.dataset_fn)
    if any(c == tf.data.INFINITE_CARDINALITY for c in counts):
        return tf.data.INFINITE_CARDINALITY
    if any(c is None for c in counts):
        return None
    return sum(counts)


def _require_finite(source, coordinator, argument):
    """Without a step count, evaluation and prediction read datasets to their end."""
    if _total_batches(source, coordinator) == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"Invalid value for argument `{argument}`: it is required when the dataset is "
            f"infinite (evaluation and prediction without `{argument}` read every worker's "
            f"dataset to its end). Received: {argument}=None")


def _build(model, per_worker):
    """Creates the model's, metrics' and optimizer's variables on the coordinator."""
    spec = per_worker.info.element_spec
    if spec is None:
        spec = per_worker.element_spec
    model._symbolic_build(data_batch=spec)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    _check_state_on_ps(model)


def _check_state_on_ps(model):
    """Metrics and optimizers created outside `strategy.scope()` hold their state on
    the coordinator, where concurrent updates from workers are lost: refuse them."""
    owners = [("metric", m) for m in model.metrics]
    if model.optimizer is not None:
        owners.append(("optimizer", model.optimizer))
    for kind, owner in owners:
        for variable in owner.variables:
            if not getattr(variable, "_kerasps_remote", False):
                raise ValueError(
                    f"Invalid {kind}: the variable {variable.path!r} was created outside "
                    "`strategy.scope()`, so it lives on the coordinator and concurrent "
                    "updates from workers would be lost. Create every metric and the "
                    f"optimizer inside `with strategy.scope():`. Received: {kind}={owner!r}")


def _check_model(model, method):
    if method != "predict":
        model._assert_compile_called(method)
    if getattr(model, "_run_eagerly", False):
        raise ValueError(
            "Invalid value for argument `run_eagerly` of `compile()`: parameter-server "
            "training schedules `tf.function`s on the workers and cannot run eagerly. "
            "Received: run_eagerly=True")


# -- scheduled functions ------------------------------------------------------------
def _functions(model) -> dict:
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


def _train_function(model):
    cache = _functions(model)
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


def _test_function(model):
    cache = _functions(model)
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


# -- dispatch -------------------------------------------------------------------------
class _Window:
    """Schedules functions with a bounded number in flight; delivers results in order."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.capacity = STEPS_IN_FLIGHT_PER_WORKER * coordinator.num_workers
        self.pending = collections.deque()

    def schedule(self, function, args, tag):
        self.pending.append((tag, self.coordinator.schedule(function, args=args)))

    def ready(self):
        """Yields `(tag, result)` for results that arrived, oldest first, blocking
        on the oldest while the window is full."""
        while self.pending and (len(self.pending) >= self.capacity
                                or _tf.remote_value_ready(self.pending[0][1])):
            tag, remote = self.pending.popleft()
            yield tag, remote.fetch()

    def drain(self):
        """Waits for everything scheduled; yields the remaining results in order."""
        self.coordinator.join()
        while self.pending:
            tag, remote = self.pending.popleft()
            yield tag, remote.fetch()

    def abandon(self):
        """After an error: wait for the functions still running, drop their results."""
        self.pending.clear()
        try:
            self.coordinator.join()
        except Exception:  # noqa: BLE001 - the first error is already being raised
            pass


def _raise_ps_failure(error, method):
    """Raises `PsTaskFailedError` from `error` if it is the loss of a ps task."""
    ps_task = failures.failed_ps_task(type(error).__name__, str(error))
    if ps_task is not None:
        raise failures.PsTaskFailedError(ps_task, method) from error


def _logs(values):
    return _keras.pythonify_logs(values) if isinstance(values, dict) else values


# -- fit ------------------------------------------------------------------------------
def _iterations(model):
    optimizer = model.optimizer
    return None if optimizer is None or not optimizer.built else int(optimizer.iterations.numpy())


def _record_reexecuted_steps(model, history, epoch, iterations_before, steps):
    """Counts the epoch's steps that ran twice and reports them in the History.

    Scheduled functions run at least once: one whose worker failed before its
    result reached the coordinator runs again elsewhere, and the steps it had
    already applied count twice in `optimizer.iterations` (a counter on the ps
    that every applied step increments). `history.history["reexecuted_steps"]`
    holds one count per epoch.
    """
    after = _iterations(model)
    count = 0 if iterations_before is None or after is None else max(
        0, after - iterations_before - steps)
    if history is not None:
        history.history.setdefault("reexecuted_steps", []).append(count)
    if count:
        logging.warning("Epoch %d: %d step(s) ran twice: a worker failed before its results "
                        "reached the coordinator (training is at-least-once).", epoch + 1, count)


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`model.fit` under a kerasps strategy; arguments as in `keras.Model.fit`."""
    _check_model(model, "fit")
    from kerasps.coordinator import ClusterCoordinator

    if x is None:
        raise ValueError("Invalid value for argument `x`: training data is required. "
                         "Received: x=None")
    if validation_split:
        raise ValueError(
            "Invalid value for argument `validation_split`: it is not supported under a "
            "kerasps strategy; pass `validation_data` instead. Received: "
            f"validation_split={validation_split!r}")
    if class_weight is not None:
        raise ValueError(
            "Invalid value for argument `class_weight`: it is not supported under a "
            "kerasps strategy; weight samples in the dataset instead. Received: "
            f"class_weight={class_weight!r}")
    epochs = positive_int("epochs", epochs)
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, (int, np.integer)) or (
            initial_epoch < 0):
        raise ValueError("Invalid value for argument `initial_epoch`: it must be an integer "
                         f">= 0. Received: initial_epoch={initial_epoch!r}")
    steps_per_epoch = positive_int("steps_per_epoch", steps_per_epoch, allow_none=True)
    validation_steps = positive_int("validation_steps", validation_steps, allow_none=True)
    validation_freq = positive_int("validation_freq", validation_freq)

    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = _make_source(x, y, sample_weight, batch_size, shuffle, training=True)
    per_worker = _per_worker_dataset(coordinator, source, "train")
    if steps_per_epoch is None:
        total = _total_batches(source, coordinator)
        if total is None or total == tf.data.INFINITE_CARDINALITY or total == 0:
            kind = {None: "of unknown size", tf.data.INFINITE_CARDINALITY: "infinite",
                    0: "empty"}[total]
            raise ValueError(
                "Invalid value for argument `steps_per_epoch`: it is required when the "
                f"training dataset is {kind} (an epoch is `steps_per_epoch` steps over all "
                "workers). Received: steps_per_epoch=None")
        steps_per_epoch = total

    _build(model, per_worker)
    validation = None
    if validation_data is not None:
        val_x, val_y, val_sw = _keras.unpack_x_y_sample_weight(validation_data) if (
            isinstance(validation_data, (list, tuple))) else (validation_data, None, None)
        validation = _Evaluation(model, coordinator, _make_source(
            val_x, val_y, val_sw, validation_batch_size or (batch_size if _is_array_like(val_x)
                                                             else None),
            shuffle=False, training=False, arg="validation_data"), validation_steps,
            steps_argument="validation_steps")

    if not isinstance(callbacks, _keras.CallbackList):
        callbacks = _keras.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch, model=model)

    spe = model.steps_per_execution
    train_function = _train_function(model)
    iterator = per_worker.persistent_iterator()
    model.stop_training = False
    callbacks.on_train_begin()
    initial_epoch = model._initial_epoch or initial_epoch
    tracing = coordinator.tracing
    training_logs = None
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        iterations_before = _iterations(model)
        callbacks.on_epoch_begin(epoch)
        if tracing:
            coordinator.set_trace_phase("train", spe)
        window = _Window(coordinator)
        step = 0
        try:
            while step < steps_per_epoch and not model.stop_training:
                n = min(spe, steps_per_epoch - step)
                callbacks.on_train_batch_begin(step)
                window.schedule(train_function, (iterator, n), step + n - 1)
                step += n
                for end, result in window.ready():
                    logs = _logs(result)
                    callbacks.on_train_batch_end(end, logs)
            for end, result in window.drain():
                logs = _logs(result)
                callbacks.on_train_batch_end(end, logs)
        except tf.errors.OutOfRangeError:
            window.abandon()
            warnings.warn(
                "Your input ran out of data; interrupting training. Make sure that your "
                "dataset can generate at least `steps_per_epoch * epochs` batches.",
                stacklevel=2)
            model.stop_training = True
        except BaseException as error:
            window.abandon()
            _raise_ps_failure(error, "fit")
            raise
        epoch_logs = dict(_keras.metrics_result_or_logs(model, logs))
        if validation is not None and _keras.should_eval(model, epoch, validation_freq):
            val_logs = validation.run(callbacks=callbacks, verbose=0, return_dict=True)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        _record_reexecuted_steps(model, _keras.history_of(callbacks), epoch, iterations_before,
                                 step)
        callbacks.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    if model.optimizer is not None and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history


# -- evaluate -------------------------------------------------------------------------
class _Evaluation:
    """An evaluation input built once and run any number of times (e.g. every epoch)."""

    def __init__(self, model, coordinator, source, steps, steps_argument="steps"):
        self.model = model
        self.coordinator = coordinator
        self.steps = steps
        if steps is None:
            _require_finite(source, coordinator, steps_argument)
        self.per_worker = _per_worker_dataset(coordinator, source, "evaluate")

    def run(self, callbacks=None, verbose="auto", return_dict=False):
        model, coordinator = self.model, self.coordinator
        _build(model, self.per_worker)
        if not isinstance(callbacks, _keras.CallbackList):
            callbacks = _keras.CallbackList(
                callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                steps=self.steps, model=model)
        spe = model.steps_per_execution
        test_function = _test_function(model)
        iterator = iter(self.per_worker)
        if coordinator.tracing:
            coordinator.set_trace_phase("eval", spe)
        model.stop_evaluating = False
        callbacks.on_test_begin()
        model.reset_metrics()
        window = _Window(coordinator)
        exhausted = set()
        scheduled = done = 0
        logs = {}

        def deliver(results):
            nonlocal done, logs
            for requested, (count, worker, result) in results:
                count = int(count)
                if count < requested:  # this worker's dataset has run out
                    exhausted.add(int(worker))
                if count:
                    callbacks.on_test_batch_begin(done)
                    done += count
                    logs = _logs(result)
                    callbacks.on_test_batch_end(done - 1, logs)

        try:
            while not model.stop_evaluating:
                if self.steps is not None and scheduled >= self.steps:
                    break
                if self.steps is None and len(exhausted) == coordinator.num_workers:
                    break
                n = spe if self.steps is None else min(spe, self.steps - scheduled)
                window.schedule(test_function, (iterator, tf.constant(n)), n)
                scheduled += n
                deliver(window.ready())
            deliver(window.drain())
        except BaseException as error:
            window.abandon()
            _raise_ps_failure(error, "evaluate")
            raise
        logs = _keras.pythonify_logs(_keras.metrics_result_or_logs(model, logs))
        callbacks.on_test_end(logs)
        if return_dict:
            return logs
        return _keras.flatten_metrics_in_order(model, logs)


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """`model.evaluate` under a kerasps strategy; arguments as in `keras.Model.evaluate`."""
    _check_model(model, "evaluate")
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    from kerasps.coordinator import ClusterCoordinator

    if x is None:
        raise ValueError("Invalid value for argument `x`: evaluation data is required. "
                         "Received: x=None")
    steps = positive_int("steps", steps, allow_none=True)
    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = _make_source(x, y, sample_weight, batch_size, shuffle=False, training=False)
    evaluation = _Evaluation(model, coordinator, source, steps)
    return evaluation.run(callbacks=callbacks, verbose=verbose, return_dict=return_dict)


# -- predict --------------------------------------------------------------------------
def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`model.predict` under a kerasps strategy; arguments as in `keras.Model.predict`.

    Returns NumPy arrays (in the structure of the model's outputs) in input
    order; see the module docstring for `DatasetCreator` inputs.
    """
    _check_model(model, "predict")
    from kerasps.coordinator import ClusterCoordinator

    steps = positive_int("steps", steps, allow_none=True)
    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = _make_source(x, None, None, batch_size, shuffle=False, training=False)
    if steps is None:
        _require_finite(source, coordinator, "steps")

    per_worker = _per_worker_dataset(coordinator, source, "predict")
    # Computing the output spec also builds an unbuilt model (its layers only:
    # prediction needs no loss, metrics or optimizer, and has no `y` to build them).
    x_spec = per_worker.info.element_spec[1]
    empty_outputs = tree.map_structure(
        lambda t: tf.zeros([0] + list(t.shape[1:]), dtype=t.dtype),
        _keras.compute_output_spec(model, x_spec))
    predict_function = _predict_function(model, empty_outputs)
    if not isinstance(callbacks, _keras.CallbackList):
        callbacks = _keras.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose,
                                        epochs=1, steps=steps, model=model)
    if coordinator.tracing:
        coordinator.set_trace_phase("predict", 1)
    iterator = iter(per_worker)
    window = _Window(coordinator)
    exhausted = set()
    batches = {}
    scheduled = 0
    model.stop_predicting = False
    callbacks.on_predict_begin()

    def deliver(results):
        for _, (index, worker, outputs) in results:
            index, worker = int(index), int(worker)
            if index < 0:
                exhausted.add(worker)
                continue
            key = (index, worker)  # batch `index` of worker `worker`: input order
            callbacks.on_predict_batch_begin(len(batches))
            batches[key] = tree.map_structure(np.asarray, outputs)
            callbacks.on_predict_batch_end(len(batches) - 1, {"outputs": outputs})

    try:
        while not model.stop_predicting:
            if steps is not None and scheduled >= steps:
                break
            if steps is None and len(exhausted) == coordinator.num_workers:
                break
            window.schedule(predict_function, (iterator,), scheduled)
            scheduled += 1
            deliver(window.ready())
        deliver(window.drain())
    except BaseException as error:
        window.abandon()
        _raise_ps_failure(error, "predict")
        raise
    callbacks.on_predict_end()
    if not batches:
        raise ValueError("Invalid value for argument `x`: the dataset yielded no batches. "
                         f"Received: x={x!r:.100}")
    ordered = [batches[k] for k in sorted(batches)]
    return tree.map_structure_up_to(ordered[0], lambda *parts: np.concatenate(parts), *ordered)


# -- single batches -------------------------------------------------------------------
def _run_on_batch(model, kind, data):
    from kerasps.coordinator import ClusterCoordinator

    strategy = model.distribute_strategy
    coordinator = ClusterCoordinator(strategy)
    cache = _functions(model)
    function = cache.get(f"{kind}_on_batch")
    if function is None:
        step = {"train": model.train_step, "test": model.test_step,
                "predict": model.predict_step}[kind]

        def on_batch(data):
            outputs = strategy.run(step, args=(data,))
            reduction = "concat" if kind == "predict" else "auto"
            return _keras.reduce_per_replica(outputs, strategy, reduction=reduction)

        function = cache[f"{kind}_on_batch"] = tf.function(on_batch, reduce_retracing=True)
    return coordinator.fetch(coordinator.schedule(function, args=(data,)))


def _batch_data(x, y, sample_weight):
    if x is None:
        raise ValueError("Invalid value for argument `x`: a batch is required. Received: x=None")
    data = tuple(v for v in (x, y, sample_weight) if v is not None)
    data = tree.map_structure(tf.convert_to_tensor, data)
    return data[0] if len(data) == 1 else data


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    """`model.train_on_batch` under a kerasps strategy: one step on some worker."""
    _check_model(model, "train_on_batch")
    if class_weight is not None:
        raise ValueError("Invalid value for argument `class_weight`: not supported under a "
                         f"kerasps strategy. Received: class_weight={class_weight!r}")
    data = _batch_data(x, y, sample_weight)
    model._symbolic_build(data_batch=data)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    logs = _keras.pythonify_logs(_run_on_batch(model, "train", data))
    return logs if return_dict else _keras.flatten_metrics_in_order(model, logs)


def test_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """`model.test_on_batch` under a kerasps strategy: one step on some worker."""
    _check_model(model, "test_on_batch")
    data = _batch_data(x, y, sample_weight)
    model._symbolic_build(data_batch=data)
    logs = _keras.pythonify_logs(_run_on_batch(model, "test", data))
    return logs if return_dict else _keras.flatten_metrics_in_order(model, logs)


def predict_on_batch(model, x):
    """`model.predict_on_batch` under a kerasps strategy: one batch on some worker."""
    data = _batch_data(x, None, None)
    _keras.compute_output_spec(model, tree.map_structure(tf.TensorSpec.from_tensor, data))
    outputs = _run_on_batch(model, "predict", (data,))
    return tree.map_structure(np.asarray, outputs)
