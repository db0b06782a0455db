"""Fault tolerance, measured: kerasps against tf_keras with TF's ParameterServerStrategy.

One job per run: 2 workers and 1 ps as `kerasps serve` processes (plain
`tf.distribute.Server`s from `TF_CONFIG`, the same for both systems), and a
chief training a small model (Adam) for `EPOCHS x STEPS` steps with
`keras.callbacks.BackupAndRestore` (kerasps: `save_freq=SAVE_FREQ`; tf_keras
under TF's PSS only allows `save_freq="epoch"`). From `on_train_begin` on (after
the backup is restored), a thread in the chief reads `optimizer.iterations`
(a variable on the ps) every few milliseconds and prints each change with
its time. Once it passes `KILL_AT`, the driver
SIGKILLs a process:

* ``worker_restarted``: worker 1, started again on its address 3 s later;
* ``worker_gone``: worker 1, never started again;
* ``ps_killed``: the ps, started again at once (as a restart agent would);
* ``coordinator_killed``: the chief, run again with the same command.

Per scenario and system, over `--runs` runs: runs finished (exit status 0
with every requested step applied), steps applied
(`optimizer.iterations` at the end) against those requested, extra steps
(applied more than once), steps lost to rollback (the counter's value at
the kill minus the lowest value read after it), and the recovery time from
the kill to the next completed step, in units of the median step time
before the kill.

    pip install -e .[bench]
    python benchmarks/faults.py              # 5 runs per scenario, a Markdown table
    python benchmarks/faults.py --runs 1 --scenarios ps_killed --systems kerasps
    python benchmarks/faults.py --quick      # a smoke run: 1 run of ps_killed per system
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from kerasps.runtime.ports import pick_port

SCENARIOS = ("worker_restarted", "worker_gone", "ps_killed", "coordinator_killed")
SYSTEMS = ("tf_keras", "kerasps")
EPOCHS, STEPS = 4, 40
SAVE_FREQ = 10
KILL_AT = 70  # optimizer steps: inside the second epoch
WORKER_OUTAGE_S = 3.0
DEADLINE_S = 300

CHIEF = f"""
import json, sys, threading, time
import tensorflow as tf

system, backup_dir = sys.argv[1], sys.argv[2]
if system == "kerasps":
    import keras, kerasps
    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
    DatasetCreator, save_freq = kerasps.DatasetCreator, {SAVE_FREQ}
else:
    import tf_keras as keras
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver())
    DatasetCreator, save_freq = keras.utils.experimental.DatasetCreator, "epoch"

with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.optimizer.build(model.trainable_variables)

def dataset_fn(context):
    x = tf.random.stateless_uniform((512, 8), [1, context.input_pipeline_id])
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

def watch():
    last = None
    while True:
        try:
            value = int(model.optimizer.iterations.numpy())
        except Exception:
            value = None
        if value is not None and value != last:
            print("it", time.time(), value, flush=True)
            last = value
        time.sleep(0.005)

# Reads start once the backup is restored (callbacks run in order).
watcher = keras.callbacks.LambdaCallback(
    on_train_begin=lambda logs: threading.Thread(target=watch, daemon=True).start())
history = model.fit(DatasetCreator(dataset_fn), epochs={EPOCHS}, steps_per_epoch={STEPS},
                    verbose=0, callbacks=[keras.callbacks.BackupAndRestore(
                        backup_dir, save_freq=save_freq, delete_checkpoint=False), watcher])
