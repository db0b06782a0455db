"""The one place kerasps reaches into TensorFlow's private modules.

A TensorFlow upgrade that moves these touches only this file.
"""

import contextlib
import copy
import gc
import logging
import socket
import sys
import threading
import time
import weakref

from tensorflow.python.distribute import input_lib, input_util
from tensorflow.python.distribute import parameter_server_strategy_v2 as pss_v2
from tensorflow.python.distribute.coordinator import cluster_coordinator, remote_value
from tensorflow.python.distribute.coordinator import values as coordinator_values
from tensorflow.python.eager import context
from tensorflow.python.framework import composite_tensor, dtypes
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import array_ops, resource_variable_ops
from tensorflow.python.util import compat, nest

from kerasps.backend import tf_logs

ParameterServerStrategyV2 = pss_v2.ParameterServerStrategyV2
ParameterServerStrategyV2Extended = pss_v2.ParameterServerStrategyV2Extended
PerWorkerValues = coordinator_values.PerWorkerValues
PerWorkerDistributedIterator = coordinator_values.PerWorkerDistributedIterator


# What a scheduled function's failure comes out of `join`/`schedule` as, besides a
# `tf.errors.OpError`: its input (a per-worker resource) failed or was aborted.
CLOSURE_ERRORS = (cluster_coordinator.ClosureInputError, cluster_coordinator.ClosureAbortedError)


def workers(tf_coordinator):
    """The coordinator's `Worker` objects, one per worker task, in task order."""
    return tf_coordinator._cluster.workers


def register_dispatchable_type(cls):
    """Lets `tf.experimental.dispatch_for_api` dispatch on `cls`, which is no
    `tf.CompositeTensor` (TensorFlow only checks signatures for arguments of
    registered types)."""
    from tensorflow.python.util import dispatch

    return dispatch.register_dispatchable_type(cls)


def get_iterator_spec(strategy, dataset):
    return input_lib.get_iterator_spec_from_dataset(strategy, dataset)


