"""TensorFlow's log lines: none reach a user of kerasps by default; `KERASPS_TF_LOGS=1`
shows them all.

TensorFlow prints, in every process that uses it, lines meant for its own developers:
at import, absl's "All log messages before absl::InitializeLog() is called are written
to STDERR", the oneDNN notice, "Could not find cuda drivers" (twice: two of its
libraries print them), the CPU-instruction notice; then `failed call to cuInit: ...
UNKNOWN ERROR (303)` on a machine without a GPU, a line per server started, a
`ConfigProto` dump per task each time a process connects to a cluster, and "Failed to
remove function remotely due to Tried to remove non-existent function" when the
functions of an earlier connection are freed. `import kerasps` calls `quiet()`, which,
unless `KERASPS_TF_LOGS=1`:

* sets `TF_CPP_MIN_LOG_LEVEL=3` (TensorFlow's C++ lines: FATAL only) unless the
  environment sets it: a value the user set wins. TensorFlow reads it when its C++
  library loads, so it applies when `tensorflow` is imported after kerasps, and to the
  processes started from this one;
* drops the start-up lines TensorFlow prints while `tensorflow` is imported, which it
  prints whatever `TF_CPP_MIN_LOG_LEVEL` says (they are logged before the library has
  read it): file descriptor 2 goes to a file while `import tensorflow` runs, and every
  other line is written back after it (not with `TF_CPP_MIN_LOG_LEVEL=0`);
* when `tensorflow` was imported before kerasps (`import keras` does so): its start-up
  lines were printed then and cannot be taken back, but every later C++ line follows
  the level, set in the loaded library (absl's minimum log level, what
  `TF_CPP_MIN_LOG_LEVEL` sets);
* drops the `default session config: ...` record that TensorFlow logs at INFO through
  absl's Python logger (a `ConfigProto` dump) each time a process connects to a cluster,
  for programs that log at INFO.
* sets TensorFlow's Python logger (`tf.get_logger()`, the `tensorflow` logger) to
  WARNING, here and again when a strategy is made, unless its level was set (INFO in an
  interactive session counts as TensorFlow's own: it sets it there): its strategy's INFO
  lines ("ParameterServerStrategy is now connecting to cluster ...", "Waiting for all
  global closures to be finished") reached programs that log at INFO and every notebook.

A program that made a strategy also keeps from its console the messages TensorFlow prints
about a failure kerasps handles (`keep_fault_detail()`): its coordinator's `ERROR:tensorflow:
Remote function on worker ... failed with UnavailableError()` blocks (gRPC messages nested
in each other, `Detected at node` stacks) and the tracebacks of its executors freed after a
task was lost (`Exception ignored in: <function Executor.__del__ ...>`, `AbortedError: Unable
to find a context_id`). They go to a file, `detail_file()`, which kerasps' own lines about
the failure name (`detail_note()`); kerasps says in a few lines what was lost, what it does
and how long it took.

With `KERASPS_TF_LOGS=1`, kerasps changes none of this (`kerasps launch` also keeps the
start-up lines in its tasks' output, as with `--tf-logs`).

Pure Python until TensorFlow is loaded: importing this module does not import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import mmap
import os
import re
import struct
import sys
import tempfile
import threading

from kerasps.backend import imports

__all__ = ["ENV", "LEVEL_ENV", "QUIET_LEVEL", "FILE_ENV", "wanted", "quiet", "is_start_up_noise",
           "set_min_log_level", "launched_environment", "detail_file", "detail_note",
           "write_detail", "keep_fault_detail"]

ENV = "KERASPS_TF_LOGS"  # "1": TensorFlow's lines as TensorFlow prints them
LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
QUIET_LEVEL = "3"  # FATAL only: the cuInit and "Failed to remove function" lines are ERRORs
FILE_ENV = "KERASPS_TF_LOG_FILE"  # where TensorFlow's messages about failures go

# An absl/glog line (`I0000 00:00:1795612757.656668   20893 port.cc:153] ...`) from one of
# the sources TensorFlow prints from at start-up.
_START_UP_SOURCES = (
    "port.cc", "cudart_stub.cc", "cuda_platform.cc", "cuda_executor.cc", "cuda_diagnostics.cc",
    "cuda_dnn.cc", "cuda_fft.cc", "cuda_blas.cc", "computation_placer.cc",
    "cpu_feature_guard.cc", "cpu_utils.cc", "gpu_device.cc", "dso_loader.cc")
_START_UP_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR"
    r"|[IWE]\d{4} [\d:.]+\s+\d+ (" + "|".join(map(re.escape, _START_UP_SOURCES)) + r"):\d+\]"
    r"|To enable the following instructions: .* in other operations, rebuild TensorFlow"
    r"|.*TF-TRT Warning: Could not find TensorRT)")

_LOCK = threading.Lock()
_SET_HERE = False  # whether `quiet()` set TF_CPP_MIN_LOG_LEVEL in this process


def is_start_up_noise(line: str) -> bool:
    """Whether `line` is one of the start-up lines TensorFlow prints in every process."""
    return _START_UP_NOISE.match(line) is not None


def wanted(environ=None) -> bool:
    """Whether `KERASPS_TF_LOGS=1` asks for TensorFlow's lines."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV, "").strip() == "1"


