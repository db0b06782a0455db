"""The one place kerasps reaches into Keras' private modules (`keras.src...`).

Keras 3 has no extension points for parameter-server training, so kerasps
hooks in at a few seams. Each seam is a function of this module, named after
what it does, whose docstring says which Keras behaviour it changes and when it
defers to Keras' own code: unless the object involved belongs to a kerasps
strategy, so Keras behaves exactly as before outside a kerasps scope. The table
`SEAMS` says which Keras attribute each replaces; `install()` replaces them (a
loop), `uninstall()` puts Keras' own objects back (the same objects). A Keras
upgrade that moves these seams touches only this file.

Seams (see `SEAMS`):
  * `Variable.__new__`: under a kerasps scope with a partitioner, a variable
    large enough to split is created as a `kerasps.ShardedVariable`.
  * `Variable._initialize`: names the variable being placed, for the
    placement report.
  * `Variable.assign_add/assign_sub`: on a ps task, TensorFlow's atomic op (no
    update lost between workers); an increment known when tracing is made there.
    `Variable.__add__/__radd__/assign`: a metric accumulator's `v.assign(v + d)`
    becomes an atomic `assign_add(d)`.
  * `Tracker.add_to_store`: a layer tracks the shards of a `ShardedVariable`
    (so `trainable_variables`, gradients and optimizers see real variables,
    as `tf_keras` did with TF's `ShardedVariable`).
  * `Layer` and `TFOptimizer` `save_own_variables/load_own_variables`,
    `Layer._check_load_own_variables`, `TFOptimizer._trackable_children`:
    weights files and checkpoints hold whole variables and whole optimizer
    slots, whatever the number of shards. `TFOptimizer.build` notes how many
    variables an optimizer had before it was built: a file saved then (a model
    saved before any training) restores those and no slots.
  * `saving_lib._load_state` (and `Variable.assign`): loading a weights file into
    a kerasps model checks every variable's shape before assigning any.
  * `saving_lib.get_attr_skipset`: what a save skips is listed once per process, on
    objects made outside any strategy (Keras made a reference optimizer, on a ps task,
    at every save).
  * `Layer.get_weights/set_weights`: whole variables; `Model.export`: a
    single-process copy is exported.
  * `TFOptimizer.__init__`: `iterations` and the learning rate on one ps task.
  * `TFOptimizer.add_variable_from_reference`: optimizer slots are never
    re-partitioned; they sit next to their variable, and the slots of a
    sharded variable's shards make a `ShardedVariable`.
  * `TFOptimizer._distributed_tf_update_step/_apply_weight_decay`: a shard
    with a row-update gradient is updated on the batch's rows only
    (`kerasps.params.sparse`), as the strategy's `sparse_updates` mode allows; the
    learning rate and `iterations` are read once per step, not per variable,
    and the small gradients of one ps task's variables cross to it in one tensor.
  * `TFOptimizer.apply`, `Trainer._symbolic_build`, `Trainer.compile_from_config`: a
    variable that a layer gave an optimizer of its own (a keras-rs table's
    `TableConfig.optimizer`) is trained by that optimizer; the model's optimizer holds
    no slot of it, also in a model loaded from a `.keras` file.
  * `backend.numpy.take`: a row lookup in a `ShardedVariable` gathers on each
    shard's ps task instead of concatenating the whole table.
  * `TensorFlowTrainer.fit/evaluate/predict` (and the `*_on_batch` methods):
    models built under a kerasps strategy run through `kerasps.keras.trainer`. As
    Keras' own, `fit`, `evaluate` and `predict` filter the tracebacks of the
    exceptions that leave them (`kerasps.backend.tracebacks`).

Not a seam: `disown_variables_of_old_context` marks the Keras variables that
TensorFlow deleted when the process connected to its cluster (`_DeletedValue`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import json
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable

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

from kerasps.backend import _tf, tracebacks

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
    "installed",
    "uninstall",
    "SEAMS",
    "Seam",
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


def is_progress_bar_of_a_fit(callback) -> bool:
    """True for Keras' progress bar called by a `fit` (it shows no validation batch)."""
    return isinstance(callback, keras.callbacks.ProgbarLogger) and bool(
        getattr(callback, "_called_in_fit", False))


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


# A Keras optimizer's update without its step count, for hybrid mode's row updates.
def check_apply_uncounted(optimizer):
    """Raises a `ValueError` if `apply_uncounted` cannot do what `optimizer.apply` would:
    where the optimizer's rule spans every variable of a step at once."""
    for name, value in (("global_clipnorm", optimizer.global_clipnorm),
                        ("gradient_accumulation_steps",
                         optimizer.gradient_accumulation_steps),
                        ("use_ema", optimizer.use_ema)):
        if value:
            raise ValueError(
                f"Invalid value for argument `{name}` of the optimizer: it is not supported "
                "with `mode='hybrid'`, where the embedding tables' row updates and the "
                "dense variables' global steps are applied at different times. Received: "
                f"{name}={value!r}")


def build_for(optimizer, variables):
    """Builds `optimizer` for the `variables` it trains, as its first `apply` would; a
    step that updates some of them before any `apply` (hybrid mode) builds it first."""
    if not optimizer.built:
        with keras_backend.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(trained_by(optimizer, variables))
        optimizer.built = True


def apply_uncounted(optimizer, grads, variables):
    """Updates `variables` with `grads` as `optimizer.apply` would (loss-scale factor,
    clipping, weight decay, the update rule, constraints) without counting a step in
    `optimizer.iterations`: in hybrid mode that counts global steps, and the row
    updates applied on arrival use the count of the global step they belong to, as
    one Keras `apply` of every variable would. See `check_apply_uncounted`.

    Variables with an optimizer of their own (`own_optimizer`: keras-rs tables) are
    handed to it (its `apply`, whose `iterations` counts the updates that reached
    it, as in async mode)."""
    grads, variables = apply_by_own_optimizers(optimizer, grads, variables)
    if not variables:
        return
    scale = optimizer.loss_scale_factor
    if scale is not None:
        grads = [g / scale for g in grads]
    grads = optimizer._clip_gradients(grads)
    optimizer._apply_weight_decay(variables)
    optimizer._backend_update_step(grads, variables, optimizer.learning_rate)
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))


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
    try:
        callback.model.save_weights(partial, overwrite=True)
    except BaseException:
        # Keras closes the file only after a complete save: the half-written one stays
        # open while the error's traceback lives, and the next save could not open it.
        _close_h5_file(partial)
        raise
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


