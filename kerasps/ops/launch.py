"""`kerasps launch`: one OS process per task on this machine, and a restart agent.

    kerasps launch --workers 2 --ps 1 --max-restarts 3 train.py --epochs 5

starts the worker and ps tasks as `kerasps serve` processes and the chief as
`python train.py ...` (`kerasps launch ... -m package.module ...`: as
`python -m package.module ...`), each with its own `TF_CONFIG` on loopback ports, so the
script is the one a platform that sets `TF_CONFIG` (Kubernetes TFJob and the
like) would run. Output is prefixed with the task (`[worker 1] ...`) and read as it
is written (`kerasps.ops.console`: a live progress bar and colours on a terminal,
complete lines of plain text elsewhere, TensorFlow's start-up lines dropped unless
`tf_logs`); each task's process is named for `ps` (`kerasps: worker 1`). The program
is checked before anything starts. The agent watches every process: a task that fails
(a signal, or a non-zero exit status) is started again on the same address while its
restart budget lasts (`kerasps.policy.restarts` holds that policy). That includes the
chief, as torchrun restarts a failed process group and Kubernetes a failed pod: the new chief
connects to the servers that kept running, and a `fit` with
`keras.callbacks.BackupAndRestore` resumes from its latest backup, inside the
epoch. The chief's exit with status 0, Ctrl-C or SIGTERM ends every process:
after Ctrl-C (or SIGTERM) the chief and the evaluator get the signal first, while
the servers still run, and everything is gone within `INTERRUPT_GRACE +
STOP_GRACE` (2 s); a second Ctrl-C kills every task at once. The launcher says so in
one line, below each task's progress bar as last drawn, and no bar is drawn again; the
chief's (or the evaluator's) `KeyboardInterrupt` ends it without a traceback
(`kerasps.runtime.launch_env.quiet_interrupts`).
A restarted (or rejoining) task starts in a warm standby interpreter that has
already imported TensorFlow and Keras (`kerasps.ops.standby`): the agent keeps one
beside the job and starts the next after each restart, so a restart no longer
waits seconds for an import.

With `--evaluator`, one more process runs the same script as task `evaluator 0`
(its `TF_CONFIG` names the training cluster without it, as TensorFlow's does), for
side-car evaluation (`kerasps.SidecarEvaluator`). The agent restarts it when it
fails and leaves it down once it exits with status 0. When the chief exits with
status 0 the workers and ps tasks are stopped, the evaluator is told that training
finished (through the file named by `$KERASPS_TRAINING_FINISHED`) and the job ends
when it has exited, so that it evaluates the last checkpoint; an evaluator that
never stops keeps the job running until Ctrl-C.

When a budget is spent the job ends. A server's: the launcher tells the chief
why (the chief's `kerasps.cluster.from_tf_config()` turns that into a
`kerasps.launch.TaskFailedError` naming the task and its exit code), stops
every process and exits with status 1. The chief's own: the launcher stops
every process and exits with the chief's last status (its exit code, or
128 + N after signal N).

With `--workers MIN:MAX` the worker pool is elastic: the cluster declares MAX
worker addresses and all of them start, because TensorFlow's coordinator
connects to every declared task once; as soon as the chief's strategy has
connected, the launcher stops workers down to the wanted count (MIN at
first; a restarted chief connects again, so they all start again until it
has). `request_workers(n)`, from the chief or any task (or writing `n` to
the file named by `$KERASPS_WORKERS_WANTED`), sets the wanted count: the
launcher starts stopped workers again on their addresses (they join) or
stops the highest-numbered ones with SIGTERM (they leave). A worker the
launcher stopped is not restarted; one that fails still is, within its
budget. The chief's strategy gets MIN as its `min_workers`
(`$KERASPS_MIN_WORKERS`): below it, `fit` holds training.

With `--engine ray` (`LaunchSpec.engine="ray"`) the launcher starts the chief only, with
`$KERASPS_RAY_JOB` in place of `TF_CONFIG`: its `kerasps.cluster.resolve()` starts the
worker and ps tasks as Ray actors (`kerasps.ray.cluster`), which Ray restarts within the
budget. The chief is the Ray driver, and Ray forwards the actors' output to it; the console
gives each actor's line to its task (`[worker 0] ...`). A chief that learns that an actor
is dead for good writes why to the report file and fails; the launcher then ends the job
(status 1) rather than restart it. After Ctrl-C the chief gets `RAY_INTERRUPT_GRACE`
(10 s) to kill its actors and stop a local Ray before it is killed.

This module is the supervisor (`Launcher`); the launch spec is `kerasps.ops.launch_spec`
and what the tasks share with the launcher `kerasps.runtime.launch_env`, both
re-exported here.

Pure Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from kerasps.backend import tf_logs as tf_logs_lib
from kerasps.ops import console as console_lib
from kerasps.ops.launch_spec import (
    _CONNECTED_FILE,
    _FINISHED_FILE,
    _REPORT_FILE,
    _STANDBY,
    _WANTED_FILE,
    LaunchSpec,
    Task,
    _command,
    _environment,
    check_engine,
    check_program,
    make_cluster,
    program_module,
    runs_program,
    tf_config,
)
from kerasps.policy import restarts as restarts_lib
from kerasps.runtime.launch_env import (
    CONNECTED_ENV,  # noqa: F401 - kerasps.ops.launch.CONNECTED_ENV, as before the split
    MIN_WORKERS_ENV,
    REPORT_ENV,
    TASK_ENV,
    TRAINING_FINISHED_ENV,
    WORKERS_WANTED_ENV,
    TaskFailedError,
    _write_atomically,
    install_chief_handler,
    name_process,
    report_connected,
    request_workers,
)

__all__ = ["LaunchSpec", "Task", "Launcher", "TaskFailedError", "make_cluster", "tf_config",
           "install_chief_handler", "runs_program", "request_workers", "report_connected",
           "check_program", "check_engine", "program_module", "name_process", "REPORT_ENV",
           "TASK_ENV", "TRAINING_FINISHED_ENV", "MIN_WORKERS_ENV", "WORKERS_WANTED_ENV"]

# Seconds a process gets to exit after SIGTERM before it is killed.
GRACE_PERIOD = 10.0
# After Ctrl-C (or SIGTERM) to the launcher: seconds the chief (and the evaluator) get to
# exit on the same signal while the servers still run (then SIGKILL: a chief stopped with
# the servers would print a screen of their errors), then seconds the servers get after
# SIGTERM before SIGKILL. A second Ctrl-C kills every task at once.
INTERRUPT_GRACE = 1.5
STOP_GRACE = 0.5
# A Ray driver (`--engine ray`) kills its actors and stops a local Ray as it exits: seconds.
RAY_INTERRUPT_GRACE = 10.0
POLL_INTERVAL = 0.05


_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - no libc to load
    _libc = None


def _die_with_launcher():
    """In the child, before exec: killed if the launcher dies, even by SIGKILL."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Process:
    """One task's current OS process, its restarts and its output pump; `done` once the
    agent no longer watches it."""

    def __init__(self, task: Task):
        self.task = task
        self.popen: subprocess.Popen | None = None
        self.restarts = 0
        self.pump: threading.Thread | None = None
        self.done = False
        self.parked = False  # stopped by the launcher: out of the elastic pool


