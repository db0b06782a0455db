"""Chaos soak: a `kerasps launch` job whose worker, ps and chief are SIGKILLed in turn.

The job: `kerasps launch --workers 2 --ps 2`, a chief training a recommendation-style
model (Embedding(VOCAB, 16) sharded over both ps tasks, mean of 4 ids, Dense 32,
Dense 1; Adam; per-worker batch 64) for `EPOCHS x STEPS` steps with
`keras.callbacks.BackupAndRestore(save_freq=25)`. Once `fit` has started, a driver
SIGKILLs a worker, a ps task and the chief in turn (run `seed` starts with kind
`seed % 3`; the worker and ps index drawn at random), one every 20-40 s (uniform,
seeded), until `fit` returns; the launcher's restart agent brings each back on its
address. Fault-free runs of the same job are interleaved with the chaos runs (one
before the first, one after each).

Reported per chaos run: whether it finished (exit status 0, and optimizer steps
applied, `optimizer.iterations` at the end, at least those requested and at most
`EXTRA_PER_KILL` more per kill: at-least-once), and **goodput** = the mean wall time
of the fault-free runs before and after it / its wall time. Each kill's cost is the
time it lost: the time until the next kill (or the last step) less the net steps
made meanwhile at the fault-free rate, split into the restarted process's start,
TensorFlow's connection, the model's build and the backup's restore, the first
step, the steps run again, and the slower steps after the first. The simulator
(`simulator.calibrate.predict_goodput`) predicts each run's goodput from its kill
schedule and each kind's median recovery time, taken two ways: from the kill to the
first step after it, or the kill's lost time without the steps run again.

    pip install -e .[bench]
    python benchmarks/chaos.py                    # 10 chaos runs, 11 fault-free; ~32 min
    python benchmarks/chaos.py --quick            # a smoke run: 1 fault-free, 1 chaos run, 3 kills
    python benchmarks/chaos.py --json chaos.json; ... --report chaos.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from simulator.calibrate import predict_goodput  # noqa: E402
from tests.launched import RunningJob  # noqa: E402

WORKERS, PS = 2, 2
SAVE_FREQ = 25
MAX_RESTARTS = 10  # per task, for the whole run
KINDS = ("worker", "ps", "chief")
# Steps a kill can make count twice: those the ps had applied and the chief not yet
# delivered when the backup it goes back to was written (a ps or chief kill), or those in
# flight on a killed worker. kerasps' dispatch window (`kerasps.keras.trainer.dispatch.Window`)
# bounds both: (BACKLOG_PER_SLOT + 1) x STEPS_IN_FLIGHT_PER_WORKER x WORKERS functions
# of one step.
EXTRA_PER_KILL = (64 + 1) * 2 * WORKERS
DEADLINE_S = 1800
# Seconds after the last requested step with no `done` from the chief before its threads'
# stacks are dumped (SIGUSR1, `faulthandler`) into its output: 3 of 21 jobs once stalled
# ~28 s there, cause unknown.
STALL_DUMP_S = 5.0


@dataclasses.dataclass(frozen=True)
class Config:
    epochs: int = 4
    steps: int = 1000  # per epoch
    vocab: int = 20_000
    kill_every: tuple = (20.0, 40.0)
    max_kills: int | None = None


FULL = Config()
# A smoke run: a short job, a worker, a ps task and the chief killed in turn (run 0's
# order), one every 4-6 s.
QUICK = Config(epochs=2, steps=600, kill_every=(4.0, 6.0), max_kills=3)

CHIEF = """
import sys, threading, time

_said = threading.Lock()


def say(*words):  # one whole line: print() from two threads can interleave their words
    with _said:
        sys.stdout.write(" ".join(map(str, words)) + "\\n")
        sys.stdout.flush()


say("phase", time.time(), "start")
import faulthandler, json, logging, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's stall dump
import keras, tensorflow as tf, kerasps
say("phase", time.time(), "imported")

epochs, steps, vocab, save_freq, backup_dir = sys.argv[1:]
epochs, steps, vocab, save_freq = int(epochs), int(steps), int(vocab), int(save_freq)


class Stamped(logging.Handler):
    def emit(self, record):
        say("log", time.time(), record.getMessage().replace("\\n", " | "))


log = logging.getLogger("kerasps")
log.addHandler(Stamped())
log.setLevel(logging.INFO)
log.propagate = False

