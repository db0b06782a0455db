"""Exactly-once input: its throughput against per-worker input, and visit counts per input mode.

Throughput: an in-process cluster of 2 workers and 1 ps trains a small
recommendation model (two ids into a 20k x 16 embedding, MLP 64-64-1, Adam,
batch 64) on 16384 examples per epoch, read either per worker (the documented
`DatasetCreator` with `shard` + `repeat()` + `steps_per_epoch`) or through the
tf.data service (`kerasps.InputOptions(exactly_once=True)`, no
`steps_per_epoch`). One warm-up epoch, then 3 timed epochs; the two modes
alternate within each of the repeats. Reported: examples/s over the training
loop alone (from each epoch's first finished step to its last, so job setup
is excluded) and over the whole `fit` call, CPU seconds of the process per
step, and the exactly-once / per-worker ratio.

Visits: does each example train exactly once per epoch? Each example carries an id; a
zero-initialised `Embedding(4096, 1)` trained with SGD(lr=1) on the sum of its outputs moves an
id's row by exactly -1 per visit. Three epochs over 4096 ids (batch 64), 3
workers, 2 ps: how many ids were seen exactly 3 times, fewer, more.

Elastic: `kerasps launch --workers 2:4` (separate processes: 1 ps, the chief)
trains the same model with per-worker input for three phases of PHASE_STEPS
steps on 2, then 4, then 2 workers (`kerasps.launch.request_workers`, each
phase starting once the pool has its size), against fixed 2- and 4-worker
launches of the same program. Reported: examples/s per phase, and the
simulator's prediction of each phase: calibrated on the first phase's trace
(`kerasps.StepTraceRecorder`), replaying the join and the leave with its
elastic model (`simulator.calibrate.predict_elastic_throughput`).

    python benchmarks/input_throughput.py            # ~6 min on 2 cores
    python benchmarks/input_throughput.py --quick    # a smoke run: 1 repeat of 1 short epoch,
                                                     # the elastic run (1 -> 2 -> 1 workers)
                                                     # without the fixed pools

Targets: exactly-once throughput >= 0.8x per-worker; 0 missed and
0 repeated with exactly_once=True; simulated phase throughput within 15% of
the measured one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "INPUT_RESULT "
# --quick sets this in the environment: its subprocesses (and the launched chiefs, which
# import this module) read the smaller sizes too.
QUICK_ENV = "KERASPS_INPUT_BENCHMARK_QUICK"
QUICK = os.environ.get(QUICK_ENV) == "1"
ROWS, BATCH, VOCAB = 4096 if QUICK else 16384, 64, 20000
VISIT_IDS, VISIT_BATCH, VISIT_EPOCHS = 4096, 64, 3


def _examples(context=None):
    import tensorflow as tf

    def example(i):
        ids = tf.stack([i % VOCAB, (i * 7919) % VOCAB])
        return ids, tf.cast(i % 2, tf.float32)

    dataset = tf.data.Dataset.range(ROWS)
    if context is not None:  # per-worker input: this worker's shard, repeated
        dataset = dataset.shard(context.num_input_pipelines, context.input_pipeline_id)
        dataset = dataset.repeat()
    return dataset.shuffle(4096).map(example, num_parallel_calls=4).batch(BATCH).prefetch(2)


def _model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((2,), dtype="int64"), keras.layers.Embedding(VOCAB, 16),
            keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


class _LoopTimer:
    """Times each epoch from its first finished step to its last (the loop alone)."""

    def __init__(self):
        import keras

        timer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                timer.first = timer.last = None
                timer.steps = 0

            def on_train_batch_end(self, batch, logs=None):
                now = time.perf_counter()
                timer.first = timer.first or now
                timer.last, timer.steps = now, batch + 1

            def on_epoch_end(self, epoch, logs=None):
                timer.seconds += timer.last - timer.first
                timer.examples += (timer.steps - 1) * BATCH

        self.callback = Callback()
        self.seconds, self.examples = 0.0, 0


def throughput(epochs):
    import kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=2,
                                                                          num_ps=1))
    inputs = {
        "per_worker": (kerasps.DatasetCreator(_examples), dict(steps_per_epoch=ROWS // BATCH)),
        "exactly_once": (kerasps.DatasetCreator(
            lambda context: _examples(), kerasps.InputOptions(exactly_once=True)), {}),
    }
    models = {mode: _model(strategy) for mode in inputs}
    for mode, (data, kwargs) in inputs.items():  # warm up: trace, build slots
        models[mode].fit(data, epochs=1, verbose=0, **kwargs)
    results = {}
    for mode, (data, kwargs) in inputs.items():
        timer = _LoopTimer()
        cpu, start = time.process_time(), time.perf_counter()
        history = models[mode].fit(data, epochs=epochs, verbose=0, callbacks=[timer.callback],
                                   **kwargs)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        steps = int(models[mode].optimizer.iterations.numpy()) - ROWS // BATCH
        results[mode] = {
            "loop_examples_per_s": timer.examples / timer.seconds,
            "call_examples_per_s": epochs * ROWS / wall,
            "cpu_ms_per_step": 1000 * cpu / steps,
            "loss": history.history["loss"][-1],
        }
    return results


def visits():
    import keras
    import numpy as np
    import tensorflow as tf

    import kerasps

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=3, num_ps=2),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    ids = np.arange(VISIT_IDS, dtype="int32").reshape(-1, 1)
    zeros = np.zeros(VISIT_IDS, "float32")

    def counter(scope):
        with scope:
            model = keras.Sequential([
                keras.Input((1,), dtype="int32"),
                keras.layers.Embedding(VISIT_IDS, 1, embeddings_initializer="zeros")])
            model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_sum(p))
        return model

    def dataset():
        return tf.data.Dataset.from_tensor_slices((ids, zeros)).batch(VISIT_BATCH)

    def repeated_fn(context):
        return tf.data.Dataset.from_tensor_slices((ids, zeros)).shard(
            context.num_input_pipelines, context.input_pipeline_id).repeat().batch(VISIT_BATCH)

    steps = VISIT_IDS // VISIT_BATCH
    runs = {
        "single-process Keras 3": (keras.name_scope("plain"), lambda: dict(x=ids, y=zeros,
                                   batch_size=VISIT_BATCH)),
        "finite `tf.data.Dataset`, `exactly_once=False`": (strategy.scope(), lambda: dict(
            x=strategy.experimental_distribute_dataset(
                dataset(), options=kerasps.InputOptions(exactly_once=False)))),
        "`DatasetCreator` + `repeat()` + `steps_per_epoch`": (strategy.scope(), lambda: dict(
            x=kerasps.DatasetCreator(repeated_fn), steps_per_epoch=steps)),
        "finite `tf.data.Dataset` (default: exactly once)": (strategy.scope(), lambda: dict(
            x=dataset())),
        "arrays (default: exactly once)": (strategy.scope(), lambda: dict(
            x=ids, y=zeros, batch_size=VISIT_BATCH)),
        "`DatasetCreator`, `exactly_once=True`": (strategy.scope(), lambda: dict(
            x=kerasps.DatasetCreator(lambda context: dataset().shuffle(64),
                                     kerasps.InputOptions(exactly_once=True)))),
    }
    table = {}
    for name, (scope, data) in runs.items():
        model = counter(scope)
        model.fit(epochs=VISIT_EPOCHS, verbose=0, **data())
        seen = -np.round(model.layers[0].embeddings.numpy()[:, 0]).astype(int)
        table[name] = {"exact": int((seen == VISIT_EPOCHS).sum()),
                       "missed": int((seen < VISIT_EPOCHS).sum()),
                       "repeated": int((seen > VISIT_EPOCHS).sum())}
    return table


PHASE_STEPS = 60 if QUICK else 300
# The pool's sizes: LOW, then HIGH, then LOW again (a smoke run: 1 -> 2 -> 1).
LOW, HIGH = (1, 2) if QUICK else (2, 4)

# The chief of the elastic and fixed launches: argv[1] is the pool size of each phase.
ELASTIC_CHIEF = f"""
import json, sys, time
import keras, tensorflow as tf, kerasps
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from input_throughput import _examples, _model, BATCH, PHASE_STEPS, RESULT

