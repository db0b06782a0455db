"""The one place kerasps reaches into Keras' private modules (`keras.src...`).

Keras 3 has no extension points for parameter-server training, so kerasps
hooks in at a few seams. Each hook defers to the original Keras code unless
the object involved belongs to a kerasps strategy, so Keras behaves exactly as
before outside a kerasps scope. A Keras upgrade that moves these seams touches
only this file.

Seams:
  * `Variable.__new__`: under a kerasps scope with a partitioner, a variable
    large enough to split is created as a `kerasps.ShardedVariable`.
  * `Variable._initialize`: names the variable being placed, for the
    placement report.
  * `Tracker.add_to_store`: a layer tracks the shards of a `ShardedVariable`
    (so `trainable_variables`, gradients and optimizers see real variables,
    as `tf_keras` did with TF's `ShardedVariable`).
  * `Layer.save_own_variables/load_own_variables/_check_load_own_variables`:
    weights files hold whole variables, whatever the number of shards.
  * `TFOptimizer.add_variable_from_reference`: optimizer slots are never
    re-partitioned; they sit next to their variable.
  * `backend.numpy.take`: a row lookup in a `ShardedVariable` gathers on each
    shard's ps task instead of concatenating the whole table.
  * `TensorFlowTrainer.fit/evaluate/predict` (and the `*_on_batch` methods):
    models built under a kerasps strategy run through `kerasps.trainer`.
"""

from __future__ import annotations

import functools
import inspect

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import callbacks as callbacks_module
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers.layer import Layer
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils import tracking
from keras.src.utils.python_utils import pythonify_logs

# `keras.Variable`: the TF backend's variable class, as layers create it.
KerasTFVariable = keras_backend.Variable
TensorFlowTrainer = tf_trainer.TensorFlowTrainer
CallbackList = callbacks_module.CallbackList
reduce_per_replica = tf_trainer.reduce_per_replica
unpack_x_y_sample_weight = data_adapter_utils.unpack_x_y_sample_weight

__all__ = [
    "KerasTFVariable",
    "TensorFlowTrainer",
    "CallbackList",
    "reduce_per_replica",
    "unpack_x_y_sample_weight",
    "pythonify_logs",
    "in_stateless_scope",
    "install",
]

def metrics_result_or_logs(model, logs):
    """Epoch logs: the model's metric results, or `logs` for custom step outputs."""
    return model._get_metrics_result_or_logs(logs)


def history_of(callbacks):
    """The `keras.callbacks.History` of a `CallbackList`, or `None`."""
    return getattr(callbacks, "_history", None)


def flatten_metrics_in_order(model, logs):
    return model._flatten_metrics_in_order(logs)


def should_eval(model, epoch, validation_freq):
    return model._should_eval(epoch, validation_freq)


def compute_output_spec(model, input_spec):
    """The model's output `KerasTensor`s for inputs described by `tf.TensorSpec`s."""
    from keras.src import tree

    def to_keras_tensor(spec):
        return keras_backend.KerasTensor(tuple(spec.shape), keras_backend.standardize_dtype(
            spec.dtype))

    return keras_backend.compute_output_spec(model, tree.map_structure(to_keras_tensor,
                                                                       input_spec))


_VARIABLE_SIGNATURE = inspect.signature(KerasTFVariable.__init__)
_installed = False