def device_ps_task(device: str):
    """Returns N from a device string '/job:ps/replica:0/task:N/...', or `None`."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device or "")
    return spec.task if spec.job == "ps" else None


def serialize_dataset(dataset):
    """A dataset's graph, so that workers can rebuild it (as TF's coordinator does)."""
    return coordinator_values.serialize_dataset_to_graph(dataset)


def deserialize_dataset(graph_def, element_spec):
    return coordinator_values.deserialize_dataset_from_graph(graph_def, element_spec)


def shard_files(dataset, num_workers: int, index: int):
    """`dataset` reading every `num_workers`-th of its files, from file `index`: TensorFlow's
    auto-shard rewrite with its FILE policy.

    TensorFlow's `_AutoShardDataset` reads the policy from `dataset.options()`,
    which inside a `tf.function` (a worker's pipeline is traced) is the default
    (AUTO) whatever was set; the policy is handed to the op here instead.
    """
    import tensorflow as tf
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.ops import gen_experimental_dataset_ops

    class AutoShardDataset(dataset_ops.UnaryUnchangedStructureDataset):
        def __init__(self, input_dataset):
            self._input_dataset = input_dataset
            variant = gen_experimental_dataset_ops.auto_shard_dataset(
                input_dataset._variant_tensor, num_workers=num_workers, index=index,
                auto_shard_policy=int(tf.data.experimental.AutoShardPolicy.FILE),
                **self._flat_structure)
            super().__init__(input_dataset, variant)

    return AutoShardDataset(dataset)


# Dataset ops that read files, and the ops a list of file names comes out of.
_FILE_READERS = ("TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset")
_FILE_LISTS = ("TensorSliceDataset",)


def file_count(dataset) -> int | None:
    """How many files `dataset` reads, as TensorFlow's `"file"` auto-shard policy
    counts them, or `None` if it reads none that can be counted.

    The files are the names a reader op (`TFRecordDataset` and the like) is
    given directly, or the elements of the file-name dataset (`list_files`,
    `from_tensor_slices(files)`) that an interleave of readers maps over.
    Nothing is read but the file names.
    """
    import tensorflow as tf

    graph_def = tf.compat.v1.GraphDef.FromString(serialize_dataset(dataset).numpy())
    nodes = {node.name: node for node in graph_def.node}
    library = {f.signature.name: f for f in graph_def.library.function}

    def reads_files(node):
        """True if `node`'s functions (and the functions they call) read files."""
        pending, seen = list(_functions_of(node)), set()
        while pending:
            name = pending.pop()
            if name in seen or name not in library:
                continue
            seen.add(name)
            for inner in library[name].node_def:
                if inner.op.startswith(_FILE_READERS):
                    return True
                pending.extend(_functions_of(inner))
        return False

    for node in graph_def.node:
        if node.op.startswith(_FILE_READERS):
            source, whole = node.input[0], True
        elif reads_files(node) and node.input:
            source = _upstream(nodes, node.input[0], _FILE_LISTS)
            if source is None:
                continue
            source, whole = nodes[source].input[0], False
        else:
            continue
        names = _evaluate(graph_def, source.split("^")[-1])
        return 1 if whole and names.ndim == 0 else int(names.shape[0])
    return None


def _functions_of(node):
    return {value.func.name for value in node.attr.values() if value.func.name}


def _upstream(nodes, name, ops):
    """The first node of type `ops` reached from `name` through first inputs."""
    seen = set()
    while name and name not in seen:
        seen.add(name)
        node = nodes.get(name.split(":")[0])
        if node is None:
            return None
        if node.op.startswith(ops):
            return node.name
        name = node.input[0] if node.input else None
    return None


def _evaluate(graph_def, tensor_name):
    import tensorflow as tf

    def imported():
        tf.graph_util.import_graph_def(graph_def, name="")

    function = tf.compat.v1.wrap_function(imported, [])
    name = tensor_name if ":" in tensor_name else tensor_name + ":0"
    return function.prune([], function.graph.get_tensor_by_name(name))().numpy()


def data_service_reader(address, dataset_id, element_spec, processing_mode, job_name,
                        task_refresh_ms: int):
    """A reader of job `job_name` of a tf.data service dataset, fetching one element at a
    time and asking the dispatcher for task changes every `task_refresh_ms` (the public
    `from_dataset_id` leaves that at about a second, which every epoch's end waits out)."""
    from tensorflow.python.data.experimental.ops import data_service_ops

    return data_service_ops._from_dataset_id(
        processing_mode=processing_mode, service=address, dataset_id=dataset_id,
        element_spec=element_spec, job_name=job_name, max_outstanding_requests=1,
        task_refresh_interval_hint_ms=task_refresh_ms)


def distributed_datasets_from_function(strategy, dataset_fn, input_workers, input_context, options):
    import tensorflow as tf

    return input_util.get_distributed_datasets_from_function(
        dataset_fn, input_workers, [input_context], strategy, options=options,
        build=tf.inside_function())


_HANDLES = (dtypes.resource, dtypes.variant)  # no array to read: copied as TensorFlow does


class _ResultOnCoordinator(coordinator_values.RemoteValueImpl):
    """A scheduled function's result, published only once it is on the coordinator.

    TensorFlow publishes a result as soon as the worker has computed it and
    copies it to the coordinator afterwards, so a `fetch()` in between reads
    from the worker itself: if that worker has just died, `fetch()` raises
    `UnavailableError` although TensorFlow runs the function again elsewhere.
    Copying before publishing keeps the copy inside TensorFlow's failure
    handling: a worker lost before its result reached the coordinator is a
    worker failure like any other, and the function runs again.
    """

    def _copy_to_local(self):
        """The result on the coordinator, each tensor read as an array.

        TensorFlow's copy is a `tf.identity` placed on the coordinator: a function
        run on the coordinator with a part on the worker. Such functions live in a
        table (`EagerClusterFunctionLibraryRuntime::function_data_`, a
        `std::vector`) that TensorFlow reads outside its lock while a new one may
        grow it: with results copied from several worker threads at once, the
        chief sent a request with a freed device name ("Unable to parse request",
        invalid UTF-8), a use after free. Reading a tensor (`numpy()`: a send on
        the worker, a receive here) never uses that table. (`_copy_to_device`, the
        same copy, raises a bare `RuntimeError`, which would end `fit`.)

        TensorFlow's coordinator tells a lost worker from the text of an error:
        `UnavailableError` naming `/job:worker` is a worker failure, a
        `CancelledError` naming a task is derived from one, and either way the
        function runs again. Its own copy's errors named the tasks of the function
        it ran; a read's do not ("RecvFromRemoteAsync is cancelled."), so each is
        raised again naming the worker the result came from.
        """
        if self._values is None:
            return None
        server_def = context.get_server_def()
        device = (f"/job:{server_def.job_name}/replica:0/task:{server_def.task_index}"
                  "/device:CPU:0")

        def copy(value):
            if isinstance(value, input_lib.DistributedIterator):
                return value  # stays on its worker: never read from the coordinator
            if isinstance(value, composite_tensor.CompositeTensor):
                return nest.map_structure(copy, value, expand_composites=True)
            if isinstance(value, tf_ops.EagerTensor) and value.dtype not in _HANDLES:
                try:
                    array = value.numpy()
                except tf_errors.OpError as error:
                    raise type(error)(error.node_def, error.op,
                                      f"Copying a result from {value.device} to the "
                                      f"coordinator: {error.message}") from None
                with tf_ops.device(device):
                    return tf_ops.convert_to_tensor(array, dtype=value.dtype)
            with tf_ops.device(device):
                return array_ops.identity(value)  # a Python value, or a handle: as TF does

        return nest.map_structure(copy, self._values)

    def _set_values(self, tensors):
        self._values = tensors
        fetched = self._copy_to_local()  # raises on a lost worker: TF re-queues the function
        with self._has_fetched_to_local_lock:
            self._fetched_tensors = fetched
            self._has_fetched_to_local = True
        super()._set_values(tensors)
        _notify_published()

    def _set_error(self, error):
        super()._set_error(_copy_of(error))
        _notify_published()

    def _set_aborted(self, error):
        super()._set_aborted(_copy_of(error))
        _notify_published()

    def _wait_and_maybe_error(self):
        """Raises a copy of the function's error, never the error itself.

        TensorFlow raises the one error it stored, and each `raise` adds the frames it
        passes through to that error's traceback: the frames of whoever fetched the
        result, and the result, its error and those frames then form a cycle that only
        the garbage collector ends, keeping everything those frames held (iterators
        on the workers, a tf.data service job's readers) until some later collection.
        A reader of the in-process tf.data service destroyed that late, while the next
        strategy connected, held that strategy's constructor for up to minutes. The
        copy's traceback belongs to the one who caught it, and the stored error is a copy
        too, without a frame: TensorFlow's closure queue raises the error it was given
        (`_raise_if_error`) at the next `schedule` or `join`.
        """
        self._status_available_event.wait()
        error = self._error
        if error is None or self._status is remote_value.RemoteValueStatus.ABORTED:
            super()._wait_and_maybe_error()
            return
        raise _copy_of(error)


def _copy_of(error: BaseException) -> BaseException:
    """`error` again, as a new exception without a traceback (the same one where it
    cannot be copied)."""
    try:
        clone = copy.copy(error)
    except Exception:  # noqa: BLE001 - an exception type copy cannot rebuild
        return error
    clone.__dict__.update(error.__dict__)
    clone.__cause__, clone.__suppress_context__ = error.__cause__, error.__suppress_context__
    return clone


# Notified whenever a scheduled function's result or error is published.
_published = threading.Condition()


def _notify_published():
    with _published:
        _published.notify_all()


def install_coordinator_stop_off_the_collecting_thread():
    """Makes a collected `ClusterCoordinator` stop its cluster on a thread of its own
    (idempotent).

    TensorFlow's `ClusterCoordinator.__del__` stops the cluster where the garbage collector
    runs it. A coordinator is collected as a cycle, so the collector can run it in one of
    that coordinator's own worker threads, while `_CoordinatedClosureQueue.get` holds the
    queue's lock (an allocation there started a collection); `stop` then waits for that
    lock in the thread that holds it, for good, and so does every later `stop` of that
    queue (the next strategy's `stop_every_coordinator`). Seen as a test session hung in a
    strategy's constructor. One collected as the interpreter finalises stops nothing."""
    cls = cluster_coordinator.ClusterCoordinator
    if getattr(cls.__del__, "_kerasps", False):
        return

    def __del__(coordinator):  # noqa: N807 - the method it replaces
        cluster = getattr(coordinator, "_cluster", None)
        if cluster is None:
            return
        if sys.is_finalizing():
            # The process is ending: its threads end with it. A thread started now never
            # runs (`start` waited for it for good), and a stop here would wake threads
            # blocked in TensorFlow into an interpreter that ends each with `pthread_exit`
            # through TensorFlow's C++ frames: SIGABRT, "FATAL: exception not rethrown"
            # (pytorch/pytorch#38228 is the same with pybind11).
            return
        try:
            threading.Thread(target=cluster.stop, name="kerasps-collected-coordinator-stop",
                             daemon=True).start()
        except RuntimeError:  # no thread can start (the process has too many)
            cluster.stop()

    __del__._kerasps = True
    cls.__del__ = __del__


_results_installed = False


def install_results_on_coordinator():
    """Makes every scheduled function's `RemoteValue` a `_ResultOnCoordinator` (idempotent)."""
    global _results_installed
    if _results_installed:
        return
    _results_installed = True
    closure_cls = cluster_coordinator.Closure
    original = closure_cls.build_output_remote_value

    def build_output_remote_value(closure):
        if type(closure) is not closure_cls:  # resources (iterators) stay on their worker
            return original(closure)
        if closure._output_remote_value_ref is not None:
            raise ValueError("The output of the Closure cannot be built more than once.")
        remote = _ResultOnCoordinator(None, closure._output_type_spec)
        closure._output_remote_value_ref = weakref.ref(remote)
        return remote

    closure_cls.build_output_remote_value = build_output_remote_value


# Seconds the functions still running when the input ended may take to finish before
# they are cancelled (as TensorFlow cancels them at once after any error).
END_OF_INPUT_GRACE = 120.0

_end_of_input_installed = False


def install_end_of_input_grace():
    """Lets the functions still running when another found the end of its input finish
    (idempotent).

    After a scheduled function fails, TensorFlow's closure queue cancels at the
    next `schedule`/`join`/`done` every function still running and then those
    queued. For the end of the input (`OutOfRangeError`) that loses data: a
    function running on another worker may have read its batch (from the
    tf.data service, which hands each element out once) and be cancelled before
    its step applies it. Here the queued functions, which have read nothing, are
    cancelled first, so that no more start; those running finish (or find the
    end themselves) within `END_OF_INPUT_GRACE` seconds, after which TensorFlow's
    own cancellation runs as before. Other errors are untouched.
    """
    global _end_of_input_installed
    if _end_of_input_installed:
        return
    _end_of_input_installed = True
    import queue

    queue_cls = cluster_coordinator._CoordinatedClosureQueue
    cancel_all = queue_cls._cancel_all_closures

    def _cancel_all_closures(self):  # called with the queue's lock held
        if isinstance(self._error, tf_errors.OutOfRangeError):
            while True:
                try:
                    closure = self._queue.get(block=False)
                except queue.Empty:
                    break
                self._queue_free_slot_condition.notify()
                closure.mark_cancelled()
            self._no_inflight_closure_condition.wait_for(
                lambda: self._inflight_closure_count == 0, timeout=END_OF_INPUT_GRACE)
        cancel_all(self)

    queue_cls._cancel_all_closures = _cancel_all_closures


def remote_value_ready(remote_value) -> bool:
    """True once a `RemoteValue` holds a result or an error (never blocks)."""
    return remote_value._status_available_event.is_set()


def wait_for_any(remote_values, timeout: float):
    """Blocks until one of `remote_values` (scheduled functions' results) holds a
    result or an error, or for at most `timeout` seconds."""
    with _published:
        _published.wait_for(lambda: any(map(remote_value_ready, remote_values)), timeout)


_closure_observers = []
_timing_installed = False


def observe_closures(observer):
    """Calls `observer(worker_index, start, end, remote_value)` after every scheduled
    function runs (`remote_value`: the function's result, as `schedule` returned it).

    Times are `time.perf_counter()` on the coordinator around the worker's
    synchronous execution of the function. Returns a function that removes
    the observer.
    """
    global _timing_installed
    if not _timing_installed:
        import time

        original = cluster_coordinator.Closure.execute_on

        def execute_on(closure, worker):
            if not _closure_observers or isinstance(closure, cluster_coordinator.ResourceClosure):
                return original(closure, worker)
            start = time.perf_counter()
            result = original(closure, worker)
            end = time.perf_counter()
            remote = closure._output_remote_value_ref
            remote = remote() if remote is not None else None
            for notify in list(_closure_observers):
                notify(worker.worker_index, start, end, remote)
            return result

        cluster_coordinator.Closure.execute_on = execute_on
        _timing_installed = True
    _closure_observers.append(observer)
    return lambda: _closure_observers.remove(observer)


_failure_observers = []
_failures_installed = False


def observe_worker_failures(observer):
    """Calls `observer(worker_index)` whenever a worker's iterators start again from the
    start of their datasets: TensorFlow's coordinator found the worker failed (its
    per-worker resources are then aborted, and rebuilt once it answers again), or it
    runs a function again after a passing failure (`restart_input_of_retried_functions`).
    Returns a function that removes the observer."""
    global _failures_installed
    if not _failures_installed:
        original = cluster_coordinator.Worker._set_resources_aborted

        def _set_resources_aborted(worker, error):
            _input_restarted(worker.worker_index)
            return original(worker, error)

        cluster_coordinator.Worker._set_resources_aborted = _set_resources_aborted
        _failures_installed = True
    _failure_observers.append(observer)
    return lambda: _failure_observers.remove(observer)


def _input_restarted(worker_index):
    for notify in list(_failure_observers):
        notify(worker_index)


_running = threading.local()  # the (worker, closure) a worker thread runs
_retries_installed = False


def restart_input_of_retried_functions():
    """Makes TensorFlow's coordinator start again, on its worker, every iterator that a
    function it runs again had read (idempotent).

    The coordinator runs a function again, with the same arguments, after an error it
    takes for a passing one (`WorkerPreemptionHandler.wait_on_failure`): an
    `UnavailableError` from a ps task (each task's first
    `TF_COORDINATOR_IGNORE_TRANSIENT_PS_FAILURES` - 1, 2 by default), a `CancelledError`
    it calls derived, a timeout. A function that failed while its `next(iterator)`
    waited for an element had cancelled that iterator for good (`IteratorGetNext`
    passes the function's cancellation on to the iterator), so the second run, and
    every later read, found the end of the input: a lost ps task ended a worker's
    repeated input. Started again, the iterator reads its dataset from the start, as
    TensorFlow's does on a worker that came back; the observers of
    `observe_worker_failures` are told. (A function cancelled after another's error
    is not run again: the caller gets that error.)
    """
    global _retries_installed
    if _retries_installed:
        return
    _retries_installed = True
    process_closure = cluster_coordinator.Worker._process_closure

    def _process_closure(worker, closure):
        _running.closure = (worker, closure)
        try:
            return process_closure(worker, closure)
        finally:
            _running.closure = None

    cluster_coordinator.Worker._process_closure = _process_closure
    for handler in (cluster_coordinator.WorkerPreemptionHandler,
                    cluster_coordinator.CoordinationServicePreemptionHandler):
        handler.wait_on_failure = _restarting_input_on_retry(handler.wait_on_failure)


def _restarting_input_on_retry(wait_on_failure):
    def restarting_wait_on_failure(handler, on_failure_fn=None, on_transient_failure_fn=None,
                                   on_recovery_fn=None, worker_device_name="(unknown)"):
        running = getattr(_running, "closure", None)  # None for a resource closure

        def run_again():
            if running is not None:
                _restart_iterators_read_by(*running)
            if on_transient_failure_fn is not None:
                on_transient_failure_fn()

        return wait_on_failure(handler, on_failure_fn=on_failure_fn,
                               on_transient_failure_fn=run_again,
                               on_recovery_fn=on_recovery_fn,
                               worker_device_name=worker_device_name)

    return restarting_wait_on_failure


def _restart_iterators_read_by(worker, closure):
    if worker._cluster.closure_queue._error is not None:
        # Cancelled, not run again: its caller gets the error and starts the input
        # again as it sees fit (`fit` restarts every pipeline after a lost ps task).
        return
    iterators = [value for value in nest.flatten((closure._args, closure._kwargs))
                 if isinstance(value, PerWorkerDistributedIterator)]
    if not iterators:
        return
    # On the worker's own queue, which it serves before the function runs again.
    if not _rebuild_on(worker, [i._values[worker.worker_index] for i in iterators]):
        return  # found failed: rebuilt when it answers again
    _input_restarted(worker.worker_index)
    now = time.monotonic()
    if now - _step_retried_at.get(worker.worker_index, -_RETRY_QUIET_S) < _RETRY_QUIET_S:
        return  # one line per worker and fault: TensorFlow runs a step again up to twice
    _step_retried_at[worker.worker_index] = now
    logging.getLogger("kerasps").warning(
        "Worker %d lost its connection to a ps task while running a step; the step runs "
        "again, and the worker's input starts again from the start of its data.",
        worker.worker_index)


_RETRY_QUIET_S = 60.0  # a worker's steps run again within this time are one fault's
_step_retried_at: dict = {}  # worker index -> when the last line said its step runs again
_down_since: dict = {}  # worker index -> when it was found failed, until it is back
_reporting_installed = False


def report_worker_failures():
    """Says, in kerasps' log, when TensorFlow's coordinator finds a worker failed (its
    steps go to the other workers) and when it is back, after how long (idempotent):
    one line each, where TensorFlow logs its error (`tf_logs.keep_fault_detail` keeps it
    in a file, which the first line names)."""
    global _reporting_installed
    if _reporting_installed:
        return
    _reporting_installed = True
    on_failure = cluster_coordinator.Worker._set_resources_aborted
    on_recovery = cluster_coordinator.Worker._on_worker_recovery

    def _set_resources_aborted(worker, error):
        if worker.worker_index not in _down_since:
            _down_since[worker.worker_index] = time.monotonic()
            logging.getLogger("kerasps").warning(
                "Worker %d stopped answering (its process or its connection is gone); its "
                "steps run on the other workers until it is back.%s", worker.worker_index,
                tf_logs.detail_note())
        return on_failure(worker, error)

    def _on_worker_recovery(worker):
        since = _down_since.pop(worker.worker_index, None)
        if since is not None:
            logging.getLogger("kerasps").warning(
                "Worker %d is back after %.1f s; its input starts again from the start of "
                "its data.", worker.worker_index, time.monotonic() - since)
        return on_recovery(worker)

    cluster_coordinator.Worker._set_resources_aborted = _set_resources_aborted
    cluster_coordinator.Worker._on_worker_recovery = _on_worker_recovery


_executor_hook_installed = False


def keep_executor_tracebacks_in_detail():
    """Sends to `tf_logs.detail_file()` the exceptions that TensorFlow's eager executors
    raise when they are freed after a task was lost (`Exception ignored in: <function
    Executor.__del__ ...>`, a traceback ending in `AbortedError: Unable to find a
    context_id`): Python prints them, through `sys.unraisablehook`, on the console
    (idempotent; none with `KERASPS_TF_LOGS=1`). Any other unraisable exception goes to
    the hook that was there."""
    global _executor_hook_installed
    if _executor_hook_installed or tf_logs.wanted():
        return
    _executor_hook_installed = True
    import sys
    import traceback

    previous = sys.unraisablehook

    def unraisablehook(unraisable):
        freed = unraisable.object
        if (getattr(freed, "__qualname__", "") == "Executor.__del__"
                and getattr(freed, "__module__", "").startswith("tensorflow.")
                and tf_logs.write_detail(
                    f"{unraisable.err_msg or 'Exception ignored in'}: {freed!r}\n" + "".join(
                        traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                   unraisable.exc_traceback)))):
            return
        previous(unraisable)

    sys.unraisablehook = unraisablehook


