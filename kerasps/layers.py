"""`kerasps.layers`: the public names of `kerasps.keras.layers`, where they live."""

from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.keras.layers.rs_tables import table_optimizers

__all__ = ["DynamicEmbedding", "table_optimizers"]
