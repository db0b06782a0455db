"""kerasps on Ray against `kerasps launch`: bring-up, steady-state steps/s, recovery.

(Named `on_ray.py`: a `ray.py` here would be what `import ray` finds.)

The same job both ways, in the same run: `fit_throughput`'s workload (Embedding(100 000,
16) -> mean -> Dense(32) -> Dense(1), Adam, the table sharded over both ps tasks, a batch
of 64 per worker), 2 workers and 2 ps tasks:

* ``launch``: `kerasps launch --workers 2 --ps 2 chief.py`, each task a process;
* ``ray``: a driver connected to a Ray cluster of simulated nodes on this machine
  (`ray.cluster_utils.Cluster`: a head with no CPU for tasks, one 1-CPU node per task and
  a spare one, all on loopback), `kerasps.ray.cluster(num_workers=2, num_ps=2)`.

Per system:

* bring-up: seconds from the command started (`kerasps launch ...`, or the driver's
  `python driver.py`) to the strategy connected to its running tasks: Python's and
  TensorFlow's imports included, the Ray cluster's own start (already running, as a
  user's is) not;
* steady state: steps/s of a timed `fit` of `--steps` steps (`steps_per_execution=10`,
  `verbose=0`) after a warm-up `fit`, and the chief's CPU milliseconds per step;
* recovery: a `fit` (`steps_per_execution=1`, `BackupAndRestore(save_freq=10)`) during
  which ps 1's process is SIGKILLed (Ray or the launcher restarts it on its address) and,
  on Ray, later the node holding ps 1 is removed (Ray places the task on the spare node, at
  a new address): seconds from each fault to the next step applied
  (`optimizer.iterations`, read by a thread of the chief every 5 ms), and in units of the
  median step time before it. Every run must end with every requested step applied.

    pip install -e ".[bench,ray]"
    python benchmarks/on_ray.py                # 3 repeats, launch and Ray interleaved
    python benchmarks/on_ray.py --quick        # a smoke run: 1 repeat, few steps

Target: Ray's steady-state steps/s at least 0.9x launch's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.launched: a launched job's lines and pids

from tests.launched import RunningJob, add_ray_node  # noqa: E402

WORKERS, PS = 2, 2
TARGET = 0.9  # ray / launch steady-state steps/s
RECOVERY_EPOCHS, RECOVERY_STEPS, SAVE_FREQ = 3, 40, 10
KILL_AT, NODE_AT = 45, 85  # optimizer steps of the recovery fit: a fault in each epoch after
DEADLINE_S = 600

CHIEF = """
import json, os, sys, threading, time

import kerasps
import keras, tensorflow as tf

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import fit_throughput as workload

root, system, steps, warmup, epochs, per_epoch, save_freq, backup = sys.argv[1:9]
steps, warmup, epochs, per_epoch = int(steps), int(warmup), int(epochs), int(per_epoch)


def report(key, value):
    print("REPORT " + json.dumps({key: value}), flush=True)


if system == "ray":
    import ray

    ray.init(address=sys.argv[9])
    resolver = kerasps.ray.cluster(num_workers=2, num_ps=2)
else:
    resolver = kerasps.cluster.resolve(num_workers=2, num_ps=2)
strategy = kerasps.ParameterServerStrategy(
    resolver, variable_partitioner=kerasps.partitioners.MinSizePartitioner(
        min_shard_bytes=workload.MIN_SHARD_BYTES, max_shards=workload.MAX_SHARDS))
report("connected", time.time())
if system == "ray":
    report("ps1", {"pid": resolver.pid("ps", 1), "node": resolver.tasks[3].node_id})


def build(spe):
    with strategy.scope():
        model = workload._build_model(keras)
        model.compile(keras.optimizers.Adam(), "mse", steps_per_execution=spe)
    return model


data = kerasps.DatasetCreator(workload._dataset_fn)
model = build(10)
model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)
cpu, wall = time.process_time(), time.perf_counter()
model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
report("steady", {"steps_per_s": steps / wall, "cpu_ms_per_step": 1000 * cpu / steps})

model = build(1)


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


watcher = keras.callbacks.LambdaCallback(
    on_train_begin=lambda logs: threading.Thread(target=watch, daemon=True).start())
