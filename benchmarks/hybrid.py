"""Hybrid training on a synthetic CTR task: async, sync, sync + 1 backup and hybrid, with a
straggler, measured and as the simulator predicts them (issue 33).

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
`training.apply_time`) is calibrated on the traces of the two runs without backup
workers (sync and hybrid): the workers' dense step (a kept gradient function of a fast
worker plus the coordinator's gap before it), the apply function of a hybrid step
(dense means only), and a row update's cost (the sync apply, which also applies the
kept row updates, less the hybrid one, per kept gradient). It predicts the runs with a
backup worker and the async run; the two calibration runs are marked as such.

    python benchmarks/hybrid.py               # about 6 min on 2 cores
    python benchmarks/hybrid.py --quick       # a smoke run
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
import time

# The repository's root, for `simulator` and `tests` run from a checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dynamic_embedding import auc  # noqa: E402  (one AUC for the benchmarks)

WORKERS = 4
BATCH = 256
ROWS = 100_000
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
    windows, fit_seconds = [], 0.0

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.origin = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            nonlocal fit_seconds
            end = time.perf_counter()
            windows.append((self.begin - self.origin, end - self.origin))
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
            "auc": curve[-1][1], "curve": curve}


def _child(args, mode, backups, delay, steps, trace_path=None):
    command = [sys.executable, __file__, "--one", mode, str(backups), str(delay),
               "--steps", str(steps), "--epochs", str(args.epochs)] + (
        ["--trace", trace_path] if trace_path else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{mode} backups={backups} failed:\n{done.stderr[-3000:]}")


def calibrate(sync_trace, hybrid_trace):
    """The simulator's costs from the two runs without backups (see the module doc)."""
    from kerasps.policy.trace import read_trace

    def costs(path):
        events = read_trace(path)
        applies = sorted((e for e in events if e.kind == "apply"), key=lambda e: e.end)
        ended = {e.version: e.end for e in applies}
        kept = [e for e in events if e.kind == "train" and not e.dropped and e.worker != 0
                and e.version >= 0]
        gaps = [e.start - ended[e.version - 1] for e in kept if e.version - 1 in ended]
        return ([e.duration for e in kept], statistics.median(e.duration for e in applies),
                max(0.0, statistics.median(gaps)) if gaps else 0.0)

    sync_gradients, sync_apply, sync_gap = costs(sync_trace)
    hybrid_gradients, hybrid_apply, hybrid_gap = costs(hybrid_trace)
    embedding = max(0.0, (sync_apply - hybrid_apply) / WORKERS)
    gap = statistics.mean([sync_gap, hybrid_gap])
    # Dense part of a worker step: a sync gradient function (its rows only queued), and
    # the coordinator's gap between an apply and the next step's functions.
    dense = [g + gap for g in sync_gradients]
    return {"dense": dense, "dense_mean": statistics.mean(dense), "embedding_time": embedding,
            "apply_time": hybrid_apply, "sync_apply": sync_apply, "gap": gap,
            "hybrid_gradient_mean": statistics.mean(hybrid_gradients)}


