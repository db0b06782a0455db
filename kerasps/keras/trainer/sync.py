"""Synchronous global steps with backup workers: gradient slots on the ps tasks.

A global step schedules one gradient function per idle worker. Each runs the
model's `train_step` with `optimizer.apply` redirected: instead of updating
the variables it writes its gradients to a slot of its own, next to each
variable on its ps task. The coordinator keeps the first
`num_workers - backup_workers` gradients to arrive from distinct workers
(`kerasps.consistency.SyncStep`), then schedules the apply function, which
averages the kept slots on the ps tasks and hands the mean to the optimizer:
one update per global step, `optimizer.iterations` counting global steps.
Gradients still computing when the step is applied are dropped when they
arrive; their slots are reused only then, so no write ever races a read.

A slot holds a gradient in the form the model gives it (`_Slots`): the row
update of an embedding table moves the rows of its batch only, as in async
mode.

In hybrid mode (`mode="hybrid"`) the gradient function applies the row
updates of embedding tables itself, as soon as they are computed, as an async
step would (without counting a step in `optimizer.iterations`, which counts
global steps), and writes only the dense gradients to slots: a late worker's
dense gradient is dropped, its row updates are not. Which variables update on
arrival is `consistency.updated_on_arrival`: those whose gradient is a row
update, unless `update_on_arrival` says otherwise for the variable or its
layer.
"""

from __future__ import annotations

import time

import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.keras.trainer import elastic, staleness
from kerasps.keras.trainer.steps import step_functions
from kerasps.policy.consistency import ON_ARRIVAL, SyncStep, updated_on_arrival


class _Slots:
    """Gradient slots of one trainable variable, on its ps task, made when the gradient
    function is first traced (the gradient's form is known then).

    * A dense gradient goes to row `slot` of one `[count, *shape]` buffer: one
      scatter to write, one gather to read the kept slots.
    * A row update (`tf.IndexedSlices`, rows repeated as often as the batch
      looks them up) goes to a one-element queue per slot: a batch touches a
      number of rows known only when it runs, variables of unknown shape
      cannot live on a remote task, and a queue takes memory only while it
      holds a gradient. It stays a row update, so the optimizer sees what
      Keras would give it for the concatenated batch. A shard of a sharded
      table always takes this form (a buffer would be `count` tables); a
      dense gradient of one becomes the update of all its rows.
    """

    def __init__(self, variable, count):
        tf_variable = _keras.tf_variable(variable)
        self.device = tf_variable.device
        self.shape = tf_variable.shape
        self.dtype = tf_variable.dtype
        self.count = count
        self.table = hasattr(variable, "_kerasps_container")
        self.rows = None  # whether gradients are row updates: known once traced
        self.buffer = None
        self.queues = None

    def _make(self):
        with tf.init_scope():  # state on the ps task, not in the traced function
            if self.rows:
                with _tf.no_colocation(), tf.device(self.device):
                    self.queues = [tf.queue.FIFOQueue(1, [tf.int64, self.dtype])
                                   for _ in range(self.count)]
            else:
                self.buffer = _tf.variable_on(
                    self.device, tf.zeros([self.count, *self.shape], self.dtype))

    def write(self, slot, gradient):
        if self.table and not isinstance(gradient, tf.IndexedSlices):
            gradient = tf.IndexedSlices(tf.convert_to_tensor(gradient), tf.range(self.shape[0]))
        self.rows = isinstance(gradient, tf.IndexedSlices)
        if self.buffer is None and self.queues is None:
            self._make()
        with tf.device(self.device):
            if not self.rows:
                gradient = tf.convert_to_tensor(gradient, self.dtype)
                self.buffer.scatter_update(tf.IndexedSlices(gradient[None], slot[None]))
                return
            indices = tf.cast(gradient.indices, tf.int64)
            values = tf.cast(gradient.values, self.dtype)

            def writer(queue):
                def write():
                    # A dropped gradient is still queued: the slot's new writer takes
                    # it out first (the slot is its own until it finishes).
                    stale = tf.cond(queue.size() > 0, lambda: tf.size(queue.dequeue()[0]),
                                    lambda: tf.constant(0))
                    with tf.control_dependencies([stale]):
                        queue.enqueue([indices, values])
                    return tf.constant(0)
                return write

            tf.switch_case(slot, [writer(q) for q in self.queues])

    def mean(self, slots, count):
        """The mean of the gradients in `slots` (a `[count]` tensor), computed on the ps."""
        with tf.device(self.device):
            if not self.rows:
                return tf.reduce_sum(tf.gather(self.buffer, slots), axis=0) / count
            parts = [tf.switch_case(slots[j], [q.dequeue for q in self.queues])
                     for j in range(count)]
            indices = tf.concat([p[0] for p in parts], axis=0)
            values = tf.concat([p[1] for p in parts], axis=0) / count
            return tf.IndexedSlices(values, indices, dense_shape=tf.constant(
                self.shape.as_list(), tf.int64))