def trace_for_workers(strategy, function, args):
    """Traces the `tf.function` `function` for `args` as `schedule` will (per-worker
    values by the first worker's type spec, inside the strategy's scope), on this
    thread; returns the concrete function."""
    specs = nest.map_structure(cluster_coordinator._maybe_as_type_spec,
                               cluster_coordinator._select_worker_slice(0, args))
    with _scheduling(strategy):
        return function.get_concrete_function(*specs)


@contextlib.contextmanager
def _scheduling(strategy):
    """Inside the strategy's scope, marked as scheduling a function (as TensorFlow's
    `ClusterCoordinator.schedule` does while it traces one): the strategy's methods
    then do not warn that they run on the coordinator."""
    with strategy.scope():
        strategy.extended._being_scheduled = True
        try:
            yield
        finally:
            strategy.extended._being_scheduled = False


_pinned_installed = False


def schedule_on(tf_coordinator, worker_index, fn, args):
    """Like `ClusterCoordinator.schedule`, but worker `worker_index` runs `fn` (once it is
    free); if that worker fails, TensorFlow runs it again on any worker.

    TensorFlow's queue has a queue per worker for its own per-worker resources
    (iterators): the function goes there, counted as in flight (as a function
    of the shared queue is once taken), with no tag, so that a failure puts it
    back in the shared queue.
    """
    global _pinned_installed
    if not _pinned_installed:
        _keep_pinned_functions_on_worker_failure()
        _pinned_installed = True
    strategy, cluster = tf_coordinator.strategy, tf_coordinator._cluster
    closures = cluster.closure_queue
    with _scheduling(strategy):
        closure = cluster_coordinator.Closure(fn, closures._cancellation_mgr, args=args)
        remote = closure.build_output_remote_value()
    with closures._queue_lock:
        closures._raise_if_error()
        closure.tag = None
        closures._tagged_queue[worker_index].put(closure, block=False)
        closures.inflight_closure_count += 1
        closures._closures_queued_condition.notify_all()
    return remote


