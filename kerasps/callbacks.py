"""`kerasps.callbacks`: the public names of `kerasps.keras.callbacks`, where they live."""

from kerasps.keras.callbacks import (
    PublishDeltas,
    StepTraceRecorder,
)

__all__ = ["PublishDeltas", "StepTraceRecorder"]