def _close_h5_file(path):
    """Closes every h5py handle of the file at `path` that this process holds."""
    import h5py

    target = os.path.realpath(path)
    for file_id in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
        if os.path.realpath(os.fsdecode(file_id.name)) == target:
            h5py.File(file_id).close()


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
    """The `sparse_updates` mode of the kerasps strategy of `optimizer`, or `None`.

    An optimizer that trains tables of its own (`own_optimizer`) has the mode it was
    given, `kerasps.params.sparse.ROWS`, whatever the strategy's.
    """
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not getattr(strategy, "_is_kerasps", False):
        return None
    return getattr(optimizer, "_kerasps_sparse_updates", None) or strategy.sparse_updates


def own_optimizer(variable):
    """The optimizer that a layer gave `variable` (a Keras variable or shard) to train it
    instead of the model's (`kerasps.keras.layers.rs_tables`), or `None`."""
    return getattr(variable, "_kerasps_optimizer", None)


def trained_by(optimizer, variables) -> list:
    """The `variables` that `optimizer` trains: those without an optimizer of their own,
    and its own (`apply_with_own_optimizers`). Build a model's optimizer with these."""
    return [v for v in variables if own_optimizer(v) is None or own_optimizer(v) is optimizer]


def own_optimizers(model) -> list:
    """The optimizers of `model`'s variables that train them instead of its optimizer,
    once each, in the order of the variables."""
    found = {}
    for variable in model.weights:
        owner = own_optimizer(variable)
        if owner is not None:
            found.setdefault(id(owner), owner)
    return list(found.values())


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


# The seams ------------------------------------------------------------------
# Each function below replaces one Keras attribute (the table `SEAMS`, after them,
# says which); each defers to Keras' own code, `_keras_original(target, attribute)`,
# unless the object involved belongs to a kerasps strategy. The handlers they call
# (the trainer, the variables' creator, the row-update rule) are `_handlers`, set by
# `install`: this module, below them all, imports none of them.


class _Handlers:
    """The kerasps modules the seams call, as `install` was handed them."""

    trainer = None  # `kerasps.keras.trainer`: `fit`, `evaluate` ..., `uses_kerasps`
    variables = None  # `kerasps.params.variables`: the variables' creator, `ShardedVariable`
    sparse = None  # `kerasps.params.sparse`: the row-update rule


_handlers = _Handlers()

# (target, attribute) -> what `getattr(target, attribute)` gave before `install`
# (inherited or not): the Keras code a seam defers to. Kept after `uninstall`, so that
# a seam bound before (a `model.fit` held by a caller) still reaches Keras' code.
_keras_code: dict = {}


def _keras_original(target, attribute: str):
    """The Keras code that the seam at `target.<attribute>` replaced."""
    return _keras_code[target, attribute]


# Variables -------------------------------------------------------------------

def new_variable_sharded_when_partitioned(cls, *args, **kwargs):
    """Replaces `keras.Variable.__new__`: a partitioned variable is a `ShardedVariable`.

    Under a kerasps scope whose partitioner splits the variable (the variables' creator,
    `kerasps.params.variables.sharded_class_for`, names a class), `keras.Variable(...)`
    makes a `kerasps.ShardedVariable`. Defers to Keras (`object.__new__`: Keras defines
    no `__new__`) for subclasses of `keras.Variable` and for variables not split.
    """
    if cls is KerasTFVariable:
        sharded_cls = _handlers.variables.sharded_class_for(args, kwargs)
        if sharded_cls is not None:
            return object.__new__(sharded_cls)
    original = _keras_original(KerasTFVariable, "__new__")
    if original is object.__new__:
        return object.__new__(cls)
    return original(cls, *args, **kwargs)


def initialize_variable_where_placed(self, value):
    """Replaces `keras.Variable._initialize`: names the variable being placed.

    Under a kerasps strategy's scope the variable is marked as a ps variable
    (`_kerasps_remote`, which the atomic updates below read) and created inside
    `kerasps.params.variables.creating(self)`, which names it for the placement report.
    Defers to Keras' `_initialize` alone outside any kerasps scope.
    """
    original = _keras_original(KerasTFVariable, "_initialize")
    if _handlers.variables.kerasps_strategy() is None:
        return original(self, value)
    self._kerasps_remote = True
    with _handlers.variables.creating(self):
        return original(self, value)


def _atomic_update(variable, value, op_name):
    """`variable.<op_name>(value)` (`"assign_add"`, `"assign_sub"`) as TensorFlow's
    atomic op on a ps variable, or Keras' read-then-write elsewhere."""
    if getattr(variable, "_kerasps_remote", False) and not in_stateless_scope():
        value = _cast_where_needed(value, variable._value)
        getattr(variable._value, op_name)(value)
        return value
    return _keras_original(KerasTFVariable, op_name)(variable, value)


def assign_add_atomically(self, value):
    """Replaces `keras.Variable.assign_add`: no update of a ps variable is lost.

    Keras adds as `assign(self + value)`, a read and a write: two workers doing it
    at once lose one update (metric totals, the optimizer's `iterations`). A ps
    variable (`_kerasps_remote`) outside a stateless scope gets TensorFlow's atomic
    `AssignAddVariableOp` instead, with an increment known when tracing made on the
    variable's device. Defers to Keras' `assign_add` for every other variable.
    """
    return _atomic_update(self, value, "assign_add")


def assign_sub_atomically(self, value):
    """Replaces `keras.Variable.assign_sub`: no update of a ps variable is lost.

    As `assign_add_atomically`, with TensorFlow's atomic `AssignSubVariableOp`.
    Defers to Keras' `assign_sub` for every variable not on a ps task and in a
    stateless scope.
    """
    return _atomic_update(self, value, "assign_sub")