strategy = kerasps.ParameterServerStrategy(
    kerasps.cluster.from_tf_config(),
    variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
say("phase", time.time(), "connected")
with strategy.scope():
    ids = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(vocab, 16)(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.Adam(0.001), "mse")


def dataset_fn(context):
    x = tf.random.stateless_uniform((4096, 4), [1, context.input_pipeline_id], maxval=vocab,
                                    dtype=tf.int32)
    y = tf.cast(tf.reduce_sum(x % 7, axis=1, keepdims=True), tf.float32) / 10.0
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)


def watch():
    last = None
    while True:
        try:
            value = int(model.optimizer.iterations.numpy())
        except Exception:  # a ps task is down
            value = None
        if value is not None and value != last:
            say("it", time.time(), value)
            last = value
        time.sleep(0.02)


def begin(logs):  # after BackupAndRestore restored the backup (callbacks run in order)
    say("phase", time.time(), "restored", int(model.optimizer.iterations.numpy()))
    threading.Thread(target=watch, daemon=True).start()


# delete_checkpoint=False: a chief killed after `fit` returned finds the finished
# backup when it runs again, and does not train from the start.
model.fit(kerasps.DatasetCreator(dataset_fn), epochs=epochs, steps_per_epoch=steps, verbose=0,
          callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq,
                                                      delete_checkpoint=False),
                     keras.callbacks.LambdaCallback(on_train_begin=begin)])
say("done", json.dumps({"iterations": int(model.optimizer.iterations.numpy())}))
"""

LINE = re.compile(r"^\[chief 0\] (it|phase|log) (\d+\.\d+) ?(.*)$")


def _start(workdir: str, config: Config) -> RunningJob:
    script = os.path.join(workdir, "chief.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(CHIEF))
    return RunningJob(
        [sys.executable, "-m", "kerasps.cli", "launch", "--workers", str(WORKERS), "--ps",
         str(PS), "--max-restarts", str(MAX_RESTARTS), script, str(config.epochs),
         str(config.steps), str(config.vocab), str(SAVE_FREQ), os.path.join(workdir, "backup")],
        cwd=workdir, env={"TF_CPP_MIN_LOG_LEVEL": "3"})


def _chief_events(job: RunningJob) -> dict:
    """The chief's time-stamped lines: counter readings, phases and log messages."""
    events = {"it": [], "phase": [], "log": []}
    for line in list(job.lines):
        match = LINE.match(line)
        if match:
            kind, t, rest = match.group(1), float(match.group(2)), match.group(3)
            if kind != "it":
                events[kind].append((t, rest))
            elif rest.isdigit():  # not the last line of a chief killed while writing it
                events[kind].append((t, int(rest)))
    return events


def _done(job: RunningJob) -> dict | None:
    for line in job.lines:
        if line.startswith("[chief 0] done "):
            return json.loads(line[len("[chief 0] done "):])
    return None


def _wait(predicate, deadline: float, job: RunningJob) -> bool:
    """Polls until `predicate()` or the job ended or `deadline`; returns `predicate()`."""
    while not predicate() and job.process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    return predicate()


def _dump_a_stall(job: RunningJob, requested: int, deadline: float) -> float | None:
    """Waits for the job to end; if the chief's counter reached `requested` and no `done`
    followed within `STALL_DUMP_S`, dumps the chief's stacks once (into its output) and
    returns when."""
    reached = None
    while job.process.poll() is None and time.time() < deadline:
        if _done(job) is not None:
            return None
        events = _chief_events(job)
        readings = events["it"]
        if reached is None and readings and readings[-1][1] >= requested:
            reached = time.time()
        imported = sum(1 for _, phase in events["phase"] if phase == "imported")
        if (reached is not None and time.time() - reached > STALL_DUMP_S
                and imported == len(job.pids.get("chief 0", []))):  # its handler is set
            try:
                job.kill("chief 0", signal.SIGUSR1)
            except (ProcessLookupError, KeyError):
                return None
            print(f"  a stall: no `done` {STALL_DUMP_S:g} s after step {requested}; the "
                  "chief's stacks are in its output", flush=True)
            return time.time()
        time.sleep(0.1)
    return None


