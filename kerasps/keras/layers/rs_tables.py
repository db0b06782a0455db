"""keras-rs embedding tables on the ps tasks, each trained by its own optimizer.

A `keras_rs.layers.DistributedEmbedding` made under a kerasps strategy's scope
(keras-rs installed: `pip install "kerasps[rs]"`) runs keras-rs' own CPU/GPU path,
one `EmbedReduce` layer per `TableConfig`, with what keras-rs gives TPUs only:

* Each table is one Keras variable (named `<layer>/<table name>/embeddings`),
  sharded over the ps tasks by the strategy's partitioner and placement like any
  variable (`strategy.placement_report()` lists its shards). Lookups gather on the
  ps tasks (`kerasps.ShardedVariable.lookup`): dense, ragged and sparse ids, each
  feature reduced by its table's combiner (`"sum"`, `"mean"`, `"sqrtn"`), several
  features sharing one table.
* Each table is trained by its `TableConfig.optimizer`, not by the model's: a
  step's gradient of the table reaches each shard as a row update, which the
  table's optimizer applies on the shard's ps task to the rows of the batch only
  (`kerasps.params.sparse`, its `"rows"` mode), with its slots next to the shard.
  The model's optimizer trains every other variable and holds no slot of a table
  (`kerasps.backend._keras.apply_with_own_optimizers`). A table optimizer's
  `iterations` counts the steps that updated its tables; a learning-rate schedule
  is read at that count.
* The tables' optimizers are state of the layer (`table_optimizers(layer)`): their
  variables are in `.weights.h5` files (so in `ModelCheckpoint` and
  `BackupAndRestore`), in `tf.train.Checkpoint`s (with the tables: the layer's
  `kerasps_tables` dependency, as keras-rs' dict of tables is not one) and in ps
  recovery inside `fit`, whole, whatever the number of ps tasks. `model.export` exports
  a single-process copy made by keras-rs' own layer.
* A table of a vocabulary not known in advance is a `DynamicTableConfig`
  (`kerasps.keras.layers.rs_dynamic`): kerasps' dynamic table, under a kerasps scope or
  not, trained by its optimizer like the others, its features looked up together.
* Bad input raises in Keras' style: an optimizer keras-rs does not train tables
  with, a feature whose `table` is not a `TableConfig`, two tables of one name, ids
  outside their table (when the step runs).

The optimizers and their arguments are keras-rs' (those its TPU path accepts):
`SGD` (without `momentum`, `nesterov`), `Adagrad` (`initial_accumulator_value`;
`epsilon` at its default), `Adam` (`beta_1`, `beta_2`, `epsilon`; not `amsgrad`),
`Ftrl` (`learning_rate_power`, `initial_accumulator_value`, `l1_`/`l2_regularization_
strength`, `beta`; not `l2_shrinkage_regularization_strength`), subclasses that keep
their `update_step` (`AdamW`), by instance or by keras-rs' names `"sgd"`,
`"adagrad"`, `"adam"` (keras-rs' default), `"ftrl"`; a constant learning rate, a
schedule or a callable; `weight_decay`. Where kerasps' rules differ from TPU
embedding's:

* `Adam` is lazy, as on TPU (`lazy_adam`): the slots of rows a step does not touch
  keep their values. Its update is Keras' `m / (sqrt(v) + epsilon)`; TPU's default
  is `m / sqrt(v + epsilon**2)`. Bias correction counts the table optimizer's steps.
* `Adagrad` divides by `sqrt(accumulator + epsilon)` as Keras does (TPU: without
  `epsilon`); the accumulator starts at `initial_accumulator_value`, as on TPU.
* `Ftrl` updates the rows of the batch from the first step, as on TPU (Keras'
  dense `Ftrl` moves every row on its first step).
* `weight_decay` is Keras' decoupled decay, of the rows of the batch (TPU adds
  `weight_decay_factor * row` to their gradient).
* `clipvalue` and `gradient_accumulation_steps`, which keras-rs hands to TPU
  embedding, raise: Keras' versions would update every row.
* An optimizer made outside the strategy's scope (its variables would live on the
  coordinator) is copied under it (`from_config`): the copy trains the table.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from kerasps.params import sparse, variables

__all__ = ["table_optimizers", "active", "check_feature_configs", "init", "build",
           "checked_ids", "register_dynamic_table_config", "is_dynamic", "init_dynamic",
           "look_up_dynamic", "table_from_config"]

# keras-rs' optimizers of tables: its name -> (the Keras class, the arguments keras-rs
# refuses for a table, each with the only value it accepts).
OPTIMIZERS = {
    "sgd": (keras.optimizers.SGD, {"momentum": 0.0, "nesterov": False}),
    "adagrad": (keras.optimizers.Adagrad, {"epsilon": 1e-7}),
    "adam": (keras.optimizers.Adam, {"amsgrad": False}),
    "ftrl": (keras.optimizers.Ftrl, {"l2_shrinkage_regularization_strength": 0.0}),
}
# Arguments of every optimizer that a table's may not use: keras-rs refuses the first
# four; kerasps the last two (keras-rs hands them to TPU embedding).
REFUSED = {"clipnorm": None, "global_clipnorm": None, "use_ema": False,
           "loss_scale_factor": None, "clipvalue": None, "gradient_accumulation_steps": None}
COMBINERS = ("mean", "sum", "sqrtn")


@dataclasses.dataclass
class _Table:
    config: object  # the `keras_rs.layers.TableConfig`
    layer: keras.layers.Layer  # keras-rs' `EmbedReduce` holding the table
    optimizer: keras.optimizers.Optimizer


@dataclasses.dataclass
class _Tables:
    """A layer's tables (by name) and the table of each feature (by keras-rs' path)."""

    by_name: dict
    of_feature: dict


def table_optimizers(layer) -> dict:
    """The optimizer of each table of a keras-rs `DistributedEmbedding` made under a
    kerasps scope, by table name: the one that trains it (a copy of its
    `TableConfig.optimizer` where that was made outside the scope, or given by name).

    Raises:
        ValueError: `layer` was not made under a kerasps strategy's scope.
    """
    tables = getattr(layer, "_kerasps_tables", None)
    if tables is None:
        raise ValueError(
            "Invalid value for argument `layer`: expected a keras-rs `DistributedEmbedding` "
            f"made under a kerasps strategy's scope. Received: layer={layer!r}")
    return {name: table.optimizer for name, table in tables.by_name.items()}


def active() -> bool:
    """Whether a layer made now is made under a kerasps strategy's scope."""
    return variables.kerasps_strategy() is not None