def _keep_pinned_functions_on_worker_failure():
    """TensorFlow empties a worker's own queue when a resource fails to build there;
    functions of `schedule_on` in it move to the shared queue instead of vanishing."""
    queue_cls = cluster_coordinator._CoordinatedClosureQueue
    original = queue_cls.clear_tag_unlocked

    def clear_tag_unlocked(self, tag):
        old = self._tagged_queue[tag]
        original(self, tag)
        with self._queue_lock:
            _move_to_shared_queue(self, old)

    queue_cls.clear_tag_unlocked = clear_tag_unlocked


def _move_to_shared_queue(closures, tagged, keep_resources=False):
    """Moves the functions of `schedule_on` in `tagged` (a worker's own queue) to the
    shared queue of `closures`, for any worker to run. Per-worker resources stay in
    `tagged` with `keep_resources`, else are dropped (TensorFlow builds them again when
    the worker recovers). Holds `_queue_lock`."""
    resources = []
    while not tagged.empty():
        closure = tagged.get(block=False)
        if isinstance(closure, cluster_coordinator.ResourceClosure):
            resources.append(closure)
            continue
        closures.inflight_closure_count -= 1  # counted again when taken from the queue
        closures._queue.put(closure, block=False)
        closures._closures_queued_condition.notify()
    for closure in resources if keep_resources else ():
        tagged.put(closure, block=False)