def run_job(workdir: str, config: Config, seed: int | None) -> dict:
    """One job; with a `seed`, kills processes in turn as the module docstring says."""
    started = time.time()
    job = _start(workdir, config)
    rng = random.Random(seed)
    kills = []
    try:
        training = lambda: any(line.startswith("[chief 0] it ") for line in job.lines)  # noqa
        finished = lambda: _done(job) is not None  # noqa: E731
        if seed is not None and _wait(training, started + DEADLINE_S, job):
            start = seed % len(KINDS)  # runs start with each kind in turn: a balanced mix
            kinds = itertools.cycle(KINDS[start:] + KINDS[:start])
            next_kill = time.time() + rng.uniform(*config.kill_every)
            while config.max_kills is None or len(kills) < config.max_kills:
                _wait(lambda at=next_kill: time.time() >= at or finished(),
                      started + DEADLINE_S, job)
                if finished() or job.process.poll() is not None or time.time() > (
                        started + DEADLINE_S):
                    break
                kind = next(kinds)
                index = 0 if kind == "chief" else rng.randrange(WORKERS if kind == "worker"
                                                                else PS)
                task = f"{kind} {index}"
                readings = _chief_events(job)["it"]
                killed_at = time.time()
                try:
                    job.kill(task)
                except ProcessLookupError:  # between its death and its restart
                    continue
                kills.append({"time": killed_at, "kind": kind, "task": task,
                              "counter": readings[-1][1] if readings else 0})
                next_kill = killed_at + rng.uniform(*config.kill_every)
        stall_dump = _dump_a_stall(job, config.epochs * config.steps, started + DEADLINE_S)
        code = job.finish(DEADLINE_S)
    finally:
        job.close()
    ended = time.time()
    events = _chief_events(job)
    done = _done(job)
    requested = config.epochs * config.steps
    result = {
        "seed": seed, "code": code, "wall_s": ended - started, "requested": requested,
        "applied": done["iterations"] if done else None, "kills": kills,
        "train_start": events["it"][0][0] - started if events["it"] else None,
        "train_end": events["it"][-1][0] - started if events["it"] else None,
        "events": events,
        "launcher": [(t, line) for t, line in zip(job.times, job.lines)
                     if line.startswith("[launcher]") or "] kerasps serve: " in line],
        "started": started,
        "stall_dump": stall_dump and stall_dump - started,
    }
    bound = requested + EXTRA_PER_KILL * len(kills)
    result["finished"] = bool(code == 0 and done and requested <= done["iterations"] <= bound)
    # What the tasks said, without the counter readings (for a post-mortem).
    result["output"] = [(t - started, line) for t, line in zip(job.times, job.lines)
                        if not line.startswith("[chief 0] it ")]
    return result


# -- analysis --------------------------------------------------------------------------
def _rate(fault_free: list[dict]) -> float:
    """Steps per second of the fault-free runs' training (first to last step)."""
    return statistics.mean(r["requested"] / (r["train_end"] - r["train_start"])
                           for r in fault_free)


def _counter_at(readings, t):
    """The last counter reading at or before `t` (None before the first)."""
    value = None
    for at, v in readings:
        if at > t:
            break
        value = v
    return value


def _after(items, t, predicate=lambda value: True):
    return next(((at, v) for at, v in items if at >= t and predicate(v)), None)


