"""`model.evaluate` under a kerasps strategy."""

from __future__ import annotations

import tensorflow as tf

from kerasps.backend import _keras
from kerasps.keras.trainer import recovery
from kerasps.keras.trainer.checks import build, check_model
from kerasps.keras.trainer.dispatch import Window, to_logs
from kerasps.keras.trainer.inputs import make_source, per_worker_dataset, require_finite
from kerasps.keras.trainer.steps import make_test_function
from kerasps.policy._validation import positive_int


class Evaluation:
    """An evaluation input built once and run any number of times (e.g. every epoch)."""

    def __init__(self, model, coordinator, source, steps, steps_argument="steps"):
        self.model = model
        self.coordinator = coordinator
        self.steps = steps
        if steps is None:
            require_finite(source, coordinator, steps_argument)
        self.per_worker = per_worker_dataset(coordinator, source, "evaluate")

    def run(self, callbacks=None, verbose="auto", return_dict=False):
        model, coordinator = self.model, self.coordinator
        build(model, self.per_worker)
        if not isinstance(callbacks, _keras.CallbackList):
            callbacks = _keras.CallbackList(
                callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                steps=self.steps, model=model)
        spe = model.steps_per_execution
        test_function = make_test_function(model)
        iterator = iter(self.per_worker)
        if coordinator.tracing:
            coordinator.set_trace_phase("eval", spe)
        model.stop_evaluating = False
        callbacks.on_test_begin()
        model.reset_metrics()
        window = Window(coordinator)
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
                    logs = to_logs(result)
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
            recovery.raise_if_ps_lost(error, model, "evaluate")
            raise
        logs = _keras.pythonify_logs(_keras.metrics_result_or_logs(model, logs))
        callbacks.on_test_end(logs)
        if return_dict:
            return logs
        return _keras.flatten_metrics_in_order(model, logs)


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
