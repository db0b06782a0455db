"""`kerasps.ParameterServerStrategy`: TensorFlow's strategy, made to work with Keras 3.

It is TensorFlow's `ParameterServerStrategy` (variables on ps tasks, steps
dispatched to workers by a `ClusterCoordinator`, workers using their GPUs
when they have them) with three additions:

* placement: each variable or shard goes to the ps task the `placement`
  policy picks (`"round_robin"`, `"greedy"` or a callable), and
  `placement_report()` lists where everything landed;
* Keras 3 sharding: partitioned Keras variables become
  `kerasps.ShardedVariable`s whose shards are real variables, so gradients,
  optimizers and checkpoints work;
* Keras integration: models built under `scope()` train with `model.fit`,
  `evaluate` and `predict` (see `kerasps.keras.trainer`).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref

import tensorflow as tf

from kerasps.backend import _keras, _tf, tf_logs
from kerasps.keras import hooks
from kerasps.keras.trainer.sync import SyncSteps
from kerasps.params import sparse as sparse_lib
from kerasps.params import variables as variables_lib
from kerasps.policy import consistency as consistency_lib
from kerasps.policy import membership as membership_lib
from kerasps.policy import placement as placement_lib
from kerasps.runtime import coordinator as coordinator_lib
from kerasps.runtime import input as input_lib
from kerasps.runtime import launch_env

__all__ = ["ParameterServerStrategy"]


def _validate_partitioner(variable_partitioner):
    if variable_partitioner is None or callable(variable_partitioner):
        return variable_partitioner
    raise ValueError(
        "Invalid value for argument `variable_partitioner`: expected a "
        "`kerasps.partitioners.Partitioner`, a callable (shape, dtype) -> list "
        f"of partitions, or None. Received: variable_partitioner={variable_partitioner!r}"
    )


def _validate_resolver(cluster_resolver):
    if not isinstance(cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
        raise ValueError(
            "Invalid value for argument `cluster_resolver`: expected a "
            "`tf.distribute.cluster_resolver.ClusterResolver` such as "
            "`kerasps.cluster.in_process(...)` or `kerasps.cluster.from_tf_config()`. "
            f"Received: cluster_resolver={cluster_resolver!r}"
        )
    jobs = cluster_resolver.cluster_spec().as_dict()
    for job in ("worker", "ps"):
        if not jobs.get(job):
            raise ValueError(
                f"Invalid value for argument `cluster_resolver`: the cluster needs "
                f"at least one `{job}` task. Received: cluster_spec={jobs!r}"
            )


def _warn_of_deleted_variables(paths, shown=8):
    """Warns that the Keras variables at `paths` were deleted, naming up to `shown` of
    them in order (the garbage collector finds them in no order of its own)."""
    if paths:
        paths = sorted(paths)
        named = ", ".join(repr(p) for p in paths[:shown]) + (", ..." if len(paths) > shown
                                                             else "")
        warnings.warn(
            f"{len(paths)} Keras variable(s) created before this strategy connected to the "
            f"cluster were deleted by the connection and can no longer be used ({named}). "
            "Create the strategy before models and variables.", stacklevel=3)


class _Extended(_tf.ParameterServerStrategyV2Extended):
    """TF's extended strategy with kerasps placement and bookkeeping."""

    def _init_kerasps(self, partitioner, placement):
        self._variable_partitioner = partitioner
        self._placer = placement_lib.get_placer(placement, self._num_ps)
        self._records = []
        self._records_lock = threading.Lock()
        self._tables = weakref.WeakSet()  # dynamic tables (`kerasps.layers`) made here

    @property
    def variable_partitioner(self):
        return self._variable_partitioner

    def num_shards(self, shape, dtype, name) -> int:
        """Number of shards the partitioner gives variable `name` (1 if none)."""
        if self._variable_partitioner is None or not shape:
            return 1
        partitions = self._variable_partitioner(tf.TensorShape(shape), tf.as_dtype(dtype))
        return placement_lib.shard_count(partitions, shape, name)

    def _record(self, var, ps_task, kwargs):
        name, shard = variables_lib.current_creation()
        shape = tuple(int(d) for d in var.shape)
        dtype = var.dtype.name
        nbytes = variables_lib.nbytes(shape, dtype)
        if name is None:
            name = kwargs.get("name") or var.name.split(":")[0]
        whole = name.rsplit("/part_", 1)[0] if shard is not None else name
        record = placement_lib.ShardRecord(
            name=name, variable=whole, shard=shard or 0, shape=shape, dtype=dtype,
            bytes=nbytes, ps_task=ps_task)
        with self._records_lock:
            self._records.append(record)
        return nbytes

    def _create_variable(self, next_creator, **kwargs):
        if "colocate_with" in kwargs and not kwargs.get("per_worker_variable"):
            var = super()._create_variable(next_creator, **kwargs)
            ps_task = _tf.device_ps_task(kwargs["colocate_with"].device)
            if ps_task is not None:
                self._placer.record(ps_task, self._record(var, ps_task, kwargs))
            return var
        if variables_lib.creating_keras_variable() and not kwargs.get("per_worker_variable"):
            # Keras variables are partitioned at the Keras level (ShardedVariable);
            # their tf.Variables, shards included, are never split again.
            var_creator = self._create_var_creator(next_creator, **kwargs)
            return self._create_variable_round_robin(var_creator, **kwargs)
        return super()._create_variable(next_creator, **kwargs)

    def _create_variable_round_robin(self, next_creator, **kwargs):
        # TF calls this for every unpartitioned variable and every TF-level shard;
        # the placement policy replaces TF's round-robin counter.
        name, _ = variables_lib.current_creation()
        name = name or kwargs.get("name") or "variable"
        shape = tuple(int(d) for d in tf.TensorShape(kwargs.get("shape") or ()))
        if not shape and kwargs.get("initial_value") is not None and not callable(
                kwargs["initial_value"]):
            shape = tuple(tf.convert_to_tensor(kwargs["initial_value"]).shape)
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        nbytes = variables_lib.nbytes(shape, dtype.name)
        ps_task = variables_lib.pinned_ps_task()
        if ps_task is None:
            ps_task = self._placer.choose(name, shape, dtype.name, nbytes)
            variables_lib.placed_on_ps_task(ps_task)
        with _tf.no_colocation():
            with tf.device(f"/job:ps/task:{ps_task}/device:CPU:0"):
                var = next_creator(**kwargs)
        self._placer.record(ps_task, self._record(var, ps_task, kwargs))
        self._variable_count += 1
        return var


    def _distribute_datasets_from_function(self, dataset_fn, options):
        # TF gives every worker input_pipeline_id=0. While kerasps builds one
        # worker's pipeline, hand the dataset_fn that worker's real context.
        context = input_lib.current_worker_input_context()
        if context is None:
            return super()._distribute_datasets_from_function(dataset_fn, options)

        def worker_dataset_fn(_):
            dataset = input_lib.check_dataset(dataset_fn(context), dataset_fn)
            input_lib.record_dataset_info(dataset)
            return dataset

        return _tf.distributed_datasets_from_function(
            self._container_strategy(), worker_dataset_fn,
            self._input_workers_with_options(options), context, options)


