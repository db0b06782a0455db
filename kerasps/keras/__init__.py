"""Layer 5: the Keras integration.

`hooks.install` installs kerasps into Keras; the trainer (`fit`, `evaluate`, `predict`
...), callbacks, layers (`DynamicEmbedding`) and the sidecar evaluator.
"""