def release_pinned_functions(tf_coordinator, worker_index):
    """Lets any worker run the functions `schedule_on` queued for worker `worker_index`,
    which left the pool: they would wait for it, TensorFlow moving them only when a
    function it runs there fails (its thread then waits for the worker to come back
    without looking at its queue)."""
    closures = tf_coordinator._cluster.closure_queue
    with closures._queue_lock:
        _move_to_shared_queue(closures, closures._tagged_queue[worker_index],
                              keep_resources=True)


def sleep_dataset(dataset, seconds: float):
    """`dataset` with each element held back `seconds` (tf.data's testing `sleep`)."""
    from tensorflow.python.data.experimental.ops import testing

    return dataset.apply(testing.sleep(int(seconds * 1e6)))


def no_colocation():
    """Clears any colocation scope (TF's own variable creator does the same)."""
    return tf_ops.colocate_with(None, ignore_existing=True)


# -- liveness of a task ---------------------------------------------------------------
TASK_PROBE_TIMEOUT = 1.0  # seconds a liveness probe waits for a task's port to accept


def task_alive(job: str, task: int) -> bool:
    """True if task `task` of `job` accepts connections on its address (a restarted one
    included).

    A TCP connection to the task's gRPC port, not the eager context's
    `check_alive`: that reads the server's worker cache, which
    `update_server_def` frees and replaces, so a poll from another thread while
    TensorFlow's failure handler reconnects killed the chief with SIGSEGV; and
    serialising the two instead left the pool watcher waiting behind an update
    that blocks until a worker gone for good comes back (`fit` never returned).
    The probe touches no TensorFlow state, so it never waits for and never
    races a reconnection.
    """
    address = task_address(job, task)
    return address is not None and address_alive(address)


def task_address(job: str, task: int) -> str | None:
    """The `host:port` of task `task` of `job` in the connected cluster, or `None`: where
    the cluster's resolver says it serves now (`follow_resolver`: a task restarted at
    another address), else where the connection declared it."""
    server_def = context.get_server_def()
    if server_def is None:
        return None
    moved = moved_tasks(server_def, _resolver_spec()).get((job, task))
    if moved is not None:
        return moved[1]
    for declared in server_def.cluster.job:
        if declared.name == job:
            return declared.tasks.get(task)
    return None


def ps_task_alive(ps_task: int) -> bool:
    """True if the ps task answers (a restarted one included)."""
    return task_alive("ps", ps_task)


def forget_functions_of_earlier_connections():
    """Clears TensorFlow's module-level cache of functions made in the eager context of
    an earlier connection, before a strategy connects.

    The tf.data service reader's uncompress function is cached per element spec
    (`data_service_ops._get_uncompress_func`, an `lru_cache`) and lives in the
    context of the cluster connected when it was made: after a connection to
    another cluster, exactly-once input of an element spec read before failed with
    `Could not find required function definition
    __inference_DataServiceDataset_uncompress_lambda_N`.
    """
    from tensorflow.python.data.experimental.ops import data_service_ops

    data_service_ops._get_uncompress_func.cache_clear()


# Bumped each time this process's eager context is reset (`set_server_def`: a first
# connection, or one to another cluster); see `install_context_bound_resource_deleters`.
_context_generation = 0