class ParameterServerStrategy(_tf.ParameterServerStrategyV2):
    """Parameter-server training for Keras 3 models.

    Variables created under `scope()` live on the ps tasks; steps run on the
    workers (on their GPUs when they have them). Use it like TensorFlow's
    `tf.distribute.experimental.ParameterServerStrategy`:

    ```python
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.resolve(num_workers=2, num_ps=2),
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=2),
        placement="greedy")
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile("adam", "mse", steps_per_execution=10)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=100)
    print(strategy.placement_report())
    ```

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            with `worker` and `ps` jobs: `kerasps.cluster.in_process` (a cluster
            in this process), `kerasps.cluster.from_tf_config` (the cluster
            `TF_CONFIG` names: `kerasps launch`, Kubernetes), or
            `kerasps.cluster.resolve` (the cluster `TF_CONFIG` names where it
            is set, an in-process one elsewhere: one script runs both ways).
            `in_process` raises in a task of a `kerasps launch` job and warns
            where another `TF_CONFIG` is set.
        variable_partitioner: a `kerasps.partitioners.Partitioner` (or any
            callable `(shape, dtype) -> partitions` in TensorFlow's format);
            `None` keeps every variable whole.
        placement: `"round_robin"` (default), `"greedy"` (the ps task holding
            the fewest bytes so far) or a callable
            `(name, shape, dtype, num_ps) -> ps index`.
        sparse_updates: how optimizers update the shards of sharded tables
            (embeddings) from the rows a batch looks up. `"exact"` (default):
            only the batch's rows of the table and of its slots are updated
            where that is exactly Keras' dense update (`SGD` without momentum,
            `Adagrad`, `Ftrl`); other optimizers update every row, as in
            Keras. `"lazy"`: `Adam`, `AdamW`, `RMSprop` and `SGD` with momentum
            also update the batch's rows only, and the slots of other rows keep
            their values (TF1's `LazyAdamOptimizer`). A strategy argument, not
            an optimizer wrapper, because it concerns the tables the strategy
            shards: models compiled with an optimizer's name get it, and the
            optimizer, its config and its saved slots stay plain Keras. See
            `kerasps.sparse`.
        mode: `"async"` (default): every worker's gradient updates the
            variables when it arrives. `"sync"`: each global step applies one
            update, the mean of the first `num_workers - backup_workers`
            gradients computed on the same variables (averaged on the ps
            tasks); later ones are dropped. `"hybrid"`: the row updates of
            embedding tables are applied as each worker's gradient arrives (as
            in async mode, a late worker's included), the dense variables'
            gradients in global steps (as in sync mode); which variables update
            on arrival can be set per layer with
            `kerasps.consistency.update_on_arrival`. See `kerasps.consistency`.
        backup_workers: sync and hybrid only: gradients a step does not wait
            for, so that the slowest workers do not set the pace (default 0).
        max_staleness: async only: the most updates a gradient may be behind
            when applied; the coordinator holds back fast workers instead
            (stale synchronous parallel). `None` (default): unbounded.
        step_timeout: seconds a call waits with none of its scheduled
            functions finishing (in sync mode: a global step for its
            gradients; a worker lost with no backup to replace it, and not
            restarted) before it fails with a `TimeoutError` naming the
            workers that do not answer; the wait is logged every 30 s before
            that. Default 600.
        min_workers: the elastic pool's lower bound. Every declared worker
            must answer when the strategy connects (TensorFlow's coordinator
            creates its context on each); after that any may leave and come
            back, and while fewer than `min_workers` answer, `fit` holds
            training. `None` (default): `$KERASPS_MIN_WORKERS`, set by
            `kerasps launch --workers MIN:MAX`, or 1. See `kerasps.membership`.
        min_workers_timeout: seconds `fit` holds training below `min_workers`
            before it fails with `kerasps.membership.TooFewWorkersError`.
            Default 600.
        measure_staleness: async only: `True` (default): every step adds its
            gradient's staleness (updates applied since it read the weights) to
            a counter on a ps task, and `fit` reports the epoch's mean as
            `staleness` in its batch and epoch logs. `False` drops that update
            and the log entry, about 0.5 ms of CPU per step on a small model
            (`benchmarks/README.md`). `max_staleness` does not need it.
    """

    _is_kerasps = True

    def __init__(self, cluster_resolver, variable_partitioner=None, placement="round_robin",
                 sparse_updates="exact", mode="async", backup_workers=0, max_staleness=None,
                 step_timeout=600.0, min_workers=None, min_workers_timeout=600.0,
                 measure_staleness=True):
        _validate_resolver(cluster_resolver)
        self._sparse_updates = sparse_lib.validate_mode(sparse_updates)
        num_workers = len(cluster_resolver.cluster_spec().as_dict()["worker"])
        self._consistency = consistency_lib.Consistency.of(
            mode, backup_workers, max_staleness, num_workers, measure_staleness)
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not (
                step_timeout > 0):
            raise ValueError("Invalid value for argument `step_timeout`: it must be a positive "
                             f"number of seconds. Received: step_timeout={step_timeout!r}")
        self._step_timeout = float(step_timeout)
        if min_workers is None:
            min_workers = int(os.environ.get(launch_env.MIN_WORKERS_ENV, "1"))
        self._pool = membership_lib.PoolSpec(num_workers, min_workers, min_workers_timeout)
        variable_partitioner = _validate_partitioner(variable_partitioner)
        num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
        placement_lib.get_placer(placement, num_ps)  # validate before connecting
        hooks.install()
        tf_logs.quiet_tensorflow_logger()  # TensorFlow's strategy logs at INFO from here
        first_connection = not _tf.connected()
        _tf.forget_functions_of_earlier_connections()
        _tf.install_context_bound_resource_deleters()
        _tf.restart_input_of_retried_functions()
        _tf.install_function_removals_per_connection()
        _tf.install_coordinator_stop_off_the_collecting_thread()  # Keras' too, at `compile`
        _tf.follow_resolver(cluster_resolver)  # where tasks move (Ray), connect where they are
        _tf.report_worker_failures()
        _tf.keep_executor_tracebacks_in_detail()
        tf_logs.keep_fault_detail()
        coordinator_lib.stop_every_coordinator()
        super().__init__(cluster_resolver, variable_partitioner=None)
        if first_connection:
            _warn_of_deleted_variables(_keras.disown_variables_of_old_context())
        self._extended.__class__ = _Extended
        self._extended._init_kerasps(variable_partitioner, placement)
        self._placement = placement
        launch_env.report_connected()

    def experimental_distribute_dataset(self, dataset, options=None):
        """TensorFlow's distributed dataset, which kerasps's `fit`, `evaluate`,
        `predict` and `ClusterCoordinator.create_per_worker_dataset` also accept.

        They read it as they read `dataset` itself (see `kerasps.keras.trainer` and
        `kerasps.ClusterCoordinator.create_per_worker_dataset`), with `options`
        a `kerasps.InputOptions` (`exactly_once`, `shard_policy`) or TensorFlow's.
        """
        kerasps_options = input_lib.as_input_options(options, "options")
        distributed = super().experimental_distribute_dataset(
            dataset, input_lib.tf_input_options(options))
        distributed._kerasps_input = input_lib.DistributedInput(
            dataset=dataset, options=kerasps_options)
        return distributed

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """TensorFlow's per-worker datasets, which kerasps's `fit`, `evaluate`,
        `predict` and `ClusterCoordinator.create_per_worker_dataset` also accept.

        They read it as `kerasps.DatasetCreator(dataset_fn, options)`: each
        worker calls `dataset_fn` with its own `kerasps.InputContext`.
        """
        input_lib.as_input_options(options, "options")
        distributed = super().distribute_datasets_from_function(
            dataset_fn, input_lib.tf_input_options(options))
        distributed._kerasps_input = input_lib.DistributedInput(
            creator=input_lib.DatasetCreator(dataset_fn, input_options=options))
        return distributed

    @property
    def num_workers(self) -> int:
        return self._extended._num_workers

    @property
    def num_ps(self) -> int:
        return self._extended._num_ps

    @property
    def variable_partitioner(self):
        return self._extended.variable_partitioner

    @property
    def sparse_updates(self) -> str:
        """`"exact"` or `"lazy"`: how sharded tables are updated (see `__init__`)."""
        return self._sparse_updates

    @property
    def mode(self) -> str:
        """`"async"`, `"sync"` or `"hybrid"` (see `__init__`)."""
        return self._consistency.mode.value

    @property
    def backup_workers(self) -> int:
        return self._consistency.backup_workers

    @property
    def max_staleness(self) -> int | None:
        return self._consistency.max_staleness

    @property
    def measure_staleness(self) -> bool:
        return self._consistency.measure_staleness

    @property
    def consistency(self) -> consistency_lib.Consistency:
        return self._consistency

    @property
    def step_timeout(self) -> float:
        return self._step_timeout

    @property
    def pool(self) -> membership_lib.PoolSpec:
        """The worker pool's bounds (`max_workers` declared, `min_workers`, timeout)."""
        return self._pool

    def placement_report(self) -> placement_lib.PlacementReport:
        """Where every variable and shard created under `scope()` lives.

        Returns:
            A `kerasps.placement.PlacementReport`: a tuple of `ShardRecord`s
            (fields `name`, `variable`, `shard`, `shape`, `dtype`, `bytes`,
            `ps_task`) that prints as a table with the bytes per ps task and
            their `imbalance` (max/mean bytes per ps task, 1.0 when even), and,
            as `tables`, each dynamic table's rows used, admitted, evicted and
            hit rate per ps task (`kerasps.tables.TableRecord`s, read now).
        """
        tables = [record for table in sorted(self._extended._tables, key=lambda t: t.name)
                  for record in table.records()]
        with self._extended._records_lock:
            return placement_lib.PlacementReport(self._extended._records, num_ps=self.num_ps,
                                                 tables=tables)

    def coordinator(self):
        """Returns the strategy's `kerasps.ClusterCoordinator` (created once)."""
        from kerasps.runtime.coordinator import ClusterCoordinator

        return ClusterCoordinator(self)

    def _sync_steps(self, coordinator, optimizer, step):
        """The synchronous global steps of `step` (`ClusterCoordinator.sync_step`): the
        coordinator, below the trainer, is handed them by the strategy."""
        return SyncSteps(coordinator, optimizer, step)

    def shutdown(self, timeout: float = 60.0):
        """Stops the strategy's coordinator, if it has one, and waits for its threads.

        After it, no kerasps or TensorFlow coordinator thread remains; the
        strategy's variables stay usable, and a later `fit` or
        `ClusterCoordinator(strategy)` starts a new coordinator.
        """
        coordinator = getattr(self, "_kerasps_coordinator", None)
        if coordinator is not None:
            coordinator.shutdown(timeout)