phases = json.loads(sys.argv[1])
strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
coordinator = kerasps.ClusterCoordinator(strategy)
model = _model(strategy)
data = kerasps.DatasetCreator(_examples)


def resize(count):
    if len(coordinator.running_workers()) == count:
        return
    kerasps.launch.request_workers(count)
    deadline = time.monotonic() + 300
    while len(coordinator.running_workers()) != count:
        assert time.monotonic() < deadline, "the pool was not resized"
        time.sleep(0.05)


resize(phases[0])
model.fit(data, epochs=1, steps_per_epoch=50, verbose=0)  # warm up: trace functions
marks = []


class Phases(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.origin = time.perf_counter()  # the trace's origin, to a millisecond
        marks.append(0.0)

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if done % PHASE_STEPS == 0:
            marks.append(time.perf_counter() - self.origin)
            if done // PHASE_STEPS < len(phases):
                resize(phases[done // PHASE_STEPS])
                marks.append(time.perf_counter() - self.origin)


recorder = kerasps.StepTraceRecorder()
model.fit(data, epochs=1, steps_per_epoch=PHASE_STEPS * len(phases), verbose=0,
          callbacks=[recorder, Phases()])
windows = list(zip(marks[::2], marks[1::2]))
print(RESULT + json.dumps({{"windows": windows, "trace": [
    [e.worker, e.start, e.end, e.steps, e.kind] for e in recorder.events]}}), flush=True)
"""


def elastic(phases):
    """A `kerasps launch` run of `ELASTIC_CHIEF` with the pool sizes of `phases`."""
    import tempfile

    low, high = min(phases), max(phases)
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(scratch, "chief.py")
        with open(script, "w") as f:
            f.write(ELASTIC_CHIEF)
        workers = f"{low}:{high}" if low < high else str(high)
        output = subprocess.run(
            [sys.executable, "-m", "kerasps.cli", "launch", "--workers", workers, "--ps", "1",
             script, json.dumps(phases)], capture_output=True, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, check=False, timeout=1800)
    for line in output.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"elastic run {phases} failed:\n{output.stdout[-3000:]}")


def elastic_table(repeats):
    from kerasps.trace import StepEvent
    from simulator.calibrate import predict_elastic_throughput

    rows = []
    for _ in range(repeats):
        run = elastic([LOW, HIGH, LOW])
        windows = run["windows"]
        rates = [PHASE_STEPS * BATCH / (end - start) for start, end in windows]
        first = [StepEvent(worker=w, step=i, start=a, end=b, steps=n, kind=k)
                 for i, (w, a, b, n, k) in enumerate(run["trace"]) if b <= windows[0][1]]
        durations = [end - start for start, end in windows]
        bounds = list(itertools.accumulate(durations))
        predicted = predict_elastic_throughput(
            first, workers=LOW, events=[(bounds[0], HIGH - LOW), (bounds[1], LOW - HIGH)],
            duration=bounds[2])
        # A smoke run (--quick) leaves out the fixed pools' launches.
        fixed = {} if QUICK else {n: elastic([n])["windows"][0] for n in (2, 4)}
        rows.append({"measured": rates,
                     "simulated": [p * BATCH for p in predicted],
                     "fixed": {n: PHASE_STEPS * BATCH / (b - a) for n, (a, b) in fixed.items()}})
    return rows


def _child(kind, epochs):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.getcwd()}
    output = subprocess.run([sys.executable, __file__, "--child", kind, "--epochs", str(epochs)],
                            capture_output=True, text=True, env=env, check=False)
    for line in output.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"{kind} run failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 repeat of 1 epoch of 4096 examples, phases of 60 "
                             "steps, the elastic run without the fixed pools' runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--only", choices=["throughput", "elastic", "visits"],
                        help="run one of the three tables")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = throughput(args.epochs) if args.child == "throughput" else visits()
        print(RESULT + json.dumps(result), flush=True)
        return
    if args.quick and not QUICK:  # again, with the sizes of a smoke run (see QUICK_ENV)
        env = {**os.environ, QUICK_ENV: "1"}
        return subprocess.run([sys.executable, os.path.abspath(__file__), *(
            argv if argv is not None else sys.argv[1:])], env=env, check=False).returncode
    repeats, epochs = (1, 1) if args.quick else (args.repeats, args.epochs)
    for table in ("throughput", "elastic", "visits"):
        if args.only in (None, table):
            {"throughput": throughput_table, "elastic": print_elastic_table,
             "visits": visits_table}[table](repeats, epochs)


def throughput_table(repeats, epochs):
    runs = [_child("throughput", epochs) for _ in range(repeats)]

    def median(mode, field):
        return statistics.median(run[mode][field] for run in runs)

    print(f"Throughput: 2 workers, 1 ps, {ROWS} examples/epoch, batch {BATCH}, {epochs} "
          f"epochs, median of {repeats}")
    print("| input | loop examples/s | whole-call examples/s | CPU ms/step | final loss |")
    print("|---|---|---|---|---|")
    for mode in ("per_worker", "exactly_once"):
        print(f"| {mode} | {median(mode, 'loop_examples_per_s'):.0f} | "
              f"{median(mode, 'call_examples_per_s'):.0f} | "
              f"{median(mode, 'cpu_ms_per_step'):.2f} | {median(mode, 'loss'):.4f} |")
    for field in ("loop_examples_per_s", "call_examples_per_s"):
        ratios = [run["exactly_once"][field] / run["per_worker"][field] for run in runs]
        print(f"exactly_once / per_worker, {field}: {statistics.median(ratios):.2f}x "
              f"(runs: {', '.join(f'{r:.2f}' for r in ratios)}; target >= 0.8x)")



def print_elastic_table(repeats, epochs):
    runs = elastic_table(repeats)
    print(f"\nElastic: kerasps launch --workers {LOW}:{HIGH}, 1 ps, {PHASE_STEPS} steps per phase "
          f"(batch {BATCH}), median of {repeats}")
    print(f"| run | {LOW} workers | {HIGH} workers | {LOW} workers again |")
    print("|---|---|---|---|")

    def phase(key, i):
        return statistics.median(r[key][i] for r in runs)

    print(f"| elastic {LOW} -> {HIGH} -> {LOW}, measured | " + " | ".join(
        f"{phase('measured', i):.0f}" for i in range(3)) + " |")
    print("| simulator (calibrated on phase 1) | " + " | ".join(
        f"{phase('simulated', i):.0f}" for i in range(3)) + " |")
    if runs[0]["fixed"]:
        fixed = {n: statistics.median(r["fixed"][n] for r in runs) for n in (2, 4)}
        print(f"| fixed pools | {fixed[2]:.0f} | {fixed[4]:.0f} | {fixed[2]:.0f} |")
    medians = [phase("simulated", i) / phase("measured", i) - 1 for i in range(3)]
    worst = max(abs(r["simulated"][i] / r["measured"][i] - 1) for r in runs for i in range(3))
    print("simulated / measured - 1 per phase (medians): " + ", ".join(
        f"{e:+.1%}" for e in medians) + f"; worst single run {worst:.0%} (target: within 15%)")


def visits_table(repeats, epochs):
    table = _child("visits", VISIT_EPOCHS)
    print(f"\nVisits: {VISIT_IDS} ids, {VISIT_EPOCHS} epochs, 3 workers, 2 ps, batch "
          f"{VISIT_BATCH}")
    print(f"| input | ids seen {VISIT_EPOCHS} times | missed | seen too often |")
    print("|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['exact']} | {row['missed']} | {row['repeated']} |")


if __name__ == "__main__":
    sys.exit(main())
