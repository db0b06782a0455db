"""`kerasps.consistency`: the public names of `kerasps.policy.consistency`, where they live."""

from kerasps.policy.consistency import (
    Consistency,
    Mode,
    StalenessBound,
    SyncStep,
    update_on_arrival,
    updated_on_arrival,
)

__all__ = ["Mode", "Consistency", "StalenessBound", "SyncStep", "updated_on_arrival",
           "update_on_arrival"]
