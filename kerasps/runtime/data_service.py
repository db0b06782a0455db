"""Exactly-once input: datasets served to the workers by TensorFlow's tf.data service.

With per-worker input every worker reads its own shard, and a fast worker
runs out of (or, repeated, re-reads) its shard while a slow one has not
finished: an epoch of `steps_per_epoch` steps visits some elements twice and
misses others. `kerasps.InputOptions(exactly_once=True)` instead registers
the whole dataset with a tf.data service dispatcher and gives every worker an
iterator of the same job: the data workers hand each element to whichever
worker asks next, once. One job is one epoch; `ServedDataset.epoch()` names
a new job for the next one.

    service = DataService.in_process()            # dispatcher + data worker here
    served = ServedDataset(service.address, dataset, data_workers=1)
    per_worker = coordinator.create_per_worker_dataset(served.epoch())

Where the pieces run: kerasps starts the dispatcher and one data worker in
the coordinator's process (the input pipeline, Python functions included, runs
there); `InputOptions(service="grpc://host:port")` uses a dispatcher that the
deployment runs instead, with data workers wherever it puts them.

How the data is split: with the one in-process data worker, that worker runs
the whole pipeline once per job (`ShardingPolicy.OFF`: nothing to split, and
no round trip per element). With a service of unknown size, the dispatcher
hands out the source's splits dynamically (`ShardingPolicy.DYNAMIC`, TF's
`"distributed_epoch"`): one file of a file-reading dataset, but one element
of `from_tensor_slices` or `range`, each fetched with an RPC, so read files
there.

What a failure costs: training steps are at-least-once (TensorFlow runs the
step of a failed worker again elsewhere) and the tf.data service is
at-most-once for what a consumer had received: the batches a killed worker
had fetched and not yet trained on are lost, never repeated. kerasps keeps
that small by asking for one element at a time (`max_outstanding_requests=1`).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import uuid

import tensorflow as tf

from kerasps.backend import _tf

__all__ = ["DataService", "ServedDataset", "serve"]

_service = tf.data.experimental.service
# How often a reader asks the dispatcher for task changes, in ms: the end of a job is
# noticed that late, at the end of every epoch.
TASK_REFRESH_MS = 50
_LOCK = threading.Lock()
_IN_PROCESS = {}  # host -> DataService, started once per process


class DataService:
    """A tf.data service dispatcher and its data workers, in this process.

    In-process servers live as long as the process (TensorFlow cannot stop
    them); `in_process()` starts them once and returns the same service after.

    Args:
        host: the name the workers reach this process by (`"localhost"` when
            every task runs on this machine).
        num_data_workers: data workers to start; each runs the whole input
            pipeline on the splits (files, slices) it is handed.
    """

    def __init__(self, host: str = "localhost", num_data_workers: int = 1):
        self.dispatcher = _service.DispatchServer()
        self.address = self.dispatcher.target.replace("localhost", host, 1)
        dispatcher_address = self.address.split("://", 1)[1]
        self.data_workers = [
            _service.WorkerServer(_service.WorkerConfig(
                dispatcher_address=dispatcher_address, worker_address=f"{host}:%port%"))
            for _ in range(num_data_workers)]
        for server in (self.dispatcher, *self.data_workers):
            _never_stopped(server)

    @classmethod
    def in_process(cls, host: str = "localhost") -> DataService:
        with _LOCK:
            if host not in _IN_PROCESS:
                _IN_PROCESS[host] = cls(host)
            return _IN_PROCESS[host]


def _never_stopped(server):
    """Keeps `server` (a tf.data service server) for the life of the process, never stopped.

    A data worker's `stop()`, which its `__del__` calls at interpreter exit, destroys its
    tasks and waits for their input threads, and the thread of a job whose readers were
    cancelled at the end of an epoch can stay blocked for good: the process never exited
    (`test_exactly_once_epochs_lose_nothing_under_cpu_load`, 2 runs of 2). An extra
    reference that is never released means `__del__` and the C++ destructor never run;
    the process's exit ends the servers.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(server))


def serve(strategy, options, dataset) -> ServedDataset:
    """`dataset` registered with the service `options` (a `kerasps.InputOptions`) asks for.

    Without `options.service`, the in-process service, named by the host the
    chief's address has in the cluster (workers on other machines connect to it).
    """
    if options.service is not None:
        return ServedDataset(options.service, dataset)
    chief = strategy._cluster_resolver.cluster_spec().as_dict().get("chief") or ["localhost:0"]
    service = DataService.in_process(chief[0].rsplit(":", 1)[0])
    return ServedDataset(service.address, dataset, data_workers=len(service.data_workers))


class ServedDataset:
    """A dataset registered with a tf.data service, read by the workers one job per epoch.

    Args:
        address: the dispatcher's address.
        dataset: the whole dataset (every element of an epoch).
        data_workers: the service's data workers if known: with exactly one,
            it produces the dataset once per job unsplit; otherwise (`None`)
            the dispatcher splits it among them dynamically.
    """

    _jobs = itertools.count()

    def __init__(self, address: str, dataset: tf.data.Dataset, data_workers: int | None = None):
        self.address = address
        self.processing_mode = (_service.ShardingPolicy.OFF if data_workers == 1
                                else _service.ShardingPolicy.DYNAMIC)
        self.element_spec = dataset.element_spec
        with tf.init_scope():
            self.dataset_id = _service.register_dataset(address, dataset, compression=None)
        self._name = uuid.uuid4().hex[:12]

    def epoch(self):
        """A no-argument dataset function: each worker's reader of a new job (epoch).

        Every worker's iterator of the returned function shares the job, so
        each element of the dataset goes to one of them; a worker that
        restarts reads on from the same job.
        """
        job_name = f"kerasps-{self._name}-{next(self._jobs)}"

        def dataset_fn():
            return _tf.data_service_reader(self.address, self.dataset_id, self.element_spec,
                                           self.processing_mode, job_name, TASK_REFRESH_MS)

        return dataset_fn
