"""What a process started by `kerasps launch` shares with the launcher: the environment
variables the launcher sets, and the helpers that read them inside the tasks.

`kerasps.runtime.cluster` (the chief's SIGTERM handler, process titles), the strategy (the
elastic pool's `min_workers`, `report_connected`) and the sidecar evaluator (training
finished) read them; the launcher itself (`kerasps.ops.launch`) sets them. Split
from the launcher so that those modules, below it, need not import the supervisor.

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from kerasps.policy._validation import positive_int

# Where the launcher writes why it is ending the job, for the chief to read.
REPORT_ENV = "KERASPS_LAUNCH_REPORT"
# A file the launcher creates when the chief has exited with status 0, for the evaluator.
TRAINING_FINISHED_ENV = "KERASPS_TRAINING_FINISHED"
# The elastic pool: the chief's `min_workers`; a file holding the wanted worker count; a
# file the chief's strategy creates once it has connected to every declared worker.
MIN_WORKERS_ENV = "KERASPS_MIN_WORKERS"
WORKERS_WANTED_ENV = "KERASPS_WORKERS_WANTED"
CONNECTED_ENV = "KERASPS_CONNECTED"
# The task a process of the job runs (`"worker 1"`), for its process title.
TASK_ENV = "KERASPS_TASK"
# `kerasps launch --engine ray`: the job's Ray tasks, as JSON (`num_workers`, `num_ps`,
# `max_restarts`, `address`, `worker_resources`), for the chief's `resolve()`.
RAY_JOB_ENV = "KERASPS_RAY_JOB"


class TaskFailedError(RuntimeError):
    """A task of the job failed for good (its restart budget is spent)."""

    # Named in tracebacks as programs import it (`[chief 0] kerasps.launch.TaskFailedError:`).
    __module__ = "kerasps.launch"


def _write_atomically(path: str, text: str):
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)



# -- in the tasks ---------------------------------------------------------------------------
def request_workers(count: int):
    """Asks `kerasps launch --workers MIN:MAX` to run `count` workers (clamped to
    [MIN, MAX]): stopped workers join, or the highest-numbered leave.

    Raises:
        RuntimeError: outside an elastic `kerasps launch` job.
    """
    positive_int("count", count)
    path = os.environ.get(WORKERS_WANTED_ENV)
    if not path:
        raise RuntimeError(
            "kerasps.launch.request_workers() resizes the worker pool of a job started by "
            f"`kerasps launch --workers MIN:MAX`; ${WORKERS_WANTED_ENV} is not set here.")
    _write_atomically(path, str(count))


def report_connected():
    """Tells an elastic launcher that the chief has connected to every declared worker
    (the strategy calls it); a no-op elsewhere."""
    path = os.environ.get(CONNECTED_ENV)
    if path:
        _write_atomically(path, "connected\n")


def launched_task() -> str | None:
    """The task this process runs in a `kerasps launch` job (`"chief 0"`), or `None`
    outside one."""
    return os.environ.get(TASK_ENV) or None


# -- in the tasks: process titles -------------------------------------------------------------
def name_process(task: str | None = None, detail: str = ""):
    """Sets this process's title, as `ps` and `top` show it, to `kerasps: <task>` (and
    `detail`); `task` defaults to `$KERASPS_TASK`, set by `kerasps launch`. A no-op
    without a task, or without the `setproctitle` package."""
    task = task or os.environ.get(TASK_ENV)
    if not task:
        return
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - a dependency of kerasps
        return
    setproctitle.setproctitle(f"kerasps: {task}" + (f" {detail}" if detail else ""))


# -- in the tasks: Ctrl-C ---------------------------------------------------------------------
def quiet_interrupts():
    """In a process of a `kerasps launch` job, an uncaught `KeyboardInterrupt` ends it
    without a traceback (a no-op elsewhere; `import kerasps` calls it).

    The launcher passes Ctrl-C on to the chief and the evaluator as SIGINT, and has said
    in one line that the job is being stopped; the traceback of the interrupted `fit`
    would only bury that line. Python exits as after any uncaught `KeyboardInterrupt`
    (by SIGINT: status 130); any other exception's traceback is printed as before.
    """
    if launched_task() is None:
        return
    shown = sys.excepthook

    def excepthook(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            shown(kind, value, traceback)

    sys.excepthook = excepthook


# -- in the chief --------------------------------------------------------------------------
# A reason given in this process (`fail_chief`), read by the handler before the report file;
# the reason the handler raised (`job_failed`).
_FAILURE = {"reason": None, "raised": None}


def job_failed() -> str | None:
    """Why the job failed, once `TaskFailedError` was raised in this process (a task's
    restart budget is spent), else `None`: functions still running need not be waited
    for (they may wait for a task that will not come back)."""
    return _FAILURE["raised"]


def install_chief_handler(anywhere: bool = False) -> bool:
    """Under `kerasps launch`, makes the launcher's SIGTERM raise `TaskFailedError` with
    its reason in the chief's main thread (a no-op elsewhere).

    Args:
        anywhere: install it outside `kerasps launch` too (a Ray driver, whose tasks'
            actors `fail_chief` reports on). A SIGTERM without a reason then goes to the
            handler that was there before (Ray's), where there was one.

    Returns:
        Whether the handler is installed (only the main thread can install it).
    """
    report = os.environ.get(REPORT_ENV)
    if (not report and not anywhere) or threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_kerasps_chief", False):
        return True

    def on_sigterm(signum, frame):
        reason, _FAILURE["reason"] = _FAILURE["reason"], None
        if not reason and report:
            try:
                with open(report) as f:
                    reason = f.read().strip()
            except OSError:
                reason = ""
        if reason:
            _FAILURE["raised"] = reason
            raise TaskFailedError(f"The job failed: {reason}.")
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:  # a program that ignores SIGTERM still does
            return None
        raise SystemExit(128 + signum)  # the job is being stopped (Ctrl-C)

    on_sigterm._kerasps_chief = True
    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def fail_chief(reason: str) -> bool:
    """From any thread of the chief, ends the job as the launcher ends it when a task's
    restart budget is spent: `TaskFailedError` naming `reason` is raised in the chief's
    main thread (wherever it is: inside `fit`, between two calls), through the handler of
    `install_chief_handler`. Under `kerasps launch` the reason is also written to the
    launcher's report file, so that the launcher ends the job rather than restart the
    chief.

    Returns:
        Whether the main thread was told (False: no handler installed, nothing done).
    """
    handler = signal.getsignal(signal.SIGTERM)
    if not getattr(handler, "_kerasps_chief", False):
        return False
    _FAILURE["reason"] = reason
    report = os.environ.get(REPORT_ENV)
    if report:
        _write_atomically(report, reason)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    return True