print("done", json.dumps({{"iterations": int(model.optimizer.iterations.numpy())}}), flush=True)
"""


class Job:
    """The servers and the chief of one run, with the chief's counter readings."""

    def __init__(self, workdir, system):
        self.workdir, self.system = workdir, system
        self.cluster = {kind: [f"localhost:{pick_port()}" for _ in range(n)]
                        for kind, n in (("chief", 1), ("worker", 2), ("ps", 1))}
        self.servers = {(kind, i): self._serve(kind, i)
                        for kind, n in (("worker", 2), ("ps", 1)) for i in range(n)}
        self.readings: list[tuple[float, int]] = []  # (time, optimizer.iterations)
        self.result = None
        self.chief = None
        self.start_chief()

    def _env(self, kind, index):
        return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": json.dumps(
            {"cluster": self.cluster, "task": {"type": kind, "index": index}})}

    def _serve(self, kind, index):
        return subprocess.Popen([sys.executable, "-m", "kerasps.cli", "serve"],
                                env=self._env(kind, index), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def start_chief(self):
        script = os.path.join(self.workdir, "chief.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(CHIEF))
        with open(os.path.join(self.workdir, "chief.err"), "a") as errors:
            self.chief = subprocess.Popen(
                [sys.executable, script, self.system, os.path.join(self.workdir, "backup")],
                env=self._env("chief", 0), stdout=subprocess.PIPE, stderr=errors, text=True)
        threading.Thread(target=self._read, args=(self.chief,), daemon=True).start()

    def _read(self, chief):
        for line in chief.stdout:
            if line.startswith("it "):
                _, t, value = line.split()
                self.readings.append((float(t), int(value)))
            elif line.startswith("done "):
                self.result = json.loads(line[5:])

    def wait_for_iterations(self, count):
        deadline = time.monotonic() + DEADLINE_S
        while not (self.readings and self.readings[-1][1] >= count):
            if time.monotonic() > deadline or self.chief.poll() is not None:
                with open(os.path.join(self.workdir, "chief.err")) as f:
                    errors = f.read()[-3000:]
                raise RuntimeError(f"{self.system}: the chief never reached step {count}:\n"
                                   f"{errors}")
            time.sleep(0.01)

    def kill(self, task):
        process = self.chief if task == ("chief", 0) else self.servers[task]
        process.kill()
        process.wait()

    def restart(self, task):
        if task == ("chief", 0):
            self.start_chief()
        else:
            self.servers[task] = self._serve(*task)

    def finish(self) -> bool:
        """True if the chief exited with 0 having applied every requested step."""
        try:
            code = self.chief.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.chief.kill()
            code = None
        return (code == 0 and self.result is not None
                and self.result["iterations"] >= EPOCHS * STEPS)

    def close(self):
        for process in [self.chief, *self.servers.values()]:
            if process.poll() is None:
                process.kill()
                process.wait()


def run_once(scenario, system) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        job = Job(workdir, system)
        try:
            job.wait_for_iterations(KILL_AT)
            before = list(job.readings)
            killed_at = time.time()
            if scenario in ("worker_restarted", "worker_gone"):
                job.kill(("worker", 1))
                if scenario == "worker_restarted":
                    time.sleep(WORKER_OUTAGE_S)  # the outage being modelled
                    job.restart(("worker", 1))
            elif scenario == "ps_killed":
                job.kill(("ps", 0))
                job.restart(("ps", 0))
            else:
                job.kill(("chief", 0))
                job.restart(("chief", 0))
            finished = job.finish()
        finally:
            job.close()
        error = None if finished else _last_error(os.path.join(workdir, "chief.err"))
    after = [(t, v) for t, v in job.readings if t > killed_at]
    (t0, v0), (t1, v1) = before[len(before) // 2], before[-1]
    step_time = (t1 - t0) / max(1, v1 - v0)
    at_kill = max(v for _, v in before)
    recovered = next((t for (_, a), (t, b) in zip(after, after[1:]) if b > a), None)
    return {
        "scenario": scenario, "system": system, "finished": finished,
        "requested": EPOCHS * STEPS,
        "iterations": job.result["iterations"] if job.result else None,
        "rolled_back": max(0, at_kill - min(v for _, v in after)) if after else None,
        "recovery_steps": None if recovered is None else (recovered - killed_at) / step_time,
        "step_time_s": step_time,
        "error": error,
    }


def _last_error(path) -> str:
    """The end of a failed chief's stderr, without TensorFlow's log lines."""
    with open(path) as f:
        lines = [line.rstrip() for line in f if not line.startswith(("I0000", "W0000", "E0000"))]
    return "\n".join(lines[-15:])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(results) -> str:
    rows = ["| scenario | system | finished | steps applied / requested | extra steps | "
            "rolled back (max) | recovery (median step times) |",
            "|---|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        for system in SYSTEMS:
            runs = [r for r in results if r["scenario"] == scenario and r["system"] == system]
            if not runs:
                continue
            done = [r for r in runs if r["finished"]]
            iterations = _median([r["iterations"] for r in done])
            extra = _median([r["iterations"] - r["requested"] for r in done])
            rolled = [r["rolled_back"] for r in done if r["rolled_back"] is not None]
            recovery = _median([r["recovery_steps"] for r in done])
            fmt = (lambda v, spec: "n/a" if v is None else format(v, spec))
            rows.append(
                f"| {scenario} | {system} | {len(done)}/{len(runs)} | "
                f"{fmt(iterations, '.0f')} / {runs[0]['requested']} | {fmt(extra, '.0f')} | "
                f"{fmt(max(rolled) if rolled else None, 'd')} | {fmt(recovery, '.1f')} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="default 5 (1 with --quick)")
    parser.add_argument("--scenarios", default=None,
                        help="comma-separated (default all; ps_killed with --quick)")
    parser.add_argument("--systems", default=None, help="comma-separated (default all)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 run of ps_killed per system; fails unless "
                             "kerasps finished it")
    parser.add_argument("--no-anchor", action="store_true",
                        help="no tf_keras runs (the default when tf_keras is not installed)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 5)
    args.scenarios = args.scenarios or ("ps_killed" if args.quick else ",".join(SCENARIOS))
    if args.systems is None:
        anchor = not args.no_anchor and importlib.util.find_spec("tf_keras") is not None
        args.systems = ",".join(s for s in SYSTEMS if anchor or s != "tf_keras")
    results = []
    for _ in range(args.runs):
        for scenario in args.scenarios.split(","):
            for system in args.systems.split(","):
                result = run_once(scenario, system)
                print(json.dumps(result), flush=True)
                results.append(result)
    print(table(results))
    if args.quick and not all(r["finished"] for r in results if r["system"] == "kerasps"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
