"""The `kerasps` command line: the demo (the main job) and its bad inputs."""

import os
import subprocess
import sys

import pytest


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


def test_serve_without_tf_config_exits_2_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "serve"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "Received: TF_CONFIG=None" in result.stderr