def _level(environ) -> int:
    try:
        return int(environ.get(LEVEL_ENV, "0"))
    except ValueError:  # TensorFlow reads what it cannot parse as 0
        return 0


def quiet(environ=None):
    """Keeps TensorFlow's lines from the user, as the module docstring says (a no-op with
    `KERASPS_TF_LOGS=1`). `import kerasps` calls it; calling it again changes nothing."""
    global _SET_HERE
    environ = os.environ if environ is None else environ
    if wanted(environ):
        return
    with _LOCK:
        user_level = environ.get(LEVEL_ENV)
        if user_level is None:
            environ[LEVEL_ENV] = QUIET_LEVEL
            _SET_HERE = environ is os.environ
        _drop_session_config_dumps()
        quiet_tensorflow_logger(environ)
        if "tensorflow" in sys.modules:  # loaded before kerasps: its start-up lines are out
            if user_level is None:
                set_min_log_level(int(QUIET_LEVEL))
        elif _level(environ) > 0:
            imports.around_first_import("tensorflow", _start_up_lines_dropped)


def launched_environment(env: dict, tf_logs: bool) -> dict:
    """The environment `kerasps launch` gives its tasks, from `env` (a copy of this
    process's, changed by `quiet()`): with `tf_logs`, TensorFlow's lines as TensorFlow
    prints them (`KERASPS_TF_LOGS=1`, and no `TF_CPP_MIN_LOG_LEVEL` that kerasps set);
    else `TF_CPP_MIN_LOG_LEVEL` is `QUIET_LEVEL` unless `env` sets it."""
    env = dict(env)
    if tf_logs:
        env[ENV] = "1"
        if _SET_HERE and env.get(LEVEL_ENV) == QUIET_LEVEL:
            del env[LEVEL_ENV]
    else:
        env.setdefault(LEVEL_ENV, QUIET_LEVEL)
    return env


# -- absl's Python logger ----------------------------------------------------------------------
class _NoSessionConfig(logging.Filter):
    """Drops `tensorflow/python/eager/remote.py`'s `default session config: %s` record."""

    def filter(self, record):
        return not (isinstance(record.msg, str)
                    and record.msg.startswith("default session config:"))


def quiet_tensorflow_logger(environ=None):
    """Sets TensorFlow's Python logger to WARNING, unless `KERASPS_TF_LOGS=1` or the user
    set its level. `quiet()` calls it when TensorFlow is loaded, and a strategy when it is
    made (TensorFlow sets INFO when it makes the logger in an interactive session)."""
    environ = os.environ if environ is None else environ
    tensorflow = sys.modules.get("tensorflow")
    if wanted(environ) or tensorflow is None:
        return
    logger = tensorflow.get_logger()  # made as TensorFlow makes it
    tensorflows_own = logger.level == logging.INFO and (
        hasattr(sys, "ps1") or sys.flags.interactive)
    if logger.level == logging.NOTSET or tensorflows_own:  # a level the user set wins
        logger.setLevel(logging.WARNING)


def _drop_session_config_dumps():
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _NoSessionConfig) for f in logger.filters):
        logger.addFilter(_NoSessionConfig())


# -- TensorFlow's messages about a failure kerasps handles -------------------------------------
# The modules of TensorFlow's coordinator, whose records are about failures it handles (a
# function run again, a worker found failed, closures cancelled) or say why a call failed,
# which the call's own error says too.
_FAULT_SOURCES = re.compile(r"[/\\]distribute[/\\](coordinator|failure_handling)[/\\]")
_DETAIL_LOCK = threading.Lock()
_detail = None  # the open detail file


def detail_file(environ=None) -> str:
    """The file TensorFlow's messages about failures go to: `KERASPS_TF_LOG_FILE`, else
    `kerasps-<task>-<pid>.tf.log` in the temporary directory (`<task>` under `kerasps
    launch`: `chief-0`)."""
    environ = os.environ if environ is None else environ
    if environ.get(FILE_ENV):
        return environ[FILE_ENV]
    task = environ.get("KERASPS_TASK", "").replace(" ", "-")
    name = f"kerasps-{task + '-' if task else ''}{os.getpid()}.tf.log"
    return os.path.join(tempfile.gettempdir(), name)


