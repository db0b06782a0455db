"""`kerasps launch` without processes: the restart policy, specs, the command line
(the Kubernetes manifests are in test_manifests.py)."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kerasps.ops import console as console_lib
from kerasps.ops import launch
from kerasps.policy.restarts import Action, RestartPolicy, describe_exit
from kerasps.runtime import cluster as cluster_lib
from tests.launched import DEADLINE, RunningJob, folded, process_gone, wait_until
from tests.launched import launch as launch_job


def test_a_failed_jobs_message_folds_repeated_lines_and_keeps_the_last_of_each_run():
    lines = (["[launcher] started ps 0 at localhost:1 (pid 2)"]
             + [f"[chief 0] train batch {i}" for i in range(1, 151)]
             + ["[chief 0] E0000 12:00 context.cc:911] Failed", "[chief 0] peer 14"] * 20
             + ["[chief 0] WARNING:kerasps:ps task(s) 1 lost their variables"])
    assert folded(lines) == [
        lines[0], "[chief 0] train batch 1",
        "    [... 149 line(s) like the ones above ...]", "[chief 0] train batch 150",
        "[chief 0] E0000 12:00 context.cc:911] Failed", "[chief 0] peer 14",
        "    [... 38 line(s) like the ones above ...]", "[chief 0] peer 14",
        lines[-1]]


def test_a_server_is_restarted_until_its_budget_is_spent():
    policy = RestartPolicy(max_restarts=2)
    assert policy.decide("worker", 1, -9, restarts=0).action is Action.RESTART
    assert policy.decide("ps", 0, 1, restarts=1).action is Action.RESTART
    spent = policy.decide("worker", 1, -9, restarts=2)
    assert spent.action is Action.END_JOB
    assert spent.reason == ("worker 1 exited with signal 9 (SIGKILL) and its restart budget "
                            "is spent (2 restarts)")


def test_the_chief_finishes_the_job_with_status_0_and_is_restarted_like_a_server_otherwise():
    policy = RestartPolicy(max_restarts=2)
    done = policy.decide("chief", 0, 0, restarts=0)
    assert done.action is Action.FINISH and done.reason == "chief 0 finished with exit code 0"
    # As torchrun and Kubernetes' OnFailure: a kill and a Python error are both restarted.
    assert policy.decide("chief", 0, -9, restarts=0).action is Action.RESTART
    restarted = policy.decide("chief", 0, 1, restarts=1)
    assert restarted.action is Action.RESTART
    assert restarted.reason == "chief 0 exited with exit code 1; restart 2 of 2"
    spent = policy.decide("chief", 0, -9, restarts=2)
    assert spent.action is Action.END_JOB
    assert spent.reason == ("chief 0 exited with signal 9 (SIGKILL) and its restart budget "
                            "is spent (2 restarts)")
    assert RestartPolicy(max_restarts=0).decide("chief", 0, 3, 0).action is Action.END_JOB


def test_the_evaluator_is_restarted_when_it_fails_and_left_down_when_it_is_done():
    policy = RestartPolicy(max_restarts=1)
    done = policy.decide("evaluator", 0, 0, restarts=0)
    assert done.action is Action.DONE and done.reason == "evaluator 0 finished"
    assert policy.decide("evaluator", 0, -9, restarts=0).action is Action.RESTART
    assert policy.decide("evaluator", 0, 1, restarts=1).action is Action.END_JOB


def test_exit_descriptions_name_signals_and_codes():
    assert describe_exit(-15) == "signal 15 (SIGTERM)"
    assert describe_exit(2) == "exit code 2"


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_restarts=-1), "max_restarts"), (dict(workers=0), "workers"),
    (dict(ps=1.5), "ps"), (dict(gpus_per_worker=0), "gpus_per_worker"),
    (dict(program=()), "program"), (dict(evaluator=1), "evaluator"),
    (dict(min_workers=0), "min_workers"), (dict(workers=2, min_workers=3), "min_workers"),
    (dict(program=("-m",)), "program"), (dict(program=("-m", "", "--lr")), "program")])
def test_bad_launch_specs_are_refused_naming_the_argument(kwargs, name):
    arguments = {"program": ("train.py",), **kwargs}
    with pytest.raises(ValueError, match=rf"argument `{name}`.*Received: {name}="):
        launch.LaunchSpec(**arguments)


def test_unknown_task_types_are_refused():
    with pytest.raises(ValueError, match=r"argument `task_type`.*Received: task_type='master'"):
        RestartPolicy().decide("master", 0, 1, 0)


def test_the_evaluator_runs_the_program_outside_the_cluster_it_is_told_about():
    spec = launch.LaunchSpec(program=("train.py", "--lr", "1"), workers=2, ps=1, evaluator=True)
    assert launch.Task("evaluator", 0) in spec.tasks
    assert launch.Task("evaluator", 0) not in launch.LaunchSpec(program=("train.py",)).tasks
    cluster = launch.make_cluster(spec, pick_port=iter(range(5000, 5100)).__next__)
    assert set(cluster) == {"chief", "worker", "ps"}  # it serves nothing: no address
    config = json.loads(launch.tf_config(cluster, launch.Task("evaluator", 0)))
    parsed = cluster_lib.parse_tf_config(json.dumps(config))
    assert (parsed["task_type"], parsed["task_index"]) == ("evaluator", 0)
    assert parsed["cluster"] == cluster
    assert launch._command(spec, launch.Task("evaluator", 0))[1:] == ["train.py", "--lr", "1"]


@pytest.mark.parametrize("argv, message", [
    (["launch"], "Invalid value for argument `program`: the chief's script is required"),
    (["launch", "--emit", "k8s", "train.py"],
     "Invalid value for argument `--image`: it is required with --emit"),
    (["launch", "--workers", "4:2", "train.py"],
     "Invalid value for argument `--workers`: MIN (4) is greater than MAX (2). "
     "Received: --workers='4:2'"),
    (["launch", "--workers", "0:2", "train.py"], "Received: --workers='0:2'"),
    (["launch", "--workers", "two", "train.py"], "Received: --workers='two'"),
    (["launch", "--ps", "0", "train.py"],
     "Invalid value for argument `--ps`: it must be a positive integer. Received: --ps='0'"),
    (["launch", "--max-restarts", "-2", "train.py"],
     "Invalid value for argument `--max-restarts`: it must be an integer >= 0. "
     "Received: --max-restarts='-2'"),
    (["launch", "--gpus-per-worker", "x", "train.py"],
     "Invalid value for argument `--gpus-per-worker`: it must be a positive integer. "
     "Received: --gpus-per-worker='x'"),
    (["launch", "--ps", "1", "-m"],
     "Invalid value for argument `-m`: the module to run is required (kerasps launch [options] "
     "-m package.module [args]). Received: -m=None"),
    (["launch", "-m", "--workers", "2", "kps_job.train"],
     "Invalid value for argument `-m`: expected a module's name; the options of kerasps launch "
     "go before -m (everything after the module's name is its own). Received: -m='--workers'"),
    (["launch", "-mkps_job.train", "train.py"],
     "Invalid value for argument `-m`: a script and a module cannot both be given; write -m "
     "apart from the module's name (kerasps launch [options] -m package.module [args]). "
     "Received: -m='kps_job.train' and program=['train.py']"),
    (["launch", "-m", "kps_nosuch.train", "--lr", "1"],
     "Invalid value for argument `-m`: the chief's module 'kps_nosuch.train' cannot be run (no "
     "module named 'kps_nosuch' in the current directory or on sys.path). "
     "Received: -m='kps_nosuch.train'"),
])
def test_launch_command_line_errors(argv, message, tmp_path):
    (tmp_path / "train.py").write_text("")
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", *argv], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert result.stderr.count("argument") == 1  # one style: argparse's prefix is gone


@pytest.mark.parametrize("program, problem", [("nosuch.py", "no such file"),
                                              (".", "a directory without __main__.py")])
def test_a_program_that_cannot_run_is_refused_before_any_task_starts(tmp_path, program, problem):
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "launch", program],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert (f"Invalid value for argument `program`: the chief's script {program!r} cannot be run "
            f"({problem}). Received: program={program!r}") in result.stderr
    assert "started" not in result.stdout
    with pytest.raises(ValueError, match=r"argument `program`.*no such file"):
        launch.Launcher(launch.LaunchSpec(program=(str(tmp_path / "x.py"),)),
                        pick_port=iter(range(5000, 5100)).__next__).run()


def test_a_module_is_checked_as_python_m_finds_it_without_running_its_packages(tmp_path,
                                                                              monkeypatch):
    package = tmp_path / "kps_job"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the launcher ran __init__')")
    (package / "train.py").write_text("")
    (tmp_path / "kps_plain.py").write_text("")
    monkeypatch.chdir(tmp_path)  # found from the current directory, as `python -m` finds it
    launch.check_program(("-m", "kps_job.train", "--lr", "1"))
    launch.check_program(("-m", "json.tool"))  # on sys.path
    assert "kps_job" not in sys.modules
    for module, problem in [
            ("kps_job.nosuch", "no module named 'kps_job.nosuch' in package 'kps_job'"),
            ("kps_nosuch.train",
             "no module named 'kps_nosuch' in the current directory or on sys.path"),
            ("kps_job", "a package without __main__"),
            ("kps_plain.train", "'kps_plain' is not a package"),
            (".train", "not a module name")]:
        with pytest.raises(ValueError, match=re.escape(
                f"Invalid value for argument `program`: the chief's module {module!r} cannot be "
                f"run ({problem}")) as refused:
            launch.check_program(("-m", module, "--lr", "1"))
        assert str(refused.value).endswith(f"Received: program=('-m', {module!r})")
    (package / "__main__.py").write_text("")
    launch.check_program(("-m", "kps_job"))  # a package runs its __main__


def test_request_workers_outside_an_elastic_launch_says_what_it_needs(monkeypatch):
    monkeypatch.delenv(launch.WORKERS_WANTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"kerasps launch --workers MIN:MAX"):
        launch.request_workers(2)
    with pytest.raises(ValueError, match=r"argument `count`.*Received: count=0"):
        launch.request_workers(0)


def test_an_elastic_launch_tells_the_chief_its_minimum_and_every_task_the_control_file():
    spec = launch.LaunchSpec(program=("train.py",), workers=4, min_workers=2)
    cluster = launch.make_cluster(spec, pick_port=iter(range(5000, 5010)).__next__)
    chief = launch._environment(spec, cluster, launch.Task("chief", 0), {}, "/scratch")
    worker = launch._environment(spec, cluster, launch.Task("worker", 3), {}, "/scratch")
    assert len(cluster["worker"]) == 4  # MAX addresses are declared
    assert chief[launch.MIN_WORKERS_ENV] == "2"
    assert chief[launch.WORKERS_WANTED_ENV] == worker[launch.WORKERS_WANTED_ENV]
    assert launch.MIN_WORKERS_ENV not in worker




# -- the console ------------------------------------------------------------------------------
def screen(raw: str) -> list[str]:
    """The lines a terminal shows after writing `raw` (carriage returns, newlines and
    erase-to-end-of-line; a pty's "\\r\\n" included)."""
    lines, line, column = [], [], 0
    raw = re.sub(r"\x1b\[[0-9;]*m", "", raw)  # colours and bold take no room
    for token in re.findall(r"\x1b\[K|\r|\n|[^\r\n\x1b]", raw):
        if token == "\r":
            column = 0
        elif token == "\n":
            lines.append("".join(line))
            line, column = [], 0
        elif token == "\x1b[K":
            del line[column:]
        else:
            line[column:column + 1] = [token]
            column += 1
    return lines + (["".join(line)] if line else [])


BAR_1 = b"\r1/3 \xe2\x94\x81\xe2\x94\x81 loss: 0.5"  # Keras' redraw: backspaces, \r, the bar
BAR_2 = b"\x08" * 20 + b"\r2/3 \xe2\x94\x81\xe2\x94\x81\xe2\x94\x81 loss: 0.4"
BAR_3 = b"\x08" * 20 + b"\r3/3 \xe2\x94\x81\xe2\x94\x81\xe2\x94\x81\xe2\x94\x81 loss: 0.3\n"


def _console_run(live):
    out = io.StringIO()
    console = console_lib.Console(out, live=live)
    bar, errors, worker = console_lib.Stream(), console_lib.Stream(), console_lib.Stream()
    shown = []
    console.feed(bar, "chief 0", BAR_1)
    shown.append(out.getvalue())
    console.feed(errors, "chief 0", b"ERROR:tensorflow:Worker failed\n")
    console.say("launcher", "worker 1 exited with signal 9 (SIGKILL); restart 1 of 3")
    console.feed(bar, "chief 0", BAR_2[:9])  # a multi-byte character cut in two
    console.feed(bar, "chief 0", BAR_2[9:])
    shown.append(out.getvalue())
    console.feed(worker, "worker 0", b"I0000 00:00:1795612757.659892   20893 cudart_stub.cc:31] "
                                     b"Could not find cuda drivers on your machine\n")
    console.feed(worker, "worker 0", b"serving\n")
    console.feed(bar, "chief 0", BAR_3)
    return out.getvalue(), shown


def test_a_progress_bar_is_drawn_live_with_its_prefix_and_lines_are_written_above_it():
    raw, shown = _console_run(live=True)
    assert screen(shown[0]) == ["[chief 0] 1/3 ━━ loss: 0.5"]  # live, before its newline
    assert screen(shown[1]) == ["[chief 0] ERROR:tensorflow:Worker failed",
                                "[launcher] worker 1 exited with signal 9 (SIGKILL); restart 1 "
                                "of 3",
                                "[chief 0] 2/3 ━━━ loss: 0.4"]
    assert screen(raw) == ["[chief 0] ERROR:tensorflow:Worker failed",
                           "[launcher] worker 1 exited with signal 9 (SIGKILL); restart 1 of 3",
                           "[worker 0] serving",
                           "[chief 0] 3/3 ━━━━ loss: 0.3"]


def test_without_a_terminal_only_complete_lines_are_written_a_bar_once_as_last_drawn():
    raw, shown = _console_run(live=False)
    assert shown == ["", "[chief 0] ERROR:tensorflow:Worker failed\n[launcher] worker 1 exited "
                         "with signal 9 (SIGKILL); restart 1 of 3\n"]
    assert raw.splitlines() == ["[chief 0] ERROR:tensorflow:Worker failed",
                                "[launcher] worker 1 exited with signal 9 (SIGKILL); restart 1 "
                                "of 3",
                                "[worker 0] serving",
                                "[chief 0] 3/3 ━━━━ loss: 0.3"]


def test_two_unfinished_lines_never_share_the_terminal_line():
    out = io.StringIO()
    console = console_lib.Console(out, live=True)
    chief, evaluator, errors = console_lib.Stream(), console_lib.Stream(), console_lib.Stream()
    console.feed(chief, "chief 0", b"\r1/3")
    console.feed(evaluator, "evaluator 0", b"\r5/10")
    assert screen(out.getvalue()) == ["[evaluator 0] 5/10"]  # the last drawn bar
    console.feed(errors, "chief 0", b"a line written in two parts")
    assert screen(out.getvalue()) == ["[evaluator 0] 5/10"]  # a bar before plain text
    console.feed(chief, "chief 0", b"\r2/3\n")
    console.feed(errors, "chief 0", b"\n")
    assert screen(out.getvalue()) == ["[chief 0] 2/3", "[chief 0] a line written in two parts",
                                      "[evaluator 0] 5/10"]
    console.close(evaluator, "evaluator 0")  # ended without a newline: its line is complete
    assert screen(out.getvalue()) == ["[chief 0] 2/3", "[chief 0] a line written in two parts",
                                      "[evaluator 0] 5/10"]
    assert out.getvalue().endswith("[evaluator 0] 5/10\n")


@pytest.mark.parametrize("live", [True, False])
def test_once_stopped_the_console_writes_the_bar_as_last_drawn_then_its_line_and_no_bar_again(
        live):
    """Ctrl-C: one line says the job is being stopped, below the bar as it was; a redraw
    that was on its way, or the bar left when the chief's output ends, is not shown."""
    out = io.StringIO()
    console = console_lib.Console(out, live=live)
    bar, errors = console_lib.Stream(), console_lib.Stream()
    console.feed(bar, "chief 0", BAR_1)
    console.feed(errors, "chief 0", b"a line in two ")
    console.feed(bar, "chief 0", BAR_2)
    console.stop("launcher", "ending the job: received SIGINT (Ctrl-C)")
    stopped = len(out.getvalue())
    console.feed(bar, "chief 0", b"\x08" * 20 + b"\r3/3 \xe2\x94\x81 loss: 0.3")
    console.feed(errors, "chief 0", b"parts\ninterrupted\n")
    console.close(bar, "chief 0")
    console.close(errors, "chief 0")
    shown = screen(out.getvalue()) if live else out.getvalue().splitlines()
    assert shown == ["[chief 0] a line in two ", "[chief 0] 2/3 ━━━ loss: 0.4",
                     "[launcher] ending the job: received SIGINT (Ctrl-C)",
                     "[chief 0] parts", "[chief 0] interrupted"]
    assert "\r" not in out.getvalue()[stopped:] and "/3 " not in out.getvalue()[stopped:]


def test_a_bar_ended_by_a_carriage_return_and_a_newline_keeps_its_last_state():
    stream = console_lib.Stream()
    assert stream.feed(b"\r1/2\r2/2\r\n") == ["2/2"]
    assert stream.feed(b"plain\n\n") == ["plain", ""]


def test_a_redrawn_lines_erase_padding_is_not_part_of_it():
    """Keras pads a redraw shorter than the one before with spaces, to erase it on a
    terminal; the line a file gets has none (the launched bar tests failed 1 run in 2)."""
    stream = console_lib.Stream()
    assert stream.feed(b"\r1/2 - loss: 0.31234\r2/2 - loss: 0.3   \n") == ["2/2 - loss: 0.3"]
    assert stream.feed(b"\r1/2 - loss: 0.31234\r2/2 - loss: 0.3   \r\n") == ["2/2 - loss: 0.3"]
    assert stream.feed(b"  indented, not redrawn  \n") == ["  indented, not redrawn  "]


# Keras' progress bar as it writes it, on a terminal or not: bold step count, green and grey
# bar, bold time.
COLOURED_BAR = (b"\r\x1b[1m3/3\x1b[0m \x1b[32m\xe2\x94\x81\xe2\x94\x81\x1b[0m \x1b[1m0s\x1b[0m "
                b"12ms/step - loss: 0.3\n")


def test_colours_reach_a_terminal_and_no_escape_sequence_reaches_a_file():
    """Keras colours its bar whatever its output is (a launched chief writes to a pipe);
    the console decides for the launcher's output: a file or a CI log gets plain text, a
    terminal the colours, live or not."""
    import pty

    out = io.StringIO()  # a file, a pipe, a CI log
    console_lib.Console(out).feed(console_lib.Stream(), "chief 0", COLOURED_BAR)
    assert out.getvalue() == "[chief 0] 3/3 ━━ 0s 12ms/step - loss: 0.3\n"
    controller, terminal = pty.openpty()
    try:
        with open(terminal, "w", closefd=True) as tty:
            console_lib.Console(tty, live=False).feed(console_lib.Stream(), "chief 0",
                                                      COLOURED_BAR)
        shown = os.read(controller, 1 << 16).decode()
    finally:
        os.close(controller)
    assert "[chief 0] \x1b[1m3/3\x1b[0m \x1b[32m━━\x1b[0m \x1b[1m0s\x1b[0m" in shown
    out = io.StringIO()  # an explicit choice wins
    console_lib.Console(out, colors=True).feed(console_lib.Stream(), "chief 0", COLOURED_BAR)
    assert "\x1b[32m━━" in out.getvalue()


@pytest.mark.parametrize("line", [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795612757.656668   20893 port.cc:153] oneDNN custom operations are on.",
    "I0000 00:00:1795612757.659892   20893 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1795612763.642368   20897 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
])
def test_tensorflow_start_up_lines_are_dropped_unless_asked_for(line):
    assert console_lib.is_start_up_noise(line)
    for tf_logs, expected in [(False, ""), (True, f"[ps 0] {line}\n")]:
        out = io.StringIO()
        console_lib.Console(out, live=False, tf_logs=tf_logs).feed(
            console_lib.Stream(), "ps 0", line.encode() + b"\n")
        assert out.getvalue() == expected


