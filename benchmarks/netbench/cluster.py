"""kerasps tasks on a network bench: `kerasps serve` in each worker and ps namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

PORT = 2222
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def environment(extra=None) -> dict:
    """This process's environment with the repository on `PYTHONPATH` and TF's logs quiet."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {})}


def start_servers(bench, port: int = PORT, kinds=("ps", "worker")) -> dict:
    """Starts `kerasps serve` for every task of `kinds` in its namespace, with TF_CONFIG
    naming the bench's addresses, and returns `{(kind, index): Popen}` once each serves.

    Raises:
        RuntimeError: if a server ends before it serves (its output in the message).
    """
    servers = {}
    for (kind, index) in bench.tasks:
        if kind in kinds:
            env = environment({"TF_CONFIG": bench.tf_config(kind, index, port)})
            servers[kind, index] = bench.popen(
                kind, index, [sys.executable, "-m", "kerasps.cli", "serve"], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for (kind, index), proc in servers.items():  # each prints a line once its server is up
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "serving at" in line:
                break
        else:
            raise RuntimeError(f"{kind} {index} ended before serving:\n" + "".join(seen[-20:]))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the pipe
    return servers
