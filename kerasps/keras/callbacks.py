"""Keras callbacks specific to parameter-server training."""

from __future__ import annotations

import os

import keras

from kerasps.keras.publish import PublishDeltas
from kerasps.policy import trace as trace_lib

__all__ = ["PublishDeltas", "StepTraceRecorder"]


class StepTraceRecorder(keras.callbacks.Callback):
    """Records which worker ran each scheduled step function, and when.

    The trace (one `kerasps.trace.StepEvent` per scheduled function, with the
    worker index and start/end times on the coordinator) is written as CSV at
    the end of training, and is the input of `python -m simulator calibrate`.

    ```python
    model.fit(kerasps.DatasetCreator(fn), epochs=2, steps_per_epoch=100,
              callbacks=[kerasps.StepTraceRecorder("trace.csv")])
    ```

    Args:
        path: where to write the CSV trace; `None` keeps it in memory only
            (`recorder.events`).
    """

    def __init__(self, path: str | os.PathLike | None = None):
        super().__init__()
        self.path = path
        self.events: list[trace_lib.StepEvent] = []
        self._coordinator = None

    def on_train_begin(self, logs=None):
        from kerasps.runtime.coordinator import ClusterCoordinator

        strategy = self.model.distribute_strategy
        if not getattr(strategy, "_is_kerasps", False):
            raise ValueError(
                "Invalid use of `StepTraceRecorder`: the model was not built under a "
                f"`kerasps.ParameterServerStrategy` scope. Received: strategy={strategy!r}")
        self._coordinator = ClusterCoordinator(strategy)
        self._coordinator.start_trace(steps=self.model.steps_per_execution)

    def on_train_end(self, logs=None):
        if self._coordinator is None:
            return
        self.events = self._coordinator.stop_trace()
        self._coordinator = None
        if self.path is not None:
            trace_lib.write_trace(self.path, self.events)
