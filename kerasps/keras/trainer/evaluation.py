"""`model.evaluate` under a kerasps strategy."""

from __future__ import annotations

import logging

import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import recovery
from kerasps.keras.trainer.checks import build, check_model
from kerasps.keras.trainer.dispatch import Window, reads_batch_logs, to_logs
from kerasps.keras.trainer.inputs import make_source, per_worker_dataset, require_finite
from kerasps.keras.trainer.steps import make_test_function, unpack_test_result
from kerasps.policy._validation import positive_int

# Times an evaluation without `steps` starts over after workers failed during it.
MAX_ATTEMPTS = 3

logger = logging.getLogger("kerasps")


class Evaluation:
    """An evaluation input built once and run any number of times (e.g. every epoch).

    Without `steps`, each worker reads its share of the data to the end and the
    metrics count every example once. A worker that fails and comes back reads
    its share again from the start (TensorFlow rebuilds its iterator), which
    would count examples twice: the evaluation then starts over (metrics reset,
    fresh iterators), up to `MAX_ATTEMPTS` times, and raises if workers keep
    failing rather than report inexact metrics.
    """

    def __init__(self, model, coordinator, source, steps, steps_argument="steps"):
        self.model = model
        self.coordinator = coordinator
        self.steps = steps
        if steps is None:
            require_finite(source, coordinator, steps_argument)
        self.per_worker = per_worker_dataset(coordinator, source, "evaluate")

    def run(self, callbacks=None, verbose="auto", return_dict=False):
        model = self.model
        build(model, self.per_worker)
        if not isinstance(callbacks, _keras.CallbackList):
            callbacks = _keras.CallbackList(
                callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                steps=self.steps, model=model)
        model.stop_evaluating = False
        callbacks.on_test_begin()
        failed = set()
        remove = _tf.observe_worker_failures(failed.add)
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                failed.clear()
                logs = self._run_once(callbacks)
                if self.steps is not None or not failed or model.stop_evaluating:
                    break
                workers = sorted(failed)
                if attempt == MAX_ATTEMPTS:
                    raise RuntimeError(
                        f"`evaluate` could not count every example once: workers {workers} "
                        f"failed during each of its {MAX_ATTEMPTS} attempts (a worker that "
                        "comes back reads its share of the data again from the start). "
                        "Pass `steps` to evaluate a fixed number of batches instead.")
                logger.warning("Evaluation starts over: workers %s failed during it and "
                               "read their data again from the start.", workers)
        finally:
            remove()
        logs = _keras.pythonify_logs(_keras.metrics_result_or_logs(model, logs))
        callbacks.on_test_end(logs)
        if return_dict:
            return logs
        return _keras.flatten_metrics_in_order(model, logs)

    def _run_once(self, callbacks):
        """One pass: resets the metrics, starts fresh iterators and returns the last logs."""
        model, coordinator = self.model, self.coordinator
        spe = model.steps_per_execution
        # Results only where they are needed: the steps each function ran (an evaluation
        # to the data's end), or a callback reading each batch's logs.
        results = self.steps is None or reads_batch_logs(callbacks, "test")
        test_function = make_test_function(model, results)
        iterator = iter(self.per_worker)
        if coordinator.tracing:
            coordinator.set_trace_phase("eval", spe)
        model.reset_metrics()
        window = Window(coordinator)
        exhausted = set()
        scheduled = done = 0
        logs = {}

        def deliver(results):
            nonlocal done, logs
            for requested, result in results:
                if result is None:  # a function without results ran its steps
                    count, batch_logs = requested, {}
                else:
                    count, worker, result = unpack_test_result(model, result)
                    if count < requested:  # this worker's dataset has run out
                        exhausted.add(worker)
                    if count:
                        logs = batch_logs = to_logs(result)
                if count:
                    callbacks.on_test_batch_begin(done)
                    done += count
                    callbacks.on_test_batch_end(done - 1, batch_logs)

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
            if not results:
                logs = dict(model.get_metrics_result())  # read on the ps tasks
        except BaseException as error:
            window.abandon()
            recovery.raise_if_ps_lost(error, model, "evaluate")
            raise
        return logs


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """`model.evaluate` under a kerasps strategy; arguments as in `keras.Model.evaluate`."""
    check_model(model, "evaluate")
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    from kerasps.runtime.coordinator import ClusterCoordinator

    if x is None:
        raise ValueError("Invalid value for argument `x`: evaluation data is required. "
                         "Received: x=None")
    steps = positive_int("steps", steps, allow_none=True)
    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = make_source(x, y, sample_weight, batch_size, shuffle=False, training=False,
                         strategy=coordinator.strategy)
    evaluation = Evaluation(model, coordinator, source, steps)
    return evaluation.run(callbacks=callbacks, verbose=verbose, return_dict=return_dict)