def _is_accumulator(variable) -> bool:
    """A metric's accumulator on a ps task (metric state is declared
    `synchronization="on_read"`), used inside a traced function."""
    return (getattr(variable, "_kerasps_remote", False)
            and variable.synchronization == "on_read" and tf.inside_function())


def _add_noting_sum(variable, other, op_name):
    result = _keras_original(KerasTFVariable, op_name)(variable, other)
    if _is_accumulator(variable):
        variable._kerasps_last_sum = (result, other)
    return result


def add_noting_accumulator_sum(self, other):
    """Replaces `keras.Variable.__add__`: notes a metric accumulator's sum.

    Keras metrics (AUC, Precision, Recall, MeanIoU ...) accumulate with
    `v.assign(v + delta)`. For an accumulator on a ps task inside a traced function
    (`_is_accumulator`), the sum and `delta` are noted on the variable, so that
    `assign_shape_checked_or_atomic` turns the assignment of that sum into an atomic
    `assign_add(delta)`. The sum itself is always Keras' `__add__`.
    """
    return _add_noting_sum(self, other, "__add__")


def radd_noting_accumulator_sum(self, other):
    """Replaces `keras.Variable.__radd__`: notes a metric accumulator's sum (`delta + v`).

    As `add_noting_accumulator_sum`; the sum itself is always Keras' `__radd__`.
    """
    return _add_noting_sum(self, other, "__radd__")


def assign_shape_checked_or_atomic(self, value):
    """Replaces `keras.Variable.assign`: checks shapes only, or adds atomically.

    During the checking pass of a weights file load (`load_weights_file_all_or_nothing`)
    the assignment only checks the value's shape (`kerasps.params.variables.check_shape`) and
    changes nothing. The assignment of a sum that `add_noting_accumulator_sum` noted
    (`v.assign(v + delta)` on a metric accumulator on a ps task) becomes TensorFlow's
    atomic `assign_add(delta)`. Any other assignment is Keras' `assign`.
    """
    if _loading.checking:
        _handlers.variables.check_shape(self, np.shape(value))
        return value
    last_sum = getattr(self, "_kerasps_last_sum", None)
    if last_sum is not None and value is last_sum[0] and _is_accumulator(self):
        self._kerasps_last_sum = None
        delta = tf.cast(last_sum[1], self._value.dtype)
        self._value.assign_add(delta)
        return value
    return _keras_original(KerasTFVariable, "assign")(self, value)


# Layer tracking ----------------------------------------------------------------

def track_shards_of_sharded_variables(self, store_name, value):
    """Replaces `keras.src.utils.tracking.Tracker.add_to_store`: a layer tracks shards.

    A `kerasps.ShardedVariable` assigned to a layer adds its shards to the store (so
    `trainable_variables`, gradients and optimizers see real variables, as `tf_keras`
    did with TensorFlow's `ShardedVariable`), and the container is marked as seen so
    that `track` does not add it again. Defers to Keras for every other value.
    """
    original = _keras_original(tracking.Tracker, "add_to_store")
    if isinstance(value, _handlers.variables.ShardedVariable):
        for shard in value.shards:
            if not self.is_in_store(store_name, shard):
                original(self, store_name, shard)
        self.stored_ids[store_name].add(id(value))
        return
    return original(self, store_name, value)


# Saved state -------------------------------------------------------------------
# Layers and optimizers save and load whole variables, never shards: a slot of a
# sharded variable is a `ShardedVariable` made of the per-shard slots
# (`kerasps.params.variables.track_slot`). `.weights.h5`, `.keras` files and
# `tf.train.Checkpoint`s do not depend on the number of ps tasks.

# A file saved before an optimizer was built (a model saved before any training)
# holds what it had then: its iteration and learning rate, no slots.
_unbuilt_sizes = weakref.WeakKeyDictionary()  # optimizer -> variables before `build`
_whole_lists = weakref.WeakKeyDictionary()  # optimizer -> {attribute: tracked list}


def _own_variables(saveable):
    if isinstance(saveable, Layer):
        return saveable._trainable_variables + saveable._non_trainable_variables
    return saveable.variables


def _logical(saveable):
    """The whole variables of a layer's or optimizer's own variables."""
    return _handlers.variables.logical_variables(_own_variables(saveable))


def _sharded(saveable) -> bool:
    """Whether a layer or optimizer holds shards of a `ShardedVariable`."""
    return any(hasattr(v, "_kerasps_container") for v in _own_variables(saveable))


def check_layer_loads_whole_variables(self, store):
    """Replaces `Layer._check_load_own_variables`: a file holds whole variables.

    A layer holding shards accepts a store with one entry per whole variable. Defers
    to Keras' check for layers without shards and for stores of another size.
    """
    if _sharded(self) and len(store.keys()) == len(_logical(self)):
        return
    return _keras_original(Layer, "_check_load_own_variables")(self, store)


def _save_whole_variables(saveable, store, target):
    if not _sharded(saveable):
        return _keras_original(target, "save_own_variables")(saveable, store)
    for i, variable in enumerate(_logical(saveable)):
        store[f"{i}"] = variable


def _load_whole_variables(saveable, store, target):
    if not _sharded(saveable):
        return _keras_original(target, "load_own_variables")(saveable, store)
    variables = _logical(saveable)
    if isinstance(saveable, Layer):
        saveable._check_load_own_variables(store)
    elif len(store.keys()) == _unbuilt_sizes.get(saveable):
        # Saved before it was built (no training yet): the file holds the
        # variables made before the slots, and no slots.
        variables = variables[:len(store.keys())]
    elif len(store.keys()) != len(variables):
        # Keras warns and keeps the optimizer as it is: never silently.
        unbuilt = _unbuilt_sizes.get(saveable)
        raise ValueError(
            f"The saved state of optimizer '{saveable.name}' does not line up with "
            f"it: it has {len(variables)} variables"
            + (f" ({unbuilt} before it was built)" if unbuilt is not None else "")
            + f", the file holds {len(store.keys())}. "
            f"Expected: {[v.path for v in variables]}. A model whose tables have "
            "optimizers of their own (keras-rs' `TableConfig.optimizer`) was saved with "
            "no slots of theirs in its optimizer, which only a kerasps strategy's scope "
            "gives it: load it there, or with `compile=False` to predict.")
    for i, variable in enumerate(variables):
        variable.assign(store[f"{i}"])


