"""A straggler among 4 workers: sync, sync + 1 backup worker and async, measured and simulated.

An in-process cluster of 4 workers and 1 ps task trains a small MLP (per-worker
batch 32, SGD). Worker 0 is made 3x slower by holding back each of its batches
(`kerasps.input.slowed`) for twice the global step time of the no-straggler
sync run. (Not twice its gradient function's time: the 4 workers share the
machine's cores, so while worker 0 waits the others compute faster, and a
delay shorter than a whole step hides behind them.) For each mode (async, sync, sync with
`backup_workers=1`), with and without the straggler, one warm-up `fit`, then a
timed `fit`; reported: time per global step (async: per 4 worker-steps, the
same examples), its ratio to the same mode without the straggler, gradients
dropped, the loss on a fixed evaluation set after the same number of examples
trained, and the simulator's prediction.

The simulator is calibrated on the no-straggler sync run's own trace
(`kerasps.StepTraceRecorder`), by `simulator.calibrate.predict_sync_step_time`.

    python benchmarks/stragglers.py            # 3 interleaved repeats, ~15 min on 2 cores
    python benchmarks/stragglers.py --quick    # a smoke run: 15 timed steps, 1 repeat

Targets: sync + 1 backup within 1.3x of its no-straggler step time
while plain sync is near 3x; sync throughput without stragglers >= 0.7x async.
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

from simulator.calibrate import predict_sync_step_time

WORKERS = 4
BATCH = 32
FEATURES = 16
RESULT = "STRAGGLERS_RESULT "
MODES = (("async", 0), ("sync", 0), ("sync", 1))


def _dataset_fn(delay):
    def dataset_fn(context):
        import tensorflow as tf

        import kerasps

        w = tf.linspace(-1.0, 1.0, FEATURES)[:, None]
        seed = context.input_pipeline_id

        def batch(i):
            x = tf.random.stateless_normal([BATCH, FEATURES], seed=tf.stack([seed, i]))
            return x, tf.tanh(x @ w)

        dataset = tf.data.Dataset.range(1 << 40).map(batch)
        if delay and context.input_pipeline_id == 0:
            dataset = kerasps.input.slowed(dataset, delay)
        return dataset
    return dataset_fn


def run_one(mode, backups, delay, steps, trace_path=None):
    import keras
    import numpy as np

    import kerasps

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=WORKERS, num_ps=1),
        **(dict(mode="sync", backup_workers=backups) if mode == "sync" else {}))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(64, "relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    data = kerasps.DatasetCreator(_dataset_fn(delay))
    # Async steps are worker-steps: 4 of them train the examples of one sync step.
    per_global = WORKERS if mode == "async" else 1
    model.fit(data, epochs=1, steps_per_epoch=10 * per_global, verbose=0)
    recorder = kerasps.StepTraceRecorder(trace_path)
    cpu, start = time.process_time(), time.perf_counter()
    history = model.fit(data, epochs=1, steps_per_epoch=steps * per_global, verbose=0,
                        callbacks=[recorder])
    wall = time.perf_counter() - start
    rng = np.random.default_rng(99)
    x = rng.normal(size=(2048, FEATURES)).astype("float32")
    y = np.tanh(x @ np.linspace(-1, 1, FEATURES, dtype="float32")[:, None])
    single = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, "relu"),
                               keras.layers.Dense(64, "relu"), keras.layers.Dense(1)])
    single.compile("sgd", "mse")
    single.set_weights(model.get_weights())
    train = [e for e in recorder.events if e.kind == "train"]
    applies = [e for e in recorder.events if e.kind == "apply"]
    return {"mode": mode, "backups": backups, "delay": delay, "steps": steps,
            "trace": trace_path,
            "step_ms": 1000 * wall / steps, "cpu_ms_per_step": 1000 * (
                time.process_time() - cpu) / steps,
            # kerasps logs these only where they can be non-zero (sync mode has no
            # staleness; only sync with backup workers drops gradients).
            "dropped": history.history.get("dropped_gradients", [0])[0],
            "staleness": history.history.get("staleness", [0])[0],
            "eval_loss": float(single.evaluate(x, y, verbose=0)),
            "gradient_ms": [1000 * e.duration for e in train if not e.dropped],
            "apply_ms": [1000 * e.duration for e in applies]}


def _child(args, mode, backups, delay, trace_path=None):
    command = [sys.executable, __file__, "--one", mode, str(backups), str(delay),
               "--steps", str(args.steps)] + (["--trace", trace_path] if trace_path else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{mode} backups={backups} failed:\n{done.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("MODE", "BACKUPS", "DELAY"))
    parser.add_argument("--steps", type=int, default=None, help="timed global steps (100)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 15 timed steps, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="default 3")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--trace", help="with --one: write the run's trace CSV here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (15 if args.quick else 100)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.one:
        mode, backups, delay = args.one
        print(RESULT + json.dumps(run_one(mode, int(backups), float(delay), args.steps,
                                          args.trace)), flush=True)
        return 0

    base_key = ("sync", 0, False)
    configs = [(mode, backups, slow) for mode, backups in MODES for slow in (False, True)]
    runs = {key: [] for key in configs}
    traces, delay, folder = [], None, tempfile.mkdtemp(prefix="stragglers-")
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        if repeat == 0:  # the first no-straggler sync run sets the delay
            order = [base_key] + [key for key in order if key != base_key]
        for key in order:
            mode, backups, slow = key
            trace = os.path.join(folder, f"sync-{repeat}.csv") if key == base_key else None
            record = _child(args, mode, backups, delay if slow else 0.0, trace)
            runs[key].append(record)
            if key == base_key:
                traces.append(trace)
                if delay is None:
                    delay = 2 * record["step_ms"] / 1000  # worker 0's steps 3x as long
                    print(f"# stragglers: {WORKERS} workers, 1 ps; worker 0 held back "
                          f"{1000 * delay:.1f} ms per batch (2x the no-straggler sync step, "
                          f"{record['step_ms']:.1f} ms)", flush=True)
            print(f"  [{repeat}] {mode:5s} backups={backups} straggler={slow!s:5s} "
                  f"{record['step_ms']:7.1f} ms/step, dropped {record['dropped']}", flush=True)

    def median(key, field):
        return statistics.median(r[field] for r in runs[key])

    def paired(numerator, denominator):  # ratios within a repeat, then their median
        return statistics.median(n["step_ms"] / d["step_ms"]
                                 for n, d in zip(runs[numerator], runs[denominator]))

    lines = ["| mode | ms per global step, no straggler | with worker 0 3x slower | ratio "
             "| simulator's ratio | gradients dropped | eval loss after the same examples "
             "| CPU ms/step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = {}
    for mode, backups in MODES:
        fast, slow = (mode, backups, False), (mode, backups, True)
        ratio = paired(slow, fast)
        predicted = ""
        if mode == "sync":
            simulated = statistics.median(
                predict_sync_step_time(t, num_workers=WORKERS, backup_workers=backups,
                                       straggler_delay=delay)
                / predict_sync_step_time(t, num_workers=WORKERS, backup_workers=backups)
                for t in traces)
            predicted = f"{simulated:.2f}"
            verdicts[f"sim vs measured, sync b={backups}"] = simulated / ratio
        name = "async" if mode == "async" else f"sync + {backups} backup" if backups else "sync"
        lines.append(f"| {name} | {median(fast, 'step_ms'):.1f} | {median(slow, 'step_ms'):.1f} "
                     f"| {ratio:.2f} | {predicted} | {median(slow, 'dropped'):.0f} "
                     f"| {median(slow, 'eval_loss'):.4f} | {median(slow, 'cpu_ms_per_step'):.1f} |")
        verdicts[name] = ratio
    throughput = paired(("async", 0, False), base_key)
    backup = verdicts["sync + 1 backup"]
    agrees = all(abs(v - 1) <= 0.15 for k, v in verdicts.items() if k.startswith("sim"))
    lines += ["", f"Targets: sync + 1 backup with a straggler {backup:.2f}x "
              f"its no-straggler step ({'meets' if backup <= 1.3 else 'MISSES'}"
              f" <= 1.3; plain sync {verdicts['sync']:.2f}x); sync / async throughput without "
              f"stragglers {throughput:.2f} ({'meets' if throughput >= 0.7 else 'MISSES'} >= 0.7);"
              " simulator / measured ratio: " + ", ".join(
                  f"{k.split(', ')[1]} {v:.2f}" for k, v in verdicts.items() if k.startswith(
                      "sim")) + f" ({'meets' if agrees else 'MISSES'} within 15%).", "",
              f"Medians of {args.repeats} interleaved repeats (ratios paired within a repeat), "
              f"{args.steps} timed global steps; nproc {os.cpu_count()}."]
    print()
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"delay": delay, "results": [
                {k: v for k, v in r.items() if not k.endswith("_ms") or k == "step_ms"}
                for records in runs.values() for r in records]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
