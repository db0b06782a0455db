"""A hung or crashed test under pytest-xdist: its stacks are shown, and it fails once
(tests/timeouts.py)."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

HUNG = """
import re
import time

import pytest


def test_before():
    pass


@pytest.mark.timeout(3)
def test_hangs():
    print("the hung test's own output")
    time.sleep(300)  # the hang: pytest-timeout ends the worker after 3 s


def test_after():
    pass


def test_crashes():
    import ctypes

    ctypes.string_at(0)  # a segfault, as when TensorFlow's C++ crashes


@pytest.mark.timeout(3)
def test_hangs_holding_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # hours in C, without releasing the GIL
"""


def _run_hung_file(tmp_path):
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG))
    (tmp_path / "conftest.py").write_text("from tests.timeouts import *  # noqa: F403\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout_method = thread\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = "-m pytest -p no:cacheprovider -n 2 --dist loadfile -rs test_hung.py".split()
    return subprocess.run(
        [sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )


def test_a_hung_or_crashed_test_fails_once_with_its_stacks_and_the_rest_of_its_file_runs(tmp_path):
    run = _run_hung_file(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    # Its stacks and output reach the run's output (xdist drops the worker's terminal).
    assert "Timeout: test_hung.py::test_hangs ran over 3 s" in out, out
    assert "the hung test's own output" in out, out
    assert re.search(r'test_hung\.py", line \d+ in test_hangs', out), out
    # Reported failed once, not run again on each replacement worker (8 by default).
    assert out.count("crashed while running 'test_hung.py::test_hangs'") == 1, out
    # One holding the GIL (pytest-timeout's thread cannot run): faulthandler's watchdog.
    assert re.search(r'test_hung\.py", line \d+ in test_hangs_holding_the_gil', out), out
    assert out.count("crashed while running 'test_hung.py::test_hangs_holding_the_gil'") == 1
    # One that crashes its worker: the stacks too, and failed once.
    assert "Fatal Python error: Segmentation fault" in out, out
    assert re.search(r'test_hung\.py", line \d+ in test_crashes', out), out
    assert out.count("crashed while running 'test_hung.py::test_crashes'") == 1, out
    assert "3 failed, 2 passed, 3 skipped" in out, out
