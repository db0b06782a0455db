"""A warm standby interpreter for `kerasps launch`: TensorFlow and Keras already
imported, waiting to become a task that must start again.

A new Python process spends seconds importing TensorFlow before a restarted
task can serve or train, and on a small machine that is most of the time a
task is away. The launcher keeps one standby (`python -m kerasps.ops.standby`)
beside the job. To restart a task it writes the task's command and environment
to the standby's stdin (one JSON line, `{"argv": [...], "env": {...}}`); the
standby takes that environment as its own and runs the task as its command
would: `kerasps serve`, the script as `python script.py args` runs it
(`runpy.run_path` as `__main__`, with `sys.argv` and `sys.path[0]` set as for a
script), or a module (`-m package.module args`) as `python -m` runs it
(`runpy.run_module` as `__main__`, `sys.argv[0]` the module's file and
`sys.path[0]` the current directory). Its exit status is the task's. The
launcher then starts a new standby.

Nothing here selects or initializes devices: a worker's `CUDA_VISIBLE_DEVICES`
arrives with its environment, before TensorFlow first looks for GPUs.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

__all__ = ["become", "main"]


def become(argv: list, env: dict) -> int:
    """Runs the task whose command (without the interpreter) is `argv`, in `env`."""
    devnull = os.open(os.devnull, os.O_RDONLY)  # tasks read nothing, as under the launcher
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    from kerasps.ops import launch

    launch.name_process()  # the task's title, as a cold start of it would have
    if argv[:2] == ["-m", "kerasps.cli"]:
        from kerasps.ops import cli

        sys.argv = ["kerasps", *argv[2:]]
        return cli.main(argv[2:])
    if argv[0] == "-m":  # as `python -m module args`
        sys.argv = ["-m", *argv[2:]]  # run_module makes argv[0] the module's file
        sys.path[0] = os.getcwd()
        importlib.invalidate_caches()  # a module written since this interpreter started
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def main() -> int:
    from kerasps.ops import launch

    launch.name_process()  # kerasps: standby
    import keras  # noqa: F401  (what a restart no longer waits for)
    import tensorflow  # noqa: F401

    import kerasps.ops.cli  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        return 0  # the launcher is gone or done: nothing to become
    task = json.loads(line)
    return become(task["argv"], task["env"])


if __name__ == "__main__":
    sys.exit(main())