def test_other_tensorflow_log_lines_are_kept():
    assert not console_lib.is_start_up_noise(
        "E0000 00:00:1795612763.642368   20897 grpc_server_lib.cc:12] worker 1 unreachable")
    assert not console_lib.is_start_up_noise("ERROR:tensorflow:Worker /job:worker/task:1 failed")


# -- launched jobs (real processes) -------------------------------------------------------------
# A chief that draws a Keras progress bar, logs a line to stderr under it, and waits for the
# file `go` before finishing the bar: its line is unfinished while the test reads the console.
BAR_CHIEF = """
    import os, sys, time
    import keras, kerasps

    kerasps.cluster.from_tf_config()  # names the process
    bar = keras.utils.Progbar(3, interval=0)
    bar.update(1, [("loss", 0.5)])
    print("a log line", file=sys.stderr, flush=True)
    bar.update(2, [("loss", 0.4)])
    while not os.path.exists("go"):
        time.sleep(0.05)
    bar.update(3, [("loss", 0.3)])
"""
NOISE = re.compile(r"absl::InitializeLog|Could not find cuda drivers|failed call to cuInit|"
                   r"oneDNN custom operations")
PREFIX = re.compile(r"^\[(launcher|chief 0|worker 0|ps 0)\] ")


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


class PtyJob:
    """`kerasps launch` with a terminal as its stdout and stderr, as a user runs it."""

    def __init__(self, tmp_path, chief_code, *options):
        import fcntl
        import pty
        import struct
        import termios

        (tmp_path / "chief.py").write_text(textwrap.dedent(chief_code))
        controller, terminal = pty.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 100, 0, 0))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kerasps.cli", "launch", *options, "chief.py"],
            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
        os.close(terminal)
        self._controller, self._raw, self._lock = controller, b"", threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while True:
            try:
                data = os.read(self._controller, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                data = b""
            if not data:
                return
            with self._lock:
                self._raw += data

    @property
    def raw(self) -> str:
        """What was written to the terminal, less colours and bold."""
        with self._lock:
            return re.sub(r"\x1b\[[0-9;]*m", "", self._raw.decode(errors="replace"))

    @property
    def raw_with_colours(self) -> str:
        with self._lock:
            return self._raw.decode(errors="replace")

    def wait_for(self, pattern, timeout=60):
        assert wait_until(lambda: re.search(pattern, self.raw), timeout=timeout), (
            f"{pattern!r} never shown:\n" + "\n".join(screen(self.raw)))
        return re.search(pattern, self.raw)

    def finish(self):
        code = self.process.wait(DEADLINE)
        self._reader.join(30)
        os.close(self._controller)
        return code


@pytest.mark.slow
def test_a_launched_jobs_console_on_a_terminal(tmp_path):
    job = PtyJob(tmp_path, BAR_CHIEF, "--workers", "1")
    try:
        # Live: the chief's bar is shown, prefixed, while its line is unfinished.
        job.wait_for(r"\r\[chief 0\] 2/3 \S+ .*loss: 0\.4")
        pids = {task: int(pid) for task, pid in
                re.findall(r"started (\w+ \d) at \S+ \(pid (\d+)\)", job.raw)}
        job.wait_for(r"\[worker 0\] kerasps serve: worker 0 serving")
        job.wait_for(r"\[ps 0\] kerasps serve: ps 0 serving")
        assert _title(pids["worker 0"]) == "kerasps: worker 0"
        assert _title(pids["ps 0"]) == "kerasps: ps 0"
        assert _title(pids["chief 0"]) == "kerasps: chief 0 chief.py"
        (tmp_path / "go").write_text("")
        assert job.finish() == 0
    finally:
        if job.process.poll() is None:
            job.process.kill()
    assert "\x1b[1m3/3\x1b[0m" in job.raw_with_colours  # Keras' bold step count, kept
    lines = screen(job.raw)
    assert all(PREFIX.match(line) for line in lines), lines  # nothing glued, nothing unprefixed
    assert "[chief 0] a log line" in lines
    bars = [line for line in lines if re.match(r"\[chief 0\] \d/3 ", line)]
    assert len(bars) == 1 and re.match(r"\[chief 0\] 3/3 \S+ .*loss: 0\.\d+$", bars[0]), lines
    assert not [line for line in lines if NOISE.search(line)], lines


@pytest.mark.slow
def test_a_launched_jobs_output_in_a_file_has_complete_lines_only(tmp_path):
    job = launch_job(tmp_path, BAR_CHIEF, "--workers", "1")
    try:
        job.wait_for(r"^\[chief 0\] a log line$")
        (tmp_path / "go").write_text("")
        assert job.finish() == 0
    finally:
        job.close()
    assert all(PREFIX.match(line) for line in job.lines), job.output()
    # Plain text: Keras' colours and bold (`\x1b[1m3/3\x1b[0m \x1b[32m━━...`) are a terminal's.
    assert not [line for line in job.lines if "\x1b" in line], job.output()
    bars = [line for line in job.lines if "/3 " in line]
    assert len(bars) == 1 and re.match(r"\[chief 0\] 3/3 \S+ .*loss: 0\.\d+$", bars[0]), (
        job.output())
    assert not [line for line in job.lines if NOISE.search(line) or "\r" in line], job.output()


# A module chief that says how Python ran it, failing its first run: the restart runs it in
# the warm standby.
MODULE_CHIEF = """
    import json, os, sys
    import setproctitle
    import kerasps

    kerasps.cluster.from_tf_config()  # names the process
    first = not os.path.exists("started")
    open("started", "w").close()
    print("ran", json.dumps({"name": __name__, "argv": sys.argv, "path": sys.path[0],
                             "title": setproctitle.getproctitle()}), flush=True)
    raise SystemExit(3 if first else 0)
"""


@pytest.mark.slow
def test_a_module_chief_runs_as_python_m_runs_it_cold_and_in_the_warm_standby(tmp_path):
    package = tmp_path / "kps_job"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "chief.py").write_text(textwrap.dedent(MODULE_CHIEF))
    job = RunningJob([sys.executable, "-m", "kerasps.cli", "launch", "--workers", "1",
                      "--max-restarts", "1", "-m", "kps_job.chief", "--lr", "0.1"], cwd=tmp_path)
    try:
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    runs = [json.loads(line.split(" ran ", 1)[1]) for line in job.lines
            if line.startswith("[chief 0] ran ")]
    here = os.path.realpath(tmp_path)
    expected = {"name": "__main__", "argv": [os.path.join(here, "kps_job", "chief.py"), "--lr",
                                             "0.1"],
                "path": here, "title": "kerasps: chief 0 -m kps_job.chief --lr 0.1"}
    assert runs == [expected, expected], job.output()
    started = [line for line in job.lines if line.startswith("[launcher] started chief 0")]
    assert started[1].endswith(" in the warm standby"), job.output()


