"""`kerasps.layers.DynamicEmbedding`: embeddings of a vocabulary that keeps growing."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from kerasps.keras import hooks
from kerasps.keras.layers import table as table_lib
from kerasps.policy import tables

__all__ = ["DynamicEmbedding"]

COMBINERS = ("mean", "sum", "sqrtn")
# Initializers whose elements are drawn independently (a row can be drawn alone).
_INITIALIZERS = ("RandomUniform", "RandomNormal", "TruncatedNormal", "Zeros", "Ones", "Constant")


class TableMetrics(keras.metrics.Metric):
    """A dynamic table's activity since the metrics were last reset (each epoch, and
    at the start of `evaluate`), in the logs as `<layer>_rows_used` (now),
    `<layer>_admitted`, `<layer>_evicted` (rows) and `<layer>_hit_rate` (ids looked
    up that had a row).

    The table counts on its ps tasks as it looks ids up; this metric only keeps
    the totals at its last reset, so a step pays nothing for it.
    """

    def __init__(self, table, prefix, **kwargs):
        super().__init__(name=f"{prefix}_table", **kwargs)
        self.prefix = prefix
        self._table = table
        self.start = self.add_variable(shape=(4,), dtype="int64", initializer="zeros",
                                       name="start")

    def update_state(self, *args, **kwargs):
        pass

    def reset_state(self):
        self.start.assign(self._table.totals()[:4])

    def result(self):
        totals = self._table.totals()
        lookups, hits, admitted, evicted = tf.unstack(
            totals[:4] - keras.ops.convert_to_tensor(self.start))
        return {f"{self.prefix}_rows_used": totals[4],
                f"{self.prefix}_admitted": admitted,
                f"{self.prefix}_evicted": evicted,
                f"{self.prefix}_hit_rate": tf.math.divide_no_nan(
                    tf.cast(hits, tf.float32), tf.cast(lookups, tf.float32))}


@keras.saving.register_keras_serializable(package="kerasps")
class DynamicEmbedding(keras.layers.Layer):
    """Embeddings for ids of any value, in a table of `capacity` rows on the ps tasks.

    Ids (int64, or strings hashed to 64-bit keys) get a row when they are
    admitted, and lose it when their partition of the table is full and they
    are the ones the eviction policy frees; ids without a row read zeros and
    get no update. Under a `kerasps.ParameterServerStrategy` the table is
    split over the ps tasks by key hash (each task holds its keys' map and
    rows), and its rows train with kerasps' sparse row updates (see
    `kerasps.sparse`); without a strategy it is one table in this process.
    Checkpoints hold whole variables (rows, optimizer slots, keys, counters)
    that restore into any number of ps tasks; see `kerasps.tables` for the
    layout and the policies.

    ```python
    with strategy.scope():
        ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
        vectors = kerasps.layers.DynamicEmbedding(
            16, capacity=1_000_000, combiner="mean", min_count=2)(ids)
    ```

    Inputs: integer ids of any shape (a trailing axis of several ids per
    example with `combiner`), a `tf.RaggedTensor` of ids (`[batch, None]`,
    with `combiner`), or strings. Output: `inputs.shape + (output_dim,)`, or
    with `combiner`, the vectors of the last axis combined.

    Training lookups (`training=True`) admit ids, touch their rows and free
    rows when needed; other lookups change nothing. The layer's metrics
    report, per epoch, the rows used, admitted and evicted and the hit rate
    (`<name>_rows_used`, ...).

    Args:
        output_dim: size of each vector.
        capacity: rows of the table.
        combiner: `None`, `"mean"`, `"sum"` or `"sqrtn"`: how the vectors of
            the last axis (several ids per example) are combined.
        min_count: occurrences (counted approximately, in bounded memory)
            before an id gets a row; 1 admits at once.
        probability: chance that an occurrence of an id without a row admits
            it (1.0: always).
        eviction: which rows a full partition frees: `"lru"` (least recently
            looked up, the default: the ids a growing stream no longer shows)
            or `"lfu"` (least often; for stationary distributions).
        steps_to_live: an id not looked up for that many training steps
            loses its row (`None`: only eviction frees rows).
        num_partitions: partitions of the table (they divide `capacity`;
            the ps tasks hold whole partitions, so at most that many ps tasks
            hold the table). Default: the most, up to 60, of at least 256 rows.
        embeddings_initializer: initial values of an admitted id's row;
            an initializer drawing each element independently (`"uniform"`,
            `"normal"`, `"truncated_normal"`, `"zeros"`, constants).
        seed: seed of the initial values.
    """

    def __init__(self, output_dim, capacity, combiner=None, min_count=1, probability=1.0,
                 eviction="lru", steps_to_live=None, num_partitions=None,
                 embeddings_initializer="uniform", seed=None, **kwargs):
        super().__init__(**kwargs)
        self.spec = tables.TableSpec(
            capacity=capacity, output_dim=output_dim, num_partitions=num_partitions,
            min_count=min_count, probability=probability, eviction=eviction,
            steps_to_live=steps_to_live)
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(
                f"Invalid value for argument `combiner`: expected None or one of "
                f"{', '.join(repr(c) for c in COMBINERS)}. Received: combiner={combiner!r}")
        self.combiner = combiner
        initializer = keras.initializers.get(embeddings_initializer)
        if type(initializer).__name__ not in _INITIALIZERS:
            raise ValueError(
                "Invalid value for argument `embeddings_initializer`: rows are initialized "
                "one at a time when ids are admitted, so the initializer must draw each "
                f"element independently ({', '.join(_INITIALIZERS)}). "
                f"Received: embeddings_initializer={embeddings_initializer!r}")
        self.embeddings_initializer = initializer
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        self.seed = int(seed)
        self.autocast = False
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self._table = None
        hooks.install()

    @property
    def output_dim(self):
        return self.spec.output_dim

    @property
    def capacity(self):
        return self.spec.capacity

    def build(self, input_shape=None):
        if self.built:
            return
        self._check_shape(input_shape)
        table = table_lib.DynamicTable(self, self.spec, self.embeddings_initializer, self.seed)
        self._table = table
        self.rows, self.state, self.stats = table.rows, table.state, table.stats
        if table.sketch is not None:
            self.sketch = table.sketch
        self.table_metrics = TableMetrics(table, self.name)
        self.table_metrics.reset_state()
        self.built = True

    def _check_shape(self, shape, ragged=False):
        if shape is None or self.combiner is None or ragged:
            return
        if len(shape) < 2:
            raise ValueError(
                f"Invalid value for argument `combiner` of layer '{self.name}': it combines "
                "the ids of the last axis of each example, and the input has one id per "
                f"example (shape {tuple(shape)}). Use combiner=None, or give ids of shape "
                f"(batch, ids). Received: combiner={self.combiner!r}")

    # -- calls ------------------------------------------------------------------------
    def _keys(self, ids):
        dtype = ids.dtype
        if dtype == tf.string:
            return tf.bitcast(tf.fingerprint(ids), tf.int64)
        if not dtype.is_integer:
            raise ValueError(
                f"Invalid value for argument `inputs` of layer '{self.name}': ids must be "
                f"integers or strings. Received: inputs.dtype={dtype.name}")
        return tf.cast(ids, tf.int64)

    def call(self, inputs, training=None):
        ids = inputs
        if isinstance(ids, tf.SparseTensor):
            ids = tf.RaggedTensor.from_sparse(ids)
        ragged = isinstance(ids, tf.RaggedTensor)
        if ragged and self.combiner is None:
            raise ValueError(
                f"Invalid value for argument `combiner` of layer '{self.name}': ragged ids "
                "need a combiner ('mean', 'sum' or 'sqrtn'). Received: combiner=None")
        if not ragged:
            ids = tf.convert_to_tensor(ids)
            self._check_shape(ids.shape)
        values = ids.flat_values if ragged else ids
        keys = self._keys(values)
        vectors = self._table.lookup(tf.reshape(keys, [-1]), bool(training))
        if ragged:
            vectors = ids.with_flat_values(vectors)
            total = tf.reduce_sum(vectors, axis=-2)
            count = tf.cast(ids.row_lengths(), vectors.dtype)[:, None]
            return self._cast(self._combine(total, count))
        vectors = tf.reshape(vectors, tf.concat([tf.shape(keys), [self.output_dim]], 0))
        if self.combiner is not None:
            count = tf.cast(tf.shape(vectors)[-2], vectors.dtype)
            vectors = self._combine(tf.reduce_sum(vectors, axis=-2), count)
        return self._cast(vectors)

    def _combine(self, total, count):
        if self.combiner == "sum":
            return total
        count = tf.maximum(count, 1.0)
        return total / (count if self.combiner == "mean" else tf.sqrt(count))

    def _cast(self, vectors):
        return tf.cast(vectors, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        self._check_shape(input_shape)
        shape = tuple(input_shape)
        if self.combiner is not None:
            shape = shape[:-1]
        return shape + (self.output_dim,)

    def compute_output_spec(self, inputs, training=None):
        ragged = bool(getattr(inputs, "ragged", False)) or bool(getattr(inputs, "sparse", False))
        if ragged and self.combiner is None:
            raise ValueError(
                f"Invalid value for argument `combiner` of layer '{self.name}': ragged ids "
                "need a combiner ('mean', 'sum' or 'sqrtn'). Received: combiner=None")
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if dtype != "string" and "int" not in dtype:
            raise ValueError(
                f"Invalid value for argument `inputs` of layer '{self.name}': ids must be "
                f"integers or strings. Received: inputs.dtype={dtype}")
        shape = tuple(inputs.shape)
        if not ragged:
            self._check_shape(shape)
        if self.combiner is not None:
            shape = shape[:-1]
        return keras.KerasTensor(shape + (self.output_dim,), dtype=self.compute_dtype)

    # -- state --------------------------------------------------------------------------
    def _kerasps_renew_resources(self, ps_tasks):
        """After `ps_tasks` restarted: new maps, free rows and locks there (ps recovery)."""
        if self._table is not None:
            self._table.renew(ps_tasks)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel" and self._table is not None:
            # A SavedModel serves lookups from the maps; checkpoints rebuild them.
            for i, shard in enumerate(self._table.shards):
                children[f"kerasps_map_{i}"] = shard.map
        return children

    def table_stats(self) -> dict:
        """The table's totals so far (they survive checkpoints): rows used, ids looked up
        in training, hits, rows admitted and freed, hit rate."""
        records = self._table.records()
        totals = {field: sum(getattr(r, field) for r in records) for field in (
            "capacity", "rows_used", "lookups", "hits", "admitted", "evicted")}
        totals["hit_rate"] = totals["hits"] / totals["lookups"] if totals["lookups"] else 0.0
        return totals

    def get_config(self):
        config = super().get_config()
        config.update({
            "output_dim": self.output_dim, "capacity": self.capacity, "combiner": self.combiner,
            "min_count": self.spec.min_count, "probability": self.spec.probability,
            "eviction": self.spec.eviction, "steps_to_live": self.spec.steps_to_live,
            "num_partitions": self.spec.num_partitions,
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer),
            "seed": self.seed})
        return config