def kill_costs(run: dict, rate: float) -> list[dict]:
    """Each kill's lost time and, for ps and chief kills, where it went."""
    readings, phases, logs = (run["events"][k] for k in ("it", "phase", "log"))
    end = readings[-1][0]
    costs = []
    for kill, following in zip(run["kills"], run["kills"][1:] + [None]):
        t0 = kill["time"]
        t1 = min(following["time"], end) if following else end
        v0, v1 = kill["counter"], _counter_at(readings, t1)
        cost = {"kind": kill["kind"], "time": t0 - run["started"],
                "lost_s": (t1 - t0) - (v1 - v0) / rate}
        resumed = None  # (time, counter) when the job trained again from the backup
        if kill["kind"] == "chief":
            marks = {}
            for name in ("imported", "connected", "restored"):
                mark = _after(phases, t0, lambda v, n=name: v.split()[0] == n)
                marks[name] = mark
            if all(marks.values()):
                restored_at, restored = marks["restored"][0], int(marks["restored"][1].split()[1])
                cost.update(process_s=marks["imported"][0] - t0,
                            connect_s=marks["connected"][0] - marks["imported"][0],
                            restore_s=restored_at - marks["connected"][0])
                resumed = (restored_at, restored)
        else:
            serving = _after(run["launcher"], t0,
                             lambda v, task=kill["task"]: v.startswith(f"[{task}] kerasps serve: "))
            cost["process_s"] = serving[0] - t0 if serving else None
            if kill["kind"] == "ps":
                answered = _after(logs, t0, lambda v: re.fullmatch(
                    r"ps task\(s\) [\d, ]+ answer again\.", v))
                restored = _after(logs, t0, lambda v: v.startswith("Restored the backup"))
                if serving and answered and restored:
                    back = _after(readings, restored[0])
                    cost.update(connect_s=answered[0] - serving[0],
                                restore_s=restored[0] - answered[0])
                    resumed = (restored[0], back[1] if back else v0)
            else:
                joined = _after(logs, t0,
                                lambda v, task=kill["task"]: v.startswith(f"{task} joined"))
                if serving and joined:
                    cost["connect_s"] = joined[0] - serving[0]
                cost["back_s"] = joined[0] - t0 if joined else None
        if resumed is not None:
            first = _after(readings, resumed[0], lambda v, at=resumed[1]: v > at)
            cost["first_step_s"] = first[0] - resumed[0] if first else None
            cost["rerun_steps"] = max(0, v0 - resumed[1])
            cost["rerun_s"] = cost["rerun_steps"] / rate
            cost["recovery_s"] = (first[0] - t0) if first else None  # to the first new step
            if first:  # what the slower steps after the first cost (the rest of lost_s)
                cost["after_s"] = cost["lost_s"] - cost["recovery_s"] - cost["rerun_s"]
            cost["outage_s"] = max(0.0, cost["lost_s"] - cost["rerun_s"])
        elif kill["kind"] == "worker":
            # One worker of WORKERS away for D seconds costs D / WORKERS of training.
            if cost.get("back_s") is not None:
                cost["recovery_s"] = cost["back_s"]
                cost["after_s"] = cost["lost_s"] - cost["back_s"] / WORKERS
            cost["outage_s"] = max(0.0, cost["lost_s"] * WORKERS)
        costs.append(cost)
    return costs


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def analyse(results: list[dict]) -> dict:
    """Pairs each chaos run with the fault-free runs beside it; costs, goodput, prediction."""
    order = [r for r in results]
    rows = []
    for i, run in enumerate(order):
        if run["seed"] is None:
            continue
        neighbours = [r for r in (order[i - 1] if i else None,
                                  order[i + 1] if i + 1 < len(order) else None)
                      if r is not None and r["seed"] is None and r["finished"]]
        if not neighbours:
            continue
        fault_free = statistics.mean(r["wall_s"] for r in neighbours)
        rate = _rate(neighbours)
        training = statistics.mean(r["train_end"] - r["train_start"] for r in neighbours)
        row = {"run": run, "fault_free_s": fault_free, "rate": rate, "training_s": training,
               "goodput": fault_free / run["wall_s"],
               "costs": kill_costs(run, rate) if run["events"]["it"] else []}
        rows.append(row)
    # The simulator's downtime per kind of kill, two ways: the median time from the kill to
    # the first step after it (a worker: to its return), or the median time the kill cost,
    # without the steps run again (which the simulator replays itself).
    recovery = {model: {kind: _median([c.get(key) for row in rows for c in row["costs"]
                                       if c["kind"] == kind]) for kind in KINDS}
                for model, key in (("first_step", "recovery_s"), ("lost", "outage_s"))}
    for row in rows:
        run = row["run"]
        train_start = run["started"] + (run["train_start"] or 0.0)
        schedule = [(k["time"] - train_start, k["kind"], int(k["task"].split()[1]))
                    for k in run["kills"]]
        for model, times in recovery.items():
            known = {kind: t for kind, t in times.items() if t is not None}
            row[model] = predict_goodput(
                known, schedule, row["fault_free_s"], training_time=row["training_s"],
                steps=run["requested"], workers=WORKERS, ps=PS, checkpoint_every=SAVE_FREQ,
                seed=run["seed"]) if run["finished"] and all(
                    kind in known for _, kind, _ in schedule) else None
    return {"rows": rows, "recovery": recovery}


def _fmt(value, spec=".1f"):
    return "" if value is None else format(value, spec)


def _overall(rows, key):
    """Goodput over several runs: their fault-free wall time over their wall time."""
    rows = [r for r in rows if r[key] is not None]
    if not rows:
        return None
    walls = [r["fault_free_s"] / r[key] for r in rows]
    return sum(r["fault_free_s"] for r in rows) / sum(walls)


