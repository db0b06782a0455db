"""`model.fit` under a kerasps strategy."""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np
import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import elastic, recovery, staleness
from kerasps.keras.trainer.checks import build, check_model
from kerasps.keras.trainer.dispatch import Window, reads_batch_logs, to_logs
from kerasps.keras.trainer.evaluation import Evaluation
from kerasps.keras.trainer.inputs import (
    is_array_like,
    make_source,
    per_worker_dataset,
    total_batches,
)
from kerasps.keras.trainer.steps import (
    make_train_function,
    make_train_to_end_function,
    prepare,
    step_functions,
    train_arguments,
    unpack,
)
from kerasps.keras.trainer.sync import SyncSteps
from kerasps.policy._validation import positive_int
from kerasps.policy.consistency import StalenessBound
from kerasps.policy.failures import Progress

_log = logging.getLogger("kerasps")


def iterations_of(model):
    optimizer = model.optimizer
    return None if optimizer is None or not optimizer.built else int(optimizer.iterations.numpy())


def _record_epoch_counts(model, history, epoch, iterations_before, steps, rerun):
    """Reports in the History the epoch's steps that ran twice and those run again
    after restoring a backup.

    Scheduled functions run at least once: one whose worker failed before its
    result reached the coordinator runs again elsewhere, and the steps it had
    already applied count twice in `optimizer.iterations` (a counter on the ps
    that every applied step increments). `history.history["reexecuted_steps"]`
    holds one count per epoch; `history.history["rolled_back_steps"]` the steps
    run again after a lost ps task's state was restored from a backup.
    """
    after = iterations_of(model)
    count = 0 if iterations_before is None or after is None else max(
        0, after - iterations_before - steps)
    if history is not None:
        history.history.setdefault("reexecuted_steps", []).append(count)
        history.history.setdefault("rolled_back_steps", []).append(rerun)
    if count:
        _log.warning("Epoch %d: %d step(s) ran twice: a worker failed before its results "
                     "reached the coordinator (training is at-least-once).", epoch + 1, count)


def _known(total):
    return total if total is not None and total > 0 else None


def _everyone_ended(ended, pool):
    """True once every worker's input has ended, or every worker still answering
    (a worker that failed for good holds no data any more), as `pool` last saw them."""
    if not ended:
        return False
    return all(i in ended or i not in pool.running for i in range(pool.spec.max_workers))


