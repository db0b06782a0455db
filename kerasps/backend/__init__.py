"""Layer 2: the seams onto private APIs, the only modules that use them.

`_tf` holds the TensorFlow internals (`tensorflow.python`), `_keras` the Keras hooks
(`keras.src`); `_keras` imports no kerasps module above it: `install` is handed the
trainer, the variables and the row-update rule (`kerasps.keras.hooks`).
"""
