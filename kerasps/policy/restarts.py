"""What the restart agent does when a task's process exits: pure policy, no TensorFlow.

`kerasps launch` (the mechanism, `kerasps.launch`) asks `RestartPolicy.decide`
what to do each time a process ends; the simulator can ask the same
questions of its simulated tasks. The budget is per task: each worker, ps and
chief task may be restarted `max_restarts` times on its own address (as
Kubernetes restarts a pod's container in place); one more exit ends the job.

The chief's exit with status 0 finishes the job. Any other exit, a signal or a
non-zero status, is a failure and the chief is restarted like the servers, as
torchrun restarts a failed process group and Kubernetes a failed pod under
`restartPolicy: OnFailure`: the exit status cannot tell a Python error that
will happen again from a transient one (a `PsTaskFailedError`, a lost
connection), and a restarted chief resumes `fit` from its
`keras.callbacks.BackupAndRestore` backup, so trying again costs at most the
budget. The side-car `evaluator` is restarted like them when it fails; when it
exits with status 0 it has finished its work and stays down while training goes
on.
"""

from __future__ import annotations

import dataclasses
import enum

from kerasps.policy._validation import positive_int

__all__ = ["Action", "Decision", "RestartPolicy", "describe_exit"]

# Task types whose processes are servers (restartable) and the one running the program.
SERVER_TYPES = ("worker", "ps")
PROGRAM_TYPE = "chief"
SIDECAR_TYPE = "evaluator"  # runs the program beside the training cluster


class Action(enum.Enum):
    RESTART = "restart"  # start the task again on the same address
    END_JOB = "end_job"  # stop every task; the job failed
    FINISH = "finish"  # the chief succeeded: stop every task, exit with status 0
    DONE = "done"  # the evaluator is done: leave it down, the job goes on


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def describe_exit(exit_code: int) -> str:
    """'exit code 3' or 'signal 9 (SIGKILL)' for a `Popen.returncode`."""
    if exit_code is not None and exit_code < 0:
        import signal

        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = "unknown signal"
        return f"signal {-exit_code} ({name})"
    return f"exit code {exit_code}"


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """Restarts failed tasks within a budget; the chief's status 0 finishes the job.

    Attributes:
        max_restarts: restarts allowed per task (0: none).
    """

    max_restarts: int = 3

    def __post_init__(self):
        positive_int("max_restarts", self.max_restarts, minimum=0)

    def decide(self, task_type: str, index: int, exit_code: int, restarts: int) -> Decision:
        """What to do now that task `task_type:index` exited with `exit_code`.

        Args:
            task_type: `"chief"`, `"worker"`, `"ps"` or `"evaluator"`.
            index: the task's index within its type.
            exit_code: the process's return code (negative: killed by a signal).
            restarts: how many times this task was already restarted.
        """
        if task_type not in (PROGRAM_TYPE,) + SERVER_TYPES + (SIDECAR_TYPE,):
            raise ValueError(f"Invalid value for argument `task_type`: expected one of "
                             f"{(PROGRAM_TYPE,) + SERVER_TYPES + (SIDECAR_TYPE,)}. "
                             f"Received: task_type={task_type!r}")
        if task_type == PROGRAM_TYPE and exit_code == 0:
            return Decision(Action.FINISH, f"{task_type} {index} finished with exit code 0")
        if task_type == SIDECAR_TYPE and exit_code == 0:
            return Decision(Action.DONE, f"{task_type} {index} finished")
        what = f"{task_type} {index} exited with {describe_exit(exit_code)}"
        if restarts < self.max_restarts:
            return Decision(Action.RESTART,
                            f"{what}; restart {restarts + 1} of {self.max_restarts}")
        return Decision(Action.END_JOB,
                        f"{what} and its restart budget is spent "
                        f"({self.max_restarts} restart{'s' * (self.max_restarts != 1)})")
