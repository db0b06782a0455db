"""`kerasps.layers`: the public names of `kerasps.keras.layers`, where they live."""

from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding

__all__ = ["DynamicEmbedding"]
