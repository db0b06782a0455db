"""Hybrid training on a synthetic CTR task: async, sync, sync + 1 backup and hybrid, with a
straggler, measured and as the simulator predicts them.

An in-process cluster of 4 workers and 1 ps task trains a click model: 8 ids per
example drawn from a Zipf law (exponent 1.1) over a 100,000 x 16 `Embedding` table
(averaged), 8 dense features, a 32-unit dense tower, SGD. Labels follow a fixed hidden
rule (a weight per id and per feature, Bernoulli of the logit), so the held-out AUC
(20,000 examples) measures what the model learnt. Worker 0's input is held back
(`kerasps.input.slowed`) 3x the global step time of a short no-straggler sync probe,
so its steps take about 3x as long.

Every mode trains on the same number of examples in applied gradients (async: one
update per worker step; sync and hybrid: one per global step of
`4 - backup_workers` gradients), in `--epochs` epochs with the held-out AUC after each
(the clock stopped while it is computed). Reported per mode: steps/s (model updates:
async worker steps, global steps otherwise) in steady state (from the trace, each
epoch's first steps left out) and over the whole `fit` call, examples/s, the final AUC,
its gap to sync and the speed-up over sync (examples/s, as PERSIA reports it), and the
simulator's predicted steady steps/s with its error.

The simulator (`training.mode = "hybrid"`, `workers.embedding_time`,
`training.apply_time`, and `[machine]`: the in-process cluster's tasks share this
machine's cores, of which other jobs keep some busy) is calibrated on the two runs without
backup workers (sync and hybrid), in seconds of work on a core of its own: the trace
tells how long each function took while how many others computed (`work`), and the CPU
time of the cluster's process sets the level (`calibrate`). That gives a fast worker's
gradient function (sync: its rows only queued; hybrid: its rows applied), the apply
function of a global step (dense means; in sync mode the kept row updates too: a row
update's cost is the difference, per kept gradient), and the coordinator's gap between an
apply and the next step's functions; an async step function costs a hybrid gradient
function (it applies its dense gradient where hybrid writes it to a slot; no apply
function follows). Each prediction runs the simulator with the cores of
this process's affinity mask, the cores the other jobs used during the run predicted
(sampled from `/proc`: Linux shares the cores fairly among sessions first, so their
runnable threads do not count), worker 0's input held back as measured, off the cores,
and sync's late workers finishing their step as kerasps lets them. It predicts the runs
with a backup worker and the async run; the two calibration runs are marked as such.
With `--repeats N` every mode runs N times (the modes in turn), each round calibrating
its own predictions, and the table has the means.

    python benchmarks/hybrid.py               # about 4 min on 2 cores
    python benchmarks/hybrid.py --repeats 3   # every mode 3 times, the means
    python benchmarks/hybrid.py --quick       # a smoke run: 96 gradients, no probe
    python benchmarks/hybrid.py --plot docs/hybrid_auc.png --json benchmarks/records/...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# The repository's root, for `simulator` and `tests` run from a checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynamic_embedding import auc  # noqa: E402  (one AUC for the benchmarks)

WORKERS = 4
BATCH = 256
ROWS = 100_000
QUICK_DELAY = 0.1  # seconds worker 0's batches are held back in a --quick run
DIM = 16
IDS = 8
FEATURES = 8
ZIPF = 1.1
HELD_OUT = 20_000
RESULT = "HYBRID_RESULT "
# (name, mode, backup workers, calibration run); sync is the anchor.
MODES = (("sync", "sync", 0, True), ("hybrid", "hybrid", 0, True),
         ("sync + 1 backup", "sync", 1, False), ("hybrid + 1 backup", "hybrid", 1, False),
         ("async", "async", 0, False))


def _hidden():
    """The hidden rule: a weight per id and per dense feature, and the Zipf CDF."""
    import numpy as np

    rng = np.random.default_rng(1234)
    id_weights = rng.normal(0.0, 1.5, ROWS).astype("float32")
    feature_weights = rng.normal(0.0, 0.7, FEATURES).astype("float32")
    p = 1.0 / np.arange(1, ROWS + 1) ** ZIPF
    cdf = np.cumsum(p / p.sum()).astype("float64")
    return id_weights, feature_weights, cdf


def held_out():
    import numpy as np

    id_weights, feature_weights, cdf = _hidden()
    rng = np.random.default_rng(99)
    ids = np.minimum(np.searchsorted(cdf, rng.random((HELD_OUT, IDS))), ROWS - 1)
    x = rng.normal(size=(HELD_OUT, FEATURES)).astype("float32")
    logit = id_weights[ids].mean(axis=1) * 2.0 + x @ feature_weights
    y = (rng.random(HELD_OUT) < 1 / (1 + np.exp(-logit))).astype("float32")
    return (x, ids.astype("int64")), y


def _dataset_fn(delay):
    id_weights, feature_weights, cdf = _hidden()

    def dataset_fn(context):
        import tensorflow as tf

        import kerasps

        seed = context.input_pipeline_id
        weights = tf.constant(id_weights)
        features = tf.constant(feature_weights)
        cdf_t = tf.constant(cdf)

        def batch(i):
            s = tf.stack([tf.cast(seed, tf.int64), i])
            u = tf.random.stateless_uniform([BATCH, IDS], seed=s, dtype=tf.float64)
            ids = tf.minimum(tf.searchsorted(cdf_t, tf.reshape(u, [-1])), ROWS - 1)
            ids = tf.reshape(tf.cast(ids, tf.int64), [BATCH, IDS])
            x = tf.random.stateless_normal([BATCH, FEATURES], seed=s + 1)
            logit = tf.reduce_mean(tf.gather(weights, ids), axis=1) * 2.0 + tf.linalg.matvec(
                x, features)
            click = tf.random.stateless_uniform([BATCH], seed=s + 2) < tf.sigmoid(logit)
            return (x, ids), tf.cast(click, tf.float32)

        dataset = tf.data.Dataset.range(1 << 40).map(batch).prefetch(2)
        if delay and context.input_pipeline_id == 0:
            dataset = kerasps.input.slowed(dataset, delay)
        return dataset
    return dataset_fn


def _model():
    import keras

    dense = keras.Input((FEATURES,))
    ids = keras.Input((IDS,), dtype="int64")
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ROWS, DIM)(ids))
    h = keras.layers.Concatenate()([dense, embedded])
    h = keras.layers.Dense(32, "relu")(h)
    return keras.Model([dense, ids], keras.layers.Dense(1, "sigmoid")(h))


def run_one(mode, backups, delay, steps, epochs, trace_path=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import kerasps

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=WORKERS, num_ps=1),
        **({} if mode == "async" else dict(mode=mode, backup_workers=backups)))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _model()
        model.compile(keras.optimizers.SGD(0.5), "binary_crossentropy")
    single = _model()
    single.compile(keras.optimizers.SGD(0.5), "binary_crossentropy")
    (x, ids), y = held_out()

    def evaluate():
        single.set_weights(model.get_weights())
        return auc(np.ravel(y), np.concatenate([
            np.asarray(single([x[i:i + 5000], ids[i:i + 5000]])).ravel()
            for i in range(0, len(y), 5000)]))

    data = kerasps.DatasetCreator(_dataset_fn(delay))
    model.fit(data, epochs=1, steps_per_epoch=8, verbose=0)  # warm-up: trace functions
    curve = [(0.0, evaluate())]
    windows, clock, fit_seconds = [], [], 0.0

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.origin = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            nonlocal fit_seconds
            end = time.perf_counter()
            windows.append((self.begin - self.origin, end - self.origin))
            clock.append((self.begin, end))
            fit_seconds += end - self.begin
            curve.append((fit_seconds, evaluate()))

    recorder = kerasps.StepTraceRecorder(trace_path)
    per_epoch = max(1, steps // epochs)
    start = time.perf_counter()
    history = model.fit(data, epochs=epochs, steps_per_epoch=per_epoch, verbose=0,
                        callbacks=[recorder, Clock()])
    call_seconds = time.perf_counter() - start
    eval_seconds = call_seconds - fit_seconds
    kind = "train" if mode == "async" else "apply"
    ends = sorted(e.end for e in recorder.events if e.kind == kind)
    counted, seconds = 0, 0.0
    for begin, end in windows:  # steady state: each epoch less its first fifth
        inside = [t for t in ends if begin <= t <= end]
        inside = inside[len(inside) // 5:]
        if len(inside) > 1:
            counted += len(inside) - 1
            seconds += inside[-1] - inside[0]
    total = per_epoch * epochs
    return {"mode": mode, "backups": backups, "delay": delay, "steps": total,
            "trace": trace_path, "call_seconds": call_seconds - eval_seconds,
            "steps_per_s_call": total / (call_seconds - eval_seconds),
            "steps_per_s": counted / seconds if seconds else float("nan"),
            "dropped": sum(history.history.get("dropped_gradients", [0])),
            "staleness": history.history.get("staleness", [float("nan")])[-1],
            "auc": curve[-1][1], "curve": curve, "epochs_at": clock}


class LoadSampler(threading.Thread):
    """What else ran on the machine during a run, sampled every `period` seconds.

    Linux shares the cores fairly among process groups (sessions, with autogroup
    scheduling) before threads, so what competes with the run is the other groups that
    keep a core busy, however many threads they run. Each sample has the CPU the run's
    process and every other group used since the previous sample (`/proc/PID/stat`,
    groups from `/proc/PID/autogroup`), and the runnable threads of the machine
    (`procs_running` of `/proc/stat`) and of the run.
    """

    def __init__(self, pid, period=0.25):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples = []  # (perf_counter, run's cores, other groups' cores, runnable, run's)
        self.stop = threading.Event()
        self._groups, self._ticks = {}, {}
        self._own = str(os.getpid())
        self._hz = os.sysconf("SC_CLK_TCK")

    def _group(self, pid):
        if pid not in self._groups:
            try:
                with open(f"/proc/{pid}/autogroup") as f:
                    self._groups[pid] = (f.read().split() or ["kernel"])[0]
            except OSError:
                self._groups[pid] = f"pid {pid}"
        return self._groups[pid]

    def _cpu(self):
        """Seconds of CPU each process used so far, by pid."""
        ticks = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid == self._own:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            ticks[pid] = (int(fields[11]) + int(fields[12])) / self._hz
        return ticks

    def _runnable(self):
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f
                           if line.startswith("procs_running"))
        own, tasks = 0, f"/proc/{self.pid}/task"
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat") as f:
                    own += f.read().rpartition(")")[2].split()[0] == "R"
            except OSError:
                pass
        return running - 1, own  # less the sampler

    def run(self):
        before, then = self._cpu(), time.perf_counter()
        while not self.stop.wait(self.period):
            try:
                running, own = self._runnable()
                now, ticks = time.perf_counter(), self._cpu()
            except (OSError, StopIteration):
                continue
            elapsed, groups, mine = now - then, {}, 0.0
            for pid, seconds in ticks.items():
                used = seconds - before.get(pid, seconds)
                if pid == str(self.pid):
                    mine = used / elapsed
                elif used > 0:
                    group = self._group(pid)
                    groups[group] = groups.get(group, 0.0) + used / elapsed
            self.samples.append((now, mine, sorted(groups.values(), reverse=True),
                                 running, own))
            before, then = ticks, now

    def load(self, windows):
        """The mean load over `windows`: cores the run used, cores the other groups used,
        other groups busy (each weighted by its share of a core, up to 1), runnable
        threads of the run and of the rest of the machine."""
        inside = [s for s in self.samples if any(b <= s[0] <= e for b, e in windows)]
        if not inside:
            return dict.fromkeys(("cores_used", "other_cores", "other_groups", "own_load",
                                  "other_load"), float("nan"))
        return {"cores_used": statistics.mean(s[1] for s in inside),
                "other_cores": statistics.mean(sum(s[2]) for s in inside),
                "other_groups": statistics.mean(sum(min(1.0, c) for c in s[2])
                                                for s in inside),
                "own_load": statistics.mean(s[4] for s in inside),
                "other_load": statistics.mean(max(0, s[3] - s[4]) for s in inside)}


def _child(args, mode, backups, delay, steps, trace_path=None):
    command = [sys.executable, __file__, "--one", mode, str(backups), str(delay),
               "--steps", str(steps), "--epochs", str(args.epochs)] + (
        ["--trace", trace_path] if trace_path else [])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    sampler = LoadSampler(process.pid)
    sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=900)
    finally:
        sampler.stop.set()
        sampler.join()
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
            result.update(sampler.load(result["epochs_at"]))
            result["load_samples"] = [s for s in sampler.samples if any(
                b <= s[0] <= e for b, e in result["epochs_at"])]
            return result
    raise RuntimeError(f"{mode} backups={backups} failed:\n{stderr[-3000:]}")


def cores():
    """The cores this process may run on (its affinity mask), as the cluster's tasks do."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def work(events, ncores, background):
    """Seconds of work on a core of its own of each event in `events` (a trace's step
    functions), as `simulator.machine` shares the cores: while `n` functions compute, each
    does `min(1, (ncores - background) / n)` seconds of work per second, `background`
    being the cores other jobs used meanwhile.

    What computes when is read from the trace: the fast workers' gradient functions and
    the apply functions all along, the coordinator between an apply and the next step's
    first function, and worker 0's functions only at their end (they wait for their
    held-back batch first, off the cores), for as long as a fast worker's median work
    takes at the rate of one function.

    Returns:
        `{"train": [(event, work)], "apply": [(event, work)], "gap": [work]}`.
    """
    train = [e for e in events if e.kind == "train"]
    applies = sorted((e for e in events if e.kind == "apply"), key=lambda e: e.end)
    starts = {}
    for e in train:
        starts[e.version] = min(starts.get(e.version, e.start), e.start)
    gaps = [(a.end, starts[a.version + 1]) for a in applies
            if starts.get(a.version + 1, a.end) > a.end]
    fast = [e for e in train if e.worker != 0]
    shared = [(a.start, a.end) for a in applies] + gaps

    def integral(busy):
        """Work done from the first of `busy`'s ends to each end: `done(begin, end)`."""
        points = sorted({t for interval in busy for t in interval})
        index = {t: i for i, t in enumerate(points)}
        change = [0] * (len(points) + 1)
        for begin, end in busy:
            change[index[begin]] += 1
            change[index[end]] -= 1
        cumulative, n = [0.0], 0
        for i in range(len(points) - 1):
            n += change[i]
            rate = min(1.0, (ncores - background) / n) if n else 1.0
            cumulative.append(cumulative[-1] + (points[i + 1] - points[i]) * rate)
        return lambda begin, end: cumulative[index[end]] - cumulative[index[begin]]

    done = integral([(e.start, e.end) for e in fast] + shared)
    median = statistics.median([done(e.start, e.end) for e in fast] or [0.0])
    tail = median / min(1.0, ncores - background)
    computing = {id(e): (e.start if e.worker != 0 else max(e.start, e.end - tail), e.end)
                 for e in train}
    done = integral(list(computing.values()) + shared)
    return {"train": [(e, done(*computing[id(e)])) for e in train],
            "apply": [(a, done(a.start, a.end)) for a in applies],
            "gap": [done(begin, end) for begin, end in gaps]}