def save_layer_whole_variables(self, store):
    """Replaces `Layer.save_own_variables`: a layer saves whole variables, not shards.

    Defers to Keras' `save_own_variables` for a layer that holds no shard.
    """
    return _save_whole_variables(self, store, Layer)


def load_layer_whole_variables(self, store):
    """Replaces `Layer.load_own_variables`: a layer loads whole variables into its shards.

    Defers to Keras' `load_own_variables` for a layer that holds no shard.
    """
    return _load_whole_variables(self, store, Layer)


def save_optimizer_whole_variables(self, store):
    """Replaces `TFOptimizer.save_own_variables`: whole variables and whole slots.

    Defers to Keras' `save_own_variables` for an optimizer that holds no shard.
    """
    return _save_whole_variables(self, store, tf_optimizer.TFOptimizer)


def load_optimizer_whole_variables(self, store):
    """Replaces `TFOptimizer.load_own_variables`: whole variables and whole slots.

    A file saved before the optimizer was built (`build_optimizer_noting_unbuilt_size`)
    restores the variables it had then, and no slots; a file of another size raises
    `ValueError` (Keras warns and loads nothing). Defers to Keras'
    `load_own_variables` for an optimizer that holds no shard.
    """
    return _load_whole_variables(self, store, tf_optimizer.TFOptimizer)


def build_optimizer_noting_unbuilt_size(self, variables):
    """Replaces `TFOptimizer.build`: notes how many variables it had before.

    Keras' optimizers build their base class first, before adding any variable:
    the number of variables then is what a file saved before any training holds
    (`load_optimizer_whole_variables`). Then builds as Keras does (the next
    `build` after `TFOptimizer`'s in the optimizer's classes).
    """
    if not self.built:
        _unbuilt_sizes.setdefault(self, len(self._variables))
    return super(tf_optimizer.TFOptimizer, self).build(variables)


def checkpoint_optimizer_whole_variables(self, save_type="checkpoint", **kwargs):
    """Replaces `TFOptimizer._trackable_children`: a checkpoint sees whole variables.

    An optimizer lists shards and their slots (`_variables`, `_momentums` ...); a
    `tf.train.Checkpoint` sees the whole variables in their place. The lists are
    kept while unchanged: checkpoints identify children by object. Keras' children
    are returned as they are where no list holds a shard.
    """
    children = _keras_original(tf_optimizer.TFOptimizer, "_trackable_children")(
        self, save_type, **kwargs)
    lists = _whole_lists.setdefault(self, {})
    for name, child in children.items():
        if isinstance(child, list) and any(hasattr(v, "_kerasps_container") for v in child):
            whole = _handlers.variables.logical_variables(child)
            if [id(v) for v in lists.get(name, ())] != [id(v) for v in whole]:
                lists[name] = tf.__internal__.tracking.wrap(whole)
            children[name] = lists[name]
    return children


def load_weights_file_all_or_nothing(saveable, weights_store, assets_store, inner_path,
                                     skip_mismatch=False, visited_saveables=None,
                                     failed_saveables=None, error_msgs=None):
    """Replaces `keras.src.saving.saving_lib._load_state`: all or nothing for kerasps.

    Loading a weights file (`load_weights`, `load_model`) into a kerasps model first
    runs Keras' loading code with `assign` only checking shapes
    (`assign_shape_checked_or_atomic`), so a file that does not match raises (naming
    the variable and both shapes) before any variable changes. Keras' `_load_state`
    alone loads a model not built under a kerasps strategy, an inner object, or with
    `skip_mismatch`.
    """
    original = _keras_original(saving_lib, "_load_state")
    if not (inner_path or skip_mismatch or _loading.checking
            or not _handlers.trainer.uses_kerasps(saveable)):
        _loading.checking = True
        try:
            original(saveable, weights_store, None, inner_path,
                     visited_saveables=set(visited_saveables or ()))
        finally:
            _loading.checking = False
    return original(saveable, weights_store, assets_store, inner_path,
                    skip_mismatch, visited_saveables, failed_saveables, error_msgs)


_skipsets: dict = {}  # a saveable's kind ("Optimizer", "Layer" ...) -> attributes saves skip
_skipsets_lock = threading.Lock()


def attr_skipset_made_once(obj_type):
    """Replaces `keras.src.saving.saving_lib.get_attr_skipset`: made once, outside any scope.

    A save or load walks the model's saveables, skipping the attributes that a plain
    object of the kind has: Keras makes a reference object to list them
    (`Optimizer(1.0)`, `Layer()`, `Metric()` ...) and means to keep the set, but stores
    it under another name than it reads (Keras 3.15: `saving_attr_skipset_` against
    `saving_attr_skiplist_`), so every save and load made new ones. Under a kerasps
    strategy the reference optimizer's `iteration` and `learning_rate` were made on a
    ps task at each `BackupAndRestore` or `ModelCheckpoint` save (`optimizer_N/...` in
    the placement report, N growing with the saves). Each set is made once per process,
    in a thread of its own, where no strategy's scope is entered: nothing is placed.
    """
    with _skipsets_lock:
        if obj_type not in _skipsets:
            original, made = _keras_original(saving_lib, "get_attr_skipset"), []

            def make():
                try:
                    made.append(original(obj_type))
                except Exception as error:  # Keras' error for an unknown kind: raised here
                    made.append(error)

            thread = threading.Thread(target=make, name="kerasps-saving-skipset")
            thread.start()
            thread.join()
            if isinstance(made[0], Exception):
                raise made[0]
            _skipsets[obj_type] = made[0]
        return _skipsets[obj_type]


def _whole_weights(layer):
    """A layer's whole variables where it holds shards, else `None`."""
    weights = layer.weights
    if any(hasattr(v, "_kerasps_container") for v in weights):
        return _handlers.variables.logical_variables(weights)
    return None


def get_whole_weights(self):
    """Replaces `Layer.get_weights`: whole variables, never shards.

    Weights move between sharded and single-process models. Defers to Keras'
    `get_weights` for a layer that holds no shard.
    """
    variables = _whole_weights(self)
    if variables is None:
        return _keras_original(Layer, "get_weights")(self)
    return [variable.numpy() for variable in variables]


