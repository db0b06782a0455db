"""`kerasps.evaluator`: the public names of `kerasps.keras.evaluator`, where they live."""

from kerasps.keras.evaluator import (
    FINISHED_MARKER,
    Evaluation,
    SidecarEvaluator,
    mark_training_finished,
    training_finished,
)

__all__ = ["SidecarEvaluator", "Evaluation", "mark_training_finished", "training_finished",
           "FINISHED_MARKER"]
