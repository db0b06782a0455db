"""Sharded variables for Keras 3.

Under a kerasps strategy with a `variable_partitioner`, a Keras variable that
the partitioner splits is created as a `ShardedVariable`: a Keras `Variable`
whose rows live in several ordinary Keras variables (the shards), each on a
ps task chosen by the placement policy.

* The layer holds the `ShardedVariable` (`layer.embeddings`), so layer code
  is unchanged; reading it as a tensor concatenates the shards.
* The layer *tracks* the shards: `layer.trainable_variables` lists them, so
  `tape.gradient(loss, model.trainable_variables)` and Keras optimizers work
  on real variables (slots are created per shard, on the shard's ps task).
  `tf_keras` behaved the same way with TF's `ShardedVariable`.
* Saved state is whole: the slots of a variable's shards make a
  `ShardedVariable` too (`track_slot`), and weights files, checkpoints and
  `get_weights()` see whole variables (`logical_variables`), so they move
  between any numbers of shards and single-process Keras.
* `ops.take(variable, ids, axis=0)` (what `keras.layers.Embedding` calls)
  gathers on each shard's ps task and moves only the rows a batch touches;
  so do `tf.nn.embedding_lookup`, `tf.nn.embedding_lookup_sparse` and
  `tf.nn.safe_embedding_lookup_sparse` of a `ShardedVariable` (registered with
  `tf.experimental.dispatch_for_api`, as TensorFlow does for its own).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading

import keras
import numpy as np
import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.policy import partitioners as partitioners_lib

__all__ = ["ShardedVariable", "creating", "no_partitioning", "current_creation",
           "logical_variables"]

_state = threading.local()


def _stack(name):
    if not hasattr(_state, name):
        setattr(_state, name, [])
    return getattr(_state, name)


@contextlib.contextmanager
def no_partitioning():
    """Variables created inside are never split (optimizer slots, shards themselves)."""
    _stack("no_partition").append(True)
    try:
        yield
    finally:
        _stack("no_partition").pop()


@contextlib.contextmanager
def creating(keras_variable=None, name=None, shard=None):
    """Records which Keras variable (or shard) the next `tf.Variable` belongs to."""
    _stack("creating").append((keras_variable, name, shard))
    try:
        yield
    finally:
        _stack("creating").pop()


def current_creation():
    """Returns `(variable_name, shard_index)` for the `tf.Variable` being created.

    The innermost `creating` context wins, except that a shard's own context
    (with an explicit `name`) is kept when the shard's Keras variable
    initializes inside it.
    """
    stack = _stack("creating")
    for _, name, shard in reversed(stack):
        if name is not None:
            return name, shard
    for keras_variable, _, _ in reversed(stack):
        if keras_variable is not None:
            return keras_variable.path, None
    return None, None


@contextlib.contextmanager
def on_ps_task(ps_task: int | None = None):
    """Variables created inside go to ps task `ps_task`, whatever the placement policy
    (the shards of a `kerasps.layers.DynamicEmbedding` table: one per ps task).

    With `ps_task=None`, they all go to the task the policy gives the first of them
    (an optimizer's `iterations` and learning rate, which every step reads together).
    """
    pin = [ps_task]
    _stack("ps_task").append(pin)
    try:
        yield
    finally:
        _stack("ps_task").pop()


def pinned_ps_task() -> int | None:
    """The ps task of the innermost `on_ps_task`, or `None`."""
    stack = _stack("ps_task")
    return stack[-1][0] if stack else None


def placed_on_ps_task(ps_task: int):
    """Records that the policy placed a variable on `ps_task`: the innermost
    `on_ps_task()` without a task now pins its other variables there."""
    stack = _stack("ps_task")
    if stack and stack[-1][0] is None:
        stack[-1][0] = ps_task


def creating_keras_variable() -> bool:
    """True while a Keras variable (sharded or not) creates its `tf.Variable`."""
    return any(v is not None or n is not None for v, n, _ in _stack("creating"))


def kerasps_strategy():
    """The kerasps strategy whose scope is active, else `None`."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    return strategy if getattr(strategy, "_is_kerasps", False) else None


def sharded_class_for(args, kwargs):
    """Returns `ShardedVariable` if `Variable(*args, **kwargs)` should be split here."""
    if _stack("no_partition") or _keras.in_stateless_scope():
        return None
    strategy = kerasps_strategy()
    if strategy is None or strategy.extended.variable_partitioner is None:
        return None
    arguments = _keras.bind_variable_args(args, kwargs)
    shape, initializer = arguments.get("shape"), arguments.get("initializer")
    if isinstance(initializer, str):
        initializer = keras.initializers.get(initializer)
    dtype = arguments.get("dtype")
    if initializer is not None and not callable(initializer):
        # `keras.Variable(value)`: shaped (and typed) by its value, like `add_weight`
        # variables by their arguments, so it is partitioned the same way.
        value = keras.ops.convert_to_tensor(initializer, dtype=dtype)
        shape, dtype = tuple(value.shape), value.dtype
    if shape is None or len(tuple(shape)) == 0:
        return None
    dtype = dtype or keras.config.floatx()
    num_shards = strategy.extended.num_shards(
        tuple(shape), dtype, _keras.variable_path(arguments.get("name") or "variable"))
    return ShardedVariable if num_shards > 1 else None


# Initializers whose elements are drawn independently of the variable's shape:
# a shard can be initialized on its own, without building the full value.
_ELEMENTWISE_INITIALIZERS = ("RandomUniform", "RandomNormal", "TruncatedNormal",
                             "Zeros", "Ones", "Constant")


def _is_elementwise(initializer) -> bool:
    return type(initializer).__name__ in _ELEMENTWISE_INITIALIZERS


def _reseeded(initializer, shard_index):
    """The initializer for shard `shard_index`: same distribution, its own draws.

    A Keras initializer with an integer seed returns the same values for the
    same shape on every call; equal-sized shards would start identical.
    """
    seed = getattr(initializer, "seed", None)
    if shard_index == 0 or not isinstance(seed, int):
        return initializer
    config = initializer.get_config()
    config["seed"] = (seed * 1_000_003 + shard_index) % (2**31 - 1)
    return type(initializer).from_config(config)


class ShardedVariable(_keras.KerasTFVariable):
    """A Keras variable split along axis 0 into shards on several ps tasks.

    Created automatically under a kerasps strategy scope with a
    `variable_partitioner`; not meant to be constructed by hand. Shard `i`
    holds rows `offsets[i]:offsets[i] + sizes[i]` (TensorFlow's "div"
    partitioning: the first `rows % num_shards` shards have one extra row).

    Attributes:
        shards: the shard variables (ordinary Keras variables), in row order.
    """

    # Not a resource variable: gradients are taken with respect to the shards.
    _should_act_as_resource_variable = False

    def __init__(self, initializer, shape=None, dtype=None, trainable=True, autocast=True,
                 aggregation="none", synchronization="auto", name=None, **kwargs):
        self._shards = []
        if isinstance(initializer, str):
            initializer = keras.initializers.get(initializer)
        if not callable(initializer):
            # A value (`keras.Variable([...])`): split it like an initializer's output.
            value = keras.ops.convert_to_tensor(initializer, dtype=dtype)
            shape, dtype = tuple(value.shape), value.dtype
            initializer = lambda shape, dtype=None: value  # noqa: E731
        self._init_kwargs = dict(trainable=trainable, autocast=autocast,
                                 aggregation=aggregation, synchronization=synchronization)
        super().__init__(initializer, shape=shape, dtype=dtype, trainable=trainable,
                         autocast=autocast, aggregation=aggregation,
                         synchronization=synchronization, name=name, **kwargs)

    # -- creation -------------------------------------------------------------
    def _initialize_with_initializer(self, initializer):
        if isinstance(initializer, _ExistingShards):
            return self._adopt(initializer.shards)
        strategy = kerasps_strategy()
        num_shards = strategy.extended.num_shards(self._shape, self._dtype, self.path)
        sizes = partitioners_lib.shard_sizes(self._shape[0], num_shards)
        offsets = partitioners_lib.shard_offsets(self._shape[0], num_shards)
        full_value, shards = None, []
        if not _is_elementwise(initializer):
            # Shape-dependent initializers (e.g. Glorot) need the full shape's
            # statistics: build the value once and slice it.
            full_value = initializer(self._shape, dtype=self._dtype)
        for i, (offset, rows) in enumerate(zip(offsets, sizes)):
            shard_shape = (rows,) + tuple(self._shape[1:])
            if full_value is None:
                shard_init = _reseeded(initializer, i)
            else:
                shard_init = full_value[offset:offset + rows]
            with no_partitioning(), creating(name=f"{self.path}/part_{i}", shard=i):
                shard = _keras.KerasTFVariable(
                    initializer=shard_init,
                    shape=shard_shape if callable(shard_init) else None,
                    dtype=self._dtype,
                    name=f"{self.name}_part_{i}",
                    **self._init_kwargs,
                )
            shard._path = f"{self.path}/part_{i}"
            shards.append(shard)
        self._adopt(shards)

    def _adopt(self, shards):
        """Makes `shards` (variables with the same trailing dims) this variable's rows."""
        for shard in shards:
            shard._kerasps_container = self
        # On ps tasks when its shards are: `_keras.install` then remembers the sums of
        # `v + delta` for metric accumulators, which `assign` makes atomic.
        self._kerasps_remote = all(getattr(s, "_kerasps_remote", False) for s in shards)
        self._shards = list(shards)
        self._sizes = [int(shard.shape[0]) for shard in shards]
        self._offsets = [0, *itertools.accumulate(self._sizes)][:-1]
        self._value = None

    @classmethod
    def of_shards(cls, shards, name, path):
        """A `ShardedVariable` whose shards are existing variables (optimizer slots).

        Args:
            shards: Keras variables, in row order, each on its own ps task.
            name: the whole variable's name.
            path: the whole variable's path.
        """
        shape = (sum(int(s.shape[0]) for s in shards),) + tuple(shards[0].shape[1:])
        variable = cls(_ExistingShards(shards), shape=shape, dtype=shards[0].dtype,
                       trainable=shards[0].trainable, name=name)
        variable._path = path
        return variable

    def _initialize(self, value):
        # Reached when restoring from an explicit value: split it.
        value = tf.convert_to_tensor(value, dtype=self._dtype)
        self._shape = tuple(value.shape)
        self._initialize_with_initializer(lambda shape, dtype=None: value)

    def _deferred_initialize(self):
        raise ValueError(
            f"Variable {self.path} is sharded and cannot be initialized lazily."
        )

    # -- structure ------------------------------------------------------------
    @property
    def shards(self):
        return list(self._shards)

    @property
    def num_shards(self):
        return len(self._shards)

    @property
    def shard_offsets(self):
        return list(self._offsets)

    @property
    def shard_sizes(self):
        return list(self._sizes)

    @property
    def trainable(self):
        return self._trainable

    @trainable.setter
    def trainable(self, value):
        self._trainable = bool(value)
        for shard in getattr(self, "_shards", ()):
            shard.trainable = value

    @property
    def regularizer(self):
        return self._regularizer

    @regularizer.setter
    def regularizer(self, value):
        # The layer collects losses from the variables it tracks (the shards).
        # L1/L2-style penalties are sums over elements, so the sum over shards
        # equals the penalty of the whole variable.
        self._regularizer = value
        for shard in self._shards:
            shard.regularizer = value

    @property
    def constraint(self):
        return self._constraint

    @constraint.setter
    def constraint(self, value):
        # Applied per shard by the optimizer; exact for row-wise constraints.
        self._constraint = value
        for shard in self._shards:
            shard.constraint = value

    @property
    def handle(self):
        raise TypeError(
            f"Variable {self.path!r} is sharded over {self.num_shards} ps tasks and "
            "has no single handle. Take gradients with respect to its shards "
            "(`model.trainable_variables` lists them) or `variable.shards`."
        )

    # -- reading --------------------------------------------------------------
    @property
    def value(self):
        parts = [shard.value for shard in self._shards]
        return tf.concat(parts, axis=0)

    def numpy(self):
        return np.concatenate([shard.numpy() for shard in self._shards], axis=0)

    def lookup(self, ids):
        """Gathers rows `ids` from the shards, each gather on its shard's ps task.

        Equivalent to `ops.take(self, ids, axis=0)` but moves only the rows
        touched instead of the whole table. Negative ids count from the end.
        Each distinct row is gathered once, and its gradient reaches its
        shard once, summed over the batch: every shard gets a row update
        (`tf.IndexedSlices`) that `kerasps.sparse` applies to those rows only.
        Ragged ids give ragged rows (`[batch, (ids), *row_shape]`).
        """
        if isinstance(ids, tf.RaggedTensor):
            return ids.with_flat_values(self.lookup(ids.flat_values))
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            ids = tf.cast(ids, "int64")
        size = tf.cast(self._shape[0], ids.dtype)
        ids = tf.where(ids < 0, ids + size, ids)
        unique_ids, positions = tf.unique(tf.reshape(ids, [-1]))
        if self._shape[0] < np.iinfo(np.int32).max:
            # Half the bytes sent to the shards. An id outside the table becomes the
            # row just past its end, which the gather refuses as it refused the id
            # (cast, 2**32 + 3 would have been row 3).
            unique_ids = tf.cast(tf.where((unique_ids >= 0) & (unique_ids < size),
                                          unique_ids, size), tf.int32)
        params = [shard.value for shard in self._shards]
        rows = tf.nn.embedding_lookup(params, unique_ids)
        result = _expand_rows(rows, tf.reshape(positions, tf.shape(ids)))
        result.set_shape(ids.shape.concatenate(self._shape[1:]))
        return result

    # -- writing --------------------------------------------------------------
    def _split(self, value):
        value = tf.convert_to_tensor(value, dtype=self._dtype)
        check_shape(self, value.shape)
        if not value.shape.is_fully_defined():
            # A tensor restored inside a function has no static shape: check it
            # when the function runs, before any shard is written.
            shape = tf.shape(value)
            check = tf.debugging.Assert(
                tf.equal(tf.strings.format("{}", [shape]),
                         tf.strings.format("{}", [tf.constant(self._shape, shape.dtype)])),
                [tf.strings.format(f"Cannot restore variable '{self.path}' of shape "
                                   f"{self._shape} from a value of shape {{}}", [shape])])
            with tf.control_dependencies([check]):
                value = tf.identity(value)
            value.set_shape(self._shape)
        return tf.split(value, self._sizes, axis=0)

    def _per_shard(self, method, value):
        """Splits `value` by rows and applies `shard.<method>(rows)` to every shard."""
        for shard, part in zip(self._shards, self._split(value)):
            getattr(shard, method)(part)
        return value

    def assign(self, value):
        delta = self._accumulated_delta(value)
        if _keras.in_stateless_scope():
            return super().assign(value)
        if delta is not None:
            # Keras metrics accumulate with `v.assign(v + delta)`, a read and a write:
            # workers doing it at once lose updates. Add `delta` to every shard with
            # TensorFlow's atomic AssignAddVariableOp instead (as `_keras.install` does
            # for unsharded accumulators).
            self._per_shard("assign_add", delta)
            return value
        return self._per_shard("assign", value)

    def _accumulated_delta(self, value):
        """`delta` if `value` is the sum `self + delta` that `_keras.install` remembered
        for this metric accumulator (ps variables, `synchronization="on_read"`, in a
        traced function), else None."""
        last_sum = getattr(self, "_kerasps_last_sum", None)
        if last_sum is None or value is not last_sum[0]:
            return None
        self._kerasps_last_sum = None
        return tf.broadcast_to(tf.cast(last_sum[1], self._dtype), self._shape)

    def _direct_assign(self, value):
        self._per_shard("_direct_assign", value)

    def assign_add(self, value):
        return self._per_shard("assign_add", value)

    def assign_sub(self, value):
        return self._per_shard("assign_sub", value)

    # -- checkpointing: save and restore the whole variable, independent of the
    # number of shards, so checkpoints move between cluster shapes.
    @property
    def _shared_name(self):
        return self.path

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.value}

    def _restore_from_tensors(self, restored_tensors):
        self.assign(restored_tensors["VARIABLE_VALUE"])
        return self.value

    def __repr__(self):
        return (f"<kerasps.ShardedVariable path={self.path}, shape={self.shape}, "
                f"dtype={self.dtype}, shards={self.num_shards}>")