# A chief's model and repeated input, for a `fit` that runs until it is stopped.
FIT_SETUP = """
    import keras, tensorflow as tf, kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")

    def dataset_fn(context):
        x = tf.random.uniform((64, 4))
        return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(8)
"""

# A chief in `fit` that says when it was interrupted.
FIT_CHIEF = FIT_SETUP + """

    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: print("train batch", batch, flush=True))
    try:
        model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1000, steps_per_epoch=50,
                  verbose=0, callbacks=[progress])
    except KeyboardInterrupt:
        print("interrupted in fit", flush=True)
        raise
"""


@pytest.mark.slow
def test_ctrl_c_stops_the_chief_first_and_everything_within_seconds(tmp_path):
    job = launch_job(tmp_path, FIT_CHIEF, "--workers", "2")
    try:
        job.wait_for(r"\[chief 0\] train batch 20$")
        pids = [pid for task_pids in job.pids.values() for pid in task_pids]
        interrupted = time.monotonic()
        job.process.send_signal(signal.SIGINT)
        assert wait_until(lambda: job.process.poll() is not None, timeout=DEADLINE)
        took = time.monotonic() - interrupted
        assert job.finish() == 130
        assert wait_until(lambda: all(process_gone(pid) for pid in pids), timeout=10)
    finally:
        job.close()
    job.wait_for(r"^\[chief 0\] interrupted in fit$")  # while the servers still ran
    assert not [line for line in job.lines if "UnavailableError" in line or " left: " in line
                or "SIGTERM" in line], job.output()
    # The chief's KeyboardInterrupt, re-raised out of the program, ends it without a traceback.
    assert not [line for line in job.lines if "Traceback" in line or "KeyboardInterrupt" in line
                or "kerasps/" in line], job.output()
    # launch.INTERRUPT_GRACE + launch.STOP_GRACE at most (2 s), and the launcher's own exit
    assert took < 6, f"{took:.1f} s:\n{job.output()}"


