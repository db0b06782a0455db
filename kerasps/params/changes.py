"""Which rows of a table changed: one flag per row, on the ps task of the rows.

`track(variable)` gives a variable (a shard of an embedding table, or a dynamic
table's rows on one ps task) a `RowChanges`: a `bool` vector with one flag per row,
made on the variable's own device. The updates that change rows set their flags
there, in the same function, after the rows are written:

* `kerasps.params.sparse.update_rows`: the rows of the batch (a row update), or every
  row where the rule is Keras' dense update (honestly: it moves every row);
* a dynamic table's admissions and evictions (`kerasps.keras.layers.table`).

No step reads a flag, and nothing crosses between tasks for them: a flag update is a
scatter on the ps task, beside the row update it follows. A publish
(`RowChanges.take`) runs one function on that ps task: the flagged rows' indices,
their flags cleared, then their values, in that order, so that an update landing
meanwhile is either in the values read or flagged again for the next publish.

A function traced before `track()` updates rows without setting flags: the publisher
tracks a model's tables before its step functions are traced (it makes `fit` trace
them again).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from kerasps.backend import _keras, _tf

__all__ = ["RowChanges", "track", "changes_of", "mark", "mark_all"]

_ATTRIBUTE = "_kerasps_row_changes"


class RowChanges:
    """The changed-row flags of one `tf.Variable` (its rows: axis 0), on its device."""

    def __init__(self, variable):
        variable = _keras.tf_variable(variable)
        self.variable = variable
        self.device = variable.device
        self.size = int(variable.shape[0])
        size = self.size

        def zeros():
            return tf.zeros([size], tf.bool)

        with tf.init_scope():
            self.flags = _tf.variable_on(self.device, zeros)
        self._functions = {}

    # -- in a step, on the ps task ----------------------------------------------------
    def mark(self, indices, after=()):
        """Flags the rows `indices` (int64, local), once the ops `after` ran."""
        with tf.control_dependencies(list(after)):
            indices = tf.cast(indices, tf.int64)
            return tf.raw_ops.ResourceScatterUpdate(
                resource=self.flags.handle, indices=indices,
                updates=tf.ones(tf.shape(indices), tf.bool))

    def mark_all(self, after=()):
        with tf.control_dependencies(list(after)):
            return self.flags.assign(tf.ones([self.size], tf.bool), read_value=False)

    # -- at a publish, from the chief -------------------------------------------------
    def take(self, variables=None, everything=False):
        """The rows changed since the last `take` (all rows if `everything`), their flags
        cleared first: `(indices, [values of each of variables at those rows])` as NumPy
        arrays. `variables`: `tf.Variable`s on this device whose rows are read with the
        flags' own (default: the tracked variable)."""
        variables = [self.variable] if variables is None else [
            _keras.tf_variable(v) for v in variables]
        key = (bool(everything), tuple(v.name for v in variables))
        function = self._functions.get(key)
        if function is None:
            # A `partial`: TensorFlow counts the traces of functions by their code, and
            # each tracker's functions are traced once, all from this one code.
            function = self._functions[key] = tf.function(
                functools.partial(self._take, variables, everything), autograph=False)
        indices, values = function()
        return indices.numpy(), [value.numpy() for value in values]

    def _take(self, variables, everything):
        with _tf.no_colocation(), tf.device(self.device):
            if everything:
                indices = tf.range(self.size, dtype=tf.int64)
                cleared = self.flags.assign(tf.zeros([self.size], tf.bool), read_value=False)
                with tf.control_dependencies([cleared]):
                    values = [tf.identity(v.read_value()) for v in variables]
                return indices, values
            indices = tf.where(self.flags.read_value())[:, 0]
            cleared = tf.raw_ops.ResourceScatterUpdate(
                resource=self.flags.handle, indices=indices,
                updates=tf.zeros(tf.shape(indices), tf.bool))
            with tf.control_dependencies([cleared]):
                values = [tf.gather(v, indices) for v in variables]
            return indices, values

    def count(self) -> int:
        """Rows flagged now (a read on the ps task)."""
        return int(tf.reduce_sum(tf.cast(self.flags.read_value(), tf.int64)).numpy())


def track(variable, renew=False) -> RowChanges:
    """The `RowChanges` of `variable` (a Keras or `tf.Variable`), made if it has none, or
    made again if `renew` (its flags were lost with their ps task)."""
    tf_variable = _keras.tf_variable(variable)
    changes = getattr(tf_variable, _ATTRIBUTE, None)
    if changes is None or renew:
        changes = RowChanges(tf_variable)
        setattr(tf_variable, _ATTRIBUTE, changes)
    return changes


def changes_of(variable) -> RowChanges | None:
    """The `RowChanges` of `variable` if it is tracked, else `None`."""
    return getattr(_keras.tf_variable(variable), _ATTRIBUTE, None)


def mark(variable, indices, after=()):
    """Flags rows `indices` of `variable` if it is tracked (in a traced update); returns
    the op, or `None` for an untracked variable."""
    changes = changes_of(variable)
    return None if changes is None else changes.mark(indices, after)


def mark_all(variable, after=()):
    changes = changes_of(variable)
    return None if changes is None else changes.mark_all(after)


def written(variable):
    """An op that runs after every write of `variable` made before it in the function
    (a read of one row: TensorFlow's automatic control dependencies order the ops on a
    resource as the program made them)."""
    return tf.gather(_keras.tf_variable(variable), tf.zeros([1], tf.int64))
