"""Installs kerasps into Keras: hands the seams of `kerasps.backend._keras` their handlers.

`_keras` sits below the variables and the trainer and imports neither; whoever installs
kerasps (a strategy, a `DynamicEmbedding` layer) calls `install`, which knows them all.
Where keras-rs is installed, `install` also hands the seams of
`kerasps.backend._keras_rs` theirs (`kerasps.keras.layers.rs_tables`): a keras-rs
`DistributedEmbedding` made under a kerasps scope then has its tables on the ps tasks,
each trained by its own optimizer.
"""

import importlib.util

from kerasps.backend import _keras
from kerasps.keras import trainer
from kerasps.params import sparse, variables


def keras_rs_installed() -> bool:
    """Whether keras-rs can be imported (`pip install "kerasps[rs]"`)."""
    return importlib.util.find_spec("keras_rs") is not None


def install():
    """Installs the Keras hooks, and keras-rs' where keras-rs is installed (idempotent)."""
    _keras.install(trainer=trainer, variables=variables, sparse=sparse)
    if keras_rs_installed():
        install_keras_rs()


def install_keras_rs():
    """Installs keras-rs' hooks alone (idempotent): `import kerasps` does once keras-rs is
    imported. Each defers to keras-rs' own code outside a kerasps scope, but a serialized
    `DynamicTableConfig` comes back as one."""
    from kerasps.backend import _keras_rs
    from kerasps.keras.layers import rs_tables

    _keras_rs.install(tables=rs_tables)


def uninstall():
    """Puts Keras back exactly as it was before `install` (`_keras.uninstall`): every
    attribute a hook replaced is Keras' own object again, and keras-rs' too where its
    hooks were installed. A new strategy installs the hooks again."""
    _keras.uninstall()
    import sys

    if "kerasps.backend._keras_rs" in sys.modules:
        sys.modules["kerasps.backend._keras_rs"].uninstall()