def write_detail(text: str) -> bool:
    """Appends `text` (one message, a line or more) to `detail_file()`; returns whether it
    could."""
    global _detail
    with _DETAIL_LOCK:
        try:
            path = detail_file()
            if _detail is None or _detail.name != path:
                if _detail is not None:
                    _detail.close()
                _detail = open(path, "a", encoding="utf-8", errors="replace")
            _detail.write(text.rstrip("\n") + "\n")
            _detail.flush()
            return True
        except (OSError, ValueError):
            return False


def detail_note() -> str:
    """What kerasps' line about a failure adds: where TensorFlow's messages are ("" with
    `KERASPS_TF_LOGS=1`: they are printed)."""
    if wanted():
        return ""
    return f" TensorFlow's messages: {detail_file()}."


class _FaultDetail(logging.Filter):
    """On the `tensorflow` logger: a record of TensorFlow's coordinator goes to
    `detail_file()`, not to the console."""

    _format = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def filter(self, record):
        if not _FAULT_SOURCES.search(record.pathname or ""):
            return True
        return not write_detail(self._format.format(record))


def keep_fault_detail(environ=None):
    """Sends TensorFlow's messages about the failures kerasps handles to `detail_file()`
    instead of the console (see the module docstring), unless `KERASPS_TF_LOGS=1`
    (idempotent). A strategy calls it when it is made."""
    if wanted(environ):
        return
    logger = logging.getLogger("tensorflow")
    if not any(isinstance(f, _FaultDetail) for f in logger.filters):
        logger.addFilter(_FaultDetail())


# -- the start-up lines, while `tensorflow` is imported ----------------------------------------
@contextlib.contextmanager
def _start_up_lines_dropped():
    """File descriptor 2 to a file while the block runs; then every line of it but
    TensorFlow's start-up lines to the real one (the lines of a process that dies in the
    block are lost: `KERASPS_TF_LOGS=1` shows them)."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no file descriptor 2
        yield
        return
    try:
        capture = tempfile.TemporaryFile()
    except OSError:
        os.close(saved)
        yield
        return
    os.dup2(capture.fileno(), 2)
    try:
        yield
    finally:
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        capture.seek(0)
        lines = capture.read().splitlines(keepends=True)
        capture.close()
        kept = b"".join(line for line in lines
                        if not is_start_up_noise(line.decode("utf-8", "replace").rstrip("\r\n")))
        while kept:
            try:
                kept = kept[os.write(2, kept):]
            except OSError:
                break


# -- the loaded library's level ----------------------------------------------------------------
def set_min_log_level(level: int) -> bool:
    """Sets the minimum level of the C++ lines of a TensorFlow already loaded (what
    `TF_CPP_MIN_LOG_LEVEL` sets when it loads: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL), through
    absl's `SetMinLogLevel` in `libtensorflow_framework`. Returns whether it could: False
    without TensorFlow, or where that library or function is not found (an ELF library is
    read for the function's name: it carries absl's version)."""
    tensorflow = sys.modules.get("tensorflow")
    directory = os.path.dirname(getattr(tensorflow, "__file__", None) or "")
    if not directory:
        return False
    for path in sorted(glob.glob(os.path.join(directory, "libtensorflow_framework.so*"))):
        try:
            name = _exported_name(path, b"14SetMinLogLevelE")
            if name is None:
                continue
            function = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError, ValueError, struct.error):
            continue
        function.restype = None
        function(ctypes.c_int(level))
        return True
    return False


def _exported_name(path: str, part: bytes) -> str | None:
    """The first name among the dynamic symbols of the ELF (64-bit, little-endian) library
    at `path` that holds `part`, or `None`."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
            return None
        section_headers, = struct.unpack_from("<Q", image, 0x28)
        entry_size, count = struct.unpack_from("<HH", image, 0x3A)
        for index in range(count):
            header = section_headers + index * entry_size
            kind, = struct.unpack_from("<I", image, header + 4)
            if kind != 11:  # SHT_DYNSYM; its sh_link is the section of its names
                continue
            link, = struct.unpack_from("<I", image, header + 0x28)
            names = section_headers + link * entry_size
            start, size = struct.unpack_from("<QQ", image, names + 0x18)
            at = image.find(part, start, start + size)
            if at < 0:
                return None
            first = image.rfind(b"\0", start, at) + 1
            last = image.find(b"\0", at, start + size)
            return image[first:last].decode("ascii")
    return None
