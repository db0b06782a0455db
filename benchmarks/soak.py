"""Soak: a `kerasps launch` job trained for a fixed time, every task's resources sampled.

Jobs that run for days must not grow with steps or saves. The job: `kerasps launch
--workers 2 --ps 2`, a chief training a recommendation-style model (Embedding(VOCAB, 16)
sharded over both ps tasks, mean of 4 ids, Dense 32, Dense 1; Adam; per-worker batch 64)
with `BackupAndRestore(save_freq=50)`, a `ModelCheckpoint` and a validation pass
(`evaluate`) at every epoch's end, until `--minutes` have passed. A ps task and a worker
are SIGKILLed in turn, `--kills` times, spread over the run's second half (or
`--kills-within`); the launcher
restarts them and `fit` goes on (a lost ps task is restored from the backup).

Sampled every `--interval` seconds, per task (chief, workers, ps tasks; each restarted
process is followed): resident memory (`VmRSS`), threads and open file descriptors, from
`/proc`. The chief reports, at the same pace, the steps applied (`optimizer.iterations`)
and what the ps tasks hold: the placement report's variables per ps task and the live
`tf.Variable`s the chief made on each ps task (tracked by a variable creator as they are
made, never by scanning `gc.get_objects()`; a ps task's own resource manager
cannot be listed from Python; a variable the chief lost track of shows as the ps task's
resident memory).

Printed per measure and task: its growth per 10,000 steps after warm-up (the first
`--warmup` of the run, and `SETTLE_S` after each kill, are left out), a least-squares
slope with each process's life between kills as its own level (a restart or a restore
moves the level, it is not growth), with its noise: 2 standard errors of the slope, and
the residuals' standard deviation. A measure is flat when its growth is within its noise
or below one unit (a thread, a descriptor, a variable, 1 MiB) per 10,000 steps. A plot of
every measure over time is written (`--plot`, docs/soak.png by default).

    pip install -e .
    python benchmarks/soak.py                        # 20 minutes; record + plot
    python benchmarks/soak.py --minutes 240          # hours
    python benchmarks/soak.py --minutes 90 --warmup 0.06 --kills 2 --kills-within 0.2 0.35
                                                     # a restored ps task watched 1 hour
    python benchmarks/soak.py --quick                # a smoke run: ~1 minute, 1 kill, no files
    python benchmarks/soak.py --report benchmarks/records/soak.json   # print a record again
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import sys
import tempfile
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.launched import RunningJob  # noqa: E402

WORKERS, PS = 2, 2
VOCAB = 50_000
STEPS_PER_EPOCH = 500
SAVE_FREQ = 50
SETTLE_S = 60.0  # seconds after a kill left out of the slopes: the restart and restore
RECORD = os.path.join(ROOT, "benchmarks", "records", "soak.json")
PLOT = os.path.join(ROOT, "docs", "soak.png")
# A measure grows when its slope exceeds both its noise and one of its units per 10,000 steps.
UNIT = {"rss_mib": 1.0, "threads": 1.0, "fds": 1.0, "report_variables": 1.0,
        "live_variables": 1.0}

CHIEF = """
import gc, json, sys, threading, time, weakref

import kerasps
import keras, numpy as np, tensorflow as tf

status_every, deadline, vocab, steps, save_freq, workdir = sys.argv[1:]
status_every, deadline = float(status_every), float(deadline)
vocab, steps, save_freq = int(vocab), int(steps), int(save_freq)

# The variables on the ps tasks, counted as they are made: a watcher thread that scans
# `gc.get_objects()` crashes the job (CPython 3.11 hands out tuples still being built,
# and the coordinator's thread building one raises SystemError: tupleobject.c).
made, made_lock = [], threading.Lock()  # weak references (a tf.Variable is unhashable)