def predict(model, mode, backups, delay, steps=3000):
    """The simulator's steady steps/s for `mode` with worker 0's input `delay`ed."""
    import simulator

    dense = model["dense"]
    if mode == "async":  # each worker step applies its dense gradient too
        samples = [d + model["embedding_time"] + model["apply_time"] for d in dense]
        step_time = {"distribution": "empirical", "samples": samples}
        workers = {"count": WORKERS, "step_time": step_time}
        training = {"mode": "async", "steps": steps * WORKERS}
        cycle = statistics.mean(samples)
    elif mode == "sync":
        # kerasps lets a late worker finish its dropped gradient and leaves it out of
        # the next step unless that step would be short, as the simulator's hybrid
        # policy does; its sync policy cancels late workers instead. So a kerasps sync
        # step is simulated as a hybrid step without row updates on arrival, whose
        # apply function takes the sync apply's time (dense means and kept rows).
        workers = {"count": WORKERS,
                   "step_time": {"distribution": "empirical", "samples": dense}}
        training = {"mode": "hybrid", "steps": steps, "backup_workers": backups,
                    "apply_time": model["sync_apply"]}
        cycle = model["dense_mean"]
    else:
        workers = {"count": WORKERS, "embedding_time": model["embedding_time"],
                   "step_time": {"distribution": "empirical", "samples": dense}}
        training = {"mode": mode, "steps": steps, "backup_workers": backups,
                    "apply_time": model["apply_time"]}
        cycle = model["dense_mean"]
    # The delayed batch is prepared while the worker's previous step runs (as in
    # `simulator.calibrate.predict_sync_step_time`): its cycle is the longer of the two.
    # The straggler is the simulator's last worker; the workers are alike otherwise.
    stragglers = {"count": 1, "slowdown": max(cycle, delay) / cycle}
    result = simulator.run(simulator.Scenario.from_dict(
        {"name": f"hybrid benchmark {mode}", "workers": workers, "training": training,
         "stragglers": stragglers}))
    return result.steps_per_second


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("MODE", "BACKUPS", "DELAY"))
    parser.add_argument("--steps", type=int, default=None,
                        help="gradients applied per mode, in worker steps (960)")
    parser.add_argument("--epochs", type=int, default=None, help="AUC points (4)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 96 gradients")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--plot", help="write the AUC against wall time figure (PNG)")
    parser.add_argument("--trace", help="with --one: write the run's trace CSV here")
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
    probe = _child(args, "sync", 0, 0.0, max(32, args.steps // WORKERS // 2))
    delay = 3 / probe["steps_per_s"]
    print(f"# hybrid: {WORKERS} workers, 1 ps, batch {BATCH}, Zipf({ZIPF}) ids over "
          f"{ROWS:,} x {DIM} rows; probe sync {probe['steps_per_s']:.1f} steps/s, worker 0 "
          f"held back {1000 * delay:.0f} ms per batch", flush=True)
    runs = {}
    for name, mode, backups, _ in MODES:
        updates = args.steps if mode == "async" else args.steps // (WORKERS - backups)
        trace = os.path.join(folder, f"{mode}{backups}.csv")
        runs[name] = _child(args, mode, backups, delay, updates, trace)
        r = runs[name]
        print(f"  {name:18s} {r['steps_per_s']:7.2f} steps/s steady, "
              f"{r['steps_per_s_call']:7.2f} whole call, AUC {r['auc']:.4f}, "
              f"dropped {r['dropped']:.0f}", flush=True)
    model = calibrate(runs["sync"]["trace"], runs["hybrid"]["trace"])
    print(f"# calibrated: dense step {1000 * model['dense_mean']:.1f} ms (gap "
          f"{1000 * model['gap']:.1f} ms), row update {1000 * model['embedding_time']:.2f} ms, "
          f"hybrid apply {1000 * model['apply_time']:.1f} ms, sync apply "
          f"{1000 * model['sync_apply']:.1f} ms", flush=True)

    anchor = runs["sync"]
    anchor_examples = anchor["steps_per_s"] * WORKERS * BATCH
    lines = ["| mode | steps/s (steady) | steps/s (whole call) | examples/s | simulator "
             "steps/s | error | AUC | AUC gap to sync | speed-up over sync | dropped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors = {}
    for name, mode, backups, calibration in MODES:
        r = runs[name]
        per_update = 1 if mode == "async" else WORKERS - backups
        examples = r["steps_per_s"] * per_update * BATCH
        predicted = predict(model, mode, backups, delay)
        error = predicted / r["steps_per_s"] - 1
        r.update(examples_per_s=examples, predicted_steps_per_s=predicted, error=error,
                 auc_gap=r["auc"] - anchor["auc"], speedup=examples / anchor_examples)
        if not calibration:
            errors[name] = error
        note = " (calibration)" if calibration else ""
        lines.append(f"| {name} | {r['steps_per_s']:.2f} | {r['steps_per_s_call']:.2f} "
                     f"| {examples:,.0f} | {predicted:.2f}{note} "
                     f"| {100 * error:+.1f}% | {r['auc']:.4f} | {r['auc_gap']:+.4f} "
                     f"| {r['speedup']:.2f}x | {r['dropped']:.0f} |")
    within = all(abs(e) <= 0.10 for e in errors.values())
    lines += ["", f"Simulator predictions ({', '.join(errors)}): "
              f"{'within' if within else 'NOT within'} 10% of the measured steady rates "
              f"(worst {100 * max(abs(e) for e in errors.values()):.1f}%). "
              f"{args.steps} gradients of {BATCH} examples applied per mode in "
              f"{args.epochs} epochs; worker 0 held back {1000 * delay:.0f} ms per batch; "
              f"nproc {os.cpu_count()}; {time.perf_counter() - began:.0f} s in all."]
    print()
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"delay": delay, "probe": probe, "calibration": {
                k: v for k, v in model.items() if k != "dense"}, "steps": args.steps,
                "epochs": args.epochs, "nproc": os.cpu_count(),
                "results": {name: {k: v for k, v in r.items() if k != "trace"}
                            for name, r in runs.items()}}, f, indent=1)
        print(f"wrote {args.json}")
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
        axes.set_title(f"{WORKERS} workers, worker 0 3x slower: AUC against wall time")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
