"""`kerasps.layers`: the public names of `kerasps.keras.layers`, where they live.

`DynamicTableConfig` needs keras-rs (an optional dependency, `pip install "kerasps[rs]"`):
it is imported on first use, so that importing this module does not import keras-rs.
"""

import importlib

from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.keras.layers.rs_tables import table_optimizers

# Public name -> the module it is read from, on first use (as in `kerasps/__init__.py`).
_LAZY = {"DynamicTableConfig": "kerasps.keras.layers.rs_dynamic"}

__all__ = ["DynamicEmbedding", "DynamicTableConfig", "table_optimizers"]  # noqa: F822 (lazy)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'kerasps.layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