def set_whole_weights(self, weights):
    """Replaces `Layer.set_weights`: whole variables, never shards.

    Every value's shape is checked before any variable is assigned. Defers to
    Keras' `set_weights` for a layer that holds no shard.
    """
    variables = _whole_weights(self)
    if variables is None:
        return _keras_original(Layer, "set_weights")(self, weights)
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


def export_single_process_copy(self, filepath, *args, **kwargs):
    """Replaces `Model.export`: a kerasps model exports a single-process copy.

    The copy (`clone_model`, built outside any strategy) has the same weights, so
    the artifact holds whole variables and loads anywhere; exporting inside
    `strategy.scope()` raises `RuntimeError`. Defers to Keras' `export` for a model
    not built under a kerasps strategy.
    """
    original = _keras_original(Model, "export")
    if not _handlers.trainer.uses_kerasps(self):
        return original(self, filepath, *args, **kwargs)
    if _handlers.variables.kerasps_strategy() is not None:
        raise RuntimeError(
            f"Call `model.export({str(filepath)!r})` outside `strategy.scope()`: the "
            "exported model is a single-process copy, built outside any strategy.")
    copy = clone_model(self)
    copy.set_weights(self.get_weights())
    return original(copy, filepath, *args, **kwargs)


# Optimizers ----------------------------------------------------------------------

def init_optimizer_on_one_ps_task(self, *args, **kwargs):
    """Replaces `TFOptimizer.__init__`: `iterations` and the learning rate share a ps task.

    Every update reads both, and `_step_scalars_sent_once` sends them together from
    there. Keras' `__init__` runs inside `kerasps.params.variables.on_ps_task()`, which
    places nothing outside a kerasps scope.
    """
    with _handlers.variables.on_ps_task():
        _keras_original(tf_optimizer.TFOptimizer, "__init__")(self, *args, **kwargs)


def _filled_slots(args, kwargs):
    """A constant slot (Adagrad's accumulators) of a shard made by one fill."""
    if len(args) >= 2:
        args = (args[0], _Filled.of(args[1]), *args[2:])
    elif "initializer" in kwargs:
        kwargs = dict(kwargs, initializer=_Filled.of(kwargs["initializer"]))
    return args, kwargs


def add_slot_next_to_its_variable(self, reference_variable, *args, **kwargs):
    """Replaces `TFOptimizer.add_variable_from_reference`: slots are never re-partitioned.

    A slot is made by Keras' `add_variable_from_reference` inside
    `kerasps.params.variables.no_partitioning()`, next to its variable, and
    `kerasps.params.variables.track_slot` makes the slots of a sharded variable's shards a
    `ShardedVariable`; a constant slot of a shard is made by one fill (`_Filled`).
    Raises `ValueError` for a shard's slot made after a `tf.train.Checkpoint` restore
    reached the optimizer (TensorFlow would restore whole slots into shards' slots).
    Outside a kerasps scope this is Keras' own slot.
    """
    if hasattr(reference_variable, "_kerasps_container") and any(
            getattr(trackable, "_deferred_dependencies", None)
            for trackable in (self, self._variables)):
        raise ValueError(
            f"Optimizer '{self.name}' is being built after a `tf.train.Checkpoint` "
            "restore reached it, and its slots for sharded variable "
            f"{reference_variable._kerasps_container.path!r} cannot be restored "
            "exactly that way. Build the optimizer before restoring: "
            "`model.optimizer.build(model.trainable_variables)` under `strategy.scope()`.")
    if hasattr(reference_variable, "_kerasps_container"):
        args, kwargs = _filled_slots(args, kwargs)
    with _handlers.variables.no_partitioning():
        slot = _keras_original(tf_optimizer.TFOptimizer, "add_variable_from_reference")(
            self, reference_variable, *args, **kwargs)
    _handlers.variables.track_slot(self, reference_variable, slot)
    return slot


def _row_updated(variable, mode) -> bool:
    """Whether `variable`'s row updates go to `kerasps.params.sparse.update_rows`: a
    table's shard, or any variable of an optimizer in the rows mode (a table's own)."""
    return hasattr(variable, "_kerasps_container") or mode == _handlers.sparse.ROWS


def variables_updated_by(optimizer) -> list:
    """The model variables `optimizer` was built for, in its order (Keras' private
    `_trainable_variables`)."""
    return list(optimizer._trainable_variables)


def decays(optimizer, variable) -> bool:
    """Whether `optimizer` applies weight decay to the Keras `variable` (Keras' private
    `_use_weight_decay`: its `exclude_from_weight_decay` lists)."""
    return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)


def _lazily_decayed(optimizer, variable) -> bool:
    """Lazy and rows modes decay a table's shard with its update: its touched rows only."""
    mode = sparse_mode(optimizer)
    return (mode in (_handlers.sparse.LAZY, _handlers.sparse.ROWS)
            and _row_updated(variable, mode) and decays(optimizer, variable))


def _update_variable(variable, optimizer, mode, received, unpack):
    """One variable's update, on its ps task: `kerasps.params.sparse.update_rows` for a
    shard with a row update where `mode` allows it, else Keras' `update_step` (whose
    moved rows are flagged where they are tracked: an unsharded table that
    `kerasps.callbacks.PublishDeltas` publishes)."""
    learning_rate = unpack()  # here: on the variable's ps task
    gradient = received()
    keras_variable = optimizer._trainable_variables[optimizer._get_variable_index(variable)]
    decayed = _lazily_decayed(optimizer, keras_variable)
    if not (_row_updated(keras_variable, mode) and _handlers.sparse.update_rows(
            optimizer, gradient, variable, learning_rate, mode, weight_decay=decayed)):
        if decayed:
            _handlers.sparse.decay(optimizer, variable)
        optimizer.update_step(gradient, variable, learning_rate)
        _handlers.sparse.flag_keras_update(optimizer, gradient, variable, keras_variable)


