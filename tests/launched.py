"""A `kerasps launch` job run by a test: its prefixed output, its pids, its exit; and the
waits and simulated Ray nodes such tests and the benchmarks share."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

DEADLINE = 240  # seconds a job may take: generous for 2 loaded cores, never asserted on

STARTED = re.compile(r"\[launcher\] started (\w+ \d+) at \S+ \(pid (\d+)\)")


def launch(tmp_path, chief_code: str, *options: str, args=(), env=None) -> RunningJob:
    """`kerasps launch [options] chief.py [args]` with `chief_code` as chief.py."""
    script = tmp_path / "chief.py"
    script.write_text(textwrap.dedent(chief_code))
    return RunningJob([sys.executable, "-m", "kerasps.cli", "launch", *options, str(script),
                       *args], cwd=tmp_path, env=env)


def default_sigint():
    """A `preexec_fn`: SIGINT at its default, so that the child's Python turns it into
    `KeyboardInterrupt` however the tests were started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RunningJob:
    """A command (a launcher, or a chief) in a subprocess, its output read line by line.

    Lines `[launcher] started <task> at <address> (pid N)` record each task's pids;
    `times[i]` is when `lines[i]` was read (`time.time()`).
    """

    def __init__(self, command, cwd=None, env=None):
        # (SIGINT at its default in the job, as a terminal's Ctrl-C finds it: a shell's
        # background job, `pytest &`, starts with SIGINT ignored and its children inherit it.)
        self.lines: list[str] = []
        self.times: list[float] = []
        self.pids: dict[str, list[int]] = {}  # task -> pids, oldest first
        self._queue: queue.Queue = queue.Queue()
        environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
        self.process = subprocess.Popen(  # `env` maps a variable to None to unset it
            command, cwd=cwd, env={k: v for k, v in environ.items() if v is not None},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=default_sigint)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            line = line.rstrip("\n")
            started = STARTED.search(line)
            if started:
                self.pids.setdefault(started.group(1), []).append(int(started.group(2)))
            self.times.append(time.time())
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = DEADLINE) -> re.Match:
        """Blocks until a line matches `pattern`; fails with the output so far."""
        regex = re.compile(pattern)
        for line in self.lines:
            if regex.search(line):
                return regex.search(line)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matched {pattern!r} in {timeout}s:\n"
                                     + self.output()) from None
            if line is None:
                raise AssertionError(f"the job ended before a line matched {pattern!r}:\n"
                                     + self.output())
            if regex.search(line):
                return regex.search(line)

    def pid(self, task: str) -> int:
        """The current pid of `task` (e.g. "worker 1")."""
        self.wait_for(rf"\[launcher\] started {task} ")
        return self.pids[task][-1]

    def kill(self, task: str, signum=signal.SIGKILL) -> int:
        pid = self.pid(task)
        os.kill(pid, signum)
        return pid

    def finish(self, timeout: float = DEADLINE) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError("the job did not end:\n" + self.output()) from None
        self._reader.join(timeout=30)
        return code

    def output(self, last: int = 200) -> str:
        """The job's output for a failure message: its last `last` lines after `folded`."""
        return "\n".join(folded(self.lines)[-last:])

    def close(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def folded(lines: list[str], window: int = 8) -> list[str]:
    """`lines` with repeats folded: a line like one of the `window` lines shown before it
    (equal but for its numbers: `train batch 7`, a gRPC error block TensorFlow prints once
    per function) is left out; a run of such lines shows as a count and its last line, so
    what a failure message keeps is what happened, not 150 lines of steps."""
    shown, recent, skipped = [], [], []
    for line in lines:
        key = re.sub(r"\d+", "#", line)
        if key in recent:
            skipped.append(line)
            continue
        if skipped:
            shown.append(f"    [... {len(skipped)} line(s) like the ones above ...]")
            shown.append(skipped[-1])
            skipped = []
        shown.append(line)
        recent = (recent + [key])[-window:]
    if skipped:
        shown.append(f"    [... {len(skipped)} line(s) like the ones above ...]")
        shown.append(skipped[-1])
    return shown


def process_gone(pid: int) -> bool:
    """True if `pid` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05) -> bool:
    """Polls `predicate` until true or `timeout`; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(interval)
    return True


def run_with_deadline(program: str, *args: str, deadline: float, cwd, what: str):
    """Runs `python -c program args` and returns its `CompletedProcess`; fails the test
    naming `what` if it has not ended within `deadline` seconds (a deadlock?)."""
    try:
        return subprocess.run([sys.executable, "-c", program, *args], capture_output=True,
                              text=True, timeout=deadline, cwd=cwd)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr or b""
        stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        pytest.fail(f"{what} did not end within {deadline} s (a deadlock?); the last lines "
                    f"of their stderr:\n{stderr[-2000:]}")


def add_ray_node(cluster):
    """`cluster.add_node` (a `ray.cluster_utils.Cluster`) of a 1-CPU node on loopback, with
    the patience two loaded cores need.

    Ray gives a new node's raylet 30 s to register with the GCS (a constant in
    `ray._private.node.Node.__init__`), polling `services.get_node` meanwhile; beside another
    test file's TensorFlow processes it once took longer in CI (9 s here beside six busy
    processes, 2-3 s idle), and the test failed. The poll stays Ray's own: each call waits
    up to 3 minutes for the node before giving Ray's answer.
    """
    import ray._private.services as services

    get_node = services.get_node

    def patient_get_node(*args, **kwargs):
        deadline = time.monotonic() + 180
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = patient_get_node
    try:
        return cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    finally:
        services.get_node = get_node
