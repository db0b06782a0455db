"""`model.predict` under a kerasps strategy."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree

from kerasps.backend import _keras
from kerasps.keras.trainer import recovery
from kerasps.keras.trainer.checks import check_model
from kerasps.keras.trainer.dispatch import Window
from kerasps.keras.trainer.inputs import make_source, per_worker_dataset, require_finite
from kerasps.keras.trainer.steps import make_predict_function
from kerasps.policy._validation import positive_int


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """`model.predict` under a kerasps strategy; arguments as in `keras.Model.predict`.

    Returns NumPy arrays (in the structure of the model's outputs): the
    predictions of the input's first `steps` batches (all of them without
    `steps`), each once, in input order. A `kerasps.DatasetCreator` is read as
    one pipeline, as tf_keras' `predict` read it: its `dataset_fn` is called
    once, with `InputContext(num_input_pipelines=1, input_pipeline_id=0)`,
    whether or not it shards by its context; see `kerasps.keras.trainer`.
    """
    check_model(model, "predict")
    from kerasps.runtime.coordinator import ClusterCoordinator

    steps = positive_int("steps", steps, allow_none=True)
    coordinator = ClusterCoordinator(model.distribute_strategy)
    source = make_source(x, None, None, batch_size, shuffle=False, training=False,
                         strategy=coordinator.strategy, predicting=True)
    if steps is None:
        require_finite(source, coordinator, "steps")

    per_worker = per_worker_dataset(coordinator, source, "predict")
    # Computing the output spec also builds an unbuilt model (its layers only:
    # prediction needs no loss, metrics or optimizer, and has no `y` to build them).
    x_spec = per_worker.info.element_spec[1]
    empty_outputs = tree.map_structure(
        lambda t: tf.zeros([0] + list(t.shape[1:]), dtype=t.dtype),
        _keras.compute_output_spec(model, x_spec))
    predict_function = make_predict_function(model, empty_outputs)
    if not isinstance(callbacks, _keras.CallbackList):
        callbacks = _keras.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose,
                                        epochs=1, steps=steps, model=model)
    if coordinator.tracing:
        coordinator.set_trace_phase("predict", 1)
    iterator = iter(per_worker)
    window = Window(coordinator)
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
            # Function k runs on worker k mod W, whose batches are k, k + W, ...: with
            # `steps`, the results are the dataset's first `steps` batches.
            window.schedule(predict_function, (iterator,), scheduled,
                            worker=scheduled % coordinator.num_workers)
            scheduled += 1
            deliver(window.ready())
        deliver(window.drain())
    except BaseException as error:
        window.abandon()
        recovery.raise_if_ps_lost(error, model, "predict")
        raise
    callbacks.on_predict_end()
    if not batches:
        raise ValueError("Invalid value for argument `x`: the dataset yielded no batches. "
                         f"Received: x={x!r:.100}")
    ordered = [batches[k] for k in sorted(batches)]
    return tree.map_structure_up_to(ordered[0], lambda *parts: np.concatenate(parts), *ordered)