history = model.fit(data, epochs=epochs, steps_per_epoch=per_epoch, verbose=0, callbacks=[
    keras.callbacks.BackupAndRestore(backup, save_freq=int(save_freq)), watcher])
report("recovered", {"iterations": int(model.optimizer.iterations.numpy()),
                     "requested": epochs * per_epoch,
                     "reexecuted": sum(history.history.get("reexecuted_steps", [0])),
                     "rolled_back": sum(history.history.get("rolled_back_steps", [0]))})
if system == "ray":
    resolver.shutdown()
"""


class Run:
    """One system's job: its chief's (or driver's) lines, step readings and reports."""

    def __init__(self, system, args, workdir, ray_address=None):
        self.system = system
        script = os.path.join(workdir, f"chief_{system}.py")  # a ray.py: `import ray`
        with open(script, "w") as f:
            f.write(textwrap.dedent(CHIEF))
        chief = [script, ROOT, system, str(args.steps), str(args.warmup),
                 str(RECOVERY_EPOCHS), str(RECOVERY_STEPS), str(SAVE_FREQ),
                 os.path.join(workdir, f"{system}-backup")]
        if system == "ray":
            command = [sys.executable, *chief, ray_address]
            env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        else:
            command = [sys.executable, "-m", "kerasps.cli", "launch", "--workers", str(WORKERS),
                       "--ps", str(PS), "--max-restarts", "3", *chief]
            env = {}
        self.started = time.time()
        self.job = RunningJob(command, cwd=workdir, env={"TF_CPP_MIN_LOG_LEVEL": None, **env})

    def _lines(self, start=0):
        """The chief's lines from the job's line `start` on, as `(time, line)`."""
        prefix = "[chief 0] " if self.system == "launch" else ""
        return [(t, line[len(prefix):]) for t, line in zip(self.job.times[start:],
                                                           self.job.lines[start:])
                if line.startswith(prefix)]

    def reports(self) -> dict:
        found = {}
        for _, line in self._lines():
            if line.startswith("REPORT "):
                found.update(json.loads(line[len("REPORT "):]))
        return found

    def readings(self, start=0) -> list[tuple[float, int]]:
        return [(float(t), int(v)) for _, line in self._lines(start) if line.startswith("it ")
                for _, t, v in [line.split()]]

    def wait(self, condition, what):
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            if time.monotonic() > deadline or self.job.process.poll() is not None:
                raise RuntimeError(f"{self.system}: {what} did not happen:\n"
                                   + "\n".join(self.job.lines[-30:]))
            time.sleep(0.01)

    def wait_for_step(self, step):
        read = 0  # the job's lines looked at so far: each poll reads the new ones only

        def reached():
            nonlocal read
            start, read = read, len(self.job.lines)
            return any(v >= step for _, v in self.readings(start))

        self.wait(reached, f"step {step}")

    def ps1_pid(self) -> int:
        if self.system == "launch":
            return self.job.pids["ps 1"][-1]
        self.wait(lambda: "ps1" in self.reports(), "the ps 1 report")
        return self.reports()["ps1"]["pid"]

    def finish(self) -> int:
        code = self.job.finish(DEADLINE_S)
        self.job.close()
        return code


def recovery(readings, fault_time) -> dict:
    """Seconds (and step times) from a fault to the next step applied after it."""
    before = [(t, v) for t, v in readings if t <= fault_time]
    after = [(t, v) for t, v in readings if t > fault_time]
    if len(before) < 4 or len(after) < 2:
        return {"seconds": None, "steps": None}
    recent = before[-min(len(before), 20):]
    step_time = statistics.median(
        (t1 - t0) / (v1 - v0) for (t0, v0), (t1, v1) in zip(recent, recent[1:]) if v1 > v0)
    next_step = next((t for (_, a), (t, b) in zip(after, after[1:]) if b > a), None)
    if next_step is None:
        return {"seconds": None, "steps": None}
    seconds = next_step - fault_time
    return {"seconds": seconds, "steps": seconds / step_time}


def run_system(system, args, cluster=None) -> dict:
    import signal

    with tempfile.TemporaryDirectory() as workdir:
        run = Run(system, args, workdir, cluster.address if cluster else None)
        faults = {}
        try:
            run.wait_for_step(KILL_AT)
            pid = run.ps1_pid()
            faults["ps_process_killed"] = time.time()
            os.kill(pid, signal.SIGKILL)
            if system == "ray":
                run.wait_for_step(NODE_AT)
                node_id = run.reports()["ps1"]["node"]
                node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
                faults["ps_node_lost"] = time.time()
                cluster.remove_node(node)
            code = run.finish()
        finally:
            run.job.close()
            if args.output:
                os.makedirs(args.output, exist_ok=True)
                with open(os.path.join(args.output, f"{system}-{len(os.listdir(args.output))}"
                                       ".log"), "w") as f:
                    f.write("\n".join(f"{t:.3f} {line}" for t, line in zip(run.job.times,
                                                                             run.job.lines)))
    reports, readings = run.reports(), run.readings()
    done = reports.get("recovered", {})
    return {
        "system": system, "code": code,
        "complete": code == 0 and done.get("iterations", 0) >= done.get("requested", 1),
        "bring_up_s": reports["connected"] - run.started if "connected" in reports else None,
        **reports.get("steady", {}),
        **{f"{fault}_to_next_step": recovery(readings, t) for fault, t in faults.items()},
        "reexecuted": done.get("reexecuted"), "rolled_back": done.get("rolled_back"),
        "error": None if code == 0 else _last_error(run.job.lines),
    }


def _last_error(lines) -> str:
    """The end of a failed job's output, without TensorFlow's log lines."""
    kept = [line for line in lines if "I0000" not in line and "W0000" not in line]
    return "\n".join(kept[-25:])


def ray_cluster():
    """A head with no CPU for tasks and one 1-CPU node per task, plus a spare one."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for _ in range(WORKERS + PS + 1):
        add_ray_node(cluster)
    cluster.wait_for_nodes()
    return cluster


def _median(results, system, key, sub=None):
    values = [r[key] if sub is None else (r.get(key) or {}).get(sub)
              for r in results if r["system"] == system]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def table(results) -> str:
    rows = ["| system | runs complete | bring-up s | steps/s | chief CPU ms/step | ps process "
            "killed -> next step s (step times) | ps node lost -> next step s (step times) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for system in ("launch", "ray"):
        mine = [r for r in results if r["system"] == system]
        cells = [f"{sum(r['complete'] for r in mine)}/{len(mine)}",
                 _fmt(_median(results, system, "bring_up_s")),
                 _fmt(_median(results, system, "steps_per_s")),
                 _fmt(_median(results, system, "cpu_ms_per_step"), 2)]
        for fault in ("ps_process_killed", "ps_node_lost"):
            key = f"{fault}_to_next_step"
            seconds, steps = (_median(results, system, key, s) for s in ("seconds", "steps"))
            cells.append("-" if seconds is None else f"{seconds:.1f} ({steps:.0f})")
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def verdict(results) -> str:
    ray, launch = (_median(results, s, "steps_per_s") for s in ("ray", "launch"))
    if not ray or not launch:
        return "Target: Ray steps/s >= 0.9x launch: not measured (a run failed)."
    ratio = ray / launch
    met = "met" if ratio >= TARGET else f"MISSES by {100 * (TARGET - ratio) / TARGET:.0f}%"
    return f"Target: Ray steps/s >= {TARGET}x launch: {ratio:.2f}x, {met}."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--json", help="also write the runs' results to this file")
    parser.add_argument("--output", help="write each job's output lines to a file there")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 40, 20
    try:
        import ray  # noqa: F401
    except ImportError:
        print('benchmarks/on_ray.py needs Ray: pip install "kerasps[ray]"', file=sys.stderr)
        return 2
    results = []
    for repeat in range(args.repeats):
        for system in (("launch", "ray") if repeat % 2 == 0 else ("ray", "launch")):
            cluster = ray_cluster() if system == "ray" else None
            try:
                result = run_system(system, args, cluster)
            finally:
                if cluster is not None:
                    cluster.shutdown()
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"\n### kerasps on Ray against kerasps launch ({WORKERS} workers, {PS} ps tasks, "
          f"{os.cpu_count()} CPUs, medians of {args.repeats})\n")
    print(table(results))
    print()
    print(verdict(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["complete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
