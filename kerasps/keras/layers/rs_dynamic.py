"""keras-rs tables whose vocabulary is not known in advance: `DynamicTableConfig`.

A `DynamicTableConfig` is a `keras_rs.layers.TableConfig` (a subclass: accepted wherever
keras-rs takes one, in a `FeatureConfig`) whose table is kerasps' dynamic table
(`kerasps.layers.DynamicEmbedding`'s): integer ids of any value get a row when
admitted and lose it when evicted. The rest of the model is unchanged: swap
`keras_rs.layers.TableConfig(...)` for `DynamicTableConfig(...)` with the dynamic
table's options.

* `vocabulary_size` is the table's number of rows (its capacity), not a bound on the
  ids: any id may be looked up; an id without a row reads zeros.
* The table's `optimizer` trains its rows under a kerasps strategy, as for any keras-rs
  table (`rs_tables`): row updates on the ps tasks, with its slots next to the rows,
  reset when a row is reused for another id.
* All the features of one dynamic table are looked up together, once per call (see
  `DynamicTableLayer.look_up` for why that matters).
* Outside a kerasps strategy the table is still dynamic (one table in this process):
  a model exported with `model.export` serves from it.

keras-rs itself (on TPU, or without kerasps' seams) sees a `TableConfig` of
`vocabulary_size` rows. Importing this module registers the class with `rs_tables`,
which the seams consult (they are installed by `kerasps.keras.hooks`, which cannot
import this module: it imports the hooks).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import keras
import keras_rs
import tensorflow as tf

from kerasps.keras import hooks
from kerasps.keras.layers import rs_tables
from kerasps.keras.layers.dynamic_embedding import _INITIALIZERS, DynamicEmbedding
from kerasps.policy import tables

__all__ = ["DynamicTableConfig", "DynamicTableLayer"]

# The key of the dynamic options in a serialized `DynamicTableConfig`: keras-rs'
# `TableConfig.from_config` hands a config holding it to `DynamicTableConfig.from_config`
# (`kerasps.backend._keras_rs`, `rs_tables.table_from_config`).
CONFIG_KEY = rs_tables.CONFIG_KEY
COMBINERS = ("mean", "sum", "sqrtn")


@dataclasses.dataclass(order=True)
class DynamicTableConfig(keras_rs.layers.TableConfig):
    """A keras-rs table of a vocabulary not known in advance: kerasps' dynamic table.

    Accepted wherever keras-rs takes a `keras_rs.layers.TableConfig` (it is one). Under a
    kerasps strategy its rows are split over the ps tasks by key hash, ids are admitted
    and evicted as the options say (see `kerasps.layers.DynamicEmbedding`), and the
    table trains with its `optimizer` as row updates, like the other keras-rs tables.

    ```python
    items = DynamicTableConfig(
        name="items", vocabulary_size=100_000, embedding_dim=16, optimizer="adagrad",
        min_count=2, eviction="lru")
    feature = keras_rs.layers.FeatureConfig(
        name="item", table=items, input_shape=(None,), output_shape=(None, 16))
    ```

    Attributes (besides `TableConfig`'s):
        vocabulary_size: the table's rows (its capacity); ids may take any value.
        min_count: occurrences before an id gets a row (1: at once).
        probability: chance that an occurrence of an id without a row admits it.
        eviction: which rows a full partition frees: `"lru"` or `"lfu"`.
        steps_to_live: training lookups after which an id not seen loses its row
            (`None`: only eviction frees rows).
        num_partitions: partitions of the table (they divide `vocabulary_size`; at most
            that many ps tasks hold the table). Default: as `DynamicEmbedding`'s.
        seed: seed of admitted rows' initial values (`None`: drawn when the layer is
            made).

    `initializer` must draw each element independently (rows are initialized one at a
    time as ids are admitted): uniform, normal, truncated normal, constants, or
    `VarianceScaling` (keras-rs' default), drawn as for a `[vocabulary_size,
    embedding_dim]` variable.
    """

    min_count: int = 1
    probability: float = 1.0
    eviction: str = "lru"
    steps_to_live: int | None = None
    num_partitions: int | None = None
    seed: int | None = None

    def __post_init__(self):
        self.spec  # noqa: B018 - validates every option, in Keras' style
        element_initializer(self)
        if self.combiner not in COMBINERS:
            raise ValueError(
                f"Invalid value for argument `combiner` of table {self.name!r}: expected one "
                f"of {', '.join(map(repr, COMBINERS))}. Received: combiner={self.combiner!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(
                f"Invalid value for argument `seed` of table {self.name!r}: expected an "
                f"integer or None. Received: seed={self.seed!r}")
        hooks.install()  # keras-rs' seams, which make its table dynamic

    @property
    def spec(self) -> tables.TableSpec:
        """The dynamic table's `kerasps.tables.TableSpec` (raises for bad options)."""
        for argument in ("vocabulary_size", "embedding_dim"):
            value = getattr(self, argument)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"Invalid value for argument `{argument}` of table {self.name!r}: "
                    f"expected a positive integer. Received: {argument}={value!r}")
        partitions = self.num_partitions
        if partitions is not None and not isinstance(partitions, bool) and isinstance(
                partitions, numbers.Integral) and partitions >= 1 and (
                self.vocabulary_size % partitions):
            raise ValueError(
                f"Invalid value for argument `num_partitions` of table {self.name!r}: it "
                f"must divide `vocabulary_size` ({self.vocabulary_size}, the table's rows) "
                f"into equal partitions. Received: num_partitions={partitions!r}")
        try:
            return tables.TableSpec(
                capacity=self.vocabulary_size, output_dim=self.embedding_dim,
                num_partitions=partitions, min_count=self.min_count,
                probability=self.probability, eviction=self.eviction,
                steps_to_live=self.steps_to_live)
        except ValueError as error:  # name the table, as keras-rs' other checks do
            message = str(error)
            start = message.find("`", len("Invalid value for argument `"))
            raise ValueError(f"{message[:start + 1]} of table {self.name!r}"
                             f"{message[start + 1:]}") from None

    def make_layer(self) -> DynamicTableLayer:
        """The layer that holds this table in a `DistributedEmbedding`."""
        return DynamicTableLayer(self)

    def get_config(self) -> dict:
        config = super().get_config()
        config[CONFIG_KEY] = {field: getattr(self, field) for field in DYNAMIC_FIELDS}
        return config

    @classmethod
    def from_config(cls, config) -> DynamicTableConfig:
        config = dict(config)
        options = config.pop(CONFIG_KEY, {})
        for argument in ("initializer", "optimizer"):  # as keras-rs' `TableConfig`
            config[argument] = keras.saving.deserialize_keras_object(config[argument])
        return cls(**config, **options)


DYNAMIC_FIELDS = ("min_count", "probability", "eviction", "steps_to_live", "num_partitions",
                  "seed")


def element_initializer(table: DynamicTableConfig):
    """The table's initializer as one drawing each element independently: `VarianceScaling`
    (keras-rs' default) becomes the normal, truncated normal or uniform it draws for a
    `[vocabulary_size, embedding_dim]` variable."""
    initializer = keras.initializers.get(table.initializer)
    kind = type(initializer).__name__
    if kind in _INITIALIZERS:
        return initializer
    if isinstance(initializer, keras.initializers.VarianceScaling):
        fan_in, fan_out = table.vocabulary_size, table.embedding_dim
        fan = {"fan_in": fan_in, "fan_out": fan_out,
               "fan_avg": (fan_in + fan_out) / 2}[initializer.mode]
        scale = initializer.scale / max(1.0, fan)
        if initializer.distribution == "truncated_normal":
            # Keras' constant: the stddev of a unit normal truncated to [-2, 2].
            return keras.initializers.TruncatedNormal(
                stddev=math.sqrt(scale) / 0.87962566103423978, seed=initializer.seed)
        if initializer.distribution == "untruncated_normal":
            return keras.initializers.RandomNormal(stddev=math.sqrt(scale),
                                                   seed=initializer.seed)
        limit = math.sqrt(3.0 * scale)
        return keras.initializers.RandomUniform(-limit, limit, seed=initializer.seed)
    raise ValueError(
        f"Invalid value for argument `initializer` of table {table.name!r}: a dynamic "
        "table initializes rows one at a time as ids are admitted, so the initializer "
        f"must draw each element independently ({', '.join(_INITIALIZERS)}, or "
        f"VarianceScaling). Received: initializer={table.initializer!r}")


class DynamicTableLayer(DynamicEmbedding):
    """keras-rs' `EmbedReduce` over a dynamic table: what a `DistributedEmbedding` holds
    for a `DynamicTableConfig` (its `_default_device_embedding_layers`, one per table).

    Its variables are `DynamicEmbedding`'s (`rows`, `state`, `stats`, `sketch`);
    `embeddings` is `rows` (row `i` is the vector of the id that `state[i]` names), which
    keras-rs' `get_embedding_tables()` returns for the table.
    """

    def __init__(self, table: DynamicTableConfig, **kwargs):
        spec = table.spec
        super().__init__(
            table.embedding_dim, capacity=table.vocabulary_size, combiner=None,
            min_count=spec.min_count, probability=spec.probability, eviction=spec.eviction,
            steps_to_live=spec.steps_to_live, num_partitions=table.num_partitions,
            embeddings_initializer=element_initializer(table), seed=table.seed,
            name=table.name, **kwargs)
        self.reduction = table.combiner  # keras-rs' combiner, applied as `EmbedReduce` does

    @property
    def embeddings(self):
        return self.rows

    def _check_shape(self, shape, ragged=False):
        pass  # one id per example (no reduction) or several (reduced): both are keras-rs'

    def look_up(self, features, training=False):
        """The reduced vectors of several features of this table, in one lookup.

        Args:
            features: a list of `(ids, weights)`: dense, ragged or sparse ids (`[batch]` or
                `[batch, ids]`), and their weights (`None`, or of the ids' shape).
            training: a Python bool; training lookups admit, touch and evict.

        Returns:
            One tensor per feature, as keras-rs' `EmbedReduce` returns it.

        One lookup, not one per feature: a training lookup holds a lock on each ps task
        of the table while it admits and evicts, and TensorFlow's automatic control
        dependencies order the releases of all the locks of a step in program order,
        across ps tasks. A table looked up twice in one step then has the second
        lookup's lock on ps task 0 released only after the first's on ps task 1: two
        workers each holding one of them would wait for each other forever, had the table
        not ordered its lookups (`Table._after_previous_lookup`: the second takes its locks
        once the first released its own). One lookup also takes each lock once.
        """
        shaped, keys = [], []
        for ids, weights in features:
            if isinstance(ids, tf.SparseTensor):
                ids = tf.RaggedTensor.from_sparse(ids)
            if isinstance(weights, tf.SparseTensor):
                weights = tf.RaggedTensor.from_sparse(weights)
            if not isinstance(ids, tf.RaggedTensor):
                ids = tf.convert_to_tensor(ids)
            values = ids.flat_values if isinstance(ids, tf.RaggedTensor) else tf.reshape(
                ids, [-1])
            shaped.append((ids, weights))
            keys.append(self._keys(values))
        sizes = [tf.size(k) for k in keys]
        vectors = self._table.lookup(tf.concat(keys, axis=0), bool(training))
        parts = tf.split(vectors, tf.stack(sizes), num=len(sizes)) if len(keys) > 1 else [
            vectors]
        return [self._cast(self._reduce(ids, weights, part))
                for (ids, weights), part in zip(shaped, parts)]

    def _reduce(self, ids, weights, flat):
        """keras-rs' `EmbedReduce` of the vectors `flat` of `ids` (flattened)."""
        if isinstance(ids, tf.RaggedTensor):
            vectors = ids.with_flat_values(flat)
        else:
            vectors = tf.reshape(flat, tf.concat([tf.shape(ids), [self.output_dim]], 0))
        rank = ids.shape.rank
        if rank is not None and rank <= 1:  # one id per example: nothing to reduce
            if weights is not None and self.reduction == "sum":
                return vectors * tf.cast(weights, vectors.dtype)[:, None]
            return vectors
        if weights is None:
            weights = tf.ones_like(ids, dtype=vectors.dtype)
        elif isinstance(ids, tf.RaggedTensor) and not isinstance(weights, tf.RaggedTensor):
            weights = tf.RaggedTensor.from_tensor(weights, lengths=ids.row_lengths())
        weights = tf.cast(weights, vectors.dtype)
        if isinstance(weights, tf.RaggedTensor):
            total = tf.reduce_sum(vectors * tf.expand_dims(weights, -1), axis=-2)
            count = tf.reduce_sum(weights, axis=-1)[:, None]
            squares = tf.reduce_sum(tf.square(weights), axis=-1)[:, None]
        else:
            total = tf.reduce_sum(vectors * weights[..., None], axis=-2)
            count = tf.reduce_sum(weights, axis=-1, keepdims=True)
            squares = tf.reduce_sum(tf.square(weights), axis=-1, keepdims=True)
        if self.reduction == "sum":
            return total
        if self.reduction == "mean":
            return tf.math.divide_no_nan(total, count)
        return tf.math.divide_no_nan(total, tf.sqrt(squares))

    def call(self, inputs, weights=None, training=None):
        return self.look_up([(inputs, weights)], training)[0]

    def compute_output_shape(self, input_shape, weights_shape=None):
        shape = tuple(input_shape)
        return (*shape, self.output_dim) if len(shape) <= 1 else (*shape[:-1], self.output_dim)

    def compute_output_spec(self, inputs, weights=None, training=None):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=self.compute_dtype)


rs_tables.register_dynamic_table_config(DynamicTableConfig)
