"""Which task an error from the cluster blames: pure Python, shared with the simulator.

TensorFlow reports a lost task as an `UnavailableError` whose message names
the remote device (`/job:ps/replica:0/task:1/device:CPU:0`). A lost worker
is TensorFlow's to handle (it runs the function again elsewhere); a lost ps
task takes its variables with it, so `fit`, `evaluate` and `predict` end
with `PsTaskFailedError` naming the task instead of a gRPC message.
"""

from __future__ import annotations

import re

__all__ = ["PsTaskFailedError", "failed_ps_task"]

_PS_DEVICE = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


class PsTaskFailedError(RuntimeError):
    """A ps task was lost during `fit`, `evaluate` or `predict`; its variables with it.

    Attributes:
        ps_task: the index of the ps task.
    """

    def __init__(self, ps_task: int, method: str):
        self.ps_task = ps_task
        super().__init__(
            f"ps task {ps_task} (/job:ps/replica:0/task:{ps_task}) became unavailable during "
            f"`{method}`, and the variables it held are lost. kerasps does not yet restore "
            "them inside a running call: run the training program again. With "
            "`keras.callbacks.BackupAndRestore(backup_dir)` among the callbacks, `fit` "
            "resumes from the last backup instead of the start.")


def failed_ps_task(error_type: str, message: str) -> int | None:
    """The ps task an error blames, or `None`.

    Args:
        error_type: the error's class name (`"UnavailableError"`, ...).
        message: its message.
    """
    if error_type not in ("UnavailableError", "PSUnavailableError"):
        return None
    match = _PS_DEVICE.search(message or "")
    return int(match.group(1)) if match else None