def _on_arrival(mode, gradient, variable) -> bool:
    """Whether `variable`'s `gradient` updates it on arrival (see `update_on_arrival`)."""
    override = None
    for holder in (variable, getattr(variable, "_kerasps_container", None)):
        if getattr(holder, ON_ARRIVAL, None) is not None:
            override = getattr(holder, ON_ARRIVAL)
            break
    row_update = isinstance(gradient, tf.IndexedSlices) or hasattr(
        variable, "_kerasps_container")
    return updated_on_arrival(mode, row_update, override)


class GradientSlots:
    """Slots for the gradients a step asks the optimizer to apply, `count` of each,
    made for each variable when the gradient function is traced."""

    def __init__(self, count):
        self.count = count
        self.slots = {}  # id(variable) -> _Slots
        self.variables = None  # as the traced step handed them to the optimizer
        self.none = set()  # variables without a gradient (not in the loss)

    def write(self, slot, grads, variables):
        self.variables = variables
        for gradient, variable in zip(grads, variables):
            if gradient is None:
                self.none.add(id(variable))
                continue
            if id(variable) not in self.slots:
                self.slots[id(variable)] = _Slots(variable, self.count)
            self.slots[id(variable)].write(slot, gradient)

    def means(self, slots, count):
        return [None if id(v) in self.none else self.slots[id(v)].mean(slots, count)
                for v in self.variables]


def sync_functions(strategy, optimizer, step, num_slots, needed, counter=None):
    """The gradient and apply functions of a synchronous (or hybrid) step.

    Args:
        strategy: the kerasps strategy.
        optimizer: the Keras optimizer `step` updates the variables with.
        step: a Python function `step(*args)` running one training step on a
            worker, which hands its gradients to `optimizer.apply_gradients`
            (or `apply`); traced with that call redirected to the slots.
        num_slots: slots per variable.
        needed: gradients averaged per step.
        counter: hybrid mode: the staleness counter of the row updates applied on
            arrival (`staleness.counter`), or `None` to measure none.

    Returns:
        `({with_logs: gradient function}, apply function, GradientSlots)`:
        a gradient function takes `(slot, *args)` and returns `step`'s outputs
        (or nothing); the apply function takes the kept slots and returns nothing.
    """
    slots = GradientSlots(num_slots)
    mode = strategy.consistency.mode
    iterations = _keras.tf_variable(optimizer.iterations)

    def gradient_function(with_logs):
        @tf.autograph.experimental.do_not_convert
        def compute(slot, *args):
            read_at = None
            if counter is not None:
                with tf.device(counter.device):  # the global step the weights are read at
                    read_at = iterations.read_value()

            def write(grads, trainable_variables=None):
                grads = list(grads)
                variables = list(trainable_variables or _keras.variables_updated_by(optimizer))
                now = [_on_arrival(mode, g, v) if g is not None else False
                       for g, v in zip(grads, variables)]
                if any(now):  # hybrid: the row updates, applied as they are
                    _keras.build_for(optimizer, variables)
                    arrived = [g for g, n in zip(grads, now) if n]
                    if read_at is not None:
                        staleness.count(counter, iterations, read_at, arrived)
                    _keras.apply_uncounted(optimizer, arrived,
                                           [v for v, n in zip(variables, now) if n])
                # The other gradients go to the slot instead of updating the variables.
                slots.write(slot, [g for g, n in zip(grads, now) if not n],
                            [v for v, n in zip(variables, now) if not n])
                return optimizer.iterations

            with staleness.apply_replaced(optimizer, write):
                outputs = step(*args)
            if not with_logs:
                return None  # the coordinator knows the worker
            if counter is not None and isinstance(outputs, dict):
                outputs = {**outputs, **staleness.mean_of(counter)}
            return outputs

        return tf.function(compute, reduce_retracing=True)

    @tf.autograph.experimental.do_not_convert
    def apply(kept):
        def update():
            if slots.variables:
                optimizer.apply(slots.means(kept, needed), slots.variables)
            else:  # hybrid, every variable updated on arrival: the global step still counts
                optimizer.iterations.assign_add(1)

        # Nothing returned: a result copied to the chief keeps a kernel on the worker for
        # good (TensorFlow's kernel cache); the closure's fetch waits for the update.
        strategy.run(update)

    return ({True: gradient_function(True), False: gradient_function(False)},
            tf.function(apply), slots)