def track(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    with made_lock:
        made.append(weakref.ref(variable))
    return variable


strategy = kerasps.ParameterServerStrategy(
    kerasps.cluster.resolve(num_workers=2, num_ps=2),
    variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
tracking = tf.variable_creator_scope(track)  # held: a dropped scope leaves when collected
tracking.__enter__()  # for this thread's variables, to the end of the run
with strategy.scope():
    ids = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(vocab, 16)(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile(keras.optimizers.Adam(0.001), "binary_crossentropy", metrics=["auc"])


def dataset_fn(context):
    x = tf.random.stateless_uniform((4096, 4), [1, context.input_pipeline_id], maxval=vocab,
                                    dtype=tf.int32)
    y = tf.cast(tf.reduce_sum(x % 7, axis=1, keepdims=True) > 12, tf.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)


def ps_task(device):
    return int(device.split("/job:ps/replica:0/task:")[1].split("/")[0])


def status():
    gc.collect()  # safe from a thread, unlike gc.get_objects()
    with made_lock:
        made[:] = [ref for ref in made if ref() is not None]
        variables = [ref() for ref in made]
    live = [0] * strategy.num_ps
    for variable in variables:
        if variable is not None and "/job:ps/" in variable.device:
            live[ps_task(variable.device)] += 1
    report = [0] * strategy.num_ps
    for record in strategy.placement_report():
        report[record.ps_task] += 1
    return {"time": time.time(), "iterations": int(model.optimizer.iterations.numpy()),
            "report_variables": report, "live_variables": live}


def watch():
    while True:
        try:
            print("soak", json.dumps(status()), flush=True)
        except Exception:  # a ps task is down: the next reading
            pass
        time.sleep(status_every)


class StopAtDeadline(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if time.time() >= deadline:
            self.model.stop_training = True


threading.Thread(target=watch, daemon=True).start()
model.fit(kerasps.DatasetCreator(dataset_fn), epochs=10**6, steps_per_epoch=steps, verbose=0,
          validation_data=kerasps.DatasetCreator(dataset_fn), validation_steps=20,
          callbacks=[keras.callbacks.BackupAndRestore(workdir + "/backup", save_freq=save_freq),
                     keras.callbacks.ModelCheckpoint(workdir + "/latest.weights.h5",
                                                     save_weights_only=True),
                     StopAtDeadline()])
print("done", json.dumps(status()), flush=True)
"""

STATUS = re.compile(r"^\[chief 0\] (soak|done) (\{.*\})$")


def _proc(pid: int) -> dict | None:
    """A process's resident memory (MiB), threads and open descriptors, or None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if fields.get("State", "").strip().startswith("Z") or "VmRSS" not in fields:
        return None  # exiting
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "fds": fds}


def _thread_names(pid: int) -> dict:
    """How many threads of each name (`comm`) a process has."""
    names = collections.Counter()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names[f.read().strip()] += 1
    except (FileNotFoundError, ProcessLookupError):
        pass
    return dict(names)


def run(minutes: float, kills: int, interval: float, workdir: str,
        within: tuple[float, float] = (0.5, 0.9)) -> dict:
    """Runs the job for `minutes`, killing `kills` tasks evenly spread over the fractions
    `within` of the run; the samples."""
    started = time.time()
    deadline = started + 60 * minutes
    script = os.path.join(workdir, "chief.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(CHIEF))
    job = RunningJob(
        [sys.executable, "-m", "kerasps.cli", "launch", "--workers", str(WORKERS), "--ps",
         str(PS), "--max-restarts", str(kills + 2), script, str(interval), str(deadline),
         str(VOCAB), str(STEPS_PER_EPOCH), str(SAVE_FREQ), workdir],
        cwd=workdir, env={"TF_CPP_MIN_LOG_LEVEL": None})
    first, last = within
    kill_times = [started + 60 * minutes * (first + (last - first) * (i + 0.5) / kills)
                  for i in range(kills)]
    samples, kills_done = [], []
    names = {}  # pid -> its task and its threads' names at its first and latest sample
    try:
        job.wait_for(r"^\[chief 0\] soak ", timeout=300)
        next_sample = time.time()
        while job.process.poll() is None:
            now = time.time()
            if kill_times and now >= kill_times[0]:
                kill_times.pop(0)
                task = ("ps", "worker")[len(kills_done) % 2] + f" {len(kills_done) % 2}"
                try:
                    job.kill(task)
                    kills_done.append({"time": now - started, "task": task})
                    print(f"  {now - started:7.0f} s  killed {task}", flush=True)
                except ProcessLookupError:
                    pass
            for task, pids in list(job.pids.items()):
                measured = _proc(pids[-1])
                if measured is not None:
                    samples.append({"time": now - started, "task": task, "pid": pids[-1],
                                    **measured})
                    names.setdefault(pids[-1], {"task": task, "first": _thread_names(pids[-1])})
                    names[pids[-1]]["last"] = _thread_names(pids[-1])
            next_sample += interval
            time.sleep(max(0.0, next_sample - time.time()))
        code = job.finish(120)
    finally:
        job.close()
    statuses = [dict(json.loads(m.group(2)), final=m.group(1) == "done")
                for m in map(STATUS.match, job.lines) if m]
    for status in statuses:
        status["time"] -= started
    problems = [line for line in job.lines
                if "Traceback" in line or "ERROR" in line or "Error:" in line]
    return {"code": code, "minutes": minutes, "interval": interval, "kills": kills_done,
            "samples": samples, "statuses": statuses, "problems": problems[:20],
            "lines": len(job.lines),
            # The processes that ran to the end (a killed one's last sample is its death).
            "thread_names": [names[pids[-1]] for pids in job.pids.values() if pids[-1] in names]}


def _steps_at(statuses, times):
    """Steps applied at each of `times`, interpolated from the chief's readings."""
    t = np.array([s["time"] for s in statuses])
    steps = np.maximum.accumulate(np.array([s["iterations"] for s in statuses], float))
    return np.interp(times, t, steps)


def _series(record):
    """(measure, task) -> list of (time, value, segment) after warm-up."""
    warmup = record["warmup_s"]
    kills = [k["time"] for k in record["kills"]]

    def segment(t, pid):
        return (pid, sum(1 for k in kills if k <= t))

    def kept(t):
        return t >= warmup and not any(k <= t < k + SETTLE_S for k in kills)

    series = {}
    for s in record["samples"]:
        if kept(s["time"]):
            for measure in ("rss_mib", "threads", "fds"):
                series.setdefault((measure, s["task"]), []).append(
                    (s["time"], s[measure], segment(s["time"], s["pid"])))
    for s in record["statuses"]:
        if kept(s["time"]) and not s["final"]:
            for measure in ("report_variables", "live_variables"):
                for ps, value in enumerate(s[measure]):
                    series.setdefault((measure, f"ps {ps}"), []).append(
                        (s["time"], value, segment(s["time"], 0)))
    return series


def growth(record) -> list[dict]:
    """Per measure and task: growth per 10,000 steps, its noise and a verdict."""
    rows = []
    for (measure, task), points in sorted(_series(record).items()):
        times = np.array([p[0] for p in points])
        values = np.array([p[1] for p in points], float)
        segments = [p[2] for p in points]
        steps = _steps_at(record["statuses"], times)
        # Each segment its own level: demean within segments, one common slope.
        x, y = steps.copy(), values.copy()
        for key in set(segments):
            where = np.array([s == key for s in segments])
            x[where] -= x[where].mean()
            y[where] -= y[where].mean()
        if len(points) < 4 or not np.any(x):
            continue
        slope = float(x @ y / (x @ x))
        residuals = y - slope * x
        dof = max(1, len(points) - len(set(segments)) - 1)
        stderr = float(np.sqrt(residuals @ residuals / dof / (x @ x)))
        per_10k, noise = slope * 1e4, 2 * stderr * 1e4
        flat = abs(per_10k) <= max(noise, UNIT[measure])
        rows.append({"measure": measure, "task": task, "per_10k_steps": per_10k,
                     "noise_per_10k_steps": noise, "residual_std": float(residuals.std()),
                     "mean": float(values.mean()), "samples": len(points), "flat": flat})
    return rows


def summary(record) -> dict:
    statuses = [s for s in record["statuses"] if not s["final"]]
    steps = max(s["iterations"] for s in record["statuses"])
    kept = [s for s in statuses if s["time"] >= record["warmup_s"]]
    return {"steps": steps, "steps_after_warmup": steps - (kept[0]["iterations"] if kept else 0),
            "steps_per_s": steps / max(1.0, statuses[-1]["time"] - statuses[0]["time"]),
            "growth": growth(record)}


def report(record) -> bool:
    s = record["summary"]
    kills = ", ".join(f"{k['task']} at {k['time']:.0f} s" for k in record["kills"]) or "none"
    print(f"soak: {record['minutes']:g} min, exit {record['code']}, {s['steps']} steps "
          f"({s['steps_after_warmup']} after warm-up, {s['steps_per_s']:.0f} steps/s), "
          f"kills: {kills}; samples every {record['interval']:g} s after the first "
          f"{record['warmup_s']:.0f} s")
    print(f"{'measure':<18}{'task':<10}{'mean':>10}{'per 10k steps':>15}{'noise (2 SE)':>14}"
          f"{'resid. std':>12}  verdict")
    for row in s["growth"]:
        print(f"{row['measure']:<18}{row['task']:<10}{row['mean']:>10.1f}"
              f"{row['per_10k_steps']:>+15.3f}{row['noise_per_10k_steps']:>14.3f}"
              f"{row['residual_std']:>12.3f}  {'flat' if row['flat'] else 'GROWS'}")
    for process in record.get("thread_names", []):
        first, last = process["first"], process.get("last", {})
        grown = {name: last.get(name, 0) - first.get(name, 0) for name in set(first) | set(last)}
        grown = {name: n for name, n in grown.items() if n}
        if grown:
            print(f"threads of {process['task']} (its last process), first to last sample: "
                  + ", ".join(f"{name} {n:+d}" for name, n in sorted(grown.items())))
    growing = [f"{r['measure']} of {r['task']}" for r in s["growth"] if not r["flat"]]
    print("soak verdict: " + ("every measure flat" if not growing
                              else "grows: " + ", ".join(growing)))
    for line in record["problems"]:
        print("  problem line:", line)
    return record["code"] == 0 and not record["problems"]


def plot(record, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [("rss_mib", "resident memory (MiB)"), ("threads", "threads"),
                ("fds", "open file descriptors"), ("live_variables", "variables per ps task")]
    fig, axes = plt.subplots(len(measures), 1, figsize=(9, 10), sharex=True)
    for ax, (measure, label) in zip(axes, measures):
        if measure == "live_variables":
            statuses = [s for s in record["statuses"] if not s["final"]]
            for ps in range(PS):
                ax.plot([s["time"] / 60 for s in statuses],
                        [s[measure][ps] for s in statuses], label=f"ps {ps} (live)")
                ax.plot([s["time"] / 60 for s in statuses],
                        [s["report_variables"][ps] for s in statuses], ":",
                        label=f"ps {ps} (report)")
        else:
            for task in sorted({s["task"] for s in record["samples"]}):
                points = [s for s in record["samples"] if s["task"] == task]
                ax.plot([s["time"] / 60 for s in points], [s[measure] for s in points],
                        ".", markersize=2, label=task)
        for kill in record["kills"]:
            ax.axvline(kill["time"] / 60, color="grey", linewidth=0.6, linestyle="--")
        ax.axvspan(0, record["warmup_s"] / 60, color="grey", alpha=0.1)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left", ncol=5)
    axes[-1].set_xlabel("minutes (shaded: warm-up; dashed: a task killed)")
    fig.suptitle(f"kerasps soak: {record['summary']['steps']} steps in "
                 f"{record['minutes']:g} min, 2 workers, 2 ps")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="how long the job trains (default 20)")
    parser.add_argument("--kills", type=int, default=4,
                        help="tasks SIGKILLed, a ps task and a worker in turn (default 4)")
    parser.add_argument("--kills-within", type=float, nargs=2, default=(0.5, 0.9),
                        metavar=("START", "END"),
                        help="the fractions of the run the kills are spread over (default "
                             "0.5 0.9); early kills leave a restored task long to watch")
    parser.add_argument("--interval", type=float, default=10.0,
                        help="seconds between samples (default 10)")
    parser.add_argument("--warmup", type=float, default=0.25,
                        help="fraction of the run left out as warm-up (default 0.25)")
    parser.add_argument("--json", default=RECORD, help=f"record (default {RECORD})")
    parser.add_argument("--plot", default=PLOT, help=f"plot (default {PLOT})")
    parser.add_argument("--report", metavar="JSON", help="print a record again; run nothing")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1.5 minutes, 1 ps kill, writes no files")
    args = parser.parse_args(argv)
    start, end = args.kills_within
    if not 0 <= start <= end <= 1:
        parser.error("Invalid value for argument `--kills-within`: expected two fractions "
                     f"0 <= START <= END <= 1. Received: --kills-within {start:g} {end:g}")
    if args.report:
        with open(args.report) as f:
            return 0 if report(json.load(f)) else 1
    if args.quick:
        args.minutes, args.kills, args.interval = 1.5, 1, 2.0
    with tempfile.TemporaryDirectory(prefix="kerasps-soak-") as workdir:
        record = run(args.minutes, args.kills, args.interval, workdir,
                     tuple(args.kills_within))
    record["warmup_s"] = 60 * args.minutes * args.warmup
    if not record["statuses"]:
        print("soak: the chief reported nothing; its exit:", record["code"])
        return 1
    record["summary"] = summary(record)
    ok = report(record)
    if not args.quick:
        with open(args.json, "w") as f:
            json.dump(record, f)
        plot(record, args.plot)
        print(f"record: {args.json}; plot: {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