def _results_so_far(window):
    """After a function found the end of exactly-once input: the results of those
    that ran their step, in order; the others (input ended, or cancelled with the
    queue) ran none. Clears the coordinator's error."""
    results = []
    for tag, remote in list(window.pending):
        try:
            results.append((tag, remote.fetch()))
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError, *_tf.CLOSURE_ERRORS):
            pass
    window.abandon()
    return results


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """`model.fit` under a kerasps strategy; arguments as in `keras.Model.fit`."""
    check_model(model, "fit")
    from kerasps.runtime.coordinator import ClusterCoordinator

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
    source = make_source(x, y, sample_weight, batch_size, shuffle, training=True,
                         strategy=coordinator.strategy, steps=steps_per_epoch)
    per_worker = per_worker_dataset(coordinator, source, "train")
    to_end = per_worker.exactly_once  # an epoch is one pass over the data
    if to_end and model.distribute_strategy.consistency.sync:
        raise ValueError(
            "Invalid value for argument `x`: exactly-once input (a tf.data service job "
            "per epoch) is not supported with `mode='sync'` yet; give `steps_per_epoch` or "
            "`kerasps.InputOptions(exactly_once=False)`. Received: x="
            f"{type(x).__name__} read exactly once")
    if steps_per_epoch is None and not to_end:
        total = total_batches(source, coordinator)
        if total is None or total == tf.data.INFINITE_CARDINALITY or total == 0:
            kind = {None: "of unknown size", tf.data.INFINITE_CARDINALITY: "infinite",
                    0: "empty"}[total]
            raise ValueError(
                "Invalid value for argument `steps_per_epoch`: it is required when the "
                f"training dataset is {kind} (an epoch is `steps_per_epoch` steps over all "
                "workers). Received: steps_per_epoch=None")
        steps_per_epoch = total

    build(model, per_worker)
    validation = None
    if validation_data is not None:
        val_x, val_y, val_sw = _keras.unpack_x_y_sample_weight(validation_data) if (
            isinstance(validation_data, (list, tuple))) else (validation_data, None, None)
        validation = Evaluation(model, coordinator, make_source(
            val_x, val_y, val_sw, validation_batch_size or (batch_size if is_array_like(val_x)
                                                             else None),
            shuffle=False, training=False, strategy=coordinator.strategy,
            arg="validation_data"), validation_steps,
            steps_argument="validation_steps")

    if not isinstance(callbacks, _keras.CallbackList):
        callbacks = _keras.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
            epochs=epochs, steps=steps_per_epoch or _known(source.total_batches), model=model)

    spe = model.steps_per_execution
    consistency = model.distribute_strategy.consistency
    staleness.hide_from_progress_bar(callbacks, staleness.meaningless(
        consistency.sync, model.distribute_strategy.num_workers))
    if consistency.sync and spe > 1:
        warnings.warn(
            f"`steps_per_execution={spe}` is not used in synchronous mode: every global step "
            "waits for the workers' gradients, one step at a time.", stacklevel=2)
    iterator = None if to_end else per_worker.persistent_iterator()
    per_worker.reading = not to_end
    renewed_at = None  # (epoch, step) where the input pipelines were last rebuilt
    retried_at, retries = None, 0  # (epoch, step) of the last recovery; recoveries there
    backup = recovery.Backup.of(callbacks)
    # Functions that return logs run where a callback reads them, and where the step's
    # logs are not the metrics' results (a custom `train_step`): at an epoch's ends.
    custom_logs = True
    if not to_end and not consistency.sync:
        custom_logs = not prepare(coordinator, model, iterator)
    model.stop_training = False
    callbacks.on_train_begin()
    initial_epoch = model._initial_epoch or initial_epoch
    # A restarted coordinator goes on from the step its latest backup recorded.
    resumed = backup.progress() if backup is not None else None
    if resumed is not None and resumed.epoch >= initial_epoch:
        initial_epoch = resumed.epoch
    position = Progress(initial_epoch, resumed.step if (
        resumed is not None and resumed.epoch == initial_epoch) else 0)
    tracing = coordinator.tracing
    training_logs = None
    logs = {}
    batch_logs = reads_batch_logs(callbacks)

    def deliver(results):
        """Records the progress of delivered results; calls `on_train_batch_end`."""
        nonlocal logs, done, position
        for end, result in results:
            done = end + 1
            position = Progress(epoch, done)
            if result is not None:
                logs = to_logs(unpack(model, result))
                if isinstance(logs, dict):
                    logs = {**logs, **({staleness.STALENESS: 0.0} if consistency.sync else {}),
                            staleness.DROPPED: dropped}
            if batch_logs:
                callbacks.on_train_batch_end(end, logs)

    def deliver_counted(results):
        """`deliver` for exactly-once input: results tagged None are one plain step's;
        the others' functions (tagged with the steps asked for) return how many steps
        they ran and which worker's input ended."""
        for requested, outputs in results:
            if requested is None:
                deliver([(done, outputs)])
                continue
            count, worker, *result = outputs
            count, result = int(count), (result[0] if result else None)
            if count < requested:
                ended.add(int(worker))
            if count:
                deliver([(done + count - 1, result)])

    def train_what_readers_hold():
        """After the data ended on a worker: each worker trains on the batches its reader
        still holds, until it finds the end too (or no longer answers)."""
        for worker in range(coordinator.num_workers):
            while worker not in ended:
                if not _tf.task_alive("worker", worker):
                    ended.add(worker)
                    break
                remote = coordinator.schedule_on(
                    worker, make_train_to_end_function(model, with_logs=True), (iterator, 1))
                deliver_counted([(1, remote.fetch())])

    origin = None  # (epoch, optimizer iterations before its first step)

    def backed_up():
        """The progress a backup written now records: with repeated input, the steps
        of the epoch that its weights hold, those applied ahead of the delivered ones
        included (they are not run again after a restore: each kill repeats at most
        the steps applied while the weights are read)."""
        applied = iterations_of(model)
        if to_end or origin is None or origin[0] != position.epoch or applied is None:
            return position
        ahead = min(applied - origin[1], steps_per_epoch)
        return Progress(position.epoch, max(position.step, ahead))

    pool = elastic.watcher(coordinator)
    with backup.recording(backed_up) if backup else contextlib.nullcontext(), (
            pool.running()), _tf.quiet_end_of_input() if to_end else contextlib.nullcontext():
        if backup is not None:
            backup.save()  # there is always a backup to go back to
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            staleness.reset(model, step_functions(model))
            dropped = 0  # gradients of this epoch a sync step did not use
            callbacks.on_epoch_begin(epoch)
            if tracing:
                coordinator.set_trace_phase("train", spe)
            step = done = position.step if position.epoch == epoch else 0
            iterations_before, counted_from, rerun = iterations_of(model), step, 0
            if iterations_before is not None:
                origin = (epoch, iterations_before - counted_from)
            if to_end:
                iterator, ended = iter(per_worker), set()  # a new pass over the data
            while True:
                window = Window(coordinator, steps=spe, bound=None if (
                    consistency.max_staleness is None) else StalenessBound(
                        consistency.max_staleness))
                synchronous = SyncSteps.of_model(model, coordinator) if (
                    consistency.sync) else None
                first = True
                try:
                    while to_end and not model.stop_training and not (
                            steps_per_epoch is not None and step >= steps_per_epoch) and not (
                            _everyone_ended(ended, pool.membership)):
                        n = spe if steps_per_epoch is None else min(spe, steps_per_epoch - step)
                        pool.wait_for_quorum()
                        callbacks.on_train_batch_begin(done)
                        if n == 1 and not ended:
                            # Plain steps until the data ends (a step inside a `tf.cond`
                            # costs a function call on every ps task), then each worker
                            # trains on what its reader still holds.
                            try:
                                window.schedule(make_train_function(model, batch_logs or first),
                                                train_arguments(model, iterator, 1), None)
                                step, first = step + 1, False
                                deliver_counted(window.ready())
                            except tf.errors.OutOfRangeError:
                                deliver_counted(_results_so_far(window))
                                train_what_readers_hold()
                            continue
                        window.schedule(make_train_to_end_function(model, batch_logs or first),
                                        (iterator, n), n, steps=n)
                        step, first = step + n, False
                        deliver_counted(window.ready())
                    while synchronous is not None and (
                            step < steps_per_epoch and not model.stop_training):
                        pool.wait_for_quorum()
                        callbacks.on_train_batch_begin(step)
                        with_logs = batch_logs or first or step + 1 == steps_per_epoch
                        results, lost = synchronous.run(
                            (iterator,), epoch * steps_per_epoch + step, with_logs)
                        dropped += lost
                        step, first = step + 1, False
                        deliver([(step - 1, results[-1])])
                    while not to_end and step < steps_per_epoch and not model.stop_training:
                        n = min(spe, steps_per_epoch - step)
                        pool.wait_for_quorum()
                        callbacks.on_train_batch_begin(step)
                        with_logs = batch_logs or custom_logs and (
                            first or step + n == steps_per_epoch)
                        window.schedule(make_train_function(model, with_logs),
                                        train_arguments(model, iterator, n),
                                        step + n - 1, steps=n)
                        step, first = step + n, False
                        deliver(window.ready())
                    if to_end:
                        deliver_counted(window.drain())
                        step = done
                        if not logs:  # no function returning logs ran a step: short data
                            logs = model.get_metrics_result()
                    deliver(window.drain())
                    if synchronous is not None:
                        synchronous.drain()
                    epoch_logs = dict(_keras.metrics_result_or_logs(
                        model, staleness.without_counts(logs)) if custom_logs else (
                            model.get_metrics_result()))
                    epoch_logs.update(staleness.epoch_logs(model, step_functions(model)))
                    epoch_logs[staleness.DROPPED] = dropped
                    break
                except tf.errors.OutOfRangeError:
                    window.abandon()
                    if epoch == initial_epoch and done == 0 and renewed_at is None:
                        # Nothing was read: the input is empty (Keras warns and stops).
                        warnings.warn(
                            "Your input ran out of data; interrupting training. Make sure "
                            "that your dataset can generate at least `steps_per_epoch * "
                            "epochs` batches.", stacklevel=2)
                        model.stop_training = True
                        epoch_logs = dict(_keras.metrics_result_or_logs(model, logs))
                        break
                    # Training input is repeated, so it cannot run out: a pipeline
                    # rebuilt after a restart ended. Rebuild them all, once per step.
                    if renewed_at == (epoch, done):
                        raise RuntimeError(
                            f"A worker's training input ended at epoch {epoch + 1} step "
                            f"{done}, and again after every worker's input pipeline was "
                            "rebuilt, although kerasps repeats training input: the dataset "
                            "yields no elements on a later pass (files removed while "
                            "training?).") from None
                    _log.warning("A worker's training input ended at epoch %d step %d although "
                                 "it is repeated (after a restart?); rebuilding every worker's "
                                 "input pipeline.", epoch + 1, done)
                    iterator = per_worker.renew_persistent_iterator()
                    renewed_at, step = (epoch, done), done
                except BaseException as error:
                    window.abandon()
                    retries = retries + 1 if retried_at == (epoch, done) else 0
                    position = recovery.recover(error, model, backup, epoch, done,
                                                retried=retries, scheduled=step)
                    retried_at = (epoch, done)
                    window.abandon()  # errors of functions that failed meanwhile
                    # The restored counters are the backup's: `iterations_before` still
                    # holds, and `position` counts the steps the backup had applied.
                    rerun += max(0, done - position.step)
                    if to_end and done > position.step:
                        _log.warning(
                            "Epoch %d: the %d step(s) rolled back read exactly-once input that "
                            "is not read again: this epoch misses their batches.", epoch + 1,
                            done - position.step)
                    step = done = position.step
            if validation is not None and _keras.should_eval(model, epoch, validation_freq):
                val_logs = validation.run(callbacks=callbacks, verbose=0, return_dict=True)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            history = _keras.history_of(callbacks)
            _record_epoch_counts(model, history, epoch, iterations_before, step - counted_from,
                                 rerun)
            if history is not None:  # the pool at the epoch's end
                history.history.setdefault("workers", []).append(pool.running_workers)
            position = Progress(epoch + 1, 0)
            callbacks.on_epoch_end(epoch, epoch_logs)
            if backup is not None:
                backup.save_at_epoch_end()
            training_logs = epoch_logs
            if model.stop_training:
                break
    per_worker.reading = False
    if model.optimizer is not None and epochs > 0:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    callbacks.on_train_end(logs=training_logs)
    return model.history