class SyncSteps:
    """Runs synchronous global steps of one step function; for `fit`, one instance per
    epoch attempt.

    Every worker computes one gradient per global step (its function is
    scheduled on it with `ClusterCoordinator.schedule_on`; if the worker
    fails, TensorFlow runs the function on another one). A worker still busy
    with a dropped gradient of an earlier step gets no function until it is
    free, unless the step would then be short of gradients.

    Args:
        coordinator: the `kerasps.ClusterCoordinator` of a sync strategy.
        optimizer: the Keras optimizer `step` applies gradients with.
        step: `step(*args)`, one training step on a worker (see `sync_functions`).
        cache: a dict to keep the traced functions in (`None`: this instance's).
        counter: hybrid mode: the staleness counter of the row updates applied on
            arrival, or `None`.
    """

    def __init__(self, coordinator, optimizer, step, cache=None, counter=None):
        strategy = coordinator.strategy
        self.coordinator = coordinator
        self.num_workers = coordinator.num_workers
        self.needed = self.num_workers - strategy.backup_workers
        self.timeout = strategy.step_timeout
        cache = {} if cache is None else cache
        if strategy.consistency.hybrid:
            _keras.check_apply_uncounted(optimizer)
        if "sync" not in cache:
            cache["sync"] = sync_functions(strategy, optimizer, step, 2 * self.num_workers,
                                           self.needed, counter)
        self.gradient_fns, self.apply_fn, slots = cache["sync"]
        self.free = list(range(slots.count))
        self.running = {}  # slot -> (remote value, its SyncStep, worker)
        self.version = 0  # the next global step of `ClusterCoordinator.sync_step`

    @classmethod
    def of_model(cls, model, coordinator):
        """Global steps of `model.train_step`, traced once per `compile`."""
        strategy = model.distribute_strategy

        def step(iterator):
            outputs = strategy.run(model.train_step, args=(next(iterator),))
            return _keras.reduce_per_replica(outputs, strategy, reduction="auto")

        cache = step_functions(model)
        # Without backup workers every row update is applied before its step: none is
        # stale, and `fit` logs no `staleness` (`staleness.meaningless`), so none is counted.
        counter = staleness.counter(model, cache) if (
            strategy.consistency.hybrid and staleness.measuring(model)
            and strategy.backup_workers) else None
        return cls(coordinator, model.optimizer, step, cache=cache, counter=counter)

    def _launch(self, step, worker, args, with_logs):
        while not self.free:
            self._collect(wait=True, deadline=None)
        slot = self.free.pop(0)
        remote = self.coordinator.schedule_on(worker, self.gradient_fns[with_logs],
                                              args=(tf.constant(slot, tf.int32), *args))
        self.coordinator.label(remote, kind="train", version=step.version)
        step.started(slot)
        self.running[slot] = (remote, step, worker)

    def _collect(self, wait, deadline):
        """Takes in the gradients that arrived; returns the results of the kept ones."""
        if wait and self.running:
            unfinished = [remote for remote, _, _ in self.running.values()]
            timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            _tf.wait_for_any(unfinished, timeout=timeout)
        kept = []
        for slot, (remote, step, _) in list(self.running.items()):
            if not _tf.remote_value_ready(remote):
                continue
            del self.running[slot]
            result = remote.fetch()  # raises the function's error
            if step.arrived(slot):
                kept.append(result)
            else:
                self.free.append(slot)
                self.coordinator.label(remote, dropped=True)
        return kept

    def run(self, args, version, with_logs):
        """Runs global step `version` of `step(*args)`; returns `(results of the kept
        gradient functions (`None`s without logs), gradients dropped)`."""
        step = SyncStep(version, self.needed)
        for worker in self._workers_for_a_step():
            self._launch(step, worker, args, with_logs)
        deadline = time.monotonic() + self.timeout
        results = []
        while not step.complete:
            if time.monotonic() > deadline:
                self._time_out(step)
            results += self._collect(wait=True, deadline=deadline)
            self._pool()  # a worker that left meanwhile holds none of the step's functions
        kept = sorted(step.kept)
        remote = self.coordinator.schedule(self.apply_fn, args=(tf.constant(kept, tf.int32),))
        self.coordinator.label(remote, kind="apply", version=version)
        remote.fetch()
        self.free.extend(kept)
        step.finish()
        return results, step.dropped

    def _workers_for_a_step(self) -> list[int]:
        """A function for each idle worker of the pool; short of them, more queued behind
        the least busy. A worker that left the pool (`elastic.watcher`) gets none."""
        pool = self._pool()
        load = dict.fromkeys(pool, 0)
        for _, _, worker in self.running.values():
            if worker in load:
                load[worker] += 1
        workers = [w for w in pool if load[w] == 0]
        for worker in workers:
            load[worker] += 1
        while len(workers) < self.needed:
            worker = min(pool, key=load.get)
            workers.append(worker)
            load[worker] += 1
        return workers

    def _pool(self) -> list[int]:
        """The workers running as the pool last saw them (all if none does); functions
        queued for the others go to whichever worker is free."""
        running = elastic.watcher(self.coordinator).membership.running
        pool = [w for w in range(self.num_workers) if w in running]
        for worker in set(range(self.num_workers)) - set(pool) if pool else ():
            _tf.release_pinned_functions(self.coordinator._tf_coordinator, worker)
        return pool or list(range(self.num_workers))

    def drain(self):
        """Waits for the gradients still computing (all dropped) and frees their slots."""
        self.coordinator.join()
        self._collect(wait=False, deadline=None)

    def _time_out(self, step):
        silent = self.coordinator.silent_workers()
        raise TimeoutError(
            f"Synchronous step {step.version} has {len(step.kept)} of the {step.needed} "
            f"gradients it needs after waiting {self.timeout:g} s (`step_timeout` of the "
            "strategy). Workers that do not answer: "
            f"{silent if silent != 'none' else 'none (they are slow)'}. "
            "Restart them, or use `backup_workers` so that a step completes without them.")
