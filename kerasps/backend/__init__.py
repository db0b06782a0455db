"""Layer 2: the seams onto private APIs, the only modules that use them.

`_tf` holds the TensorFlow internals (`tensorflow.python`), `_keras` the Keras hooks
(`keras.src`), `tf_logs` what keeps TensorFlow's log lines from the user (its C++
library's log level; pure Python until TensorFlow is loaded), `tracebacks` the
filter of the tracebacks that leave kerasps' `fit`; `_keras` imports no
kerasps module above it: `install` is handed the trainer, the variables and the
row-update rule (`kerasps.keras.hooks`).
"""