def calibrate(sync_run, hybrid_run, ncores):
    """The simulator's costs, seconds of work on a core of its own, from the two runs
    without backups (see the module doc).

    The trace shares each run's functions' time out as `work` does, with the cores the
    other jobs used during the run; the CPU time the cluster's process used (all its
    threads: the coordinator's and the input pipelines' too) then sets the level: the
    functions' work is scaled so that it adds up to it.
    """
    from kerasps.policy.trace import read_trace

    def costs(run):
        shares = work(read_trace(run["trace"]), ncores, run["other_cores"])
        total = (sum(w for _, w in shares["train"]) + sum(w for _, w in shares["apply"])
                 + sum(shares["gap"]))
        scale = run["cores_used"] * run["call_seconds"] / total
        gradients = [scale * w for e, w in shares["train"] if not e.dropped
                     and e.worker != 0 and e.version >= 0]
        return (gradients, scale * statistics.median(w for _, w in shares["apply"]),
                scale * statistics.median(shares["gap"]) if shares["gap"] else 0.0, scale)

    sync_gradients, sync_apply, sync_gap, sync_scale = costs(sync_run)
    hybrid_gradients, hybrid_apply, hybrid_gap, hybrid_scale = costs(hybrid_run)
    embedding = max(0.0, (sync_apply - hybrid_apply) / WORKERS)
    gap = statistics.mean([sync_gap, hybrid_gap])
    # A sync gradient function only queues its rows on the ps tasks; a hybrid one applies
    # them (the row update's `embedding_time`, in the worker step) besides the dense part.
    return {"sync_dense": sync_gradients, "hybrid_dense": [
                max(0.0, g - embedding) for g in hybrid_gradients],
            "sync_dense_mean": statistics.mean(sync_gradients),
            "hybrid_gradient_mean": statistics.mean(hybrid_gradients),
            "embedding_time": embedding, "apply_time": hybrid_apply, "sync_apply": sync_apply,
            "gap": gap, "cores": ncores, "scale": [sync_scale, hybrid_scale]}


