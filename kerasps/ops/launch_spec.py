"""What `kerasps launch` runs: the launch spec, its tasks, their addresses, commands
and environments. Pure Python, no processes (those are `kerasps.ops.launch`'s).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import json
import os
import sys

from kerasps.policy import restarts as restarts_lib
from kerasps.policy._validation import positive_int
from kerasps.runtime.launch_env import (
    CONNECTED_ENV,
    MIN_WORKERS_ENV,
    RAY_JOB_ENV,
    REPORT_ENV,
    TASK_ENV,
    TRAINING_FINISHED_ENV,
    WORKERS_WANTED_ENV,
)

_REPORT_FILE, _FINISHED_FILE = "report.txt", "training_finished"  # in the launcher's scratch dir
_WANTED_FILE, _CONNECTED_FILE = "workers_wanted", "connected"
_STANDBY = "standby"  # the label of a standby interpreter's output until it gets a task
MODULE_FLAG = "-m"  # `program` as `("-m", module, *args)`: the chief runs `python -m module args`
ENGINES = ("local", "ray")  # where the worker and ps tasks run: processes here, Ray actors
RAY_INSTALL = 'pip install "kerasps[ray]"'


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the job: `type` is `"chief"`, `"worker"`, `"ps"` or `"evaluator"`."""

    type: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.type} {self.index}"


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What `kerasps launch` runs.

    Attributes:
        program: the chief's script and its arguments (`("train.py", "--epochs", "5")`),
            or `("-m", module, *args)` to run a module as `python -m module args` does
            (`("-m", "trainer.main", "--epochs", "5")`).
        workers: worker tasks.
        ps: ps tasks.
        max_restarts: restarts allowed per task (chief, worker, ps or evaluator).
        gpus_per_worker: GPUs given to each worker through
            `CUDA_VISIBLE_DEVICES` (worker `i` gets GPUs `i*G .. i*G+G-1`; the
            chief and ps tasks get none); `None` leaves the variable alone.
        host: the address the tasks listen on.
        evaluator: also run the program as task `evaluator 0`, beside the cluster.
        min_workers: makes the worker pool elastic, between `min_workers` and
            `workers` (see the module docstring); `None`: a fixed pool.
        engine: `"local"`: each task a process on this machine; `"ray"`: the chief (the
            program) a Ray driver, the worker and ps tasks Ray actors that its
            `kerasps.cluster.resolve()` starts (`kerasps.ray.cluster`), restarted by Ray
            `max_restarts` times each.
        address: with `engine="ray"`, the Ray cluster to run on (`ray.init`'s `address`:
            `"auto"`, `"host:6379"`, `"ray://host:10001"`); `None`: `$RAY_ADDRESS`'s, else
            a local Ray started by the chief.
    """

    program: tuple
    workers: int = 2
    ps: int = 1
    max_restarts: int = 3
    gpus_per_worker: int | None = None
    host: str = "localhost"
    evaluator: bool = False
    min_workers: int | None = None
    engine: str = "local"
    address: str | None = None

    def __post_init__(self):
        positive_int("workers", self.workers)
        positive_int("min_workers", self.min_workers, allow_none=True)
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(
                f"Invalid value for argument `min_workers`: MIN ({self.min_workers}) is greater "
                f"than MAX (workers={self.workers}). Received: min_workers={self.min_workers}")
        positive_int("ps", self.ps)
        positive_int("max_restarts", self.max_restarts, minimum=0)
        positive_int("gpus_per_worker", self.gpus_per_worker, allow_none=True)
        if not self.program or not isinstance(self.program[0], str) or not self.program[0]:
            raise ValueError("Invalid value for argument `program`: expected the chief's "
                             f"script and its arguments. Received: program={self.program!r}")
        object.__setattr__(self, "program", tuple(self.program))
        if self.program[0] == MODULE_FLAG and (
                len(self.program) < 2 or not isinstance(self.program[1], str)
                or not self.program[1]):
            raise ValueError("Invalid value for argument `program`: expected the module's name "
                             "after '-m' (`('-m', 'package.module', *args)`). "
                             f"Received: program={self.program!r}")
        if not isinstance(self.evaluator, bool):
            raise ValueError("Invalid value for argument `evaluator`: expected True or False. "
                             f"Received: evaluator={self.evaluator!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"Invalid value for argument `engine`: expected one of "
                             f"{list(ENGINES)}. Received: engine={self.engine!r}")
        if self.address is not None and (self.engine != "ray" or not isinstance(
                self.address, str) or not self.address):
            raise ValueError("Invalid value for argument `address`: a Ray cluster's address, "
                             "given with engine='ray' only. Received: "
                             f"address={self.address!r} with engine={self.engine!r}")
        if self.engine == "ray":
            for name, value in (("evaluator", self.evaluator or None),
                                ("min_workers", self.min_workers)):
                if value is not None:
                    raise ValueError(
                        f"Invalid value for argument `{name}`: engine='ray' runs a fixed "
                        "pool of workers and no side-car evaluator yet. "
                        f"Received: {name}={value!r} with engine='ray'")

    @property
    def ray_job(self) -> dict:
        """With `engine="ray"`: what the chief's `resolve()` passes to
        `kerasps.ray.cluster`."""
        resources = ({"CPU": 1, "GPU": self.gpus_per_worker} if self.gpus_per_worker
                     else None)
        return {"num_workers": self.workers, "num_ps": self.ps,
                "max_restarts": self.max_restarts, "address": self.address,
                "worker_resources": resources}

    @property
    def tasks(self) -> list[Task]:
        """The processes the launcher starts (with `engine="ray"`, the chief only: Ray
        starts the others)."""
        if self.engine == "ray":
            return [Task("chief", 0)]
        return ([Task("ps", i) for i in range(self.ps)]
                + [Task("worker", i) for i in range(self.workers)] + [Task("chief", 0)]
                + [Task("evaluator", 0)] * self.evaluator)


def make_cluster(spec: LaunchSpec, pick_port=None) -> dict:
    """`{"chief": [...], "worker": [...], "ps": [...]}` with a free port per task (the
    evaluator serves nothing and has no address)."""
    if spec.engine == "ray":  # Ray's actors pick their ports, the chief its own
        return {}
    if pick_port is None:
        from kerasps.runtime.ports import pick_port
    counts = {"chief": 1, "worker": spec.workers, "ps": spec.ps}
    return {kind: [f"{spec.host}:{pick_port()}" for _ in range(n)] for kind, n in counts.items()}


def tf_config(cluster: dict, task: Task) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})


def runs_program(task_type: str) -> bool:
    """Whether a task of `task_type` runs the program (the others run `kerasps serve`)."""
    return task_type in (restarts_lib.PROGRAM_TYPE, restarts_lib.SIDECAR_TYPE)


def program_module(program) -> str | None:
    """The module `program` runs (`"pkg.mod"` for `("-m", "pkg.mod", *args)`), or `None`
    for a script."""
    return program[1] if program[0] == MODULE_FLAG else None


def check_program(program) -> None:
    """Raises a `ValueError` naming the script or module unless Python can run it: checked
    before any task starts.

    A script must be a readable file, or a directory holding `__main__.py`. A module
    (`("-m", "pkg.mod", ...)`) must be found as `python -m` finds it from this directory (the
    current directory first, then the rest of `sys.path`), and a package must hold a
    `__main__` module. Finding it runs no code of its packages (their `__init__`s run in the
    chief, not here).
    """
    module = program_module(program)
    if module is not None:
        problem = _module_problem(module)
        if problem:
            raise ValueError(
                f"Invalid value for argument `program`: the chief's module {module!r} cannot be "
                f"run ({problem}). Received: program={tuple(program[:2])!r}")
        return
    script = program[0]
    problem = None
    if not os.path.exists(script):
        problem = "no such file"
    elif os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        problem = "a directory without __main__.py"
    elif not os.access(script, os.R_OK):
        problem = "not readable"
    if problem:
        raise ValueError(f"Invalid value for argument `program`: the chief's script "
                         f"{script!r} cannot be run ({problem}). Received: program={script!r}")


def _module_problem(name: str) -> str | None:
    """Why `python -m name`, started in this directory, would not find `name`; `None` if it
    would. Walks the dotted name with the import system's finders (`sys.meta_path`), as
    `importlib.util.find_spec` does, without importing the parent packages."""
    parts = name.split(".")
    if not all(parts):
        return "not a module name: relative and empty names cannot be run"
    # A task's `python -m` puts its current directory (this one) first on its path, where
    # this process has its own script's directory.
    search = [os.getcwd(), *sys.path[0 if sys.flags.safe_path else 1:]]
    importlib.invalidate_caches()  # a module written since this process last looked
    try:
        spec = None
        for depth in range(1, len(parts) + 1):
            fullname = ".".join(parts[:depth])
            if spec is not None and spec.submodule_search_locations is None:
                return f"{spec.name!r} is not a package"
            spec = _find_spec(fullname, search if spec is None
                              else spec.submodule_search_locations)
            if spec is None:
                where = ("in the current directory or on sys.path" if depth == 1
                         else f"in package {'.'.join(parts[:depth - 1])!r}")
                return f"no module named {fullname!r} {where}"
        if (spec.submodule_search_locations is not None
                and _find_spec(f"{name}.__main__", spec.submodule_search_locations) is None):
            return "a package without __main__"
    except Exception as error:  # noqa: BLE001 - a finder's own error says why
        return f"{type(error).__name__}: {error}"
    return None


def _find_spec(fullname: str, path):
    """The first spec `sys.meta_path`'s finders give for `fullname`: for a top-level name
    the path finder searches `path` (the task's `sys.path`), for a submodule `path` is its
    package's `__path__`."""
    top_level = "." not in fullname
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, None if top_level and finder is not importlib.machinery.PathFinder
                    else path)
        if spec is not None:
            return spec
    return None