def bind_variable_args(args, kwargs) -> dict:
    """Binds `Variable(...)` arguments to their names (without `self`)."""
    bound = _VARIABLE_SIGNATURE.bind_partial(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", {})
    arguments.update(extra)
    return arguments


def install():
    """Installs the hooks (idempotent). Called when `kerasps.strategy` is imported."""
    global _installed
    if _installed:
        return
    _installed = True
    from kerasps import trainer as kerasps_trainer
    from kerasps import variables as kerasps_variables

    # Variable creation -------------------------------------------------------
    original_new = KerasTFVariable.__new__

    def variable_new(cls, *args, **kwargs):
        if cls is KerasTFVariable:
            sharded_cls = kerasps_variables.sharded_class_for(args, kwargs)
            if sharded_cls is not None:
                return object.__new__(sharded_cls)
        if original_new is object.__new__:
            return object.__new__(cls)
        return original_new(cls, *args, **kwargs)

    KerasTFVariable.__new__ = variable_new

    original_initialize = KerasTFVariable._initialize

    @functools.wraps(original_initialize)
    def variable_initialize(self, value):
        if kerasps_variables.kerasps_strategy() is None:
            return original_initialize(self, value)
        self._kerasps_remote = True
        with kerasps_variables.creating(self):
            return original_initialize(self, value)

    KerasTFVariable._initialize = variable_initialize

    # Concurrent updates of ps variables must not be lost. Keras implements
    # `assign_add` as `assign(self + value)`, a read and a write: two workers
    # doing it at once lose one update (metric totals, the optimizer's
    # `iterations`). On ps variables use TensorFlow's atomic AssignAddVariableOp.
    for op_name in ("assign_add", "assign_sub"):
        original_op = getattr(KerasTFVariable, op_name)

        def atomic_op(self, value, __original=original_op, __name=op_name):
            if getattr(self, "_kerasps_remote", False) and not in_stateless_scope():
                value = tf.cast(value, self._value.dtype)
                getattr(self._value, __name)(value)
                return value
            return __original(self, value)

        functools.update_wrapper(atomic_op, original_op)
        setattr(KerasTFVariable, op_name, atomic_op)

    # Keras metrics (AUC, Precision, Recall, MeanIoU...) accumulate with
    # `v.assign(v + delta)`. For accumulators on ps tasks (metric state is
    # declared `synchronization="on_read"`), remember the sum `v + delta`
    # computed in a traced function, and turn its assignment into an atomic
    # `assign_add(delta)`. Any other assignment is left alone.
    def _is_accumulator(variable):
        return (getattr(variable, "_kerasps_remote", False)
                and variable.synchronization == "on_read" and tf.inside_function())

    for op_name in ("__add__", "__radd__"):
        original_add = getattr(KerasTFVariable, op_name)

        def remembered_add(self, other, __original=original_add):
            result = __original(self, other)
            if _is_accumulator(self):
                self._kerasps_last_sum = (result, other)
            return result

        functools.update_wrapper(remembered_add, original_add)
        setattr(KerasTFVariable, op_name, remembered_add)

    original_assign = KerasTFVariable.assign

    @functools.wraps(original_assign)
    def assign(self, value):
        last_sum = getattr(self, "_kerasps_last_sum", None)
        if last_sum is not None and value is last_sum[0] and _is_accumulator(self):
            self._kerasps_last_sum = None
            delta = tf.cast(last_sum[1], self._value.dtype)
            self._value.assign_add(delta)
            return value
        return original_assign(self, value)

    KerasTFVariable.assign = assign

    # Layer tracking ----------------------------------------------------------
    original_add_to_store = tracking.Tracker.add_to_store

    @functools.wraps(original_add_to_store)
    def add_to_store(self, store_name, value):
        if isinstance(value, kerasps_variables.ShardedVariable):
            for shard in value.shards:
                if not self.is_in_store(store_name, shard):
                    original_add_to_store(self, store_name, shard)
            # Mark the container as seen so `track` does not add it again.
            self.stored_ids[store_name].add(id(value))
            return
        return original_add_to_store(self, store_name, value)

    tracking.Tracker.add_to_store = add_to_store

    # Weights files -------------------------------------------------------------
    # Layers save and load whole variables, never shards, so `.weights.h5` and
    # `.keras` files do not depend on the number of ps tasks.
    def _logical(layer):
        return kerasps_variables.logical_variables(
            layer._trainable_variables + layer._non_trainable_variables)

    def _sharded(layer):
        return any(hasattr(v, "_kerasps_container") for v in
                   layer._trainable_variables + layer._non_trainable_variables)

    original_check = Layer._check_load_own_variables

    @functools.wraps(original_check)
    def check_load_own_variables(self, store):
        if _sharded(self) and len(store.keys()) == len(_logical(self)):
            return
        return original_check(self, store)

    Layer._check_load_own_variables = check_load_own_variables

    original_save = Layer.save_own_variables
    original_load = Layer.load_own_variables

    @functools.wraps(original_save)
    def save_own_variables(self, store):
        if not _sharded(self):
            return original_save(self, store)
        for i, variable in enumerate(_logical(self)):
            store[f"{i}"] = variable

    @functools.wraps(original_load)
    def load_own_variables(self, store):
        if not _sharded(self):
            return original_load(self, store)
        self._check_load_own_variables(store)
        for i, variable in enumerate(_logical(self)):
            variable.assign(store[f"{i}"])

    Layer.save_own_variables = save_own_variables
    Layer.load_own_variables = load_own_variables

    # Optimizer slots -----------------------------------------------------------
    original_from_reference = tf_optimizer.TFOptimizer.add_variable_from_reference

    @functools.wraps(original_from_reference)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        with kerasps_variables.no_partitioning():
            return original_from_reference(self, reference_variable, *args, **kwargs)

    tf_optimizer.TFOptimizer.add_variable_from_reference = add_variable_from_reference

    # Row lookups ---------------------------------------------------------------
    original_take = tf_numpy.take

    @functools.wraps(original_take)
    def take(x, indices, axis=None):
        if isinstance(x, kerasps_variables.ShardedVariable) and axis in (0, -x.ndim):
            return x.lookup(indices)
        return original_take(x, indices, axis=axis)

    tf_numpy.take = take

    # Training loops ------------------------------------------------------------
    for name in ("fit", "evaluate", "predict",
                 "train_on_batch", "test_on_batch", "predict_on_batch"):
        original = getattr(TensorFlowTrainer, name)
        replacement = getattr(kerasps_trainer, name)

        def dispatch(self, *args, __original=original, __replacement=replacement, **kwargs):
            if kerasps_trainer.uses_kerasps(self):
                with self.distribute_strategy.scope():
                    return __replacement(self, *args, **kwargs)
            return __original(self, *args, **kwargs)

        functools.update_wrapper(dispatch, original)
        setattr(TensorFlowTrainer, name, dispatch)
