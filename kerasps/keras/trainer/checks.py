"""Building a model's state on the ps tasks, and the checks every call makes first."""

from __future__ import annotations

from kerasps.backend import _keras


def build(model, per_worker):
    """Creates the model's, metrics' and optimizer's variables on the coordinator."""
    spec = per_worker.info.element_spec
    if spec is None:
        spec = per_worker.element_spec
    model._symbolic_build(data_batch=spec)
    build_optimizer(model)
    _check_state_on_ps(model)


def build_optimizer(model):
    """Builds the model's optimizer, if not yet, with the variables it trains: not the
    tables that train with optimizers of their own (keras-rs tables)."""
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(_keras.trained_by(model.optimizer, model.trainable_variables))


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


def check_model(model, method):
    if method != "predict":
        model._assert_compile_called(method)
    if getattr(model, "_run_eagerly", False):
        raise ValueError(
            "Invalid value for argument `run_eagerly` of `compile()`: parameter-server "
            "training schedules `tf.function`s on the workers and cannot run eagerly. "
            "Received: run_eagerly=True")