def check_feature_configs(feature_configs):
    """Raises `ValueError` for feature configs that kerasps cannot train, in Keras' style:
    a feature that is not a keras-rs `FeatureConfig` (TPU embedding's own), one whose
    `table` is not a `TableConfig`, two tables of one name, a table's bad vocabulary
    size, dimension, combiner or optimizer (`check_optimizer`)."""
    import keras_rs

    tables = {}
    for path, feature in keras.tree.flatten_with_path(feature_configs):
        where = ".".join(str(p) for p in path)
        if not isinstance(feature, keras_rs.layers.FeatureConfig):
            raise ValueError(
                f"Invalid value for argument `feature_configs` at {where!r}: under a kerasps "
                "strategy every feature is a `keras_rs.layers.FeatureConfig`. "
                f"Received: {feature!r}")
        table = feature.table
        if not isinstance(table, keras_rs.layers.TableConfig):
            raise ValueError(
                f"Invalid value for argument `table` of feature {feature.name!r}: it names no "
                "table of the layer; expected a `keras_rs.layers.TableConfig`. "
                f"Received: table={table!r}")
        other = tables.setdefault(table.name, table)
        if other is not table:
            raise ValueError(
                f"Invalid value for argument `feature_configs`: two different tables are "
                f"named {table.name!r} (each table is one variable, named after it). Give "
                "features that share a table the same `TableConfig` object, or name the "
                f"tables apart. Received: {other!r} and {table!r}")
    for table in tables.values():
        _check_table(table)


