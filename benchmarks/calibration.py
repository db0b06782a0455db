"""Simulator calibration against real kerasps runs.

    python benchmarks/calibration.py [--steps 300] [--calibrate-on 2] [--predict 1,3]
    python benchmarks/calibration.py --quick   # a smoke run: 1 and 2 workers, 20 steps

Trains the demo recommendation model with kerasps on an in-process cluster
(2 ps tasks) with W workers, for each W in `--calibrate-on` and `--predict`,
recording a per-step trace with `kerasps.StepTraceRecorder`. It calibrates the
simulator on the trace(s) of `--calibrate-on` (`simulator.calibrate`, shared-CPU
model of this machine, each step able to use every core) and compares the
predicted steps/s at the other worker counts with the measured ones. Target:
within 15%. Each run is its own
process (in-process TensorFlow servers cannot be stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = 0.15


def one_run(workers: int, steps: int, trace_path: str, warmup: int = 30) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import kerasps
    from kerasps.ops import demo

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=workers, num_ps=2),
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(256 << 10, max_shards=2))
    with strategy.scope():
        model = demo.build_model()
        model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy")
    data = kerasps.DatasetCreator(demo.clicks_dataset_fn(256))
    model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)  # warm up: trace functions
    recorder = kerasps.StepTraceRecorder(trace_path)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[recorder])
    wall = time.perf_counter() - start
    return {"workers": workers, "steps": steps, "wall": wall, "steps_per_s": steps / wall,
            "trace": trace_path}


def measure(workers: int, steps: int, directory: str, warmup: int = 30) -> dict:
    trace = os.path.join(directory, f"trace_w{workers}.csv")
    out = subprocess.run([sys.executable, __file__, "--one", str(workers), "--steps", str(steps),
                          "--warmup", str(warmup), "--trace", trace],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"run with {workers} workers failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (300)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (30)")
    parser.add_argument("--calibrate-on", default=None, help="worker counts (default 2)")
    parser.add_argument("--predict", default=None, help="worker counts (default 1,3)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: calibrated on 1 worker, predicts 2; 20 steps each; "
                             "the target not checked")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (20 if args.quick else 300)
    args.warmup = args.warmup or (10 if args.quick else 30)
    args.calibrate_on = args.calibrate_on or ("1" if args.quick else "2")
    args.predict = args.predict or ("2" if args.quick else "1,3")
    if args.one:
        print(json.dumps(one_run(args.one, args.steps, args.trace, args.warmup)))
        return 0

    sys.path.insert(0, str(ROOT))
    import simulator

    calibrate_on = [int(w) for w in args.calibrate_on.split(",")]
    predict = [int(w) for w in args.predict.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        runs = {w: measure(w, args.steps, directory, args.warmup)
                for w in sorted(set(calibrate_on + predict))}
        # In-process: all workers share this machine's cores, and a TensorFlow step
        # spreads its ops over all of them (intra-op threads).
        model = simulator.calibrate([runs[w]["trace"] for w in calibrate_on], cpus="auto",
                                    cores_per_step="all")
        print(model.report())
        print()
        print(f"calibrated on the trace(s) of {calibrate_on} worker(s); {args.steps} steps per run")
        print("| workers | measured steps/s | predicted steps/s | error |")
        print("|---:|---:|---:|---:|")
        worst = 0.0
        for w in sorted(runs):
            measured = runs[w]["steps_per_s"]
            predicted = simulator.predict_throughput(model, w)
            error = predicted / measured - 1
            role = " (calibration)" if w in calibrate_on else ""
            print(f"| {w}{role} | {measured:.1f} | {predicted:.1f} | {error:+.1%} |")
            if w not in calibrate_on:
                worst = max(worst, abs(error))
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"\nworst prediction error {worst:.1%}: target <= {TARGET:.0%} {verdict}")
    if args.quick:  # a few steps on a shared machine: the target is not checked
        return 0
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