class _ContextBoundResourceDeleter(resource_variable_ops.EagerResourceDeleter):
    """TensorFlow's deleter of an eagerly made resource, which leaves alone a resource
    of an eager context that was reset since it was made: that context's devices are
    gone, and so is the resource for this process."""

    __slots__ = ("_generation",)

    def __init__(self, handle, handle_device):
        super().__init__(handle, handle_device)
        self._generation = _context_generation

    def __del__(self):
        if self._generation == _context_generation:
            super().__del__()


_deleters_bound = False


def install_context_bound_resource_deleters():
    """Makes every resource deleter made from here on skip the resources of an earlier
    eager context (idempotent).

    TensorFlow deletes a queue (`tf.queue.FIFOQueue` and the others of
    `data_flow_ops`, which kerasps' sync mode keeps its row updates' gradients in),
    a multi-device iterator or a summary writer in `EagerResourceDeleter.__del__`
    with a `DestroyResourceOp` placed by the handle's `Device*` pointer
    (`MaybePinToResourceDevice`). A handle can outlive its context's devices: after
    a switch to another cluster and back (a test suite, a notebook), the remote
    device's incarnation is valid again, TensorFlow's check
    (`ValidateTensorHandleRemoteDevice`) passes, and the op reads the freed device:
    SIGSEGV, seen in the garbage collection at a pytest session's exit.
    (Variables are reference-counted handles with no delete op.)
    """
    global _deleters_bound
    if _deleters_bound:
        return
    _deleters_bound = True
    resource_variable_ops.EagerResourceDeleter = _ContextBoundResourceDeleter
    set_server_def = context.Context.set_server_def

    def set_server_def_bumping_the_generation(self, *args, **kwargs):
        global _context_generation
        _context_generation += 1
        return set_server_def(self, *args, **kwargs)

    context.Context.set_server_def = set_server_def_bumping_the_generation


# The names of the traced functions this process's eager context held when it last
# connected to a cluster (`set_server_def`); see `install_function_removals_per_connection`.
_functions_of_earlier_connections: set = set()
_removals_installed = False


def install_function_removals_per_connection():
    """Keeps the freeing of a traced function from asking tasks that never had it to
    remove it, and stops every such request at the interpreter's exit (idempotent).

    A traced function freed in a connected process (`AtomicFunction.__del__` in
    TensorFlow's `python/eager/polymorphic_function/atomic_function.py`) is removed
    from the local context and from every task of the cluster connected now
    (`EagerContext::MaybeRemoveFunctionRemotely`), which registered only the functions
    made since it connected. A function made before the latest connection (before the
    first strategy, or in an earlier cluster's: each `kerasps.cluster.in_process()`
    block of a test session or notebook connects again) is unknown to those tasks, and
    each logged `E0000 ... context.cc:911] Failed to remove function remotely due to
    Tried to remove non-existent function '__inference__next_func_N'` (four lines per
    function and task): 90 errors after a pytest session of 3 documentation blocks,
    printed when pytest collects the garbage at its end. Such a function is now freed
    without a request (its definition stays in the local context's library, a few
    kilobytes); one of the current connection is removed everywhere, as before.

    After the `atexit` handlers no removal is sent at all: the process and its context
    end, and the tasks drop a context with its functions when its client goes away.
    """
    global _removals_installed
    if _removals_installed:
        return
    _removals_installed = True
    from tensorflow.python.eager.polymorphic_function import atomic_function
    from tensorflow.python.framework import func_graph as func_graph_module

    free = atomic_function.AtomicFunction.__del__

    def __del__(function):  # noqa: N807 - the method it wraps
        if function.name not in _functions_of_earlier_connections:
            return free(function)
        # TensorFlow's __del__, less the removal (its refcount per name and context).
        if function._generated_graph:
            func_graph_module.dismantle_func_graph(function._generated_graph)
        references = atomic_function.RUNTIME_FUNCTION_REFS
        if references is None:
            return
        key = (function._bound_context.function_scope_id, function.name)
        references[key] = references.get(key, 1) - 1
        if references[key] <= 0:
            references.pop(key, None)
            _functions_of_earlier_connections.discard(function.name)

    atomic_function.AtomicFunction.__del__ = __del__
    set_server_def = context.Context.set_server_def

    def set_server_def_after_noting_the_functions(self, *args, **kwargs):
        if self._context_handle is not None:
            _functions_of_earlier_connections.update(
                compat.as_bytes(name) for name in self.list_function_names())
        return set_server_def(self, *args, **kwargs)

    context.Context.set_server_def = set_server_def_after_noting_the_functions
    import atexit

    atexit.register(_no_removals_after_exit)


def _no_removals_after_exit():
    from tensorflow.python.eager.polymorphic_function import atomic_function

    def __del__(function):  # noqa: N807 - the method it replaces
        pass

    atomic_function.AtomicFunction.__del__ = __del__


def connected() -> bool:
    """True once this process's eager context has connected to a cluster."""
    return context.get_server_def() is not None


def reconnect_cluster(tf_coordinator):
    """Re-establishes the coordinator's eager context with every task.

    A task that restarted on its address knows nothing of the coordinator's
    context; this is what TensorFlow's coordinator does after a worker comes
    back (`WorkerPreemptionHandler`), applied to a ps task, under the same lock
    so that the two never update the context at once. A task the cluster's
    resolver now puts at another address is reconnected there (`follow_resolver`).
    """
    handler = tf_coordinator._cluster.failure_handler
    with handler._cluster_update_lock:
        context.context().update_server_def(context.get_server_def())


# The resolver of the cluster this process is connected to, asked where its tasks serve
# now at each reconnection (`follow_resolver`), or None.
_followed_resolver = None
_following_installed = False
# Seconds between two looks at the tasks a reconnection waits for.
RECONNECT_POLL_S = 0.25
_log = logging.getLogger("kerasps")