def check_engine(spec: LaunchSpec) -> None:
    """Raises an `ImportError` naming the `kerasps[ray]` extra where `spec` runs on Ray and
    Ray is not installed (found without importing it)."""
    if spec.engine != "ray":
        return
    import importlib.util

    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # `ray` in sys.modules without a spec
        found = "ray" in sys.modules and sys.modules["ray"] is not None
    if not found:
        raise ImportError("kerasps launch --engine ray needs Ray, which is not installed. "
                          f"Install it with kerasps' `ray` extra: {RAY_INSTALL}")


def _command(spec: LaunchSpec, task: Task) -> list[str]:
    if runs_program(task.type):
        return [sys.executable, *spec.program]
    return [sys.executable, "-m", "kerasps.cli", "serve"]


def _environment(spec: LaunchSpec, cluster: dict, task: Task, base: dict, scratch: str) -> dict:
    env = dict(base)
    if spec.engine == "ray":
        env.pop("TF_CONFIG", None)  # `resolve()` makes the Ray cluster of `RAY_JOB_ENV`
        env[RAY_JOB_ENV] = json.dumps(spec.ray_job)
        # Ray forwards the actors' output to the driver as `(worker 0 pid=N) line`: plain,
        # every line (the launcher relabels them, `kerasps.ops.console.RayActorLines`).
        env.update(RAY_COLOR_PREFIX="0", RAY_DEDUP_LOGS="0")
    else:
        env["TF_CONFIG"] = tf_config(cluster, task)
    env["PYTHONUNBUFFERED"] = "1"  # output (a progress bar's redraws) arrives as written
    env[TASK_ENV] = task.name
    if spec.min_workers is not None:
        env[WORKERS_WANTED_ENV] = os.path.join(scratch, _WANTED_FILE)
    if task.type == "chief":
        env[REPORT_ENV] = os.path.join(scratch, _REPORT_FILE)
        if spec.min_workers is not None:
            env[MIN_WORKERS_ENV] = str(spec.min_workers)
            env[CONNECTED_ENV] = os.path.join(scratch, _CONNECTED_FILE)
    elif task.type == "evaluator":
        env[TRAINING_FINISHED_ENV] = os.path.join(scratch, _FINISHED_FILE)
    if spec.gpus_per_worker is not None:
        if task.type == "worker":
            first = task.index * spec.gpus_per_worker
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(g) for g in range(first, first + spec.gpus_per_worker))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
    return env
