"""How long a test may run, and what a hung or crashed test leaves behind (pytest hooks).

A test that runs past its limit (`TIMEOUT_S`, by its kind) has every thread's stack
printed and its process ended by pytest-timeout (`timeout_method = "thread"`: a call
blocked in TensorFlow's C++ cannot be interrupted). Under pytest-xdist (every run, as
pyproject's `addopts` asks) four things would go wrong without these hooks:

- pytest-timeout prints to the worker's terminal writer, which xdist throws away: CI
  would show "node down: Not properly terminated" and no stack. Here the stacks go to the
  worker's standard error, which reaches the run's output.
- A worker that crashes (TensorFlow aborts, a segfault) would die silently: its standard
  error is pytest's capture file while a test runs. Here `faulthandler` prints every
  thread's stack to the worker's own standard error.
- A test that hangs in TensorFlow's C++ while holding Python's GIL stops pytest-timeout's
  thread too, and so the whole run. Here `faulthandler`'s watchdog (C, no GIL) prints the
  stacks and ends the worker `WATCHDOG_GRACE_S` after the limit (at most the limit again).
- xdist's `--dist loadfile` puts the rest of a crashed worker's file back in its queue,
  the test that hung included, so a hung test ran again on each replacement worker (8 by
  default): 8 more limits, which is how a hang held CI past its 90 minutes. Here a test
  that ended its worker is reported failed once, and skipped when it comes round again.

The controller and its workers share a directory (`STATE_DIR_ENV`, made by the
controller): each worker writes there the test it runs; the controller, told a worker
died, adds that worker's test to the file of tests not to run again.

`tests/conftest.py` imports the hooks (`__all__`), so they hold for every item of a run
that loads it (`docs/` and README.md included: these hooks are not scoped to a directory).
"""

import faulthandler
import os
import shutil
import sys
import tempfile
import threading

import pytest

__all__ = [  # pytest's hooks, found by name in the conftest that imports them
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_runtest_protocol",
    "pytest_testnodedown",
    "pytest_timeout_set_timer",
    "pytest_unconfigure",
]

# Seconds a test may run before its stacks are printed and its process ended. Tests take
# under 30 s in the default run, a few minutes when `slow` and up to 15 when `stress`.
TIMEOUT_S = {"stress": 2400, "slow": 1200, None: 300}
# Seconds after the limit (at most the limit again) that the watchdog ends a worker whose
# hung test holds the GIL.
WATCHDOG_GRACE_S = 30
STATE_DIR_ENV = "KERASPS_PYTEST_STATE_DIR"
_CRASHED = "crashed"


def pytest_collection_modifyitems(items):
    """A tutorial takes minutes: every `notebook` test is also `slow`. Every test gets
    the time limit of its kind (`TIMEOUT_S`) unless it sets its own."""
    for item in items:
        if item.get_closest_marker("notebook") is not None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("timeout") is None:
            kind = next((k for k in ("stress", "slow") if item.get_closest_marker(k)), None)
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[kind]))


_stderr = None  # in a worker: its standard error as it was before pytest captured it


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin
def pytest_configure(config):
    """The controller (or a run without workers) makes the shared directory (its own,
    also in a pytest that a test starts: its workers are named gw0, gw1 too). A worker
    keeps its standard error for the watchdog and for a crash's stacks (pytest redirects
    file descriptor 2 while a test runs)."""
    global _stderr
    if hasattr(config, "workerinput"):
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None and _stderr is None:
            capture.suspend_global_capture()
            _stderr = os.fdopen(os.dup(2), "w")
            capture.resume_global_capture()
            faulthandler.enable(file=_stderr, all_threads=True)
        return
    config._kerasps_outer_state_dir = os.environ.get(STATE_DIR_ENV)
    os.environ[STATE_DIR_ENV] = config._kerasps_state_dir = tempfile.mkdtemp(
        prefix="kerasps-pytest-"
    )


def pytest_unconfigure(config):
    state_dir = getattr(config, "_kerasps_state_dir", None)
    if state_dir is None:
        return
    shutil.rmtree(state_dir, ignore_errors=True)
    outer = config._kerasps_outer_state_dir
    if outer is None:
        os.environ.pop(STATE_DIR_ENV, None)
    else:
        os.environ[STATE_DIR_ENV] = outer


def _files(state_dir, worker):
    """(`worker`'s file of the test it runs, the file of tests not to run again)."""
    return os.path.join(state_dir, worker), os.path.join(state_dir, _CRASHED)


def _worker_state(config):
    """`_files` of this worker, or None outside an xdist worker."""
    state_dir = os.environ.get(STATE_DIR_ENV)
    if not hasattr(config, "workerinput") or state_dir is None:
        return None
    return _files(state_dir, config.workerinput["workerid"])


def _read_lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    state = _worker_state(item.config)
    if state is None:
        return (yield)
    running, crashed = state
    if item.nodeid in _read_lines(crashed):
        item.add_marker(
            pytest.mark.skip(reason="ended a worker process when it ran (reported failed)")
        )
    with open(running, "w") as f:
        f.write(item.nodeid)
    try:
        return (yield)
    finally:
        os.remove(running)


def pytest_testnodedown(node, error):
    """In the controller, before xdist hands the dead worker's tests to another."""
    state_dir = os.environ.get(STATE_DIR_ENV)
    if error is None or state_dir is None:
        return
    running, crashed = _files(state_dir, node.gateway.id)
    test = _read_lines(running)
    if test:
        with open(crashed, "a") as f:
            f.write(test[0] + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """In an xdist worker, a hung test's stacks go to standard error (which reaches the
    run's output), then the worker ends as pytest-timeout would end it."""
    if _worker_state(item.config) is None or settings.method != "thread":
        return None
    timer = threading.Timer(settings.timeout, _print_stacks_and_exit, (item, settings))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel():
        timer.cancel()
        timer.join()
        if _stderr is not None:
            faulthandler.cancel_dump_traceback_later()

    item.cancel_timeout = cancel  # pytest-timeout's own cancel hook calls it
    timer.start()
    if _stderr is not None:
        faulthandler.dump_traceback_later(
            settings.timeout + min(WATCHDOG_GRACE_S, settings.timeout), exit=True, file=_stderr
        )
    return True


def _print_stacks_and_exit(item, settings):
    try:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        out = err = ""
        if capture is not None:
            capture.suspend_global_capture(item)
            out, err = capture.read_global_capture()
        bar = "+" * 30
        sys.stderr.write(
            f"\n{bar} Timeout: {item.nodeid} ran over {settings.timeout:g} s "
            f"(worker {item.config.workerinput['workerid']}) {bar}\n"
        )
        for name, text in (("stdout", out), ("stderr", err)):
            if text:
                sys.stderr.write(f"--- its captured {name} (last 4000 characters):\n")
                sys.stderr.write(text[-4000:] + "\n")
        sys.stderr.write("--- every thread's stack:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.write(f"{bar} end of timeout {bar}\n")
    finally:
        sys.stderr.flush()
        os._exit(1)