def check_shape(variable, shape):
    """Raises unless a value of `shape` can be assigned to `variable`, naming both shapes."""
    if not tf.TensorShape(shape).is_compatible_with(tuple(variable.shape)):
        raise ValueError(
            "The shape of the target variable and the shape of the target value in "
            f"`variable.assign(value)` must match. variable.shape={tuple(variable.shape)}, "
            f"Received: value.shape={tuple(shape)}. Target variable: {variable.path}")


class _ExistingShards:
    """The "initializer" of `ShardedVariable.of_shards`: the shards exist already."""

    def __init__(self, shards):
        self.shards = shards

    def __call__(self, shape, dtype=None):
        raise TypeError("Existing shards are adopted, not initialized.")


def track_slot(optimizer, reference, slot):
    """Records that `optimizer` made `slot` for `reference`, a variable or a shard.

    Slots of shards sit next to their shard. Once every shard of a
    `ShardedVariable` has its slot of one kind (Adam's `momentum`, ...), the
    slots become the shards of a `ShardedVariable` too, so that the slot is
    saved whole, like the variable (see `logical_variables`).
    """
    on_slot = getattr(reference, "_kerasps_on_slot", None)
    if on_slot is not None:  # a dynamic table resets the slots of the rows it reuses
        on_slot(slot)
    container = getattr(reference, "_kerasps_container", None)
    if container is None:
        return
    shard_prefix = reference.path.replace("/", "_")
    suffix = slot.name[len(shard_prefix):] if slot.name.startswith(shard_prefix) else slot.name
    pending = container.__dict__.setdefault("_kerasps_pending_slots", {})
    slots = pending.setdefault((id(optimizer), suffix), [None] * container.num_shards)
    slots[next(i for i, s in enumerate(container.shards) if s is reference)] = slot
    if any(s is None for s in slots):
        return
    del pending[(id(optimizer), suffix)]
    name = container.path.replace("/", "_") + suffix
    ShardedVariable.of_shards(slots, name=name, path=slot.path[:-len(slot.name)] + name)