# A chief in a long `fit` that draws Keras' live progress bar.
BAR_FIT_CHIEF = FIT_SETUP + """

    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1000, steps_per_epoch=10000)
"""
BAR = r"\[chief 0\] +\d+/10000 "  # Keras' bar, its step count right-aligned


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_says_one_line_and_shows_no_traceback_and_no_bar_after_it(tmp_path):
    """Ctrl-C printed the chief's 20-line KeyboardInterrupt traceback through kerasps'
    trainer, and the live bar was drawn again inside and after it (issue 31)."""
    job = PtyJob(tmp_path, BAR_FIT_CHIEF, "--workers", "1")
    try:
        job.wait_for(BAR, timeout=DEADLINE)
        job.process.send_signal(signal.SIGINT)
        assert job.finish() == 130
    finally:
        if job.process.poll() is None:
            job.process.kill()
    raw, lines = job.raw, screen(job.raw)
    stopping = [line for line in lines if line.startswith("[launcher] ending the job")]
    assert stopping == ["[launcher] ending the job: received SIGINT (Ctrl-C); press Ctrl-C "
                        "again to kill every task"], lines
    assert "Traceback" not in raw and "KeyboardInterrupt" not in raw, lines
    after = raw.split(stopping[0], 1)[1]
    assert not re.search(BAR, after), lines  # neither redrawn live nor written as a line
    bars = [line for line in lines if re.match(BAR, line)]
    assert len(bars) == 1 and lines.index(bars[0]) < lines.index(stopping[0]), lines