def update_rows_and_send_once(self, distribution, grads_and_vars, learning_rate):
    """Replaces `TFOptimizer._distributed_tf_update_step`: row updates, fewer transfers.

    Under a kerasps strategy (`sparse_mode` is not `None`), a shard of a
    `ShardedVariable` whose gradient is a row update is updated on the batch's rows
    only (`kerasps.params.sparse.update_rows`) as the strategy's `sparse_updates` mode
    allows; every other variable gets Keras' `update_step`. The learning rate and
    `iterations` cross to each ps task once per step (`_step_scalars_sent_once`),
    and the small gradients of one ps task's variables in one tensor
    (`_gradients_sent_together`). Defers to Keras for an optimizer of no kerasps
    strategy.
    """
    mode = sparse_mode(self)
    if mode is None:
        return _keras_original(tf_optimizer.TFOptimizer, "_distributed_tf_update_step")(
            self, distribution, grads_and_vars, learning_rate)
    grads_and_vars = list(grads_and_vars)
    with _step_scalars_sent_once(self, learning_rate) as unpack:
        for (_, variable), received in zip(grads_and_vars,
                                           _gradients_sent_together(grads_and_vars)):
            distribution.extended.update(
                variable, functools.partial(_update_variable, optimizer=self, mode=mode,
                                            received=received, unpack=unpack),
                group=False)


def apply_weight_decay_but_lazily(self, variables):
    """Replaces `TFOptimizer._apply_weight_decay`: lazy mode decays tables' touched rows.

    Keras' `_apply_weight_decay` runs on every variable except the shards that
    `update_rows_and_send_once` decays with their row update (the strategy's
    `sparse_updates="lazy"`); with no such shard, it is Keras' own.
    """
    return _keras_original(tf_optimizer.TFOptimizer, "_apply_weight_decay")(
        self, [v for v in variables if not _lazily_decayed(self, v)])


def apply_with_own_optimizers(self, grads, trainable_variables=None):
    """Replaces `TFOptimizer.apply`: variables with an optimizer of their own are trained
    by it.

    A layer may give some of its variables an optimizer of their own (`own_optimizer`:
    the tables of a keras-rs `DistributedEmbedding`, each with its
    `TableConfig.optimizer`, see `kerasps.keras.layers.rs_tables`). Handed their
    gradients with the others (`model.optimizer.apply` in Keras' `train_step`, or
    `apply_gradients` in a custom loop), an optimizer hands each own optimizer the
    gradients of its variables (its `apply`, once per call, so that its `iterations`
    counts the steps that reached it) and applies the others itself; with none left,
    it counts the step (`iterations`) all the same. Defers to Keras' `apply` where no
    variable has an optimizer other than this one.
    """
    original = _keras_original(tf_optimizer.TFOptimizer, "apply")
    variables = trainable_variables
    if variables is None and self.built:
        variables = self._trainable_variables
    if variables is None:
        return original(self, grads, trainable_variables)
    grads, variables = list(grads), list(variables)
    if all(own_optimizer(v) in (None, self) for v in variables):
        return original(self, grads, trainable_variables)
    grads, variables = apply_by_own_optimizers(self, grads, variables)
    if variables:
        return original(self, grads, variables)
    self._iterations.assign_add(1)


def apply_by_own_optimizers(optimizer, grads, variables) -> tuple[list, list]:
    """Hands the gradients of the variables that have an optimizer of their own (other
    than `optimizer`) to it, one `apply` per optimizer; returns the other gradients and
    variables, which `optimizer` trains."""
    mine, theirs = ([], []), {}  # theirs: id(owner) -> (owner, gradients, variables)
    for gradient, variable in zip(grads, variables):
        owner = own_optimizer(variable)
        if owner is None or owner is optimizer:
            mine[0].append(gradient)
            mine[1].append(variable)
        else:
            _, owned_grads, owned_variables = theirs.setdefault(id(owner), (owner, [], []))
            owned_grads.append(gradient)
            owned_variables.append(variable)
    for owner, owned_grads, owned_variables in theirs.values():
        owner.apply(owned_grads, owned_variables)
    return mine


@contextlib.contextmanager
def _optimizer_built_with_what_it_trains(optimizer):
    """Inside the block, `optimizer.build(variables)` builds it with `trained_by(optimizer,
    variables)`: no slot for a table that trains with an optimizer of its own. The
    optimizer's `build` is an instance attribute meanwhile, set with
    `object.__setattr__` and removed after."""

    def build(variables):
        return type(optimizer).build(optimizer, trained_by(optimizer, variables))

    object.__setattr__(optimizer, "build", build)
    try:
        yield
    finally:
        object.__delattr__(optimizer, "build")


def build_optimizer_without_own_tables(self, *args, **kwargs):
    """Replaces `Trainer._symbolic_build`: the model's optimizer skips tables of their own.

    Keras' `_symbolic_build` builds the model's optimizer with every trainable
    variable; for a model built under a kerasps strategy it is built with those it
    trains (`trained_by`): no slot for a table that trains with an optimizer of its
    own. Defers to Keras' own otherwise.
    """
    original = _keras_original(TensorFlowTrainer, "_symbolic_build")
    optimizer = getattr(self, "optimizer", None)
    if optimizer is None or optimizer.built or not _handlers.trainer.uses_kerasps(self):
        return original(self, *args, **kwargs)
    with _optimizer_built_with_what_it_trains(optimizer):
        return original(self, *args, **kwargs)


