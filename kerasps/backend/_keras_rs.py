"""The one place kerasps reaches into keras-rs' private code (`keras_rs.src...`).

keras-rs' `DistributedEmbedding` shards its tables only on TPUs with SparseCore.
Elsewhere it places every table on the "default device": one `EmbedReduce` layer
(a Keras `Embedding` with a combiner) per `TableConfig`, trained by the model's
optimizer, `TableConfig.optimizer` ignored. kerasps hooks in at that default-device
path, at a few methods of keras-rs' base `DistributedEmbedding` (the class of
`keras_rs.layers.DistributedEmbedding` on every backend). Each seam is a function of
this module whose docstring says what it changes; each defers to keras-rs' own code
unless the layer is made under a kerasps strategy's scope, and calls the handlers of
`kerasps.keras.layers.rs_tables` (handed over by `install`: this module imports
nothing above it).

Seams (see `SEAMS`):
  * `_init_feature_configs_structures`: the feature configs are checked
    (`rs_tables.check_feature_configs`), and tables placed on `"sparsecore"` go to
    the default-device path too: under kerasps, that is the ps tasks.
  * `_default_device_init`: a dynamic table (`DynamicTableConfig`, of
    `kerasps.keras.layers.rs_dynamic`) gets a `DynamicTableLayer` instead of keras-rs'
    `EmbedReduce` (`rs_tables.init_dynamic`); each table gets its own optimizer
    (`rs_tables.init`).
  * `_default_device_build`: the tables' variables, sharded by the strategy's
    partitioner, are given to their optimizers, which are built next to them
    (`rs_tables.build`).
  * `_default_device_call`: the ids of every fixed table's feature are checked against
    its vocabulary (`rs_tables.checked_ids`); each dynamic table is looked up once for
    all its features (`rs_tables.look_up_dynamic`).
  * `TableConfig.from_config`: a serialized `DynamicTableConfig` comes back as one
    (`rs_tables.table_from_config`), so that `.keras` files, `clone_model` and
    `model.export` keep dynamic tables dynamic.

A `DynamicTableConfig` is kerasps' own: its table is dynamic under a kerasps scope or
not (outside, it is one table in this process, trained by the model's optimizer).

Imported only where keras-rs is installed (`kerasps.keras.hooks.install`).
"""

from __future__ import annotations

import keras
from keras_rs.src.layers.embedding import base_distributed_embedding

from kerasps.backend._keras import Seam

DistributedEmbedding = base_distributed_embedding.DistributedEmbedding
TableConfig = base_distributed_embedding.TableConfig

__all__ = ["DistributedEmbedding", "SEAMS", "install", "installed", "uninstall"]

DEFAULT_DEVICE = "default_device"
SPARSECORE = "sparsecore"


class _Handlers:
    tables = None  # `kerasps.keras.layers.rs_tables`


_handlers = _Handlers()
_keras_rs_code: dict = {}  # attribute -> keras-rs' own function


def _original(attribute: str):
    return _keras_rs_code[attribute]


def _on_ps(layer) -> bool:
    return getattr(layer, "_kerasps_tables", None) is not None


def _has_dynamic_tables(layer) -> bool:
    return bool(getattr(layer, "_kerasps_dynamic_tables", None))


def _dynamic_features(feature_configs) -> bool:
    return any(_handlers.tables.is_dynamic(getattr(feature, "table", None))
               for feature in keras.tree.flatten(feature_configs))


def check_configs_and_place_tables_on_ps(self, feature_configs):
    """Replaces `DistributedEmbedding._init_feature_configs_structures`: checked configs.

    Under a kerasps scope, the feature configs are checked first
    (`rs_tables.check_feature_configs`: Keras-style errors where keras-rs would fail
    on an attribute), and the features of tables placed on `"sparsecore"` are placed
    on the default device, which under kerasps is the ps tasks: a model written for
    TPUs trains unchanged. Outside a kerasps scope, only dynamic tables' features are
    (kerasps' dynamic table is not a SparseCore table); keras-rs' own otherwise.
    """
    original = _original("_init_feature_configs_structures")
    active = _handlers.tables.active()
    if not active and not _dynamic_features(feature_configs):
        return original(self, feature_configs)
    if active:
        _handlers.tables.check_feature_configs(feature_configs)
    original(self, feature_configs)
    by_placement = self._placement_to_path_to_feature_config
    moved = {path: feature for path, feature in by_placement.get(SPARSECORE, {}).items()
             if active or _handlers.tables.is_dynamic(feature.table)}
    if not moved:
        return
    for path in moved:
        del by_placement[SPARSECORE][path]
    if not by_placement[SPARSECORE]:
        del by_placement[SPARSECORE]
    by_placement.setdefault(DEFAULT_DEVICE, {}).update(moved)
    for placement_and_path in keras.tree.flatten(
            self._feature_deeply_nested_placement_and_paths):
        if placement_and_path.path in moved:
            placement_and_path.placement = DEFAULT_DEVICE


