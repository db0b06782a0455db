"""`kerasps.layers`: the public names of `kerasps.keras.layers`, where they live.

`DynamicTableConfig` needs keras-rs (an optional dependency, `pip install "kerasps[rs]"`):
it is imported on first use, so that importing this module does not import keras-rs.
"""

from kerasps.backend import imports as _imports
from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.keras.layers.rs_tables import table_optimizers

# Public name -> the module it is read from, on first use (as in `kerasps/__init__.py`).
_LAZY = {"DynamicTableConfig": "kerasps.keras.layers.rs_dynamic"}

__all__ = ["DynamicEmbedding", "DynamicTableConfig", "table_optimizers"]  # noqa: F822 (lazy)


__getattr__ = _imports.lazy_attributes(__name__, _LAZY)


def __dir__():
    return __all__
