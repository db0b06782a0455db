"""Layer 3: the TensorFlow cluster runtime.

Servers and `TF_CONFIG` (`cluster`), the coordinator, the input layer (`input`), the
tf.data service, and what a task of `kerasps launch` shares with the launcher
(`launch_env`).
"""
