"""`kerasps.ClusterCoordinator`: schedule functions on workers, as in TensorFlow.

A thin layer over TensorFlow's `ClusterCoordinator` (its worker threads,
retries on worker failure and error propagation are TensorFlow's own) that
adds what Keras users of kerasps need:

* `create_per_worker_dataset` gives every worker its own
  `kerasps.InputContext` (distinct `input_pipeline_id`);
* an optional per-step trace (`start_trace` / `stop_trace`), the input of
  `python -m simulator calibrate`.

Semantics follow TensorFlow: `schedule` returns a `RemoteValue` at once; a
function may run on any worker, and again on another if its worker fails;
the first error raised by a scheduled function is raised by the next `join`,
`done` or `schedule`, and the functions still queued are cancelled.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref

import tensorflow as tf

from kerasps.backend import _tf
from kerasps.policy import trace as trace_lib
from kerasps.runtime import input as input_lib

__all__ = ["ClusterCoordinator", "RemoteValue"]

RemoteValue = tf.distribute.experimental.coordinator.RemoteValue


class ClusterCoordinator:
    """Dispatches functions to the workers of a `kerasps.ParameterServerStrategy`.

    There is one coordinator per strategy: constructing it twice returns the
    same object.

    ```python
    coordinator = kerasps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def train_step(iterator):
        ...

    for _ in range(100):
        coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()
    ```

    Args:
        strategy: a `kerasps.ParameterServerStrategy`.
    """

    def __new__(cls, strategy):
        existing = getattr(strategy, "_kerasps_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy):
        if getattr(strategy, "_kerasps_coordinator", None) is self:
            return
        if not getattr(strategy, "_is_kerasps", False):
            raise ValueError(
                "Invalid value for argument `strategy`: expected a "
                f"`kerasps.ParameterServerStrategy`. Received: strategy={strategy!r}"
            )
        self._strategy = strategy
        _tf.install_results_on_coordinator()
        _tf.install_end_of_input_grace()
        self._tf_coordinator = _tf.running_coordinator(strategy)
        _tf.release_at_exit(self._tf_coordinator)
        self._trace_lock = threading.Lock()
        self._trace = None
        self._trace_origin = 0.0
        self._sequence = 0
        self._phase = ("train", 1)
        self._labels = {}  # id(remote value) -> (remote value, fields of its StepEvent)
        self._sync_steps = {}  # (fn, optimizer) -> the strategy's `_sync_steps`
        # Per-worker pipelines of `DatasetCreator`s, built once (see kerasps.keras.trainer).
        self._dataset_cache = weakref.WeakKeyDictionary()
        strategy._kerasps_coordinator = self
        _LIVE.add(self)

    @property
    def strategy(self):
        return self._strategy

    @property
    def num_workers(self) -> int:
        return self._strategy.num_workers

    def schedule(self, fn, args=None, kwargs=None) -> RemoteValue:
        """Queues `fn(*args, **kwargs)` to run on some worker; returns its `RemoteValue`.

        Per-worker values in `args` (such as iterators of
        `create_per_worker_dataset`) are replaced by the executing worker's own.
        """
        return self._tf_coordinator.schedule(fn, args=args, kwargs=kwargs)

    def schedule_on(self, worker: int, fn, args=None) -> RemoteValue:
        """Like `schedule`, but worker `worker` runs `fn` once it is free (TensorFlow
        runs it on another worker if that one fails). Sync steps use it: every
        worker computes one gradient of a global step."""
        return _tf.schedule_on(self._tf_coordinator, worker, fn, args)

    def sync_step(self, fn, args=None, *, optimizer) -> list:
        """Runs one synchronous global step of a custom training loop.

        Under a strategy with `mode="sync"` (or `"hybrid"`, where the row updates of
        embedding tables are applied as each worker computes them), every worker
        runs `fn(*args)` once
        on the same variables; the gradients `fn` hands to
        `optimizer.apply_gradients` are kept on the ps tasks instead of
        applied, and the mean of the first `num_workers - backup_workers` is
        applied as one update (see `kerasps.consistency`). Per-worker values in
        `args` (iterators of `create_per_worker_dataset`) are each worker's own.

        ```python
        @tf.function
        def step(iterator):
            def replica_fn(batch):
                with tf.GradientTape() as tape:
                    loss = loss_fn(batch)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.run(replica_fn, args=(next(iterator),))

        for _ in range(100):
            losses = coordinator.sync_step(step, args=(iterator,), optimizer=optimizer)
        ```

        Args:
            fn: a `tf.function` (or Python function) running one training step.
            args: its positional arguments.
            optimizer: the Keras optimizer `fn` applies its gradients with.

        Returns:
            The results of `fn` on the workers whose gradients the step kept.
        """
        if not self._strategy.consistency.sync:
            raise ValueError(
                "Invalid use of `sync_step`: the strategy trains asynchronously; create it "
                "with `mode='sync'` or `mode='hybrid'`, or use `schedule`. Received: "
                f"mode={self._strategy.mode!r}")
        steps = self._sync_steps.get((fn, optimizer))
        if steps is None:
            step = getattr(fn, "python_function", fn)  # traced again, gradients redirected
            steps = self._strategy._sync_steps(self, optimizer, step)
            self._sync_steps[(fn, optimizer)] = steps
        results, _ = steps.run(tuple(args or ()), steps.version, with_logs=True)
        steps.version += 1
        return results

    def join(self):
        """Blocks until every scheduled function has finished; raises the first error."""
        self._tf_coordinator.join()

    def running_workers(self) -> list[int]:
        """The indices of the declared workers that answer now (one connection each, at
        the address the cluster's resolver gives now).

        In an elastic pool (`kerasps launch --workers MIN:MAX`) the others have
        left or not joined yet; TensorFlow runs functions on the ones that answer.
        A worker restarted at another address (a Ray actor on another node) is
        looked for there (TensorFlow's reconnection goes there too:
        `kerasps.backend._tf.follow_resolver`).
        """
        return [i for i in range(self.num_workers) if _tf.task_alive("worker", i)]

    def silent_workers(self) -> str:
        """The declared workers that do not answer now, as device names for a message
        (`"none"` if every one answers)."""
        running = self.running_workers()
        return ", ".join(f"/job:worker/task:{i}" for i in range(self.num_workers)
                         if i not in running) or "none"

    def done(self) -> bool:
        """True if every scheduled function has finished; raises the first error."""
        return self._tf_coordinator.done()

    def fetch(self, value):
        """Blocks for and returns the result of a `RemoteValue` (or a nest of them)."""
        return self._tf_coordinator.fetch(value)

    def shutdown(self, timeout: float = 60.0):
        """Stops the coordinator: its worker and failure-handling threads end.

        Functions still queued are cancelled. `ClusterCoordinator(strategy)`
        afterwards makes a new coordinator (`fit` does so by itself).

        Args:
            timeout: seconds to wait for the threads to end.

        Raises:
            RuntimeError: threads still run after `timeout` (named in the message).
        """
        self._detach()
        alive = _tf.join_coordinator_threads(timeout)
        if alive:
            raise RuntimeError(f"Coordinator threads still running after {timeout} s: {alive}")

    def _detach(self):
        _tf.stop_coordinator(self._tf_coordinator, self._strategy)
        if getattr(self._strategy, "_kerasps_coordinator", None) is self:
            self._strategy._kerasps_coordinator = None

    def create_per_worker_dataset(self, dataset_fn) -> input_lib.PerWorkerDataset:
        """Builds one input pipeline per worker.

        Args:
            dataset_fn: a `kerasps.DatasetCreator`, a callable taking a
                `kerasps.InputContext`, a no-argument callable (which may call
                `strategy.distribute_datasets_from_function`), or a
                `tf.data.Dataset` that every worker reads whole.

        Returns:
            A `PerWorkerDataset`; `iter()` of it gives the per-worker iterators
            to pass to `schedule`, its `build()` each worker's dataset (to
            iterate inside the scheduled function), as TensorFlow's does.
        """
        return input_lib.PerWorkerDataset(self._strategy, self._tf_coordinator, dataset_fn)

    # -- tracing -------------------------------------------------------------------
    def start_trace(self, kind: str = "train", steps: int = 1):
        """Starts recording one `kerasps.trace.StepEvent` per executed function.

        Args:
            kind: label of the events recorded from now on (`"train"`,
                `"eval"`, `"predict"`); change it with `set_trace_phase`.
            steps: training steps each scheduled function runs.
        """
        with self._trace_lock:
            if self._trace is None:
                self._remove_observer = _tf.observe_closures(self._on_executed)
            self._trace = []
            self._trace_origin = time.perf_counter()
            self._sequence = 0
            self._phase = (kind, steps)

    def set_trace_phase(self, kind: str, steps: int = 1):
        """Labels the events recorded from now on."""
        self._phase = (kind, steps)

    def label(self, remote_value, **fields):
        """Sets `StepEvent` fields (`kind`, `version`, `dropped`) of the traced event of
        the function that returned `remote_value`, before or after it runs."""
        if self._trace is None:
            return
        with self._trace_lock:
            entry = self._labels.setdefault(id(remote_value), (remote_value, {}))
            if entry[1] is not None:
                entry[1].update(fields)

    def untraced(self, remote_value):
        """Leaves the function that returned `remote_value` out of the trace (a run that
        takes no training step, such as `fit`'s warm-up)."""
        if self._trace is None:
            return
        with self._trace_lock:
            self._labels[id(remote_value)] = (remote_value, None)

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    def stop_trace(self) -> list[trace_lib.StepEvent]:
        """Stops recording and returns the events, ordered by start time."""
        with self._trace_lock:
            recorded, self._trace = self._trace or [], None
            labels, self._labels = self._labels, {}
            if getattr(self, "_remove_observer", None) is not None:
                self._remove_observer()
                self._remove_observer = None
        events = [dataclasses.replace(event, **labels[key][1]) if key in labels else event
                  for event, key in recorded
                  if key not in labels or labels[key][1] is not None]
        return trace_lib.with_staleness(sorted(events, key=lambda e: e.start))

    def _on_executed(self, worker_index, start, end, remote_value=None):
        with self._trace_lock:
            if self._trace is None:
                return
            kind, steps = self._phase
            self._trace.append((trace_lib.StepEvent(
                worker=worker_index, step=self._sequence, start=start - self._trace_origin,
                end=end - self._trace_origin, steps=steps, kind=kind), id(remote_value)))
            self._sequence += 1


_LIVE = weakref.WeakSet()  # the process's kerasps coordinators


def stop_every_coordinator(timeout: float = 60.0) -> list:
    """Stops every coordinator of the process and waits for their threads, before a
    strategy connects (which resets the eager context); their strategies get a new
    coordinator if used again, as after `shutdown()`.

    A coordinator's threads call into the eager context: its worker threads run
    scheduled functions and build per-worker resources (a per-worker iterator is
    built by a queued closure, after `iter()` returned), its failure handler
    reconnects. A connection that resets the context while one of them runs frees
    the remote devices the call reads: the chief died with SIGSEGV in
    `TensorHandle::DeviceName` when a strategy was made while closures built the
    previous one's iterators (`tests/test_threads.py`). TensorFlow stops those
    threads only asynchronously; see the TODO in `WorkerPreemptionHandler.stop`,
    tensorflow/python/distribute/coordinator/cluster_coordinator.py ("The preemption
    handler thread shouldn't be terminated asynchronously since it touches eager
    context which is a process-wide singleton").

    Returns the names of the threads still running after `timeout` seconds (logged
    as a warning: the connection goes on without them).
    """
    for coordinator in list(_LIVE):
        coordinator._detach()
    _tf.stop_every_coordinator()
    running = _tf.join_coordinator_threads(timeout)
    if running:
        logging.getLogger("kerasps").warning(
            "%d thread(s) of an earlier strategy's coordinator still run after %.0f s (%s); "
            "connecting anyway: a TensorFlow call they make from now on may fail or crash.",
            len(running), timeout, ", ".join(running))
    return running
