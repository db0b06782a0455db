"""`train_on_batch`, `test_on_batch` and `predict_on_batch`: one step on some worker."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree

from kerasps.backend import _keras
from kerasps.keras.trainer import checks
from kerasps.keras.trainer.checks import check_model
from kerasps.keras.trainer.steps import step_functions


def _run_on_batch(model, kind, data):
    from kerasps.runtime.coordinator import ClusterCoordinator

    strategy = model.distribute_strategy
    coordinator = ClusterCoordinator(strategy)
    cache = step_functions(model)
    function = cache.get(f"{kind}_on_batch")
    if function is None:
        step = {"train": model.train_step, "test": model.test_step,
                "predict": model.predict_step}[kind]

        def on_batch(data):
            outputs = strategy.run(step, args=(data,))
            reduction = "concat" if kind == "predict" else "auto"
            return _keras.reduce_per_replica(outputs, strategy, reduction=reduction)

        function = cache[f"{kind}_on_batch"] = tf.function(on_batch, reduce_retracing=True)
    remote = coordinator.schedule(function, args=(data,))
    coordinator.join()  # raises this call's error, and clears it for the next call
    return coordinator.fetch(remote)


def _batch_data(x, y, sample_weight):
    if x is None:
        raise ValueError("Invalid value for argument `x`: a batch is required. Received: x=None")
    data = tuple(v for v in (x, y, sample_weight) if v is not None)
    data = tree.map_structure(tf.convert_to_tensor, data)
    return data[0] if len(data) == 1 else data


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    """`model.train_on_batch` under a kerasps strategy: one step on some worker."""
    check_model(model, "train_on_batch")
    if class_weight is not None:
        raise ValueError("Invalid value for argument `class_weight`: not supported under a "
                         f"kerasps strategy. Received: class_weight={class_weight!r}")
    data = _batch_data(x, y, sample_weight)
    model._symbolic_build(data_batch=data)
    checks.build_optimizer(model)
    logs = _keras.pythonify_logs(_run_on_batch(model, "train", data))
    return logs if return_dict else _keras.flatten_metrics_in_order(model, logs)


def test_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """`model.test_on_batch` under a kerasps strategy: one step on some worker."""
    check_model(model, "test_on_batch")
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