def predict(model, mode, backups, delay, background, steps=3000):
    """The simulator's steady steps/s for `mode` with worker 0's input `delay`ed, on the
    calibrated cores, of which other jobs use `background`."""
    import simulator

    def empirical(samples):
        return {"distribution": "empirical", "samples": samples}

    if mode == "async":
        # An async step function is a hybrid gradient function that applies its dense
        # gradient (800 weights) where hybrid writes it to a slot; the apply function of
        # a global step (a second function: its dispatch, the slots' mean) has no
        # counterpart.
        workers = {"step_time": empirical([d + model["embedding_time"]
                                           for d in model["hybrid_dense"]])}
        training = {"mode": "async", "steps": steps * WORKERS}
    elif mode == "sync":  # kerasps lets a late worker finish: `late_workers = "finish"`
        workers = {"step_time": empirical(model["sync_dense"])}
        training = {"mode": "sync", "steps": steps, "backup_workers": backups,
                    "late_workers": "finish", "apply_time": model["sync_apply"] + model["gap"]}
    else:
        workers = {"step_time": empirical(model["hybrid_dense"]),
                   "embedding_time": model["embedding_time"]}
        training = {"mode": mode, "steps": steps, "backup_workers": backups,
                    "apply_time": model["apply_time"] + model["gap"]}
    # The straggler is the simulator's last worker; its batch is prepared while it computes.
    # Every task of the in-process cluster (the ps task's apply functions and the
    # coordinator included) shares this machine's cores.
    result = simulator.run(simulator.Scenario.from_dict(
        {"name": f"hybrid benchmark {mode}", "workers": {"count": WORKERS, **workers},
         "training": training, "stragglers": {"count": 1, "input_delay": delay},
         "machine": {"cores": model["cores"], "background": background,
                     "ps": mode != "async"}}))
    return result.steps_per_second


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("MODE", "BACKUPS", "DELAY"))
    parser.add_argument("--steps", type=int, default=None,
                        help="gradients applied per mode, in worker steps (960)")
    parser.add_argument("--epochs", type=int, default=None, help="AUC points (4)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: 96 gradients per mode in 2 epochs, worker 0 held "
                             f"back {1000 * QUICK_DELAY:.0f} ms per batch (no probe run)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--plot", help="write the AUC against wall time figure (PNG)")
    parser.add_argument("--trace", help="with --one: write the run's trace CSV here")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every mode, each calibrating its own predictions; "
                             "the table has their means (1)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (96 if args.quick else 960)
    args.epochs = args.epochs or (2 if args.quick else 4)
    if args.one:
        mode, backups, delay = args.one
        print(RESULT + json.dumps(run_one(mode, int(backups), float(delay), args.steps,
                                          args.epochs, args.trace)), flush=True)
        return 0

    began = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="hybrid-")
    if args.quick:  # no probe: a fixed delay
        probe, delay = None, QUICK_DELAY
    else:
        probe = _child(args, "sync", 0, 0.0, max(32, args.steps // WORKERS // 2))
        delay = 3 / probe["steps_per_s"]
    ncores = cores()
    print(f"# hybrid: {WORKERS} workers, 1 ps, batch {BATCH}, Zipf({ZIPF}) ids over "
          f"{ROWS:,} x {DIM} rows, {ncores} cores; "
          + (f"probe sync {probe['steps_per_s']:.1f} steps/s, " if probe else "")
          + f"worker 0 held back {1000 * delay:.0f} ms per batch; traces in {folder}",
          flush=True)
    repeats, loads = [], []
    for repeat in range(args.repeats):
        runs = {}
        for name, mode, backups, _ in MODES:
            updates = args.steps if mode == "async" else args.steps // (WORKERS - backups)
            trace = os.path.join(folder, f"{mode}{backups}-{repeat}.csv")
            runs[name] = r = _child(args, mode, backups, delay, updates, trace)
            loads.append(os.getloadavg()[0])
            print(f"  {repeat + 1}/{args.repeats} {name:18s} {r['steps_per_s']:7.2f} steps/s "
                  f"steady, {r['steps_per_s_call']:7.2f} whole call, AUC {r['auc']:.4f}, "
                  f"dropped {r['dropped']:.0f}; cores used: its {r['cores_used']:.2f}, other "
                  f"jobs' {r['other_cores']:.2f}; load average {loads[-1]:.1f}", flush=True)
        model = calibrate(runs["sync"], runs["hybrid"], ncores)
        print(f"  calibrated, seconds of work on a core of its own: a fast worker's gradient "
              f"function {1000 * model['sync_dense_mean']:.1f} ms (sync), "
              f"{1000 * model['hybrid_gradient_mean']:.1f} ms (hybrid); row update "
              f"{1000 * model['embedding_time']:.2f} ms; apply "
              f"{1000 * model['apply_time']:.1f} ms (hybrid), "
              f"{1000 * model['sync_apply']:.1f} ms (sync); coordinator gap "
              f"{1000 * model['gap']:.1f} ms", flush=True)
        for name, mode, backups, _ in MODES:
            r = runs[name]
            r["predicted_steps_per_s"] = predict(model, mode, backups, delay,
                                                 r["other_cores"])
            r["error"] = r["predicted_steps_per_s"] / r["steps_per_s"] - 1
        repeats.append({"calibration": {k: v for k, v in model.items()
                                        if not isinstance(v, list) or k == "scale"},
                        "results": runs})

    def mean(name, key):
        return statistics.mean(rep["results"][name][key] for rep in repeats)

    anchor_examples = mean("sync", "steps_per_s") * WORKERS * BATCH
    lines = ["| mode | steps/s (steady) | steps/s (whole call) | examples/s | other jobs' "
             "cores | simulator steps/s | error | AUC | AUC gap to sync | speed-up over "
             "sync | dense gradients dropped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors, summary = {}, {}
    for name, mode, backups, calibration in MODES:
        measured, predicted = mean(name, "steps_per_s"), mean(name, "predicted_steps_per_s")
        examples = measured * (1 if mode == "async" else WORKERS - backups) * BATCH
        error = predicted / measured - 1
        summary[name] = row = {
            "steps_per_s": measured, "steps_per_s_call": mean(name, "steps_per_s_call"),
            "examples_per_s": examples, "other_cores": mean(name, "other_cores"),
            "predicted_steps_per_s": predicted, "error": error,
            "errors": [rep["results"][name]["error"] for rep in repeats],
            "auc": mean(name, "auc"), "auc_gap": mean(name, "auc") - mean("sync", "auc"),
            "speedup": examples / anchor_examples, "dropped": mean(name, "dropped")}
        if not calibration:
            errors[name] = error
        note = " (calibration)" if calibration else ""
        lines.append(f"| {name} | {measured:.2f} | {row['steps_per_s_call']:.2f} "
                     f"| {examples:,.0f} | {row['other_cores']:.2f} | {predicted:.2f}{note} "
                     f"| {100 * error:+.1f}% | {row['auc']:.4f} | {row['auc_gap']:+.4f} "
                     f"| {row['speedup']:.2f}x | {row['dropped']:.0f} |")
    within = all(abs(e) <= 0.10 for e in errors.values())
    worst = max(abs(e) for name in errors for e in summary[name]["errors"])
    lines += ["", f"Simulator predictions ({', '.join(errors)}): "
              f"{'within' if within else 'NOT within'} 10% of the measured steady rates "
              f"(worst {100 * max(abs(e) for e in errors.values()):.1f}%; worst single run "
              f"{100 * worst:.1f}%). Means of {args.repeats} run(s) per mode; "
              f"{args.steps} gradients of {BATCH} examples applied per run in "
              f"{args.epochs} epochs; worker 0 held back {1000 * delay:.0f} ms per batch; "
              f"{ncores} cores; load average {min(loads):.1f} to {max(loads):.1f}; "
              f"{time.perf_counter() - began:.0f} s in all."]
    print()
    print("\n".join(lines))
    if args.json:
        dropped = ("trace", "load_samples", "epochs_at")
        with open(args.json, "w") as f:
            json.dump({"delay": delay, "probe": probe, "steps": args.steps,
                       "epochs": args.epochs, "repeats": args.repeats, "cores": ncores,
                       "nproc": os.cpu_count(), "load_average": [min(loads), max(loads)],
                       "summary": summary, "runs": [
                           {"calibration": rep["calibration"], "results": {
                               name: {k: v for k, v in r.items() if k not in dropped}
                               for name, r in rep["results"].items()}}
                           for rep in repeats]}, f, indent=1)
        print(f"wrote {args.json}")
    runs = repeats[0]["results"]
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6.4, 4.0))
        for name, r in runs.items():
            seconds, aucs = zip(*r["curve"])
            axes.plot(seconds, aucs, marker="o", label=name)
        axes.set_xlabel("training wall time (s), evaluation excluded")
        axes.set_ylabel("held-out AUC")
        axes.set_title(f"{WORKERS} workers, worker 0 3x slower: AUC against wall time"
                       + (" (run 1)" if args.repeats > 1 else ""))
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
