"""Installs kerasps into Keras: hands the seams of `kerasps.backend._keras` their handlers.

`_keras` sits below the variables and the trainer and imports neither; whoever installs
kerasps (a strategy, a `DynamicEmbedding` layer) calls `install`, which knows them all.
"""

from kerasps.backend import _keras
from kerasps.keras import trainer
from kerasps.params import sparse, variables


def install():
    """Installs the Keras hooks (idempotent)."""
    _keras.install(trainer=trainer, variables=variables, sparse=sparse)


def uninstall():
    """Puts Keras back exactly as it was before `install` (`_keras.uninstall`): every
    attribute a hook replaced is Keras' own object again. A new strategy installs the
    hooks again."""
    _keras.uninstall()