def follow_resolver(cluster_resolver):
    """Makes this process's connections to its cluster follow `cluster_resolver`'s tasks
    where they can move (`cluster_resolver.tasks_move`: a Ray actor restarted on another
    node serves at a new address, `kerasps.ray.cluster`); call it before connecting. Each
    connection sets its own; TF_CONFIG and in-process clusters, whose addresses never
    change, keep TensorFlow's own connections.

    Where tasks move:

    * every reconnection (`update_server_def`: TensorFlow's failure handler's after a
      worker failed, kerasps' after a ps task's, `reconnect_cluster`) first waits until
      every task accepts connections, each at the address the resolver gives then, and
      connects there: the eager context, and every task's view of the cluster, from then
      on. TensorFlow's own update blocks in its first RPC until every task it knows
      answers, at the address it knows, so a task that moved would hold it for good;
    * each ps task sees the other ps tasks (`let_ps_tasks_see_each_other`), so a
      reconnection tells them where a moved one serves.
    """
    global _followed_resolver, _following_installed, _ps_see_ps
    moving = bool(getattr(cluster_resolver, "tasks_move", False))
    _followed_resolver = cluster_resolver if moving else None
    _ps_see_ps = moving
    if _following_installed:
        return
    _following_installed = True
    let_ps_tasks_see_each_other()
    update = context.Context.update_server_def

    def update_server_def_where_tasks_serve(self, server_def, *args, **kwargs):
        if _followed_resolver is not None:
            server_def = _where_tasks_serve(server_def)
        return update(self, server_def, *args, **kwargs)

    context.Context.update_server_def = update_server_def_where_tasks_serve


_ps_see_ps = False  # whether the connection being made shows each ps task the others
_ps_see_ps_installed = False


def let_ps_tasks_see_each_other():
    """Makes TensorFlow's strategy connect with device filters that show each ps task the
    other ps tasks too, where the cluster's tasks move (`follow_resolver`; installed once;
    TensorFlow's show a ps task the workers and the chief).

    A ps task whose filtered view of the cluster does not change gets no update of it
    when the coordinator reconnects (`update_server_def`), and reaches another ps task
    (ops of one step span ps tasks: a sharded table's optimizer) through the addresses of
    its server's start. A ps task restarted at another address was then unreachable from
    the others for good; with each ps task in the others' view, every reconnection gives
    them its new address.
    """
    global _ps_see_ps_installed
    if _ps_see_ps_installed:
        return
    _ps_see_ps_installed = True
    from tensorflow.python.training import server_lib

    set_filters = server_lib.ClusterDeviceFilters.set_device_filters

    def set_device_filters_ps_seeing_ps(self, job_name, task_index, device_filters):
        if _ps_see_ps and job_name == "ps" and "/job:ps" not in device_filters:
            device_filters = [*device_filters, "/job:ps"]
        return set_filters(self, job_name, task_index, device_filters)

    server_lib.ClusterDeviceFilters.set_device_filters = set_device_filters_ps_seeing_ps


def _where_tasks_serve(server_def):
    """`server_def` with its tasks where the followed resolver says they serve, once every
    one (but this process's own) accepts connections there."""
    logged = set()
    while True:
        moves = moved_tasks(server_def, _resolver_spec())
        for (job, index), (old, new) in moves.items():
            if (job, index, new) not in logged:
                logged.add((job, index, new))
                _log.warning("%s %d serves at %s now (was %s): reconnecting there.", job,
                             index, new, old)
        server_def = _moved(server_def, moves)
        silent = [address for job in server_def.cluster.job for index, address in
                  job.tasks.items() if (job.name, index) != (server_def.job_name,
                                                             server_def.task_index)
                  and not address_alive(address)]
        if not silent:
            return server_def
        time.sleep(RECONNECT_POLL_S)


def _resolver_spec():
    """The followed resolver's cluster now (`follow_resolver`), or `None`."""
    resolver = _followed_resolver
    try:
        return None if resolver is None else resolver.cluster_spec()
    except Exception:  # noqa: BLE001 - a resolver going away: the addresses known
        return None


def moved_tasks(server_def, cluster_spec) -> dict:
    """`{(job, index): (old address, new address)}` of the tasks of `server_def`'s cluster
    that `cluster_spec` (a `tf.train.ClusterSpec`) puts elsewhere."""
    if server_def is None or cluster_spec is None:
        return {}
    now = cluster_spec.as_dict()
    moves = {}
    for job in server_def.cluster.job:
        addresses = now.get(job.name, [])
        if isinstance(addresses, dict):
            addresses = [addresses[i] for i in sorted(addresses)]
        for index, address in job.tasks.items():
            if index < len(addresses) and addresses[index] != address:
                moves[job.name, index] = (address, addresses[index])
    return moves


def _moved(server_def, moves: dict):
    """`server_def` with the tasks of `moves` (`{(job, index): (old, new)}`) at their new
    addresses (itself when there are none)."""
    if not moves:
        return server_def
    updated = type(server_def)()
    updated.CopyFrom(server_def)
    for job in updated.cluster.job:
        for index in job.tasks:
            if (job.name, index) in moves:
                job.tasks[index] = moves[job.name, index][1]
    return updated


def address_alive(address: str) -> bool:
    """True if `host:port` accepts connections (see `task_alive`)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), TASK_PROBE_TIMEOUT):
            return True
    except (OSError, ValueError):  # refused, unreachable, unresolvable: not alive
        return False


def resource_variable(variable):
    """The `tf.Variable` under a Keras variable and TF's PSS wrappers, or `None`."""
    value = getattr(variable, "_value", variable)
    while value is not None and not type(value).__name__ == "ResourceVariable":
        value = getattr(value, "_v", None) if hasattr(value, "_v") else getattr(
            value, "_variable", None)
    return value


def variable_on(device: str, initial_value, shape=None):
    """A plain `tf.Variable` on `device`, made outside any strategy's variable creator
    (kerasps's own buffers: not placed, partitioned or reported as model state)."""
    with no_colocation(), tf_ops.device(device):
        return resource_variable_ops.ResourceVariable(
            initial_value=initial_value, shape=shape, trainable=False)


def holds_state(variable) -> bool:
    """True if reading `variable` works: its ps task still holds it."""
    try:
        resource_variable(variable).read_value().numpy()
        return True
    except tf_errors.OpError:
        return False


def renew_variable(variable):
    """Gives a `tf.Variable` whose ps task restarted a new, uninitialized resource there.

    The Python objects (the Keras variable, TF's wrappers, optimizer slot maps,
    checkpoint dependencies) stay the same; only the resource handle changes,
    so functions traced before must be traced again. The caller assigns a
    value (restoring a backup does).
    """
    resource = resource_variable(variable)
    with tf_ops.device(resource.device):
        handle = resource_variable_ops._variable_handle_from_shape_and_dtype(
            resource.shape, resource.dtype, None, resource._handle_name[:-2], False)
    handle._parent_trackable = weakref.ref(resource)
    handle._name = resource._handle_name
    handle._unique_id = resource._unique_id
    resource._handle = handle
    resource._cached_value = None


