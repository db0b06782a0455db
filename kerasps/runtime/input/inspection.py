"""Dataset inspection on the coordinator (sizes, element specs) and the input context
a worker's pipeline is built under."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading

import tensorflow as tf

from kerasps.runtime.input.options import InputContext, check_dataset

# -- Per-worker input contexts -------------------------------------------------
_building = threading.local()


@dataclasses.dataclass
class DatasetInfo:
    """What tracing the workers' pipelines revealed.

    Attributes:
        element_spec: the spec of one element of a worker's `tf.data.Dataset`.
    """

    element_spec: object = None


@contextlib.contextmanager
def worker_input_context(context: InputContext, info: DatasetInfo | None = None):
    """While active, `strategy.distribute_datasets_from_function` passes `context`."""
    previous = getattr(_building, "state", None)
    _building.state = (context, info)
    try:
        yield
    finally:
        _building.state = previous


def current_worker_input_context():
    state = getattr(_building, "state", None)
    return None if state is None else state[0]


def _worker_context(strategy, worker_index) -> InputContext:
    return InputContext(
        num_input_pipelines=strategy.num_workers,
        input_pipeline_id=worker_index,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )


def cardinalities(strategy, dataset_fn) -> list:
    """Per worker, the number of elements `dataset_fn(input_context)` yields.

    `tf.data.INFINITE_CARDINALITY` (-1) marks an endless pipeline and `None`
    one whose size TensorFlow cannot tell without reading it. The function is
    called eagerly on the coordinator, once per worker; no data is read.
    """
    result = []
    with tf.init_scope():
        for i in range(strategy.num_workers):
            dataset = check_dataset(dataset_fn(_worker_context(strategy, i)), dataset_fn)
            n = int(dataset.cardinality())
            result.append(None if n == tf.data.UNKNOWN_CARDINALITY else n)
    return result


def whole_dataset(strategy, dataset_fn):
    """`dataset_fn`'s dataset for one input pipeline that feeds every worker
    (`exactly_once` input), built eagerly on the coordinator."""
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=strategy.num_replicas_in_sync)
    with tf.init_scope():
        return check_dataset(dataset_fn(context), dataset_fn)


def _takes_argument(fn) -> bool:
    fn = getattr(fn, "python_function", fn)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


def record_dataset_info(dataset):
    """Called while tracing a worker's pipeline: remembers its element spec."""
    state = getattr(_building, "state", None)
    if state is None or state[1] is None:
        return
    state[1].element_spec = dataset.element_spec