def report(results: list[dict]) -> str:
    analysis = analyse(results)
    rows = analysis["rows"]
    lines = ["| run | finished | steps applied / requested | kills (worker, ps, chief) | "
             "wall s (fault-free) | wall s (chaos) | goodput | simulator, recovery = to "
             "first step | simulator, recovery = lost time |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for n, row in enumerate(rows, 1):
        run = row["run"]
        kinds = [k["kind"] for k in run["kills"]]
        lines.append(
            f"| {n} | {'yes' if run['finished'] else 'no'} | "
            f"{run['applied'] if run['applied'] is not None else 'n/a'} / {run['requested']} | "
            f"{len(kinds)} ({kinds.count('worker')}, {kinds.count('ps')}, "
            f"{kinds.count('chief')}) | {row['fault_free_s']:.1f} | {run['wall_s']:.1f} | "
            f"{row['goodput']:.3f} | {_fmt(row['first_step'], '.3f')} | "
            f"{_fmt(row['lost'], '.3f')} |")
    done = [row for row in rows if row["run"]["finished"]]
    if rows:
        measured = sum(r["fault_free_s"] for r in rows) / sum(r["run"]["wall_s"] for r in rows)
        kills = sum(len(r["run"]["kills"]) for r in rows)
        training = sum(r["run"]["train_end"] - r["run"]["train_start"] for r in rows)
        extra = [(r["run"]["applied"] - r["run"]["requested"], len(r["run"]["kills"]))
                 for r in done]
        worst = max((e / max(k, 1) for e, k in extra), default=0)
        lines.append(
            f"| all | {len(done)}/{len(rows)} | +{sum(e for e, _ in extra)} over "
            f"{sum(k for _, k in extra)} kills (at most {worst:.1f} per kill in a run; bound "
            f"{EXTRA_PER_KILL}) | {kills} (one per {training / max(kills, 1):.0f} s of "
            f"training) | {sum(r['fault_free_s'] for r in rows):.0f} | "
            f"{sum(r['run']['wall_s'] for r in rows):.0f} | **{measured:.3f}** | "
            f"{_fmt(_overall(done, 'first_step'), '.3f')} | "
            f"{_fmt(_overall(done, 'lost'), '.3f')} |")
    costs = [c for row in rows for c in row["costs"]]
    lines += ["", "| kill | count | lost s per kill (median) | lost s (total) | "
              "process start s | TF connect s | build + restore s | first step s | "
              "re-run s (steps) | slower steps after s | to first step s | lost without "
              "re-run s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        mine = [c for c in costs if c["kind"] == kind]
        if not mine:
            continue

        def med(key, mine=mine):
            return _fmt(_median([c.get(key) for c in mine]))

        rerun = _median([c.get("rerun_steps") for c in mine])
        lines.append(
            f"| {kind} | {len(mine)} | {med('lost_s')} | "
            f"{sum(c['lost_s'] for c in mine):.1f} | {med('process_s')} | {med('connect_s')} | "
            f"{med('restore_s')} | {med('first_step_s')} | "
            f"{med('rerun_s')}{'' if rerun is None else f' ({rerun:.0f})'} | "
            f"{med('after_s')} | {_fmt(analysis['recovery']['first_step'][kind])} | "
            f"{_fmt(analysis['recovery']['lost'][kind])} |")
    if rows:
        lost = sum(c["lost_s"] for c in costs)
        delta = sum(r["run"]["wall_s"] - r["fault_free_s"] for r in rows)
        lines.append(f"\nChaos runs took {delta:.0f} s more than their fault-free neighbours; "
                     f"the kills' lost time adds up to {lost:.0f} s (the rest: start-up and "
                     "shut-down differences, and kills' effects past the next kill).")
    return "\n".join(lines)


def _compact(result: dict) -> dict:
    """The run without its per-step readings (kept with --json)."""
    return {k: v for k, v in result.items() if k not in ("events", "launcher", "output")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=None,
                        help="chaos runs (default 10; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: a short job in which a worker, a ps task and the "
                             "chief are killed in turn, one fault-free run before it and none "
                             "after; exits 1 unless every requested step was applied, each "
                             "at most as often as the at-least-once bound allows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every run's results here")
    parser.add_argument("--report", help="print the tables of a saved --json file")
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return
    config = QUICK if args.quick else FULL
    args.runs = args.runs or (1 if args.quick else 10)
    results = []
    plan = [None] + [x for i in range(args.runs) for x in (args.seed + i, None)]
    if args.quick:
        plan = plan[:-1]  # a chaos run's goodput needs one fault-free neighbour
    for seed in plan:
        with tempfile.TemporaryDirectory(prefix="kerasps-chaos-") as workdir:
            result = run_job(workdir, config, seed)
        results.append(result)
        print(json.dumps(_compact(result)), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    print(f"\n`python benchmarks/chaos.py{' --quick' if args.quick else ''} --runs {args.runs}`"
          f" ({config.epochs} x {config.steps} steps, a kill every {config.kill_every[0]:.0f}-"
          f"{config.kill_every[1]:.0f} s; nproc {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}):\n")
    print(report(results))
    if args.quick and not all(r["finished"] for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
