"""`kerasps.sparse`: the public names of `kerasps.params.sparse`, where they live."""

from kerasps.params.sparse import (
    EXACT,
    LAZY,
    MODES,
    update_rows,
    validate_mode,
)

__all__ = ["EXACT", "LAZY", "MODES", "validate_mode", "update_rows"]