def compile_loaded_model_without_own_tables(self, config):
    """Replaces `Trainer.compile_from_config`: a loaded model's optimizer skips own tables.

    Loading a `.keras` file compiles the model from its config and, once it is built,
    builds the new optimizer with every trainable variable, before the file's
    optimizer variables are loaded: under a kerasps strategy's scope it would hold
    slots of the tables that train with an optimizer of their own (keras-rs'
    `TableConfig.optimizer`), and the file's variables would not match them. For a
    model built under a kerasps strategy, the optimizer is built right after
    compiling with those it trains (`trained_by`), as `build_optimizer_without_own_tables`
    does. Defers to Keras' own otherwise.
    """
    original = _keras_original(TensorFlowTrainer, "compile_from_config")
    if not _handlers.trainer.uses_kerasps(self):
        return original(self, config)
    compile_model = self.compile  # Keras' (a model overriding it is not compiled)

    with contextlib.ExitStack() as builds:
        def compile_for_what_it_trains(*args, **kwargs):
            compile_model(*args, **kwargs)
            optimizer = getattr(self, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                builds.enter_context(_optimizer_built_with_what_it_trains(optimizer))

        object.__setattr__(self, "compile", compile_for_what_it_trains)
        try:
            return original(self, config)
        finally:
            object.__delattr__(self, "compile")


# Row lookups -----------------------------------------------------------------------

def take_rows_from_shards(x, indices, axis=None):
    """Replaces `keras.src.backend.tensorflow.numpy.take` (`keras.ops.take`): per shard.

    A row lookup (`axis` 0) in a `kerasps.ShardedVariable` gathers on each shard's ps
    task (`ShardedVariable.lookup`) instead of concatenating the whole table: dense
    and ragged ids, and sparse ids as Keras looks them up (each id its own row, the
    missing ones row 0, which keras-rs' `EmbedReduce` masks). Defers to Keras' `take`
    for anything else.
    """
    if isinstance(x, _handlers.variables.ShardedVariable) and axis in (0, -x.ndim):
        if isinstance(indices, tf.SparseTensor):
            values = tf.where(indices.values < 0,
                              indices.values + tf.cast(x.shape[0], indices.values.dtype),
                              indices.values)
            indices = tf.SparseTensor(indices.indices, values, indices.dense_shape)
            output = tf.nn.safe_embedding_lookup_sparse(
                x, tf.sparse.expand_dims(indices, axis=-1), default_id=0)
            output.set_shape(indices.shape + output.shape[len(indices.shape):])
            return output
        return x.lookup(indices)
    return _keras_original(tf_numpy, "take")(x, indices, axis=axis)


# Training loops --------------------------------------------------------------------

def _dispatch(model, name, args, kwargs):
    """`model.<name>(*args, **kwargs)`: `kerasps.keras.trainer`'s for a model built under a
    kerasps strategy (inside its scope), else Keras'."""
    if _handlers.trainer.uses_kerasps(model):
        with model.distribute_strategy.scope():
            return getattr(_handlers.trainer, name)(model, *args, **kwargs)
    _build_optimizer_for_tables(model)
    return _keras_original(TensorFlowTrainer, name)(model, *args, **kwargs)


@tracebacks.filtered
def fit_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.fit`: a kerasps model trains on the workers.

    A model built under a kerasps strategy trains with `kerasps.keras.trainer.fit`. Any
    other model trains with Keras' `fit` (its optimizer built first where a
    `kerasps.layers.DynamicEmbedding` needs its slots when tracing).
    """
    return _dispatch(self, "fit", args, kwargs)


@tracebacks.filtered
def evaluate_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.evaluate`: `kerasps.keras.trainer.evaluate` for a kerasps
    model, Keras' `evaluate` for any other."""
    return _dispatch(self, "evaluate", args, kwargs)


@tracebacks.filtered
def predict_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.predict`: `kerasps.keras.trainer.predict` for a kerasps
    model, Keras' `predict` for any other."""
    return _dispatch(self, "predict", args, kwargs)


def train_on_batch_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.train_on_batch`: `kerasps.keras.trainer.train_on_batch`
    for a kerasps model, Keras' `train_on_batch` for any other."""
    return _dispatch(self, "train_on_batch", args, kwargs)


def test_on_batch_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.test_on_batch`: `kerasps.keras.trainer.test_on_batch`
    for a kerasps model, Keras' `test_on_batch` for any other."""
    return _dispatch(self, "test_on_batch", args, kwargs)


def predict_on_batch_on_workers(self, *args, **kwargs):
    """Replaces `TensorFlowTrainer.predict_on_batch`: `kerasps.keras.trainer.predict_on_batch`
    for a kerasps model, Keras' `predict_on_batch` for any other."""
    return _dispatch(self, "predict_on_batch", args, kwargs)


# The table ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Seam:
    """One Keras attribute kerasps replaces: `target.<attribute> = replacement`."""

    target: object  # a Keras class or module
    attribute: str
    replacement: Callable


_TFOptimizer = tf_optimizer.TFOptimizer

SEAMS = (
    # Variables: creation, placement, atomic updates of ps variables.
    Seam(KerasTFVariable, "__new__", new_variable_sharded_when_partitioned),
    Seam(KerasTFVariable, "_initialize", initialize_variable_where_placed),
    Seam(KerasTFVariable, "assign_add", assign_add_atomically),
    Seam(KerasTFVariable, "assign_sub", assign_sub_atomically),
    Seam(KerasTFVariable, "__add__", add_noting_accumulator_sum),
    Seam(KerasTFVariable, "__radd__", radd_noting_accumulator_sum),
    Seam(KerasTFVariable, "assign", assign_shape_checked_or_atomic),
    # Layer tracking.
    Seam(tracking.Tracker, "add_to_store", track_shards_of_sharded_variables),
    # Saved state: whole variables, whatever the number of shards.
    Seam(Layer, "_check_load_own_variables", check_layer_loads_whole_variables),
    Seam(Layer, "save_own_variables", save_layer_whole_variables),
    Seam(Layer, "load_own_variables", load_layer_whole_variables),
    Seam(_TFOptimizer, "build", build_optimizer_noting_unbuilt_size),
    Seam(_TFOptimizer, "save_own_variables", save_optimizer_whole_variables),
    Seam(_TFOptimizer, "load_own_variables", load_optimizer_whole_variables),
    Seam(_TFOptimizer, "_trackable_children", checkpoint_optimizer_whole_variables),
    Seam(saving_lib, "_load_state", load_weights_file_all_or_nothing),
    Seam(saving_lib, "get_attr_skipset", attr_skipset_made_once),
    Seam(Layer, "get_weights", get_whole_weights),
    Seam(Layer, "set_weights", set_whole_weights),
    Seam(Model, "export", export_single_process_copy),
    # Optimizers: scalars on one ps task, slots next to their variable, row updates.
    Seam(_TFOptimizer, "__init__", init_optimizer_on_one_ps_task),
    Seam(_TFOptimizer, "add_variable_from_reference", add_slot_next_to_its_variable),
    Seam(_TFOptimizer, "_distributed_tf_update_step", update_rows_and_send_once),
    Seam(_TFOptimizer, "_apply_weight_decay", apply_weight_decay_but_lazily),
    Seam(_TFOptimizer, "apply", apply_with_own_optimizers),
    Seam(TensorFlowTrainer, "_symbolic_build", build_optimizer_without_own_tables),
    Seam(TensorFlowTrainer, "compile_from_config", compile_loaded_model_without_own_tables),
    # Row lookups.
    Seam(tf_numpy, "take", take_rows_from_shards),
    # Training loops.
    Seam(TensorFlowTrainer, "fit", fit_on_workers),
    Seam(TensorFlowTrainer, "evaluate", evaluate_on_workers),
    Seam(TensorFlowTrainer, "predict", predict_on_workers),
    Seam(TensorFlowTrainer, "train_on_batch", train_on_batch_on_workers),
    Seam(TensorFlowTrainer, "test_on_batch", test_on_batch_on_workers),
    Seam(TensorFlowTrainer, "predict_on_batch", predict_on_batch_on_workers),
)

_ABSENT = object()  # a target had no attribute of that name of its own
_saved: dict = {}  # Seam -> the target's own attribute before `install`, or `_ABSENT`
_installed = False


def installed() -> bool:
    """Whether the seams are in Keras (`install` ran, `uninstall` did not since)."""
    return _installed


def _put_back(seams):
    """Puts back what each of `seams` replaced: the same object, or no attribute."""
    for seam in reversed(seams):
        saved = _saved.pop(seam)
        if saved is not _ABSENT:
            setattr(seam.target, seam.attribute, saved)
        elif seam.attribute == "__new__":
            _delete_new(seam.target)
        else:
            delattr(seam.target, seam.attribute)
        seam.replacement.__dict__.pop("__wrapped__", None)


_Py_tp_new = 65  # CPython's slot number of `tp_new` (`Include/typeslots.h`)


def _tp_new(cls) -> int:
    """The address of the C function that makes `cls`'s instances (CPython's `tp_new`)."""
    get_slot = ctypes.pythonapi.PyType_GetSlot
    get_slot.argtypes, get_slot.restype = (ctypes.py_object, ctypes.c_int), ctypes.c_void_p
    return get_slot(cls, _Py_tp_new)


@functools.cache
def _tp_new_offset() -> int:
    """Where a class object holds its `tp_new`: the one word that holds `object`'s in a
    class without `__new__` and CPython's `slot_tp_new` in a class with one."""
    class Plain:
        pass

    class WithNew:
        def __new__(cls):
            return object.__new__(cls)

    size = ctypes.sizeof(ctypes.c_void_p)

    def word(cls, i):
        return ctypes.c_void_p.from_address(id(cls) + i * size).value

    found = [i * size for i in range(type.__basicsize__ // size)
             if word(Plain, i) == _tp_new(Plain) and word(WithNew, i) == _tp_new(WithNew)]
    if len(found) != 1:
        raise RuntimeError(f"kerasps cannot find `tp_new` in a class object (found {found})")
    return found[0]


def _delete_new(cls):
    """Deletes `cls.__new__`, and lets the classes whose `__new__` is `object.__new__`
    again make their instances as they did before it was set.

    CPython does not recompute a class's `tp_new` when its `__new__` is deleted
    (`update_one_slot` in `Objects/typeobject.c` keeps the `slot_tp_new` that setting
    it put there, in the class and its subclasses; CPython issues bpo-25731 and
    gh-105888): the class then calls `object.__new__` with the constructor's
    arguments, which raises `TypeError: object.__new__() takes exactly one argument`.
    The `tp_new` of each class of the tree whose `__new__` is `object.__new__` again is
    set back to `object`'s, as it was before `__new__` was set.
    """
    slot_tp_new = _tp_new(cls)
    delattr(cls, "__new__")
    if sys.implementation.name != "cpython":
        return
    classes = [cls]
    while classes:
        each = classes.pop()
        classes.extend(each.__subclasses__())
        if each.__new__ is object.__new__ and _tp_new(each) == slot_tp_new:
            ctypes.c_void_p.from_address(id(each) + _tp_new_offset()).value = _tp_new(object)
            ctypes.pythonapi.PyType_Modified(ctypes.py_object(each))


def install(*, trainer, variables, sparse):
    """Installs the seams into Keras (idempotent), handing them kerasps's handlers.

    Called by `kerasps.keras.hooks.install` (a strategy, a `DynamicEmbedding`): this
    module, below them all, imports none of the handlers. Each seam of `SEAMS` saves
    what its target held (the target's own attribute, or none: `uninstall` puts it
    back) and the Keras code it defers to, then replaces it. A replacement's
    `__wrapped__` is the Keras code, so `inspect.signature(model.fit)` is Keras'.

    Args:
        trainer: the module of the trainer's `fit`, `evaluate` ... (`kerasps.keras.trainer`).
        variables: the module of the variables' creator (`kerasps.params.variables`).
        sparse: the module of the row-update rule (`kerasps.params.sparse`).
    """
    global _installed
    if _installed:
        return
    _handlers.trainer, _handlers.variables, _handlers.sparse = trainer, variables, sparse
    done = []
    try:
        for seam in SEAMS:
            saved = vars(seam.target).get(seam.attribute, _ABSENT)
            keras_code = getattr(seam.target, seam.attribute)
            setattr(seam.target, seam.attribute, seam.replacement)
            _saved[seam], _keras_code[seam.target, seam.attribute] = saved, keras_code
            done.append(seam)
            seam.replacement.__wrapped__ = keras_code
    except BaseException:
        _put_back(done)
        raise
    _installed = True


def uninstall():
    """Puts Keras back as it was before `install`: every attribute a seam replaced is
    the very object it was (`is`), and one the target did not have is deleted.

    Models and variables made while kerasps was installed keep what they are (a
    `ShardedVariable` stays one), but Keras no longer runs kerasps' code for them;
    `install` (a new strategy) puts the seams back. Does nothing when not installed.
    """
    global _installed
    if not _installed:
        return
    _put_back(SEAMS)
    _installed = False
