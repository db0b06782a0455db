"""The `kerasps` command line: the demo (the main job) and its bad inputs."""

import os
import signal
import subprocess
import sys

import pytest

from tests.launched import RunningJob


def kerasps_cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "kerasps.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_demo_trains_and_prints_placement_progress_and_metrics():
    result = kerasps_cli("demo", "--epochs", "2", "--steps-per-epoch", "6", "--workers", "2",
                         "--ps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "name" in out and "ps_task" in out  # the placement table
    assert "user_embedding/embeddings/part_1" in out  # the big table is sharded
    assert "bytes per ps task: ps0=" in out
    assert "Epoch 2/2" in out and "6/6" in out  # progress
    assert "Final metrics (model.evaluate on 10 new batches of synthetic clicks): " in out
    assert "auc=" in out


def test_demo_prints_none_of_tensorflows_lines():
    """The main job printed TensorFlow's start-up lines twice (absl's "All log messages
    before absl::InitializeLog()", oneDNN, "Could not find cuda drivers") and then
    `E0000 ... failed call to cuInit: ... UNKNOWN ERROR (303)`: none by default, every one
    with `KERASPS_TF_LOGS=1`. Run in a user's environment: no TF_CPP_MIN_LOG_LEVEL."""
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "demo", "--epochs", "1",
                             "--steps-per-epoch", "2", "--workers", "1", "--ps", "1",
                             "--verbose", "0"],
                            capture_output=True, text=True, timeout=300, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Final metrics" in result.stdout
    assert result.stderr == ""


def test_demo_to_a_file_writes_plain_lines(tmp_path):
    """Issue 38: `kerasps demo > file` wrote Keras' progress bar as a terminal draws it,
    ANSI colour codes, carriage returns and runs of backspaces; now, as `kerasps launch`
    writes to a file, each bar once as last drawn, in plain text."""
    out = tmp_path / "demo.txt"
    with open(out, "wb") as f:
        result = subprocess.run([sys.executable, "-m", "kerasps.cli", "demo", "--epochs", "2",
                                 "--steps-per-epoch", "3", "--workers", "1", "--ps", "1"],
                                stdout=f, stderr=subprocess.PIPE, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = out.read_bytes()
    assert [c for c in (b"\x1b", b"\r", b"\b") if c in written] == [], written[-2000:]
    lines = written.decode().splitlines()
    assert [line for line in lines if line.startswith("3/3 ")] == [
        line for line in lines if "/step" in line]  # each bar once, complete
    assert len([line for line in lines if line.startswith("3/3 ")]) == 2, lines
    assert lines[-1].startswith("Per-epoch loss: ")


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_with_one_line_and_status_130():
    """Ctrl-C printed a KeyboardInterrupt traceback through kerasps' trainer (issue 31)."""
    demo = RunningJob([sys.executable, "-m", "kerasps.cli", "demo", "--workers", "1", "--ps",
                       "1", "--epochs", "1000", "--steps-per-epoch", "2", "--verbose", "2"])
    try:
        demo.wait_for(r"^Epoch 3/1000$")  # inside `fit`
        demo.process.send_signal(signal.SIGINT)
        assert demo.finish() == 130, demo.output()
    finally:
        demo.close()
    assert [line for line in demo.lines if "Ctrl-C" in line] == [
        "kerasps demo: stopped (Ctrl-C)"], demo.output()
    assert not [line for line in demo.lines if "Traceback" in line
                or "KeyboardInterrupt" in line], demo.output()


def test_demo_with_greedy_placement_and_three_workers():
    result = kerasps_cli("demo", "--epochs", "1", "--steps-per-epoch", "3", "--workers", "3",
                         "--ps", "1", "--placement", "greedy", "--verbose", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 workers, 1 ps tasks" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["demo", "--workers", "0"],
     "Invalid value for argument `--workers`: it must be a positive integer. "
     "Received: --workers='0'"),
    (["demo", "--epochs", "two"],
     "Invalid value for argument `--epochs`: it must be a positive integer. "
     "Received: --epochs='two'"),
    (["demo", "--placement", "random"], "argument --placement: invalid choice: 'random'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_exit_2_naming_the_option(args, message):
    result = kerasps_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--engine", "spark"], "Invalid value for argument `--engine`: expected one of local, ray. "
                            "Received: --engine='spark'"),
    (["--address", "auto"], "Invalid value for argument `--address`: a Ray cluster's address, "
                            "given with --engine ray only. Received: --address='auto' with "
                            "--engine='local'"),
    (["--engine", "ray", "--evaluator"], "Received: --evaluator=True with --engine='ray'"),
    (["--engine", "ray", "--workers", "1:3"], "Received: --workers='1:3' with --engine='ray'"),
])
def test_launch_engine_errors_name_the_option(tmp_path, args, message):
    (tmp_path / "train.py").write_text("")
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "launch", *args, "train.py"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stderr.count("argument") == 1


def test_launch_engine_ray_without_ray_names_the_extra(tmp_path, monkeypatch, capsys):
    from kerasps.ops import cli

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` would raise
    assert cli.main(["launch", "--engine", "ray", "train.py"]) == 2
    assert ('kerasps launch --engine ray needs Ray, which is not installed. Install it with '
            'kerasps\' `ray` extra: pip install "kerasps[ray]"') in capsys.readouterr().err


def test_serve_without_tf_config_exits_2_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "serve"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "Received: TF_CONFIG=None" in result.stderr