def _check_table(table):
    for argument in ("vocabulary_size", "embedding_dim"):
        value = getattr(table, argument)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"Invalid value for argument `{argument}` of table {table.name!r}: expected "
                f"a positive integer. Received: {argument}={value!r}")
    if table.combiner not in COMBINERS:
        raise ValueError(
            f"Invalid value for argument `combiner` of table {table.name!r}: expected one of "
            f"{', '.join(map(repr, COMBINERS))}. Received: combiner={table.combiner!r}")
    check_optimizer(table.optimizer, table.name)


def check_optimizer(optimizer, table_name: str):
    """Raises `ValueError` unless `optimizer` is one keras-rs trains tables with, with
    arguments it accepts and kerasps can apply as row updates; returns its keras-rs
    name (`"sgd"`, `"adagrad"`, `"adam"`, `"ftrl"`)."""
    prefix = f"Invalid value for argument `optimizer` of table {table_name!r}"
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(
                f"{prefix}: keras-rs names a table's optimizer "
                f"{', '.join(map(repr, OPTIMIZERS))}. Received: optimizer={optimizer!r}")
        return optimizer
    found = next(((name, *rule) for name, rule in OPTIMIZERS.items()
                  if isinstance(optimizer, rule[0])), None)
    if found is None:
        raise ValueError(
            f"{prefix}: keras-rs trains tables with `SGD`, `Adagrad`, `Adam` or `Ftrl` "
            f"(or their names {', '.join(map(repr, OPTIMIZERS))}). "
            f"Received: optimizer={optimizer!r}")
    name, cls, refused = found
    if type(optimizer).update_step is not cls.update_step:
        raise ValueError(
            f"{prefix}: `{type(optimizer).__name__}` overrides `update_step`, and kerasps "
            f"applies `{cls.__name__}`'s rule as row updates on the ps tasks. "
            f"Received: optimizer={optimizer!r}")
    for argument, accepted in {**refused, **REFUSED}.items():
        value = getattr(optimizer, argument, accepted)
        if value != accepted and not (accepted is False and not value):
            raise ValueError(
                f"{prefix}: keras-rs trains a table's `{cls.__name__}` without "
                f"`{argument}` (it must stay {accepted!r}). "
                f"Received: optimizer={type(optimizer).__name__}({argument}={value!r})")
    return name


def _resolved(optimizer, table_name, strategy, made):
    """The optimizer that trains a table: made under the scope, one per optimizer given."""
    name = check_optimizer(optimizer, table_name)
    if isinstance(optimizer, str):
        resolved = OPTIMIZERS[name][0](name=f"{table_name}_{name}")
    elif id(optimizer) in made:
        return made[id(optimizer)]
    elif getattr(optimizer, "_distribution_strategy", None) is strategy:
        resolved = optimizer
    else:  # made outside the scope: its variables would live on the coordinator
        resolved = type(optimizer).from_config(optimizer.get_config())
    if resolved.built:
        raise ValueError(
            f"Invalid value for argument `optimizer` of table {table_name!r}: it is built "
            "already (for other variables); a table's optimizer trains tables only. "
            f"Received: optimizer={optimizer!r}")
    object.__setattr__(resolved, "_kerasps_sparse_updates", sparse.ROWS)
    if not isinstance(optimizer, str):
        made[id(optimizer)] = resolved
    return resolved


