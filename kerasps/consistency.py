"""`kerasps.consistency`: the public names of `kerasps.policy.consistency`, where they live."""

from kerasps.policy.consistency import (
    Consistency,
    Mode,
    StalenessBound,
    SyncStep,
)

__all__ = ["Mode", "Consistency", "StalenessBound", "SyncStep"]