_COORDINATOR_THREADS = ("WorkerClosureProcessingLoop-", "WorkerPreemptionHandler")


def coordinator_threads():
    """The live threads TensorFlow's `ClusterCoordinator` started."""
    return [t for t in threading.enumerate() if t.name.startswith(_COORDINATOR_THREADS)]


class _EndOfInputFilter(logging.Filter):
    def filter(self, record):
        message = record.getMessage()
        return "OutOfRangeError" not in message and not (
            "failed with CancelledError" in message and "derived error is ignored" in message)


@contextlib.contextmanager
def quiet_end_of_input():
    """Drops TensorFlow's ERROR logs of scheduled functions that found the end of their
    input, and of the functions cancelled with them (exactly-once epochs end that way,
    every epoch); TensorFlow itself marks the cancellations as derived and ignored."""
    logger = logging.getLogger("tensorflow")
    end_of_input = _EndOfInputFilter()
    logger.addFilter(end_of_input)
    try:
        yield
    finally:
        logger.removeFilter(end_of_input)


_AT_EXIT = weakref.WeakSet()  # TF coordinators whose failure handler must not hold up exit
_AT_EXIT_LOCK = threading.Lock()


def release_at_exit(tf_coordinator):
    """Lets the process exit promptly once its program has ended.

    * TensorFlow's failure handler holds its cluster lock while it reconnects to
      a failed worker, which blocks until that worker answers; the coordinator's
      `__del__` at interpreter exit then waits for the lock forever (a worker that
      left an elastic pool never answers). At exit, the handler is told to stop
      without taking the lock.
    * The interpreter's finalization (after the `atexit` handlers) runs the
      cyclic garbage collector over every object the process holds, three
      times (`Py_FinalizeEx`, `finalize_modules` and `finalize_interp_clear` in
      CPython 3.11's `Python/pylifecycle.c`): some 350,000 in a chief after
      `fit` (TensorFlow's and Keras' modules, traced functions and their
      graphs), and the deleters of those in reference cycles (a traced
      function's sends a `RemoveFunction` RPC to every task:
      `AtomicFunction.__del__` in TensorFlow's
      `python/eager/polymorphic_function/atomic_function.py`). That took 0.9-1.5
      s of CPU in every chief, whatever its job, and 2-6 s of wall time on two
      cores shared with the job's other processes and other runs (the 10-16 s
      of 3 chaos-soak jobs were most likely the same under more load), between
      the program's last line and its exit. At exit, the objects alive
      are moved out of the collector's reach (`gc.freeze()`): those in
      reference cycles are left to the operating system with the process
      (Python does not promise to finalize objects alive at exit; `atexit`
      handlers and `weakref.finalize` run as before, and objects no cycle holds
      are still freed as their modules are cleared). The exit takes 0.03-0.1 s
      of CPU.
    """
    import atexit

    with _AT_EXIT_LOCK:
        if not _AT_EXIT:
            atexit.register(_release_all)
        _AT_EXIT.add(tf_coordinator)


def _release_all():
    gc.freeze()
    for tf_coordinator in list(_AT_EXIT):
        handler = tf_coordinator._cluster.failure_handler
        handler._should_preemption_thread_run = False
        handler._cluster_due_for_update_or_finish.set()
        handler.stop = lambda: None  # its thread is a daemon: it ends with the process


def stop_coordinator(tf_coordinator, strategy):
    """Stops a TF `ClusterCoordinator`'s threads and detaches it from its strategy.

    Its worker threads end once their current function returns; the closure
    queue's watchdog and the failure handler stop at once.
    """
    tf_coordinator._cluster.stop()
    strategy._cluster_coordinator = None


def running_coordinator(strategy):
    """The strategy's TF `ClusterCoordinator`, a new one if it has none or its one was
    stopped (`stop_every_coordinator` stops those Keras made at `compile`, which stay
    attached to their strategies)."""
    existing = strategy._cluster_coordinator
    if existing is not None and not existing._cluster.closure_queue._should_process_closures:
        strategy._cluster_coordinator = None
    return cluster_coordinator.ClusterCoordinator(strategy)


def stop_every_coordinator():
    """Stops the threads of every TF `ClusterCoordinator` whose worker threads still run,
    including those of coordinators already garbage: TensorFlow's `__del__` only
    starts stopping them (`Cluster.stop()` lets the closure in progress run on).
    Queued closures are cancelled; wait with `join_coordinator_threads`."""
    clusters = {id(owner._cluster): owner._cluster for owner in (
        getattr(getattr(thread, "_target", None), "__self__", None)
        for thread in threading.enumerate()) if isinstance(owner, cluster_coordinator.Worker)}
    for cluster in clusters.values():
        cluster.stop()


def join_coordinator_threads(timeout: float) -> list:
    """Waits up to `timeout` seconds for TensorFlow's coordinator threads to end; returns
    the names of those still running."""
    deadline = time.monotonic() + timeout
    for thread in coordinator_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(thread.name for thread in coordinator_threads())


def rebuild_per_worker_resources(tf_coordinator, per_worker_values):
    """Makes each of `per_worker_values` (per-worker resources of `Worker.create_resource`,
    such as iterators, in worker order) again on its worker, from the start, as
    TensorFlow's coordinator does for a worker that came back: the function that made
    it runs again there and the same `RemoteValue` then holds the new resource.

    It runs on the worker's own queue, which the worker serves before the shared one:
    a function scheduled afterwards on that worker finds the new resource. A worker
    found failed is skipped (TensorFlow rebuilds its resources once it is back).
    """
    for worker, remote in zip(workers(tf_coordinator), per_worker_values._values):
        _rebuild_on(worker, [remote])


def _rebuild_on(worker, remotes) -> bool:
    """Runs the functions that made `remotes` (per-worker resources) again on `worker`'s
    own queue, unless TensorFlow found it failed; returns whether they run."""
    with worker._resource_tracking_lock:
        if worker._is_dead_with_error:
            return False
        for remote in remotes:
            worker._schedule_resource(remote._closure)
        return True