def init(layer, feature_configs, embedding_layers):
    """Gives each table of `layer` its optimizer, made under the strategy's scope.

    Args:
        layer: keras-rs' `DistributedEmbedding`, being made under a kerasps scope.
        feature_configs: its default-device features, by keras-rs path.
        embedding_layers: the `EmbedReduce` layer of each feature, by keras-rs path.
    """
    strategy = variables.kerasps_strategy()
    by_name, of_feature, made = {}, {}, {}
    for path, feature in feature_configs.items():
        table = feature.table
        if table.name not in by_name:
            optimizer = _resolved(table.optimizer, table.name, strategy, made)
            by_name[table.name] = _Table(table, embedding_layers[path], optimizer)
        of_feature[path] = by_name[table.name]
    layer._kerasps_tables = _Tables(by_name, of_feature)
    # Tracked by the layer: saved with it (weights files), each once.
    distinct = {id(t.optimizer): t.optimizer for t in by_name.values()}
    layer._kerasps_table_optimizers = list(distinct.values())
    _checkpointed(layer, {name: table.layer for name, table in by_name.items()},
                  layer._kerasps_table_optimizers)


def _checkpointed(layer, tables, optimizers=()):
    """Makes `tf.train.Checkpoint`s of `layer` hold its tables (by name) and their
    optimizers.

    keras-rs keeps the tables' layers in a dict (`_default_device_embedding_layers`),
    and the layer its tables' optimizers in a list: Keras' tracked collections, which
    `.weights.h5` files follow and TensorFlow's checkpoints do not (a keras-rs layer
    alone has no checkpoint dependency at all). One `tf.Module` attribute,
    `kerasps_tables`, holds both as TensorFlow dependencies; `.weights.h5` files do
    not see it (it is not a Keras object), so their layout is keras-rs' own.
    """
    holder = tf.Module(name="kerasps_tables")
    holder.tables = dict(tables)
    holder.optimizers = list(optimizers)
    layer.kerasps_tables = holder


def build(layer):
    """Gives each table's variables (the shards, and the whole variable) to its optimizer,
    and builds every optimizer with the variables of its tables, under the strategy's
    scope: its slots sit next to the shards, on their ps tasks."""
    owned = {}
    for table in layer._kerasps_tables.by_name.values():
        embeddings = table.layer.embeddings
        shards = list(table.layer.trainable_variables)
        for variable in [embeddings, *shards]:
            variable._kerasps_optimizer = table.optimizer
        owned.setdefault(id(table.optimizer), (table.optimizer, []))[1].extend(shards)
    for optimizer, owned_variables in owned.values():
        if optimizer.built:
            continue
        # Named as if built by its first `apply`, outside the layer's name scope.
        with keras.name_scope(optimizer.name, caller=optimizer, override_parent=""):
            optimizer.build(owned_variables)


# -- dynamic tables (`kerasps.keras.layers.rs_dynamic`) ---------------------------------------
# `rs_dynamic` registers its `DynamicTableConfig` here when imported: this module, which
# `kerasps.keras.hooks` imports, does not import it (it imports the hooks: a circle).
# Loading a dynamic table's config before anything imported it asks the package for
# `DynamicTableConfig` (`kerasps.keras.layers`' lazy names), which imports it then.

class _Dynamic:
    config_class = None  # `rs_dynamic.DynamicTableConfig`, once `rs_dynamic` is imported


_dynamic = _Dynamic()
CONFIG_KEY = "kerasps_dynamic_table"  # the dynamic options in a serialized config


def register_dynamic_table_config(cls):
    """Called by `rs_dynamic` as it is imported, with its `DynamicTableConfig`."""
    _dynamic.config_class = cls


def is_dynamic(table) -> bool:
    """Whether `table` is a `DynamicTableConfig`."""
    cls = _dynamic.config_class
    return cls is not None and isinstance(table, cls)