def _expand_rows(rows, positions):
    """`tf.gather(rows, positions)` whose gradient sums per row (dense, one per row).

    `tf.gather`'s own gradient repeats a row for each of its positions, and
    densifying it later warns about memory; summing here keeps the shards'
    gradients as small as the number of distinct rows.
    """

    @tf.custom_gradient
    def expand(rows):
        def grad(upstream):
            return tf.math.unsorted_segment_sum(upstream, positions, tf.shape(rows)[0])

        return tf.gather(rows, positions), grad

    return expand(rows)


def logical_variables(variables):
    """`variables` with each run of shards replaced by their `ShardedVariable`, in order."""
    result, seen = [], set()
    for variable in variables:
        variable = getattr(variable, "_kerasps_container", variable)
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def nbytes(shape, dtype) -> int:
    return math.prod(tuple(shape)) * partitioners_lib.element_bytes(dtype)


# -- tf.nn embedding lookups of a ShardedVariable ----------------------------------------
# As for TensorFlow's own ShardedVariable (which registers the same dispatches), the
# lookups gather on each shard's ps task instead of reading the table whole (or failing:
# the sparse lookups colocate with `params[0].device`). Shards are TensorFlow's "div"
# partitioning, which is what the `tf.nn` (v2) lookups assume of a list of tensors.
_tf.register_dispatchable_type(ShardedVariable)


