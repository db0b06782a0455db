"""`kerasps.callbacks`: the public names of `kerasps.keras.callbacks`, where they live."""

from kerasps.keras.callbacks import (
    StepTraceRecorder,
)

__all__ = ["StepTraceRecorder"]