def table_from_config(config):
    """The `DynamicTableConfig` of a serialized one (keras-rs' `TableConfig.from_config`
    hands its configs here first), or `None` for another table's.

    A program that loads a `.keras` file with a dynamic table need not import
    `DynamicTableConfig` first: it is imported here, when the first one is loaded
    (`kerasps.keras.layers.DynamicTableConfig`, a lazy name of the package; by then this
    module and the hooks are imported, and `rs_dynamic` imports them as it would anyway).
    """
    if not isinstance(config, dict) or CONFIG_KEY not in config:
        return None
    if _dynamic.config_class is None:
        from kerasps.keras import layers

        register_dynamic_table_config(layers.DynamicTableConfig)
    return _dynamic.config_class.from_config(config)


def init_dynamic(layer, feature_configs, embedding_layers):
    """Gives each dynamic table of `layer` its `DynamicTableLayer`, in `embedding_layers`
    (keras-rs' `_default_device_embedding_layers`, by feature path), one per table.

    Args:
        layer: keras-rs' `DistributedEmbedding`, being made (under a kerasps scope or not).
        feature_configs: its default-device features whose table is dynamic, by path.
        embedding_layers: keras-rs' dict of the layer of each feature, by path.
    """
    made, paths = {}, {}
    for path, feature in feature_configs.items():
        table = feature.table
        if id(table) not in made:
            made[id(table)] = table.make_layer()
        embedding_layers[path] = made[id(table)]
        paths.setdefault(id(table), []).append(path)
    # table layer -> the paths of its features, in keras-rs' order: looked up together.
    layer._kerasps_dynamic_tables = [(made[key], paths[key]) for key in made]
    if not active():  # `init` makes it under a kerasps scope, with the optimizers
        _checkpointed(layer, {table_layer.name: table_layer for table_layer in made.values()})


def look_up_dynamic(layer, inputs, weights, training):
    """The outputs of the features of `layer`'s dynamic tables (by path), each table looked
    up once for all its features (`DynamicTableLayer.look_up`), and the inputs and weights
    of the other features, for keras-rs' own lookups."""
    outputs = {}
    for table_layer, paths in layer._kerasps_dynamic_tables:
        present = [path for path in paths if path in inputs]
        if not present:
            continue
        looked_up = table_layer.look_up(
            [(inputs[path], None if weights is None else weights.get(path))
             for path in present], training=training)
        outputs.update(zip(present, looked_up))
    rest = {path: ids for path, ids in inputs.items() if path not in outputs}
    rest_weights = None if weights is None else {
        path: value for path, value in weights.items() if path not in outputs}
    return outputs, rest, rest_weights


def checked_ids(layer, inputs):
    """`inputs` (keras-rs path -> ids: dense, ragged or sparse) once every feature's ids
    are known to lie in its table: an id outside raises `InvalidArgumentError` where
    the step runs, in Keras' style, naming the feature, its table and the ids."""
    checked = dict(inputs)
    for path, ids in inputs.items():
        table = layer._kerasps_tables.of_feature.get(path)
        if table is None or is_dynamic(table.config) or not isinstance(
                ids, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
            continue
        checked[path] = _checked(ids, path, table.config)
    return checked


def _checked(ids, path, table):
    values = ids.flat_values if isinstance(ids, tf.RaggedTensor) else (
        ids.values if isinstance(ids, tf.SparseTensor) else ids)
    if not values.dtype.is_integer:
        return ids
    size = table.vocabulary_size
    outside = (values < 0) | (values >= tf.cast(size, values.dtype))
    assertion = tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(outside)),
        # Names in backticks: TensorFlow escapes the quotes of an assertion's message.
        [f"Invalid value for argument `inputs`: the ids of feature `{path}` look up table "
         f"`{table.name}` of vocabulary_size={size}, so each must lie in [0, {size}). "
         "Received: ids outside it:", tf.boolean_mask(values, outside)],
        summarize=10)
    if assertion is None:  # eager, and every id in the table
        return ids
    with tf.control_dependencies([assertion]):
        values = tf.identity(values)
    if isinstance(ids, tf.RaggedTensor):
        return ids.with_flat_values(values)
    if isinstance(ids, tf.SparseTensor):
        return tf.SparseTensor(ids.indices, values, ids.dense_shape)
    return values