def _shard_values(variable):
    return [shard.value for shard in variable.shards]


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup, {"params": ShardedVariable})
def _embedding_lookup(params, ids, max_norm=None, name=None):
    """`tf.nn.embedding_lookup(sharded_variable, ids)`: `ShardedVariable.lookup`."""
    if max_norm is not None:
        return tf.nn.embedding_lookup(_shard_values(params), ids, max_norm=max_norm,
                                      name=name)
    with tf.name_scope(name or "embedding_lookup"):
        return params.lookup(ids)


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup_sparse, {"params": ShardedVariable})
def _embedding_lookup_sparse(params, sp_ids, sp_weights, combiner=None, max_norm=None,
                             name=None, allow_fast_lookup=False):
    return tf.nn.embedding_lookup_sparse(
        _shard_values(params), sp_ids, sp_weights, combiner=combiner, max_norm=max_norm,
        name=name, allow_fast_lookup=allow_fast_lookup)


@tf.experimental.dispatch_for_api(tf.nn.safe_embedding_lookup_sparse,
                                  {"embedding_weights": ShardedVariable})
def _safe_embedding_lookup_sparse(embedding_weights, sparse_ids, sparse_weights=None,
                                  combiner="mean", default_id=None, max_norm=None, name=None,
                                  allow_fast_lookup=False):
    return tf.nn.safe_embedding_lookup_sparse(
        _shard_values(embedding_weights), sparse_ids, sparse_weights, combiner=combiner,
        default_id=default_id, max_norm=max_norm, name=name,
        allow_fast_lookup=allow_fast_lookup)