class Launcher:
    """Runs a `LaunchSpec` and its restart agent; `run()` returns the exit status.

    Args:
        spec: what to run.
        out: where the tasks' prefixed output and the launcher's messages go
            (`kerasps.ops.console.Console`: progress bars redrawn in place on a terminal,
            complete lines only elsewhere).
        env: the environment the tasks start from (default `os.environ`).
        pick_port: returns a free port (default `kerasps.runtime.ports.pick_port`).
        tf_logs: TensorFlow's lines as TensorFlow prints them: its start-up lines kept in
            the tasks' output, and the tasks run with `KERASPS_TF_LOGS=1`. By default the
            start-up lines are dropped and `TF_CPP_MIN_LOG_LEVEL` is 3 unless `env` sets
            it (`kerasps.backend.tf_logs`).
        live: redraw progress bars in place; default: whether `out` is a terminal.
        colors: keep the tasks' colours (Keras' bar); default: whether `out` is a
            terminal (a file or a CI log gets plain text).
    """

    def __init__(self, spec: LaunchSpec, out=None, env=None, pick_port=None,
                 tf_logs: bool = False, live: bool | None = None, colors: bool | None = None):
        self.spec = spec
        self.policy = restarts_lib.RestartPolicy(spec.max_restarts)
        self.cluster = make_cluster(spec, pick_port)
        self._console = console_lib.Console(out or sys.stdout, live=live, tf_logs=tf_logs,
                                            colors=colors)
        self._base_env = tf_logs_lib.launched_environment(
            os.environ if env is None else env, tf_logs)
        self._stop = threading.Event()
        self._stop_reason = None
        self._stop_signal = None  # the signal that stopped the job
        self._processes: dict[Task, _Process] = {}
        self._scratch = None  # the report for the chief, the training-finished flag
        self._wanted = None  # the elastic pool's wanted size, once the chief has connected
        self._standby: _Process | None = None  # the next restarted task's interpreter

    # -- output ------------------------------------------------------------------------
    def _say(self, line: str):
        self._console.say("launcher", line)

    def _pump(self, process: _Process, popen: subprocess.Popen):
        """Forwards `popen`'s stdout and stderr to the console, chunk by chunk, labelled
        with `process`'s current task."""
        selector = selectors.DefaultSelector()
        for pipe in (popen.stdout, popen.stderr):
            selector.register(pipe, selectors.EVENT_READ, console_lib.Stream())
        # A Ray driver's output holds its actors' lines: each goes to its task's stream.
        routers, actor_streams = {}, {}
        while selector.get_map():
            for key, _ in selector.select():
                data = os.read(key.fd, 1 << 16)
                standby = process.task.type == _STANDBY  # its own start-up output
                if standby:
                    if not data:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                if self.spec.engine != "ray" or process.task.type != "chief":
                    pieces = [(None, data)]
                else:
                    router = routers.setdefault(key.fd, console_lib.RayActorLines())
                    pieces = router.split(data, final=not data)
                for task, piece in pieces:
                    stream = key.data if task is None else actor_streams.setdefault(
                        (task, key.fd), console_lib.Stream())
                    self._console.feed(stream, task or process.task.name, piece)
                if not data:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    self._console.close(key.data, process.task.name)
                    for (task, fd), stream in actor_streams.items():
                        if fd == key.fd:
                            self._console.close(stream, task)
        selector.close()

    # -- processes ---------------------------------------------------------------------
    def _spawn(self, process: _Process, command, env, stdin=subprocess.DEVNULL):
        process.popen = subprocess.Popen(
            command, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_launcher)
        process.pump = threading.Thread(target=self._pump, args=(process, process.popen),
                                        name=f"kerasps-launch-{process.task.type}",
                                        daemon=True)
        process.pump.start()

    def _start(self, process: _Process, warm: bool = False):
        """Starts `process`'s task; with `warm`, in the standby interpreter if there is one."""
        task = process.task
        env = _environment(self.spec, self.cluster, task, self._base_env, self._scratch)
        command = _command(self.spec, task)
        warmed = warm and self._hand_to_standby(process, command, env)
        if not warmed:
            self._spawn(process, command, env)
        where = f" at {self.cluster[task.type][task.index]}" if task.type in self.cluster else ""
        self._say(f"started {task.name}{where} (pid {process.popen.pid})"
                  + (" in the warm standby" if warmed else ""))

    def _start_standby(self):
        """Starts an interpreter that imports TensorFlow and Keras, then waits for a task
        (`kerasps.ops.standby`)."""
        self._standby = _Process(Task(_STANDBY, 0))
        self._spawn(self._standby, [sys.executable, "-m", "kerasps.ops.standby"],
                    dict(self._base_env, PYTHONUNBUFFERED="1", **{TASK_ENV: _STANDBY}),
                    stdin=subprocess.PIPE)

    def _hand_to_standby(self, process: _Process, command, env) -> bool:
        """Makes the standby interpreter `process`'s task, then starts a new standby.
        Returns False if there was none, or it had died."""
        standby, self._standby = self._standby, None
        if standby is None:
            return False
        standby.task = process.task  # its output is the task's from here on
        try:
            standby.popen.stdin.write(json.dumps({"argv": command[1:], "env": env}).encode()
                                      + b"\n")
            standby.popen.stdin.close()
        except (OSError, ValueError):  # it died: the task starts cold
            _signal_group(standby.popen, signal.SIGKILL)
            standby.popen.wait()
            standby = None
        else:
            process.popen, process.pump = standby.popen, standby.pump
        self._start_standby()
        return standby is not None

    def request_stop(self, reason: str = "stopped"):
        """Ends the job from another thread or a signal handler."""
        self._stop_reason = reason
        self._stop.set()

    def _signal_handler(self, signum, frame):
        if self._stop_signal is not None:  # the second Ctrl-C: no more waiting
            self._kill_everything(f"received {signal.Signals(signum).name} again")
            return
        self._stop_signal = signum
        name = signal.Signals(signum).name
        self.request_stop(f"received {name}" + (" (Ctrl-C)" if signum == signal.SIGINT else ""))

    def _kill_everything(self, reason: str):
        self._say(f"{reason}: killing every task")
        for process in self._all_processes():
            if process.popen is not None:
                _signal_group(process.popen, signal.SIGKILL)

    def _all_processes(self) -> list[_Process]:
        return [*self._processes.values(), *[self._standby] * (self._standby is not None)]

    def run(self) -> int:
        """Starts every task, restarts failed ones, and returns the job's exit status: 0
        once the chief succeeded; the chief's last status (its exit code, or 128 + N
        after signal N) if its own budget was spent; 1 if another task's was; 130 or 143
        after Ctrl-C or SIGTERM.

        Raises:
            ValueError: if the program cannot be run (before any task starts).
        """
        check_program(self.spec.program)
        check_engine(self.spec)
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, self._signal_handler)
        self._scratch = tempfile.mkdtemp(prefix="kerasps-launch-")
        if self.spec.min_workers is not None:
            _write_atomically(os.path.join(self._scratch, _WANTED_FILE),
                              str(self.spec.min_workers))
            self._say(f"elastic workers {self.spec.min_workers}:{self.spec.workers}; all start "
                      f"for the chief to connect, then {self.spec.min_workers} run; "
                      f"resize with kerasps.launch.request_workers(n)")
        if self.spec.engine == "ray":
            where = (f"the Ray cluster at {self.spec.address}" if self.spec.address else
                     "$RAY_ADDRESS's Ray cluster" if self._base_env.get("RAY_ADDRESS") else
                     "a local Ray the chief starts")
            self._say(f"engine ray: chief 0 is the Ray driver; kerasps.cluster.resolve() "
                      f"starts {self.spec.workers} worker(s) and {self.spec.ps} ps task(s) as "
                      f"Ray actors on {where}, restarted up to {self.spec.max_restarts} "
                      "time(s) each")
        try:
            for task in self.spec.tasks:
                self._processes[task] = _Process(task)
                self._start(self._processes[task])
            if self.spec.engine != "ray":  # a restarted Ray driver waits for its actors
                self._start_standby()
            return self._supervise()
        finally:
            if self._stop_signal is not None:
                self._interrupt(self._stop_signal)
            self._shutdown()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            shutil.rmtree(self._scratch, ignore_errors=True)

    def _supervise(self) -> int:
        status = None  # the chief's, once it exited with 0 and the evaluator still runs
        while not self._stop.wait(POLL_INTERVAL):
            if self.spec.min_workers is not None:
                self._resize()
            for process in self._processes.values():
                code = None if process.done or process.parked else process.popen.poll()
                if code is None:
                    continue
                failed = self._reported_failure() if code != 0 else None
                if failed and process.task.type == restarts_lib.PROGRAM_TYPE:
                    # The chief ended the job: a Ray actor's restart budget is spent.
                    self._say(f"ending the job: {failed}")
                    return 1
                decision = self.policy.decide(process.task.type, process.task.index, code,
                                              process.restarts)
                if decision.action is restarts_lib.Action.RESTART:
                    self._say(decision.reason)
                    self._restart(process)
                elif decision.action is restarts_lib.Action.DONE:
                    self._say(decision.reason)
                    process.done = True
                elif decision.action is restarts_lib.Action.FINISH:
                    self._say(decision.reason)
                    process.done = True
                    status = 0
                    if not self._finish_training():
                        return status
                elif process.task.type == restarts_lib.PROGRAM_TYPE:
                    self._say(f"ending the job: {decision.reason}")
                    return code if code >= 0 else 128 - code
                else:
                    self._say(f"ending the job: {decision.reason}")
                    self._fail_chief(decision.reason)
                    return 1
            if status is not None and all(p.done for p in self._processes.values()):
                return status
        # One line says so; the tasks' progress bars are not drawn again.
        self._console.stop("launcher", f"ending the job: {self._stop_reason}" + (
            "; press Ctrl-C again to kill every task" if self._stop_signal == signal.SIGINT
            else ""))
        return 130 if "SIGINT" in (self._stop_reason or "") else 143

    def _restart(self, process: _Process):
        """Starts `process`'s task again on its address. A restarted chief connects to
        every declared worker, so the workers an elastic pool stopped start again until
        it has (then the pool shrinks back to the wanted count)."""
        process.restarts += 1
        _signal_group(process.popen, signal.SIGKILL)  # leftovers of the task's group
        process.pump.join()
        self._start(process, warm=True)
        if process.task.type != restarts_lib.PROGRAM_TYPE or self.spec.min_workers is None:
            return
        try:
            os.remove(os.path.join(self._scratch, _CONNECTED_FILE))
        except FileNotFoundError:
            pass
        self._wanted = None
        for parked in [p for p in self._processes.values() if p.parked]:
            if parked.popen.poll() is None:
                self._stop_processes([parked])  # still leaving: let it go first
            parked.pump.join()
            parked.parked = False
            self._say(f"worker {parked.task.index} starts again for the restarted chief to "
                      "connect")
            self._start(parked)

    def _resize(self):
        """Starts or stops workers to the wanted count, once the chief has connected."""
        if self._wanted is None and not os.path.exists(
                os.path.join(self._scratch, _CONNECTED_FILE)):
            return  # every declared worker runs until the coordinator has connected
        try:
            with open(os.path.join(self._scratch, _WANTED_FILE)) as f:
                wanted = int(f.read().strip())
        except (OSError, ValueError):
            return  # being written, or not a number: keep the last count
        wanted = max(self.spec.min_workers, min(self.spec.workers, wanted))
        if wanted == self._wanted:
            return
        self._wanted = wanted
        workers = [p for task, p in sorted(self._processes.items(),
                                           key=lambda item: item[0].index)
                   if task.type == "worker" and not p.done]
        running = [p for p in workers if not p.parked]
        for process in reversed(running[wanted:]):
            process.parked = True
            self._say(f"worker {process.task.index} leaves the pool ({wanted} of "
                      f"{self.spec.workers} workers wanted)")
            self._stop_processes([process], wait=False)
        for process in [p for p in workers if p.parked][:max(0, wanted - len(running))]:
            if process.popen.poll() is None:
                self._stop_processes([process])  # still leaving: let it go first
            process.pump.join()
            process.parked = False
            self._say(f"worker {process.task.index} joins the pool ({wanted} of "
                      f"{self.spec.workers} workers wanted)")
            self._start(process, warm=True)

    def _finish_training(self) -> bool:
        """After the chief's success: stops the servers and tells a running evaluator that
        training finished. Returns whether the job waits for the evaluator."""
        evaluator = self._processes.get(Task("evaluator", 0))
        if evaluator is None or evaluator.done:
            return False
        servers = [p for p in self._processes.values() if not runs_program(p.task.type)]
        self._stop_processes(servers)
        for process in servers:
            process.done = True
        with open(os.path.join(self._scratch, _FINISHED_FILE), "w") as f:
            f.write("the chief exited with status 0\n")
        self._say("training finished; waiting for evaluator 0 to evaluate the last checkpoint")
        return True

    def _reported_failure(self) -> str:
        """What the chief wrote to the report file (`kerasps.runtime.launch_env.fail_chief`,
        with `--engine ray`: a task's actor dead for good), or ""."""
        try:
            with open(os.path.join(self._scratch, _REPORT_FILE)) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _fail_chief(self, reason: str):
        """Tells the chief why the job ends; its handler raises `TaskFailedError`."""
        with open(os.path.join(self._scratch, _REPORT_FILE), "w") as f:
            f.write(reason)
        chief = self._processes[Task("chief", 0)].popen
        if chief.poll() is None:
            chief.send_signal(signal.SIGTERM)
            try:
                chief.wait(GRACE_PERIOD)
            except subprocess.TimeoutExpired:
                pass

    def _interrupt(self, signum):
        """After Ctrl-C (SIGINT) or SIGTERM to the launcher: the same signal to the chief
        and the evaluator first, while the servers still run, so that they end cleanly
        (SIGKILL after `INTERRUPT_GRACE`); then SIGTERM to every task left, SIGKILL to
        those still there after `STOP_GRACE`."""
        programs = [p for p in self._processes.values() if runs_program(p.task.type)]
        grace = RAY_INTERRUPT_GRACE if self.spec.engine == "ray" else INTERRUPT_GRACE
        self._stop_processes(programs, signum=signum, grace=grace, report=True)
        self._stop_processes(self._all_processes(), grace=STOP_GRACE, report=True)

    def _shutdown(self):
        """Stops every process, and whatever is left of their process groups."""
        processes = self._all_processes()
        self._stop_processes(processes)
        for process in processes:
            if process.popen is not None:
                _signal_group(process.popen, signal.SIGKILL)  # leftovers of the task's group
            if process.pump is not None:
                process.pump.join(timeout=GRACE_PERIOD)

    def _stop_processes(self, processes, wait=True, signum=signal.SIGTERM, grace=GRACE_PERIOD,
                        report=False):
        """`signum` (SIGTERM) to the process groups of the running `processes`, SIGKILL to
        those still there after `grace` seconds (with `wait=False`, only the first signal;
        with `report`, each kill is said)."""
        alive = [p for p in processes if p.popen and p.popen.poll() is None]
        for process in alive:
            _signal_group(process.popen, signum)
        if not wait:
            return
        deadline = time.monotonic() + grace
        for process in alive:
            try:
                process.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if report:
                    self._say(f"{process.task.name} did not exit within {grace:g} s of "
                              f"{signal.Signals(signum).name}: killed")
                _signal_group(process.popen, signal.SIGKILL)
                process.popen.wait()


def _signal_group(popen: subprocess.Popen, signum):
    try:
        os.killpg(popen.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
