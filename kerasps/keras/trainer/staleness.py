"""Staleness of applied gradients, measured on the ps tasks, and the logs that report it.

A gradient's staleness is the number of updates applied between the read of
`optimizer.iterations` at the start of its step and its own update. Every
training step adds its staleness and a count of 1 to a two-element counter
on the ps task of `optimizer.iterations` (one `assign_add` there per step);
with several workers in async mode `fit` reports the epoch's mean as
`staleness` in the batch and epoch logs; in sync mode it reports
`dropped_gradients` (gradients a step did not use) instead. A strategy made
with `measure_staleness=False` has no counter: its steps do not update it and
its logs have no `staleness`.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from kerasps.backend import _keras, _tf

STALENESS = "staleness"
DROPPED = "dropped_gradients"


def meaningless(sync: bool, num_workers: int, hybrid: bool = False,
                backup_workers: int = 0) -> set:
    """The counts `fit` leaves out of its logs (batch and epoch logs, so also the
    progress bar and the History), as they cannot be other than 0: `staleness` in
    sync mode (each gradient is applied to the weights it was computed on) and with
    one worker (it runs one step at a time); `dropped_gradients` in async mode
    (every gradient is applied). Hybrid mode (`sync` too) has both with backup
    workers: the staleness of its row updates, in global steps, and the dense
    gradients it dropped; without, neither (a global step waits for every worker's
    gradient, so no row update is applied after a step it did not see).
    (Sync mode keeps `dropped_gradients` without backup workers, 0, as it always has.)"""
    hidden = set()
    if sync and not hybrid or num_workers == 1 or hybrid and not backup_workers:
        hidden.add(STALENESS)
    if not sync or hybrid and not backup_workers:
        hidden.add(DROPPED)
    return hidden


def without_counts(logs):
    """`logs` without the two counts (Keras compares their keys to the metrics')."""
    if not isinstance(logs, dict):
        return logs
    return {k: v for k, v in logs.items() if k not in (STALENESS, DROPPED)}


def measuring(model) -> bool:
    """Whether `model`'s steps add their staleness to its counter (the strategy's
    `measure_staleness`)."""
    return model.distribute_strategy.consistency.measure_staleness


def counter(model, cache):
    """The model's `[sum of staleness, applied gradients]` counter on the ps task of
    `optimizer.iterations`.

    Kept with the traced step functions, so that it is made again, with them,
    after `compile` and after a lost ps task is restored (its resource went
    with the task): `cache` is the model's `steps.step_functions(model)`, handed
    in because `steps` imports this module.
    """
    if "staleness" not in cache:
        iterations = _keras.tf_variable(model.optimizer.iterations)
        with tf.init_scope():  # state on the ps task, also when first asked while tracing
            cache["staleness"] = _tf.variable_on(iterations.device, tf.zeros([2], tf.float64))
    return cache["staleness"]


def reset(model, cache):
    if measuring(model):
        counter(model, cache).assign(tf.zeros([2], tf.float64))


def epoch_logs(model, cache, dropped: int) -> dict:
    """The counts of an epoch that mean something (see `meaningless`): `staleness`
    (the epoch's mean; not without `measure_staleness`), `dropped_gradients`
    (`dropped`, in sync mode)."""
    strategy = model.distribute_strategy
    hidden = meaningless(strategy.consistency.sync, strategy.num_workers,
                         strategy.consistency.hybrid, strategy.backup_workers)
    logs = {}
    if STALENESS not in hidden and measuring(model):
        total, count = counter(model, cache).numpy()
        logs[STALENESS] = float(total / count) if count else 0.0
    if DROPPED not in hidden:
        logs[DROPPED] = dropped
    return logs


@contextlib.contextmanager
def apply_replaced(optimizer, apply):
    """While a step function is traced, `optimizer.apply` (and so `apply_gradients`,
    which calls it) is `apply(grads, trainable_variables=None)`.

    An instance attribute, set with `object.__setattr__` so that Keras does not
    track it, and removed afterwards: the optimizer stays plain Keras.
    """
    object.__setattr__(optimizer, "apply", apply)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "apply")


def measured(model, train_step, cache):
    """`train_step` that adds its gradient's staleness to the model's counter.

    Used while the step function is traced: it reads `optimizer.iterations`
    first and again just before `optimizer.apply` updates the variables.
    `train_step` itself when not `measuring`.
    """
    if not measuring(model):
        return train_step
    optimizer = model.optimizer
    staleness = counter(model, cache)
    iterations = _keras.tf_variable(optimizer.iterations)
    original_apply = optimizer.apply

    def step(data):
        with tf.device(staleness.device):  # the value stays on that ps task
            read_at = iterations.read_value()

        def apply(grads, trainable_variables=None):
            grads = list(grads)
            count(staleness, iterations, read_at, grads)
            return original_apply(grads, trainable_variables)

        with apply_replaced(optimizer, apply):
            outputs = train_step(data)
        if isinstance(outputs, dict):
            outputs = {**outputs, **mean_of(staleness)}
        return outputs

    return step


def count(counter, iterations, read_at, gradients):
    """Adds the staleness of `gradients` (the updates counted in `iterations` since it
    read `read_at`, read again once they are computed) and a count of 1 to `counter`."""
    computed = [g.values if isinstance(g, tf.IndexedSlices) else g
                for g in gradients if g is not None]
    # Read again once the gradients exist, not as soon as the function starts.
    with tf.device(counter.device), tf.control_dependencies(computed):
        behind = tf.cast(iterations.read_value() - read_at, tf.float64)
        counter.assign_add(tf.stack([behind, tf.constant(1.0, tf.float64)]))


def mean_of(counter) -> dict:
    """`{"staleness": the mean staleness counted in `counter` so far}`, as a tensor."""
    total, applied = tf.unstack(counter.read_value())
    return {STALENESS: tf.math.divide_no_nan(total, applied)}