IGNORING_CHIEF = """
    import signal, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring signals", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_second_ctrl_c_kills_every_task_at_once(tmp_path):
    job = launch_job(tmp_path, IGNORING_CHIEF, "--workers", "1")
    try:
        job.wait_for(r"^\[chief 0\] ignoring signals$")
        job.process.send_signal(signal.SIGINT)
        job.wait_for(r"^\[launcher\] ending the job: received SIGINT")
        job.process.send_signal(signal.SIGINT)
        job.wait_for(r"^\[launcher\] received SIGINT again: killing every task$")
        assert job.finish() == 130
        pids = [pid for task_pids in job.pids.values() for pid in task_pids]
        assert len(pids) == 3 and wait_until(lambda: all(process_gone(p) for p in pids), 10)
    finally:
        job.close()


def test_a_live_line_is_cut_to_the_terminals_width_escape_sequences_taking_no_room(tmp_path):
    import pty

    controller, terminal = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 30, 0, 0))
    with open(terminal, "w", closefd=True) as out:
        assert console_lib.Console(out)._fit("[chief 0] \x1b[1m1/3\x1b[0m " + "━" * 40) == (
            "[chief 0] \x1b[1m1/3\x1b[0m " + "━" * 15 + "\x1b[0m")
        assert console_lib.Console(out)._fit("short") == "short"
    os.close(controller)


# A chief that keeps the README's in-process cluster, then asks for the cluster it runs in.
IN_PROCESS_CHIEF = """
    import json
    import kerasps

    try:
        kerasps.cluster.in_process(num_workers=1, num_ps=1)  # the README's line, as it is
    except RuntimeError as error:
        print("refused", str(error), flush=True)
    resolver = kerasps.cluster.resolve(num_workers=1, num_ps=1)
    print("resolved", json.dumps(resolver.cluster_spec().as_dict()), flush=True)
