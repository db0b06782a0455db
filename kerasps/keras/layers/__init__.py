"""Keras layers whose state lives on the ps tasks.

* `DynamicEmbedding`: an embedding table for ids of any value (a dynamic
  vocabulary), with admission and eviction; see `kerasps.tables` for its
  policies and layout.
* `table_optimizers`: the optimizer that trains each table of a keras-rs
  `DistributedEmbedding` made under a kerasps scope (`rs_tables`).
* `DynamicTableConfig`: a keras-rs `TableConfig` backed by kerasps' dynamic table
  (`rs_dynamic`; needs keras-rs, `pip install "kerasps[rs]"`).

Each name is imported on first use: importing this package imports neither keras-rs
nor the layers' modules.
"""

from kerasps.backend import imports as _imports

_LAZY = {"DynamicEmbedding": "kerasps.keras.layers.dynamic_embedding",
         "DynamicTableConfig": "kerasps.keras.layers.rs_dynamic",
         "table_optimizers": "kerasps.keras.layers.rs_tables"}

__all__ = sorted(_LAZY)


__getattr__ = _imports.lazy_attributes(__name__, _LAZY)


def __dir__():
    return __all__
