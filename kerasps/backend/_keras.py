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
  * `Variable.assign_add/assign_sub`: on a ps task, TensorFlow's atomic op (no
    update lost between workers); an increment known when tracing is made there.
  * `Tracker.add_to_store`: a layer tracks the shards of a `ShardedVariable`
    (so `trainable_variables`, gradients and optimizers see real variables,
    as `tf_keras` did with TF's `ShardedVariable`).
  * `Layer` and `TFOptimizer` `save_own_variables/load_own_variables`,
    `Layer._check_load_own_variables`, `TFOptimizer._trackable_children`:
    weights files and checkpoints hold whole variables and whole optimizer
    slots, whatever the number of shards. `TFOptimizer.build` notes how many
    variables an optimizer had before it was built: a file saved then (a model
    saved before any training) restores those and no slots.
  * `saving_lib._load_state`: loading a weights file into a kerasps model
    checks every variable's shape before assigning any.
  * `Layer.get_weights/set_weights`: whole variables; `Model.export`: a
    single-process copy is exported.
  * `TFOptimizer.add_variable_from_reference`: optimizer slots are never
    re-partitioned; they sit next to their variable, and the slots of a
    sharded variable's shards make a `ShardedVariable`.
  * `TFOptimizer._distributed_tf_update_step/_apply_weight_decay`: a shard
    with a row-update gradient is updated on the batch's rows only
    (`kerasps.sparse`), as the strategy's `sparse_updates` mode allows; the
    learning rate and `iterations` are read once per step, not per variable,
    and the small gradients of one ps task's variables cross to it in one tensor.
  * `backend.numpy.take`: a row lookup in a `ShardedVariable` gathers on each
    shard's ps task instead of concatenating the whole table.
  * `TensorFlowTrainer.fit/evaluate/predict` (and the `*_on_batch` methods):
    models built under a kerasps strategy run through `kerasps.trainer`.
  * `Variable._value`: a Keras variable whose TensorFlow variable was deleted
    when the process connected to its cluster raises an error saying so.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import shutil
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import callbacks as callbacks_module
from keras.src.backend.common.name_scope import current_path
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers.layer import Layer
from keras.src.models.cloning import clone_model
from keras.src.models.model import Model
from keras.src.saving import saving_lib
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils import tracking
from keras.src.utils.python_utils import pythonify_logs

from kerasps.backend import _tf

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

class _DeletedValue:
    """Stands for the `tf.Variable` of a Keras variable that TensorFlow deleted when
    this process connected to a cluster: every use raises `RuntimeError(message)`."""

    def __init__(self, message: str):
        object.__setattr__(self, "_message", message)

    def __getattr__(self, name):
        raise RuntimeError(object.__getattribute__(self, "_message"))

    def __repr__(self):
        return f"<deleted variable: {object.__getattribute__(self, '_message')}>"


def disown_variables_of_old_context(job: str = "localhost") -> list[str]:
    """Marks the Keras variables whose TensorFlow variable lived on `job` (this
    process before it connected to a cluster) as deleted; returns their paths.

    Connecting resets TensorFlow's eager context, which deletes every variable
    made before; using one afterwards raised TensorFlow's `Client for target
    /job:localhost/replica:0/task:0 not found`. Called once, on the first
    connection of the process (the only one that changes the local job).
    """
    import gc

    paths = []
    for variable in gc.get_objects():
        if not isinstance(variable, KerasTFVariable):
            continue
        value = variable.__dict__.get("_value")
        if not isinstance(value, tf.Variable) or f"/job:{job}/" not in value.device:
            continue
        paths.append(variable.path)
        variable._value = _DeletedValue(
            f"Keras variable '{variable.path}' was created before "
            "`kerasps.ParameterServerStrategy` connected this process to its cluster; "
            "connecting resets TensorFlow's eager context, which deleted it (TensorFlow's "
            "own ParameterServerStrategy does the same). Create the strategy first, then "
            "the models and variables (under `strategy.scope()` to place them on the ps "
            "tasks, outside it to keep them in this process).")
    return paths


def metrics_result_or_logs(model, logs):
    """Epoch logs: the model's metric results, or `logs` for custom step outputs."""
    return model._get_metrics_result_or_logs(logs)


def history_of(callbacks):
    """The `keras.callbacks.History` of a `CallbackList`, or `None`."""
    return getattr(callbacks, "_history", None)


# `keras.callbacks.BackupAndRestore` as `fit` uses it to recover a lost ps task.
def backup_callback(callbacks):
    """The `BackupAndRestore` among a `CallbackList`'s callbacks, or `None`."""
    found = [c for c in callbacks.callbacks if isinstance(c, callbacks_module.BackupAndRestore)]
    return found[0] if found else None


def backup_paths(callback) -> tuple[str, str]:
    """The latest and the previous weights file of a `BackupAndRestore`."""
    return callback._weights_path, callback._prev_weights_path


def backup_saves_each_epoch(callback) -> bool:
    return callback.save_freq == "epoch"


def write_backup(callback, annotate):
    """Backs up as `callback` (a `BackupAndRestore`) does, but atomically.

    Keras writes the new weights over the latest ones; a save that fails
    half-way (a ps task lost while its variables are read) would leave a
    partial file behind. Here they go to a temporary file, `annotate(path)`
    adds to it, and it replaces the latest only once complete (after the
    latest became the previous one, with `double_checkpoint=True`).
    Local paths only.
    """
    os.makedirs(callback.backup_dir, exist_ok=True)
    partial = callback._weights_path[:-len(".weights.h5")] + ".partial.weights.h5"
    callback.model.save_weights(partial, overwrite=True)
    annotate(partial)
    if callback.double_checkpoint:
        for path, previous in ((callback._weights_path, callback._prev_weights_path),
                               (callback._training_metadata_path,
                                callback._prev_training_metadata_path)):
            if os.path.exists(path):
                shutil.copyfile(path, previous)
    os.replace(partial, callback._weights_path)
    with open(callback._training_metadata_path, "w") as f:
        json.dump({"epoch": callback._current_epoch, "batch": callback._last_batch_seen}, f)


@contextlib.contextmanager
def backups_written_by(callback, save):
    """Inside the block, `callback` backs up by calling `save()`."""
    callback._save_model = save
    try:
        yield
    finally:
        del callback._save_model


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


def _cast_where_needed(value, variable):
    """`value` cast to the dtype of the TensorFlow `variable`, to be added to it.

    A value known when tracing (`iterations.assign_add(1)`, a metric's count of a
    fixed batch) is made on the variable's own device: made where the step runs,
    it would be sent to the ps task every step.
    """
    static = None if tf.executing_eagerly() else tf.get_static_value(value)
    if static is not None:
        with tf.device(variable.device):
            return tf.cast(tf.constant(static), variable.dtype)
    return tf.cast(value, variable.dtype)


@contextlib.contextmanager
def _step_scalars_sent_once(optimizer, learning_rate):
    """While the variables' updates are made, `iterations` and `learning_rate` cross once.

    Each update reads the learning rate and `iterations` (Adam's bias correction)
    next to its variable, on its ps task, and each tensor that crosses to another
    task is one more transfer there, every step. Both go in one tensor, made where
    `iterations` lives (the optimizer's learning rate variable is made on the same
    ps task): one transfer to each other task. Yields `unpack()`, to call inside an
    update (on the variable's ps task): it sets `optimizer._iterations` to that
    task's copy and returns its learning rate. The values are exact: float64 holds
    every step count below 2**53 and every float32 learning rate. `_iterations` is
    set with `object.__setattr__` (Keras would track a new attribute) and put back
    after.
    """
    iterations = optimizer._iterations
    learning_rate = tf.convert_to_tensor(learning_rate)
    with tf.device(tf_variable(iterations).device):
        packed = tf.stack([tf.cast(tf.convert_to_tensor(iterations), tf.float64),
                           tf.cast(learning_rate, tf.float64)])

    def unpack():  # `tf.gather`: Grappler would turn `packed[i]` back into two transfers
        object.__setattr__(optimizer, "_iterations",
                           tf.cast(tf.gather(packed, 0), iterations.dtype))
        return tf.cast(tf.gather(packed, 1), learning_rate.dtype)

    try:
        yield unpack
    finally:
        object.__setattr__(optimizer, "_iterations", iterations)


# A gradient at most this large crosses to its ps task in one tensor with the others
# there (`_gradients_sent_together`); a larger one's own transfer costs little beside
# its bytes, and joining it would copy it twice.
PACKED_GRADIENT_BYTES = 64 << 10


def _itself(value):
    return value


def _sliced(packed, begin, size, shape):
    # `tf.gather` of a range, not `packed[begin:begin + size]`: Grappler folds a
    # slice of a concatenation back into the separate tensors.
    return tf.reshape(tf.gather(packed, tf.range(begin, begin + size)), shape)


def _made_on_ps_task_of(gradient, variable):
    task = _tf.device_ps_task(gradient.device)  # `None`: where the step runs, a worker
    return task is not None and task == _tf.device_ps_task(variable.device)


def _gradients_sent_together(grads_and_vars):
    """For each `(gradient, variable)`, a function that returns the gradient where it
    is called: inside the variable's update, on its ps task.

    Each tensor that crosses to another task is a transfer of its own every step,
    whatever its size. The small dense gradients of the variables of one ps task
    (of one dtype, each at most `PACKED_GRADIENT_BYTES`) are concatenated where
    they are computed and cross in one tensor; each update slices its own out,
    on its ps task. Row updates (`tf.IndexedSlices`), gradients of unknown size,
    gradients made on their variable's task already (sync training's means) and a
    task's single gradient are left as they are. Exact: the values are only copied.
    """
    groups = {}
    for index, (gradient, variable) in enumerate(grads_and_vars):
        if (isinstance(gradient, tf.Tensor) and gradient.shape.is_fully_defined()
                and gradient.shape.num_elements() * gradient.dtype.size
                <= PACKED_GRADIENT_BYTES
                and not _made_on_ps_task_of(gradient, variable)):
            groups.setdefault((variable.device, gradient.dtype), []).append(index)
    received = [functools.partial(_itself, gradient) for gradient, _ in grads_and_vars]
    for members in groups.values():
        if len(members) < 2:
            continue
        gradients = [grads_and_vars[i][0] for i in members]
        packed = tf.concat([tf.reshape(g, [-1]) for g in gradients], axis=0)
        start = 0
        for index, gradient in zip(members, gradients):
            size = gradient.shape.num_elements()
            received[index] = functools.partial(_sliced, packed, start, size, gradient.shape)
            start += size
    return received


def sparse_mode(optimizer):
    """The `sparse_updates` mode of the kerasps strategy of `optimizer`, or `None`."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not getattr(strategy, "_is_kerasps", False):
        return None
    return strategy.sparse_updates


def optimizer_slot(optimizer, attribute, variable):
    """The slot variable `optimizer.<attribute>` (e.g. `"_momentums"`) of `variable`."""
    return getattr(optimizer, attribute)[optimizer._get_variable_index(variable)]


def tf_variable(variable):
    """The `tf.Variable` of a Keras variable (a `tf.Variable` is returned as is)."""
    return variable.value if isinstance(variable, KerasTFVariable) else variable


def has_constant_learning_rate(optimizer) -> bool:
    """False when the learning rate is a schedule or a callable."""
    return isinstance(optimizer._learning_rate, KerasTFVariable) or not callable(
        optimizer._learning_rate)


class _Loading(threading.local):
    checking = False  # True during the checking pass of a weights file load


_loading = _Loading()


def checking_weights_file() -> bool:
    """True during the checking pass of a weights file load (`assign` only checks shapes)."""
    return _loading.checking


_VARIABLE_SIGNATURE = inspect.signature(KerasTFVariable.__init__)
_installed = False


def variable_path(name: str) -> str:
    """The path a Keras variable named `name` created here gets."""
    parent = current_path()
    return f"{parent}/{name}" if parent else name


def bind_variable_args(args, kwargs) -> dict:
    """Binds `Variable(...)` arguments to their names (without `self`)."""
    bound = _VARIABLE_SIGNATURE.bind_partial(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", {})
    arguments.update(extra)
    return arguments


def _build_optimizer_for_tables(model):
    """Builds the optimizer of a model with a `kerasps.layers.DynamicEmbedding` before
    Keras traces a step (Keras builds it inside the trace, after the layers' calls): a
    table resets the optimizer slots of the rows it reuses, and its lookups can only do
    that if the slots exist when they are traced. kerasps' own `fit` builds it first."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built or not model.built:
        return
    if any(hasattr(layer, "_kerasps_renew_resources") for layer in model._flatten_layers()):
        optimizer.build(model.trainable_variables)


class _Filled(keras.initializers.Constant):
    """Keras' `Constant` made by one fill: Keras multiplies a tensor of ones by the value,
    two tensors the variable's size at once, and TensorFlow's CPU allocator (oneDNN's,
    on by default) keeps the freed one for the process: Adagrad's accumulators of a
    table of 1e6 x 32 took 253 MiB of RSS for 122 MiB of slots."""

    @classmethod
    def of(cls, initializer):
        if type(initializer) is keras.initializers.Constant:
            return cls(initializer.value)
        return initializer

    def __call__(self, shape, dtype=None):
        dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())
        return tf.fill(shape, tf.cast(self.value, dtype))


def install(*, trainer, variables, sparse):
    """Installs the hooks (idempotent), handing them to kerasps's handlers.

    Called by `kerasps.keras.hooks.install` (a strategy, a `DynamicEmbedding`): this
    module, below them all, imports none of the handlers.

    Args:
        trainer: the module of the trainer's `fit`, `evaluate` ... (`kerasps.trainer`).
        variables: the module of the variables' creator (`kerasps.variables`).
        sparse: the module of the row-update rule (`kerasps.sparse`).
    """
    global _installed
    if _installed:
        return
    _installed = True
    kerasps_trainer, kerasps_variables, kerasps_sparse = trainer, variables, sparse

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
                value = _cast_where_needed(value, self._value)
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

    # Saved state ---------------------------------------------------------------
    # Layers and optimizers save and load whole variables, never shards: a slot
    # of a sharded variable is a `ShardedVariable` made of the per-shard slots
    # (`kerasps.variables.track_slot`). `.weights.h5`, `.keras` files and
    # `tf.train.Checkpoint`s do not depend on the number of ps tasks.
    def _own_variables(saveable):
        if isinstance(saveable, Layer):
            return saveable._trainable_variables + saveable._non_trainable_variables
        return saveable.variables

    def _logical(saveable):
        return kerasps_variables.logical_variables(_own_variables(saveable))

    def _sharded(saveable):
        return any(hasattr(v, "_kerasps_container") for v in _own_variables(saveable))

    original_check = Layer._check_load_own_variables

    @functools.wraps(original_check)
    def check_load_own_variables(self, store):
        if _sharded(self) and len(store.keys()) == len(_logical(self)):
            return
        return original_check(self, store)

    Layer._check_load_own_variables = check_load_own_variables

    def save_and_load_whole_variables(cls):
        original_save, original_load = cls.save_own_variables, cls.load_own_variables

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
            variables = _logical(self)
            if isinstance(self, Layer):
                self._check_load_own_variables(store)
            elif len(store.keys()) == unbuilt_sizes.get(self):
                # Saved before it was built (no training yet): the file holds the
                # variables made before the slots, and no slots.
                variables = variables[:len(store.keys())]
            elif len(store.keys()) != len(variables):
                # Keras warns and keeps the optimizer as it is: never silently.
                unbuilt = unbuilt_sizes.get(self)
                raise ValueError(
                    f"The saved state of optimizer '{self.name}' does not line up with "
                    f"it: it has {len(variables)} variables"
                    + (f" ({unbuilt} before it was built)" if unbuilt is not None else "")
                    + f", the file holds {len(store.keys())}. "
                    f"Expected: {[v.path for v in variables]}")
            for i, variable in enumerate(variables):
                variable.assign(store[f"{i}"])

        cls.save_own_variables = save_own_variables
        cls.load_own_variables = load_own_variables

    # A file saved before an optimizer was built (a model saved before any
    # training) holds what it had then: its iteration and learning rate, no slots.
    # Keras' optimizers build their base class first, before adding any variable.
    unbuilt_sizes = weakref.WeakKeyDictionary()  # optimizer -> variables before `build`

    def build(self, variables):
        if not self.built:
            unbuilt_sizes.setdefault(self, len(self._variables))
        return super(tf_optimizer.TFOptimizer, self).build(variables)

    tf_optimizer.TFOptimizer.build = build

    save_and_load_whole_variables(Layer)
    save_and_load_whole_variables(tf_optimizer.TFOptimizer)

    original_children = tf_optimizer.TFOptimizer._trackable_children
    whole_lists = weakref.WeakKeyDictionary()  # optimizer -> {attribute: list}

    @functools.wraps(original_children)
    def trackable_children(self, save_type="checkpoint", **kwargs):
        # An optimizer lists shards and their slots (`_variables`, `_momentums`,
        # ...); a checkpoint sees whole variables in their place. The lists are
        # kept while unchanged: checkpoints identify children by object.
        children = original_children(self, save_type, **kwargs)
        lists = whole_lists.setdefault(self, {})
        for name, child in children.items():
            if isinstance(child, list) and any(hasattr(v, "_kerasps_container")
                                               for v in child):
                whole = kerasps_variables.logical_variables(child)
                if [id(v) for v in lists.get(name, ())] != [id(v) for v in whole]:
                    lists[name] = tf.__internal__.tracking.wrap(whole)
                children[name] = lists[name]
        return children

    tf_optimizer.TFOptimizer._trackable_children = trackable_children

    # Loading a weights file (`load_weights`, `load_model`) into a kerasps model
    # is all or nothing: a first pass runs the loading code with `assign` only
    # checking shapes, so a file that does not match raises (naming the variable
    # and both shapes) before any variable changes.
    original_load_state = saving_lib._load_state
    original_variable_assign = KerasTFVariable.assign

    @functools.wraps(original_load_state)
    def load_state(saveable, weights_store, assets_store, inner_path, skip_mismatch=False,
                   visited_saveables=None, failed_saveables=None, error_msgs=None):
        if not (inner_path or skip_mismatch or _loading.checking
                or not kerasps_trainer.uses_kerasps(saveable)):
            _loading.checking = True
            try:
                original_load_state(saveable, weights_store, None, inner_path,
                                    visited_saveables=set(visited_saveables or ()))
            finally:
                _loading.checking = False
        return original_load_state(saveable, weights_store, assets_store, inner_path,
                                   skip_mismatch, visited_saveables, failed_saveables, error_msgs)

    @functools.wraps(original_variable_assign)
    def checked_assign(self, value):
        if _loading.checking:
            kerasps_variables.check_shape(self, np.shape(value))
            return value
        return original_variable_assign(self, value)

    saving_lib._load_state = load_state
    KerasTFVariable.assign = checked_assign

    # `get_weights()` / `set_weights()` use whole variables too, so weights move
    # between sharded and single-process models.
    original_get_weights, original_set_weights = Layer.get_weights, Layer.set_weights

    def _whole_weights(layer):
        weights = layer.weights
        if any(hasattr(v, "_kerasps_container") for v in weights):
            return kerasps_variables.logical_variables(weights)
        return None

    @functools.wraps(original_get_weights)
    def get_weights(self):
        variables = _whole_weights(self)
        if variables is None:
            return original_get_weights(self)
        return [variable.numpy() for variable in variables]

    @functools.wraps(original_set_weights)
    def set_weights(self, weights):
        variables = _whole_weights(self)
        if variables is None:
            return original_set_weights(self, weights)
        if len(variables) != len(weights):
            raise ValueError(
                f"You called `set_weights(weights)` on layer '{self.name}' with a weight "
                f"list of length {len(weights)}, but the layer was expecting "
                f"{len(variables)} weights (whole variables, not shards).")
        for variable, value in zip(variables, weights):  # check all, then assign
            if tuple(variable.shape) != np.shape(value):
                raise ValueError(
                    f"Layer {self.name} weight {variable.path!r} has shape "
                    f"{tuple(variable.shape)}, not compatible with provided weight shape "
                    f"{np.shape(value)}.")
        for variable, value in zip(variables, weights):
            variable.assign(value)

    Layer.get_weights = get_weights
    Layer.set_weights = set_weights

    # `model.export()` of a kerasps model exports a single-process copy with the
    # same weights: the artifact holds whole variables and loads anywhere.
    original_export = Model.export

    @functools.wraps(original_export)
    def export(self, filepath, *args, **kwargs):
        if not kerasps_trainer.uses_kerasps(self):
            return original_export(self, filepath, *args, **kwargs)
        if kerasps_variables.kerasps_strategy() is not None:
            raise RuntimeError(
                f"Call `model.export({str(filepath)!r})` outside `strategy.scope()`: the "
                "exported model is a single-process copy, built outside any strategy.")
        copy = clone_model(self)
        copy.set_weights(self.get_weights())
        return original_export(copy, filepath, *args, **kwargs)

    Model.export = export

    # Optimizer scalars ---------------------------------------------------------
    # `iterations` and the learning rate share a ps task: every update reads
    # both, and `_step_scalars_sent_once` sends them together from there.
    original_optimizer_init = tf_optimizer.TFOptimizer.__init__

    @functools.wraps(original_optimizer_init)
    def optimizer_init(self, *args, **kwargs):
        with kerasps_variables.on_ps_task():
            original_optimizer_init(self, *args, **kwargs)

    tf_optimizer.TFOptimizer.__init__ = optimizer_init

    # Optimizer slots -----------------------------------------------------------
    original_from_reference = tf_optimizer.TFOptimizer.add_variable_from_reference

    def _filled_slots(args, kwargs):
        # A constant slot (Adagrad's accumulators) of a shard made by one fill.
        if len(args) >= 2:
            args = (args[0], _Filled.of(args[1]), *args[2:])
        elif "initializer" in kwargs:
            kwargs = dict(kwargs, initializer=_Filled.of(kwargs["initializer"]))
        return args, kwargs

    @functools.wraps(original_from_reference)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        if hasattr(reference_variable, "_kerasps_container") and any(
                getattr(trackable, "_deferred_dependencies", None)
                for trackable in (self, self._variables)):
            # TensorFlow would restore whole slots into the slots of shards.
            raise ValueError(
                f"Optimizer '{self.name}' is being built after a `tf.train.Checkpoint` "
                "restore reached it, and its slots for sharded variable "
                f"{reference_variable._kerasps_container.path!r} cannot be restored "
                "exactly that way. Build the optimizer before restoring: "
                "`model.optimizer.build(model.trainable_variables)` under `strategy.scope()`.")
        if hasattr(reference_variable, "_kerasps_container"):
            args, kwargs = _filled_slots(args, kwargs)
        with kerasps_variables.no_partitioning():
            slot = original_from_reference(self, reference_variable, *args, **kwargs)
        kerasps_variables.track_slot(self, reference_variable, slot)
        return slot

    tf_optimizer.TFOptimizer.add_variable_from_reference = add_variable_from_reference

    # Sparse updates ------------------------------------------------------------
    # A shard of a `ShardedVariable` whose gradient is a row update is updated
    # on the rows of the batch (`kerasps.sparse`) where the strategy's
    # `sparse_updates` mode allows it; everything else gets Keras' update.

    original_update_step = tf_optimizer.TFOptimizer._distributed_tf_update_step
    original_weight_decay = tf_optimizer.TFOptimizer._apply_weight_decay

    def lazily_decayed(optimizer, variable):
        # Lazy mode decays a table's shard with its update: its touched rows only.
        return (sparse_mode(optimizer) == kerasps_sparse.LAZY
                and optimizer.weight_decay is not None
                and hasattr(variable, "_kerasps_container")
                and optimizer._use_weight_decay(variable))

    @functools.wraps(original_update_step)
    def distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        mode = sparse_mode(self)
        if mode is None:
            return original_update_step(self, distribution, grads_and_vars, learning_rate)

        def update(variable, received, unpack):
            learning_rate = unpack()  # here: on the variable's ps task
            gradient = received()
            keras_variable = self._trainable_variables[self._get_variable_index(variable)]
            decayed = lazily_decayed(self, keras_variable)
            if not (hasattr(keras_variable, "_kerasps_container") and kerasps_sparse.update_rows(
                    self, gradient, variable, learning_rate, mode, weight_decay=decayed)):
                if decayed:
                    kerasps_sparse.decay(self, variable)
                self.update_step(gradient, variable, learning_rate)

        grads_and_vars = list(grads_and_vars)
        with _step_scalars_sent_once(self, learning_rate) as unpack:
            for (_, variable), received in zip(grads_and_vars,
                                               _gradients_sent_together(grads_and_vars)):
                distribution.extended.update(
                    variable, functools.partial(update, received=received, unpack=unpack),
                    group=False)

    @functools.wraps(original_weight_decay)
    def apply_weight_decay(self, variables):
        return original_weight_decay(
            self, [v for v in variables if not lazily_decayed(self, v)])

    tf_optimizer.TFOptimizer._distributed_tf_update_step = distributed_tf_update_step
    tf_optimizer.TFOptimizer._apply_weight_decay = apply_weight_decay

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
            _build_optimizer_for_tables(self)
            return __original(self, *args, **kwargs)

        functools.update_wrapper(dispatch, original)
        setattr(TensorFlowTrainer, name, dispatch)
