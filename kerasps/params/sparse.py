"""Row updates of sharded embedding tables: exact where the math allows, lazy on request.

A batch touches a few rows of an embedding table, and the gradient of a
`kerasps.ShardedVariable` lookup reaches each shard as a row update (a
`tf.IndexedSlices` holding each touched row once). Keras 3 optimizers still
update every row of the table and of its slots each step, so a step costs in
proportion to the table. Here the update of a shard runs on the rows of the
batch only, on the shard's ps task, in one of two modes (the `sparse_updates`
argument of `kerasps.ParameterServerStrategy`):

* `"exact"` (the default): only where the result is exactly Keras' dense
  update, because the dense rule leaves the other rows and their slots as they
  are: `SGD` without momentum, `Adagrad`, and `Ftrl` with a constant learning
  rate (a `learning_rate` changed during training, e.g. by `ReduceLROnPlateau`,
  moves untouched rows in Keras' rule) and no
  `l2_shrinkage_regularization_strength`; `Ftrl`'s first step is dense, as
  Keras' `Ftrl` moves every row to its closed form then. `Adam` (without
  `amsgrad`) keeps Keras' dense update of every row, run as TensorFlow's fused
  `ResourceApplyAdam` on the shard's ps task (one pass over the shard and its
  slots instead of one per Keras op). Other optimizers keep Keras' dense update.
* `"lazy"`: in addition, `Adam`, `AdamW`, `RMSprop`, `SGD` with momentum, and
  `Ftrl` with a learning-rate schedule or L2 shrinkage, update the rows of the
  batch only: the slots of the other rows keep their values instead of
  decaying, as TF1's `LazyAdamOptimizer` and TensorFlow Recommenders-Addons do.
  Weight decay decays the rows of the batch only. Rare rows then move more per
  step than under the dense rule; this is the usual choice for large embedding
  tables. The optimizers of the exact mode keep their exact update.

A third mode, `"rows"`, is not a choice of the strategy: it is the rule of an
embedding table trained by an optimizer of its own (a keras-rs `TableConfig`'s,
see `kerasps.keras.layers.rs_tables`), sharded or not, as TPU embedding
optimizers train theirs: every supported optimizer (`SGD` without momentum,
`Adagrad`, `Adam`, `Ftrl`) updates the rows of the batch only, `Ftrl` from its
first step, `Adam` lazily.

Unsharded variables (except in the `"rows"` mode), dense gradients (a table read
whole), optimizers not listed and subclasses that override `update_step` keep
Keras' own update. Slots are the same variables in every mode, so checkpoints
move between them.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasps.backend import _keras
from kerasps.params import changes as changes_lib

__all__ = ["EXACT", "LAZY", "MODES", "validate_mode", "update_rows"]

EXACT = "exact"
LAZY = "lazy"
MODES = (EXACT, LAZY)  # the strategy's choices
ROWS = "rows"  # a table's own optimizer: the rows of the batch only, always


def validate_mode(sparse_updates) -> str:
    """Returns `sparse_updates` if it names a mode, else raises a `ValueError`."""
    if sparse_updates not in MODES:
        raise ValueError(
            "Invalid value for argument `sparse_updates`: expected one of "
            f"{', '.join(repr(m) for m in MODES)}. Received: sparse_updates={sparse_updates!r}"
        )
    return sparse_updates


class _Rows:
    """The rows of one shard that a gradient touches, each once, with their update."""

    def __init__(self, optimizer, gradient, variable, learning_rate):
        self.optimizer = optimizer
        self.gradient = gradient
        self.variable = variable  # the shard's `tf.Variable`
        self.dtype = variable.dtype
        # Rows may repeat (two lookups of one table): sum their gradients, so
        # that non-linear rules (squares, maxima) see the dense gradient's rows.
        self.indices, positions = tf.unique(gradient.indices)
        self.grad = tf.math.unsorted_segment_sum(
            tf.cast(gradient.values, self.dtype), positions, tf.shape(self.indices)[0])
        self.lr = tf.cast(learning_rate, self.dtype)
        self.moved_every_row = None  # a bool tensor where the rule may move every row

    def cast(self, value):
        return tf.cast(value, self.dtype)

    def slot(self, attribute):
        return _keras.optimizer_slot(self.optimizer, attribute, self.variable)

    def read(self, variable):
        """The touched rows of `variable` (the shard or a slot), gathered on its ps task."""
        return tf.gather(_keras.tf_variable(variable), self.indices)

    def assign(self, variable, rows):
        self.optimizer.assign(variable, tf.IndexedSlices(rows, self.indices))

    def assign_add(self, variable, rows):
        self.optimizer.assign_add(variable, tf.IndexedSlices(rows, self.indices))

    def assign_sub(self, variable, rows):
        self.optimizer.assign_sub(variable, tf.IndexedSlices(rows, self.indices))


# Each rule mirrors the Keras `update_step` it replaces, restricted to the rows
# of the batch, with the same assign / assign_add / assign_sub per variable.

def _sgd(rows, exact):
    opt, g, lr = rows.optimizer, rows.grad, rows.lr
    if opt.momentum == 0:
        rows.assign_sub(rows.variable, g * lr)
        return
    m = rows.slot("momentums")
    momentum = rows.cast(opt.momentum)
    m_rows = rows.read(m) * momentum - g * lr
    rows.assign(m, m_rows)
    rows.assign_add(rows.variable, m_rows * momentum - g * lr if opt.nesterov else m_rows)


def _adagrad(rows, exact):
    accumulator = rows.slot("_accumulators")
    rows.assign_add(accumulator, tf.square(rows.grad))
    rows.assign_sub(rows.variable,
                    rows.lr * rows.grad / tf.sqrt(rows.read(accumulator) + rows.optimizer.epsilon))


def _adam(rows, exact):
    opt, g = rows.optimizer, rows.grad
    local_step = rows.cast(opt.iterations + 1)
    beta_1_power = tf.pow(rows.cast(opt.beta_1), local_step)
    beta_2_power = tf.pow(rows.cast(opt.beta_2), local_step)
    alpha = rows.lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m, v = rows.slot("_momentums"), rows.slot("_velocities")
    m_rows, v_rows = rows.read(m), rows.read(v)
    m_delta = (g - m_rows) * (1 - opt.beta_1)
    v_delta = (tf.square(g) - v_rows) * (1 - opt.beta_2)
    rows.assign_add(m, m_delta)
    rows.assign_add(v, v_delta)
    m_rows, v_rows = m_rows + m_delta, v_rows + v_delta
    if opt.amsgrad:
        v_hat = rows.slot("_velocity_hats")
        v_rows = tf.maximum(rows.read(v_hat), v_rows)
        rows.assign(v_hat, v_rows)
    rows.assign_sub(rows.variable, m_rows * alpha / (tf.sqrt(v_rows) + opt.epsilon))


def _rmsprop(rows, exact):
    opt, g, rho = rows.optimizer, rows.grad, rows.optimizer.rho
    velocity = rows.slot("_velocities")
    v_rows = rho * rows.read(velocity) + (1 - rho) * tf.square(g)
    rows.assign(velocity, v_rows)
    if opt.centered:
        average_grad = rows.slot("_average_gradients")
        a_rows = rho * rows.read(average_grad) + (1 - rho) * g
        rows.assign(average_grad, a_rows)
        denominator = v_rows - tf.square(a_rows) + opt.epsilon
    else:
        denominator = v_rows + opt.epsilon
    increment = rows.lr * g / tf.sqrt(denominator)
    if opt.momentum > 0:
        momentum = rows.slot("_momentums")
        increment = opt.momentum * rows.read(momentum) + increment
        rows.assign(momentum, increment)
    rows.assign_sub(rows.variable, increment)


def _ftrl_rows(rows):
    opt, g, lr = rows.optimizer, rows.grad, rows.lr
    accumulator, linear = rows.slot("_accumulators"), rows.slot("_linears")
    lr_power = opt.learning_rate_power
    l2_reg = opt.l2_regularization_strength + opt.beta / (2.0 * lr)
    var_rows, accum_rows = rows.read(rows.variable), rows.read(accumulator)
    grad_to_use = g + 2 * opt.l2_shrinkage_regularization_strength * var_rows
    new_accum = accum_rows + tf.square(g)
    sigma = (tf.pow(new_accum, -lr_power) - tf.pow(accum_rows, -lr_power)) / lr
    rows.assign_add(linear, grad_to_use - sigma * var_rows)
    linear_rows = rows.read(linear)
    quadratic = tf.pow(new_accum, -lr_power) / lr + 2 * l2_reg
    l1 = opt.l1_regularization_strength
    rows.assign(rows.variable,
                (tf.clip_by_value(linear_rows, -l1, l1) - linear_rows) / quadratic)
    rows.assign(accumulator, new_accum)


def _ftrl(rows, exact):
    if not exact:
        _ftrl_rows(rows)
        return

    # Keras' dense rule moves every row to its closed form on the first step
    # (rows no batch touched go to zero) and leaves untouched rows there after.
    def dense():
        rows.optimizer.update_step(tf.convert_to_tensor(rows.gradient), rows.variable, rows.lr)
        return tf.constant(True)

    def sparse():
        _ftrl_rows(rows)
        return tf.constant(False)

    rows.moved_every_row = tf.cond(tf.equal(rows.optimizer.iterations, 0), dense, sparse)


def _ftrl_is_exact(opt):
    return opt.l2_shrinkage_regularization_strength == 0 and _keras.has_constant_learning_rate(opt)


# Keras' `update_step` replaced -> (the rule, whether the rule is exact for an optimizer).
_RULES = {
    keras.optimizers.SGD.update_step: (_sgd, lambda opt: opt.momentum == 0),
    keras.optimizers.Adagrad.update_step: (_adagrad, lambda opt: True),
    keras.optimizers.Ftrl.update_step: (_ftrl, _ftrl_is_exact),
    keras.optimizers.Adam.update_step: (_adam, lambda opt: False),  # and AdamW
    keras.optimizers.RMSprop.update_step: (_rmsprop, lambda opt: False),
}


def flag_keras_update(optimizer, gradient, variable, keras_variable):
    """Flags the rows that Keras' own `update_step` of `gradient` moved in `variable`, if
    its changed rows are tracked (`kerasps.params.changes.track`: a table that is no
    shard keeps Keras' update, bit for bit): the gradient's rows where Keras' rule moves
    no other (a row update with SGD without momentum or Adagrad, no weight decay),
    every row otherwise. Returns the op, or `None` for an untracked variable."""
    changes = changes_lib.changes_of(variable)
    if changes is None:
        return None
    rule = type(optimizer).update_step
    row_local = isinstance(gradient, tf.IndexedSlices) and (
        rule is keras.optimizers.Adagrad.update_step
        or (rule is keras.optimizers.SGD.update_step and optimizer.momentum == 0)) and not (
        _keras.decays(optimizer, keras_variable))
    written = [changes_lib.written(variable)]
    if row_local:
        return changes.mark(gradient.indices, after=written)
    return changes.mark_all(after=written)


def update_rows(optimizer, gradient, variable, learning_rate, mode, weight_decay=False) -> bool:
    """Updates the rows of `variable` that `gradient` touches, if `mode` allows.

    Args:
        optimizer: the Keras optimizer.
        gradient: the shard's gradient; only a `tf.IndexedSlices` is a row update.
        variable: the shard's `tf.Variable`.
        learning_rate: the current learning rate.
        mode: `"exact"`, `"lazy"` or `"rows"`.
        weight_decay: decay the touched rows first (lazy and rows modes: the
            optimizer's own weight decay skips the tables).

    Returns:
        `True` if the rows were updated, `False` if nothing was done and the
        caller must run Keras' dense update. A variable whose changed rows are
        tracked (`kerasps.params.changes.track`) always gets its update here, the
        dense one included, and its rows flagged after it: `True`.
    """
    changes = changes_lib.changes_of(variable)
    rows = _update_rows(optimizer, gradient, variable, learning_rate, mode, weight_decay)
    if changes is None:
        return rows is not False
    # A tracked table's rows (`kerasps.params.changes`): flagged once written.
    if rows is False:
        # Keras' dense update, run here so that every row is flagged after it.
        if weight_decay:
            decay(optimizer, variable)
        optimizer.update_step(gradient, variable, learning_rate)
    if isinstance(rows, _Rows) and rows.moved_every_row is not None:  # Ftrl's first step
        def flagged(mark):
            def run():
                with tf.control_dependencies([mark([changes_lib.written(variable)])]):
                    return tf.constant(True)
            return run

        tf.cond(rows.moved_every_row, flagged(changes.mark_all),
                flagged(lambda after: changes.mark(rows.indices, after)))
    elif isinstance(rows, _Rows):
        changes.mark(rows.indices, after=[changes_lib.written(variable)])
    else:  # every row moved: the dense rule, or fused Adam over the shard
        changes.mark_all(after=[changes_lib.written(variable)])
    return True


def _update_rows(optimizer, gradient, variable, learning_rate, mode, weight_decay):
    """`update_rows`' work: the `_Rows` updated, `True` for a dense update done here
    (fused Adam), `False` for nothing done."""
    rule = _RULES.get(type(optimizer).update_step)
    if not isinstance(gradient, tf.IndexedSlices) or rule is None:
        return False
    apply, is_exact = rule
    exact = is_exact(optimizer)
    if mode == EXACT and not exact:
        return apply is _adam and _adam_in_one_pass(
            optimizer, gradient, variable, learning_rate, weight_decay)
    rows = _Rows(optimizer, gradient, variable, learning_rate)
    if weight_decay:
        decay(optimizer, variable, rows)
    # Exact wherever the math allows it, in the strategy's modes; rows only in "rows".
    apply(rows, exact and mode != ROWS)
    return rows


def _adam_in_one_pass(optimizer, gradient, variable, learning_rate, weight_decay) -> bool:
    """Keras' dense Adam update of a shard, as TensorFlow's fused `ResourceApplyAdam`.

    The same arithmetic as `keras.optimizers.Adam.update_step` (every row and
    both slots move), in one pass over the shard and its slots on its ps task
    instead of one per Keras op; the row update becomes dense there, never on
    the worker. Its rounding differs: ~2e-6 from Keras' float32 ops after 3
    steps at a learning rate of 0.1, and closer than they are to the formula in
    float64. Returns `False` (Keras' update runs instead) with `amsgrad`,
    weight decay to apply first, or slots that are not on the shard's device
    (an optimizer built outside the strategy's scope).
    """
    m = _keras.optimizer_slot(optimizer, "_momentums", variable)
    v = _keras.optimizer_slot(optimizer, "_velocities", variable)
    device = _keras.tf_variable(variable).device
    if optimizer.amsgrad or weight_decay or any(
            _keras.tf_variable(slot).device != device for slot in (m, v)):
        return False
    dtype = variable.dtype
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
    dense = tf.math.unsorted_segment_sum(
        tf.cast(gradient.values, dtype), gradient.indices, tf.shape(variable)[0])
    tf.raw_ops.ResourceApplyAdam(
        var=_keras.tf_variable(variable).handle,
        m=_keras.tf_variable(m).handle, v=_keras.tf_variable(v).handle,
        beta1_power=tf.pow(beta_1, local_step), beta2_power=tf.pow(beta_2, local_step),
        lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
        epsilon=tf.cast(optimizer.epsilon, dtype), grad=dense)
    return True


def decay(optimizer, variable, rows=None):
    """Keras' weight decay of `variable`, on the touched `rows` only if given."""
    lr = tf.cast(optimizer.learning_rate, variable.dtype)
    wd = tf.cast(optimizer.weight_decay, variable.dtype)
    if rows is None:
        optimizer.assign_sub(variable, variable * wd * lr)
    else:
        rows.assign_sub(variable, rows.read(variable) * wd * lr)
