"""`model.fit`, `evaluate` and `predict` for Keras models built under a kerasps strategy.

One module per concern: `inputs` (the `x` argument made into per-worker
pipelines), `steps` (the functions scheduled on workers), `dispatch` (a
bounded window of scheduled functions, results in order), `recovery`
(bringing a lost ps task's state back inside `fit`), `sync` and `staleness`
(consistency modes), `elastic` (watching the worker pool), `epochs` (one class
per way of running an epoch: async, sync, exactly-once), then `training` (the
epoch loop, written once), `evaluation`, `prediction` and `on_batch`.

Keras' own TensorFlow trainer runs each step with `strategy.run` on the
coordinator; under parameter-server training steps must instead be scheduled
on the workers. These functions replace `fit`, `evaluate`, `predict` and the
`*_on_batch` methods for models whose strategy is a
`kerasps.ParameterServerStrategy` (the dispatch lives in `kerasps.backend._keras`);
every other model keeps Keras' code.

How a `fit` runs:

* Each worker builds its own input pipeline (see `kerasps.input`) once per
  `DatasetCreator` and keeps one iterator over it; training input is
  repeated, so an epoch is `steps_per_epoch` steps taken by whichever workers
  are free, and a later `fit` with the same `DatasetCreator` continues the
  stream where the previous one stopped. Exactly-once input
  (`kerasps.InputOptions(exactly_once=True)`, and a finite dataset or arrays
  without `steps_per_epoch`) is instead one tf.data service job per epoch
  that every worker reads from (`kerasps.data_service`). Plain steps run
  until one finds the end of the data (TensorFlow then cancels the queued
  ones, which had read nothing); each worker then trains on the batches its
  reader still holds, one step at a time, until it finds the end too (or no
  longer answers). With `steps_per_execution > 1` the scheduled functions
  count the steps they ran instead.
* A scheduled function runs `steps_per_execution` training steps on a worker.
  The coordinator keeps a bounded number of functions in flight
  (`STEPS_IN_FLIGHT_PER_WORKER` per worker) and, as results arrive, calls
  `on_train_batch_end` in step order with the running metrics: batch-level
  callbacks and a live progress bar work, at most a window behind the workers.
  `on_train_batch_begin` is called when a step is scheduled. When no callback
  overrides `on_train_batch_end` (or `on_batch_end`), as with `verbose=0` and
  epoch-level callbacks only, it is not called and only the first and last
  functions of an epoch return their logs (the others skip copying them to
  the coordinator); epoch logs are the metrics read on the ps as before.
* Metrics live on the ps tasks and every worker updates them, so epoch logs,
  read on the coordinator after the epoch's steps finish, aggregate all
  workers exactly.

Inputs accepted for `x`:

* `kerasps.DatasetCreator` (or a callable taking an `InputContext`);
* a batched `tf.data.Dataset`: without `steps_per_epoch` (finite datasets),
  read exactly once per epoch; otherwise each worker reads its shard under
  `shard_policy` (default `"auto"`: by files when it reads enough of them,
  else worker `i` reads the batches `k` with `k % num_workers == i`);
* arrays (NumPy, tensors, or dicts/lists of them) with `y`, `sample_weight`
  and `batch_size` (default 32): converted to such a dataset; `fit`
  shuffles them each epoch unless `shuffle=False`;
* what the strategy's own `experimental_distribute_dataset(dataset, options)`
  and `distribute_datasets_from_function(fn, options)` return (code ported
  from tf_keras): read as `dataset` (with `options`, a `kerasps.InputOptions`)
  and as `DatasetCreator(fn, options)`.

A compiled model need not be built first: `fit`, `evaluate` and the
`*_on_batch` methods build it with its loss and metrics, `predict` and
`predict_on_batch` build its layers only (there are no targets).

`evaluate` and `predict` without `steps` run until every worker's dataset is
exhausted, visiting each element once. `predict` returns each of the input's
first `steps` batches (all of them without `steps`) once, in input order. Both
read one pipeline whatever the input, as tf_keras' did: a `DatasetCreator`'s
`dataset_fn` is called once, on the coordinator, with
`InputContext(num_input_pipelines=1, input_pipeline_id=0)` (kerasps cannot tell
whether a `dataset_fn` shards by its context; one that ignores it would give
every worker the same batches, counted once per worker). Every worker runs that
pipeline and keeps batches `k` with `k % num_workers == i`; for `predict` the
function for batch `k` runs on worker `k % num_workers`. (`evaluate`, and
`fit`'s `validation_data`, split it by files instead with
`kerasps.InputOptions(shard_policy="file")` or `"auto"`, and serve it through
the tf.data service with `exactly_once=True`.) The pipeline must yield the same
batches in the same order on every worker (no unseeded shuffling).
"""

from __future__ import annotations

from kerasps.keras.trainer.dispatch import STEPS_IN_FLIGHT_PER_WORKER
from kerasps.keras.trainer.evaluation import evaluate
from kerasps.keras.trainer.on_batch import predict_on_batch, test_on_batch, train_on_batch
from kerasps.keras.trainer.prediction import predict
from kerasps.keras.trainer.training import fit

__all__ = ["fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
           "predict_on_batch", "uses_kerasps", "STEPS_IN_FLIGHT_PER_WORKER"]


def uses_kerasps(model) -> bool:
    """True if `model` was built under a `kerasps.ParameterServerStrategy` scope."""
    strategy = getattr(model, "_distribute_strategy", None)
    return bool(getattr(strategy, "_is_kerasps", False))