def init_tables_with_their_optimizers(self, feature_configs, table_stacking):
    """Replaces `DistributedEmbedding._default_device_init`: tables with own optimizers.

    keras-rs' own makes one `EmbedReduce` layer per fixed table; a dynamic table
    (`DynamicTableConfig`) gets a `DynamicTableLayer` instead (`rs_tables.init_dynamic`),
    under a kerasps scope or not. Under a kerasps scope, each table then gets the
    optimizer of its `TableConfig` (`rs_tables.init`).
    """
    dynamic = {path: feature for path, feature in feature_configs.items()
               if _handlers.tables.is_dynamic(feature.table)}
    fixed = {path: feature for path, feature in feature_configs.items()
             if path not in dynamic}
    _original("_default_device_init")(self, fixed, table_stacking)
    if dynamic:
        _handlers.tables.init_dynamic(self, dynamic, self._default_device_embedding_layers)
    if _handlers.tables.active():
        _handlers.tables.init(self, feature_configs, self._default_device_embedding_layers)


def build_tables_and_their_optimizers(self, input_shapes):
    """Replaces `DistributedEmbedding._default_device_build`: optimizers built with tables.

    After keras-rs' own (each table's variable made, and sharded on the ps tasks by
    the strategy's partitioner), a layer made under a kerasps scope gives each table's
    variables to its optimizer and builds it, its slots next to the shards
    (`rs_tables.build`).
    """
    _original("_default_device_build")(self, input_shapes)
    if _on_ps(self):
        _handlers.tables.build(self)


def look_up_checked_ids(self, inputs, weights=None, training=False):
    """Replaces `DistributedEmbedding._default_device_call`: ids checked first, dynamic
    tables looked up once each.

    In a layer made under a kerasps scope, every fixed table's feature's ids must lie
    in its table (`rs_tables.checked_ids`) before keras-rs' own lookups run. Each
    dynamic table is looked up once for all its features (`rs_tables.look_up_dynamic`),
    keras-rs' own lookups run for the other features.
    """
    original = _original("_default_device_call")
    if _on_ps(self):
        inputs = _handlers.tables.checked_ids(self, inputs)
    if not _has_dynamic_tables(self):
        return original(self, inputs, weights, training)
    outputs, inputs, weights = _handlers.tables.look_up_dynamic(self, inputs, weights, training)
    if inputs:
        outputs.update(original(self, inputs, weights, training))
    return outputs


def dynamic_table_from_config(cls, config):
    """Replaces `TableConfig.from_config` (a classmethod): a dynamic table's config.

    A serialized `DynamicTableConfig` (keras-rs' `FeatureConfig.from_config`
    hands every table's config to `TableConfig.from_config`) comes back as one
    (`rs_tables.table_from_config`); keras-rs' own for any other.
    """
    if cls is TableConfig:
        table = _handlers.tables.table_from_config(config)
        if table is not None:
            return table
    return _original("from_config")(cls, config)


SEAMS = (
    Seam(DistributedEmbedding, "_init_feature_configs_structures",
         check_configs_and_place_tables_on_ps),
    Seam(DistributedEmbedding, "_default_device_init", init_tables_with_their_optimizers),
    Seam(DistributedEmbedding, "_default_device_build", build_tables_and_their_optimizers),
    Seam(DistributedEmbedding, "_default_device_call", look_up_checked_ids),
    Seam(TableConfig, "from_config", dynamic_table_from_config),
)

_saved: dict = {}  # attribute -> the class's own attribute before `install`


def installed() -> bool:
    return bool(_saved)


def install(*, tables):
    """Installs the seams (idempotent), handing them `tables`
    (`kerasps.keras.layers.rs_tables`)."""
    if _saved:
        return
    _handlers.tables = tables
    for seam in SEAMS:
        own = vars(seam.target)[seam.attribute]
        _saved[seam.attribute] = own
        if isinstance(own, classmethod):  # called as `_original(attribute)(cls, ...)`
            _keras_rs_code[seam.attribute] = own.__func__
            setattr(seam.target, seam.attribute, classmethod(seam.replacement))
        else:
            _keras_rs_code[seam.attribute] = getattr(seam.target, seam.attribute)
            setattr(seam.target, seam.attribute, seam.replacement)
        seam.replacement.__wrapped__ = _keras_rs_code[seam.attribute]


def uninstall():
    """Puts keras-rs' own functions back (the same objects)."""
    for seam in SEAMS:
        if seam.attribute in _saved:
            setattr(seam.target, seam.attribute, _saved.pop(seam.attribute))
            seam.replacement.__dict__.pop("__wrapped__", None)
