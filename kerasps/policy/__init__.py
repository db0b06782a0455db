"""Layer 1, the bottom: pure Python policies, no TensorFlow and no Keras.

Partitioning, placement, table arithmetic, consistency, membership, failure and
restart decisions, the trace format: the simulator (`simulator/`) imports these.
Modules here import only the standard library and each other.
"""