"""


@pytest.mark.slow
def test_a_launched_chief_that_starts_an_in_process_cluster_is_stopped_and_resolve_finds_the_job(
        tmp_path):
    """`kerasps.cluster.in_process()` in a launched chief trained on a cluster of its own
    while the launched servers sat idle, with no word: it raises, naming
    `from_tf_config()` and `resolve()`, before starting any server; `resolve()` gives the
    launched cluster."""
    job = launch_job(tmp_path, IN_PROCESS_CHIEF, "--workers", "1")
    try:
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    refused = job.wait_for(r"^\[chief 0\] refused (.*)$").group(1)
    assert ("kerasps.cluster.in_process() was called in chief 0 of a `kerasps launch` job"
            in refused), refused
    assert "started no cluster" in refused, refused
    assert "kerasps.cluster.from_tf_config()" in refused, refused
    assert "kerasps.cluster.resolve(" in refused, refused
    assert "under_launch='allow'" in refused, refused
    assert not [line for line in job.lines if "UserWarning" in line], job.output()
    launched = {task: address for task, address in
                (re.search(r"started (\w+ \d) at (\S+) ", line).groups() for line in job.lines
                 if re.search(r"^\[launcher\] started \w+ \d at ", line))}
    resolved = json.loads(job.wait_for(r"^\[chief 0\] resolved (.*)$").group(1))
    assert resolved == {"chief": [launched["chief 0"]], "worker": [launched["worker 0"]],
                        "ps": [launched["ps 0"]]}, job.output()
