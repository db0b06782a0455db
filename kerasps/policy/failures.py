"""What a failure in the cluster means for a running call: pure Python, shared with the
simulator.

A lost worker is TensorFlow's to handle (it runs the function again
elsewhere). A lost ps task takes its variables with it: `fit` with a
`keras.callbacks.BackupAndRestore` among its callbacks restores every
variable from the latest backup once the task is back and goes on from the
step the backup was written at; without one, and in `evaluate` and
`predict`, the call ends with `PsTaskFailedError` naming the task.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["PsTaskFailedError", "Progress", "Recovery", "decide", "steps_rolled_back"]

_HOW_TO_RECOVER = {
    "fit": ("Add `keras.callbacks.BackupAndRestore(backup_dir, save_freq=N)` to the callbacks "
            "of `fit`: kerasps then restores every variable and the optimizer state from the "
            "latest backup once the task is back (a launcher or Kubernetes restarts it) and "
            "continues the same `fit` call."),
    "evaluate": "`evaluate` does not recover: restore the model from a checkpoint and call it "
                "again.",
    "predict": "`predict` does not recover: restore the model from a checkpoint and call it "
               "again.",
}


class PsTaskFailedError(RuntimeError):
    """A ps task was lost during `fit`, `evaluate` or `predict`, its variables with it.

    Attributes:
        ps_task: the index of the ps task.
    """

    # Named in tracebacks as programs import it (`kerasps.PsTaskFailedError`).
    __module__ = "kerasps"

    def __init__(self, ps_task: int, method: str, reason: str | None = None):
        self.ps_task = ps_task
        reason = reason or _HOW_TO_RECOVER.get(method, _HOW_TO_RECOVER["fit"])
        super().__init__(
            f"ps task {ps_task} (/job:ps/replica:0/task:{ps_task}) became unavailable during "
            f"`{method}`, and the variables it held are lost. {reason}")


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a `fit` call was when a backup was written.

    Attributes:
        epoch: the epoch (0-based) the next step belongs to.
        step: the steps of `epoch` whose results had reached the coordinator.
    """

    epoch: int
    step: int


class Recovery(enum.Enum):
    """What a running `fit` does after an error from the cluster."""

    RESTORE = "restore"  # wait for the tasks, restore the latest backup, go on from there
    RAISE = "raise"  # no backup to restore: end the call with `PsTaskFailedError`
    RETRY = "retry"  # a ps was unreachable but holds its state: run the failed steps again


def decide(lost_ps_tasks, has_backup: bool, ps_unreachable: bool = False) -> Recovery | None:
    """The recovery of a call after an error; `None` if the error is not the cluster's
    (it is raised as it is).

    Args:
        lost_ps_tasks: the ps tasks whose variables can no longer be read.
        has_backup: whether the call backs up its state (`BackupAndRestore`).
        ps_unreachable: whether the error says a ps task could not be reached (it
            may have been restored since, or the network failed for a moment).
    """
    if lost_ps_tasks:
        return Recovery.RESTORE if has_backup else Recovery.RAISE
    return Recovery.RETRY if ps_unreachable else None


# Times the steps after one position are run again while a ps task is unreachable.
UNREACHABLE_RETRIES = 8


def retry_delay(attempt: int) -> float | None:
    """Seconds to wait before running again, for the `attempt`-th time (from 0), the
    steps that failed because a ps task was unreachable; `None`: give up.

    A ps task restarted on its address answers the coordinator first: the workers'
    gRPC channels to it back off before reconnecting (1 s, growing 1.6x per try),
    and refuse meanwhile. The delays (0.5 s growing 1.6x, at most 8 s; about 30 s
    in all) outlast that backoff.
    """
    if attempt >= UNREACHABLE_RETRIES:
        return None
    return min(0.5 * 1.6 ** attempt, 8.0)


def steps_rolled_back(backup: Progress, epoch: int, finished: int,
                      scheduled: int | None = None) -> int:
    """The steps of `epoch` to run again after restoring `backup`.

    Args:
        backup: where the restored backup was written: the steps its weights hold.
        epoch: the epoch running when the state was lost.
        finished: the steps of `epoch` whose results had reached the coordinator.
        scheduled: the steps of `epoch` scheduled so far (default `finished`): a
            backup may hold steps applied ahead of the delivered ones, never more
            than were scheduled.

    Raises:
        RuntimeError: the backup is not from this epoch (or is ahead of what was
            scheduled), so going on from it would not give the requested steps exactly.
    """
    scheduled = finished if scheduled is None else scheduled
    if backup.epoch != epoch or backup.step > scheduled:
        raise RuntimeError(
            f"Cannot go on from the latest backup: it was written at epoch {backup.epoch + 1} "
            f"step {backup.step}, but training was at epoch {epoch + 1} step {finished}"
            + ("" if scheduled == finished else f" ({scheduled} scheduled)") + ".")
    return max(0, finished - backup.step)
