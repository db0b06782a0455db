"""Embedding tables from 2e4 to 1e7 rows: `model.fit` steps/s, kerasps against tf_keras.

An in-process cluster of 2 workers and 2 ps tasks; a model
Embedding(vocab, 32) (split in 2 shards by `MinSizePartitioner(256 KiB,
max_shards=2)`) -> Flatten -> Dense(32) -> Dense(1), MSE; 3 uniformly drawn ids
per example, per-worker batch 64, `steps_per_execution=10`; one warm-up `fit`,
then one timed `fit` of `--steps` steps; worker-steps per second. Rows: vocab
2e4, 2e5, 2e6 and 1e7 (kerasps only) x optimizer:

* ``sgd``, ``adagrad``: kerasps updates only the rows of the batch (its default
  `sparse_updates="exact"`); so does tf_keras' Adagrad, while tf_keras' SGD
  always has a momentum slot (zero momentum included) and updates it and the
  table densely;
* ``adam``: both systems update the whole table and its slots every step
  (Keras' dense rule; tf_keras decays `m` and `v` densely too);
* ``lazy_adam``: kerasps with `sparse_updates="lazy"` (rows of the batch only);
  tf_keras has no lazy Adam, so this row has no anchor.

Every configuration runs in its own subprocess (in-process TF servers cannot be
stopped; tf_keras and Keras 3 should not share a process), on the same cluster
(`kerasps.cluster.in_process`, plain `tf.distribute.Server`s); the whole set is
repeated `--repeats` times in alternating order and ratios are taken within a
repeat, then their median is reported.

`--scale`: a 1e7 x 32 table (1.28 GB; 3.84 GB with Adam's slots) sharded over 4
ps tasks, trained with lazy Adam, against the same model at 1e5 rows; also
reports the peak memory of the process (coordinator, workers and ps tasks all
live in it) and the placement imbalance.

    pip install -e .[bench]
    python benchmarks/embedding_scaling.py                 # the table (~30 min on 2 cores)
    python benchmarks/embedding_scaling.py --scale         # the 1e7-row table in 4 ps
    python benchmarks/embedding_scaling.py --quick         # smoke run: 2e4 rows, Adagrad
    python benchmarks/embedding_scaling.py --one kerasps adagrad 2000000   # one JSON line

Targets: kerasps >= 1.2x tf_keras in every row where tf_keras runs;
kerasps Adagrad and lazy Adam at 2e6 rows >= 0.8x their own step rate at 2e4;
with `--scale`, 1e7 rows >= 0.8x the step rate at 1e5.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

NUM_WORKERS = 2
DIM = 32
IDS_PER_EXAMPLE = 3
BATCH = 64  # per worker
SPE = 10
MIN_SHARD_BYTES = 256 << 10
VOCABS = (20_000, 200_000, 2_000_000, 10_000_000)
TF_KERAS_MAX_VOCAB = 2_000_000
DENSE_MAX_VOCAB = 2_000_000  # a dense update of 1e7 rows and 2 slots takes seconds per step
SCALE_VOCABS = (100_000, 10_000_000)
SCALE_PS = 4
SYSTEMS = ("tf_keras", "kerasps")
# name -> (Keras class, kerasps `sparse_updates`, and per system the optimizer's update of
#          the table: (rows of the batch only?, slot variables), None where it has none).
# tf_keras' SGD always makes a momentum slot and updates it and the table densely.
OPTIMIZERS = {
    "sgd": ("SGD", "exact", {"kerasps": (True, 0), "tf_keras": (False, 1)}),
    "adagrad": ("Adagrad", "exact", {"kerasps": (True, 1), "tf_keras": (True, 1)}),
    "adam": ("Adam", "exact", {"kerasps": (False, 2), "tf_keras": (False, 2)}),
    "lazy_adam": ("Adam", "lazy", {"kerasps": (True, 2), "tf_keras": None}),
}
RESULT_PREFIX = "EMBEDDING_SCALING_RESULT "


# -- the workload (in the child process) ---------------------------------------------------
def _dataset_fn(vocab):
    def dataset_fn(input_context):
        import tensorflow as tf

        seed = input_context.input_pipeline_id

        def make_batch(_):
            ids = tf.random.uniform([BATCH, IDS_PER_EXAMPLE], maxval=vocab, dtype=tf.int64,
                                    seed=seed + 1)
            return ids, tf.random.uniform([BATCH, 1], seed=seed + 2)

        return tf.data.Dataset.from_tensors(0).repeat().map(make_batch).prefetch(2)

    return dataset_fn


def _compiled_model(keras_module, vocab, optimizer):
    layers = keras_module.layers
    model = keras_module.Sequential([
        keras_module.Input(shape=(IDS_PER_EXAMPLE,), dtype="int64"),
        layers.Embedding(vocab, DIM),
        layers.Flatten(),
        layers.Dense(32, activation="relu"),
        layers.Dense(1),
    ])
    model.compile(getattr(keras_module.optimizers, OPTIMIZERS[optimizer][0])(), "mse",
                  steps_per_execution=SPE)
    return model


def kerasps_strategy(resolver, optimizer, num_ps):
    """The workload's kerasps strategy: the table split in up to `num_ps` shards of at
    least `MIN_SHARD_BYTES`, row updates as `OPTIMIZERS` says for `optimizer`."""
    import kerasps

    return kerasps.ParameterServerStrategy(
        resolver, sparse_updates=OPTIMIZERS[optimizer][1],
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps))


def _gib(nbytes):
    return nbytes / 2**30


def _rss_gib():
    with open("/proc/self/statm") as f:
        return _gib(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))


def _peak_rss_gib():
    return _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run_one(system, optimizer, vocab, num_ps, steps, warmup):
    """Builds, warms up and times one configuration in this process; returns its record."""
    import kerasps.cluster  # plain TF servers; imports neither Keras 3 nor tf_keras

    resolver = kerasps.cluster.in_process(num_workers=NUM_WORKERS, num_ps=num_ps)
    start = time.perf_counter()
    if system == "kerasps":
        import keras

        import kerasps

        strategy = kerasps_strategy(resolver, optimizer, num_ps)
        with strategy.scope():
            model = _compiled_model(keras, vocab, optimizer)
        data = kerasps.DatasetCreator(_dataset_fn(vocab))
        extra = {"imbalance": strategy.placement_report().imbalance}
    else:
        import tensorflow as tf
        import tf_keras

        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners
            .MinSizePartitioner(min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps))
        with strategy.scope():
            model = _compiled_model(tf_keras, vocab, optimizer)
        data = tf_keras.utils.experimental.DatasetCreator(_dataset_fn(vocab))
        extra = {}
    extra.update(created_s=time.perf_counter() - start, rss_created_gib=_rss_gib())
    model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)  # traces; builds slots
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    return {"system": system, "optimizer": optimizer, "vocab": vocab, "ps": num_ps,
            "steps": steps, "warmup": warmup, "steps_per_s": steps / seconds,
            # Coordinator, workers and ps tasks all run in this process.
            "cpu_ms_per_step": 1000 * (time.process_time() - cpu) / steps,
            "loss": float(history.history["loss"][-1]), "peak_rss_gib": _peak_rss_gib(),
            **extra}


# -- touched-rows arithmetic ----------------------------------------------------------------
def rows_per_worker_step(vocab):
    """Expected distinct rows among a worker batch's uniformly drawn ids."""
    ids = BATCH * IDS_PER_EXAMPLE
    return vocab * (1 - (1 - 1 / vocab) ** ids)


def moved_kib(vocab):
    """Table bytes over the network per worker step: the rows gathered, their gradient sent."""
    return 2 * rows_per_worker_step(vocab) * DIM * 4 / 1024


def written_mib(vocab, optimizer, system):
    """Bytes of table and slots the optimizer writes on the ps tasks per worker step."""
    update = OPTIMIZERS[optimizer][2][system]
    if update is None:
        return None
    sparse, slots = update
    rows = rows_per_worker_step(vocab) if sparse else vocab
    return rows * DIM * 4 * (1 + slots) / 2**20


# -- orchestration -------------------------------------------------------------------------
def matrix_plan(vocabs, optimizers, systems=SYSTEMS):
    plan = []
    for optimizer in optimizers:  # a row's runs close together in time: paired ratios
        for vocab in vocabs:
            for system in systems:
                update = OPTIMIZERS[optimizer][2][system]
                if update is None or (system == "tf_keras" and vocab > TF_KERAS_MAX_VOCAB):
                    continue
                if not update[0] and vocab > DENSE_MAX_VOCAB:
                    continue
                plan.append((system, optimizer, vocab, 2))
    return plan


def _child(config, steps, warmup, timeout):
    system, optimizer, vocab, num_ps = config
    cmd = [sys.executable, os.path.abspath(__file__), "--one", system, optimizer, str(vocab),
           "--ps", str(num_ps), "--steps", str(steps), "--warmup", str(warmup)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    record = {"system": system, "optimizer": optimizer, "vocab": vocab, "ps": num_ps}
    for _ in range(2):  # one retry: a run can fail for reasons outside it (a full machine)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired:
            record["error"] = f"timed out after {timeout}s"
            continue
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        record["error"] = f"exit {proc.returncode}:\n{tail}"
    return record


def _key(record):
    return record["system"], record["optimizer"], record["vocab"], record["ps"]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _per_repeat(results, key, field="steps_per_s"):
    return {r["repeat"]: r[field] for r in results if _key(r) == key and field in r}


def _med(results, key, field="steps_per_s"):
    """Median of `field` over the repeats of configuration `key`."""
    return _median(_per_repeat(results, key, field).values())


def _paired_ratio(results, numerator, denominator):
    """Median over repeats of numerator/denominator, both measured in the same repeat."""
    num, den = _per_repeat(results, numerator), _per_repeat(results, denominator)
    return _median([num[k] / den[k] for k in num if k in den])


def _fmt(x, digits=2, missing=""):
    return missing if x is None else f"{x:,.{digits}f}"


def matrix_table(results):
    vocabs = sorted({r["vocab"] for r in results})
    optimizers = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in results)]
    lines = ["| vocab | optimizer | tf_keras steps/s | kerasps steps/s | kerasps / tf_keras "
             "| kerasps vs own 2e4 | CPU ms/step tf_keras / kerasps | moved KiB/step "
             "| writes MiB/step tf_keras / kerasps | peak RSS GiB kerasps |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for vocab in vocabs:
        for optimizer in optimizers:
            tf_key, ps_key = ("tf_keras", optimizer, vocab, 2), ("kerasps", optimizer, vocab, 2)
            if _med(results, tf_key) is None and _med(results, ps_key) is None:
                continue
            tf_written = (written_mib(vocab, optimizer, "tf_keras")
                          if _med(results, tf_key) is not None else None)
            ratio = _paired_ratio(results, ps_key, tf_key)
            own = _paired_ratio(results, ps_key, ("kerasps", optimizer, vocabs[0], 2))
            lines.append(
                f"| {vocab:,} | {optimizer} | {_fmt(_med(results, tf_key), 1, 'n/a')} "
                f"| {_fmt(_med(results, ps_key), 1, 'not run')} | {_fmt(ratio)} "
                f"| {_fmt(own) if vocab != vocabs[0] else ''} "
                f"| {_fmt(_med(results, tf_key, 'cpu_ms_per_step'), 1, 'n/a')} / "
                f"{_fmt(_med(results, ps_key, 'cpu_ms_per_step'), 1)} "
                f"| {moved_kib(vocab):.1f} "
                f"| {_fmt(tf_written, 2, 'n/a')} / "
                f"{_fmt(written_mib(vocab, optimizer, 'kerasps'))} "
                f"| {_fmt(_med(results, ps_key, 'peak_rss_gib'))} |")
            if ratio is not None:
                verdicts.append((f"{vocab:,} {optimizer} vs tf_keras", ratio, 1.2))
            if optimizer in ("adagrad", "lazy_adam") and vocab == 2_000_000 and own is not None:
                verdicts.append((f"{optimizer} 2e6 vs 2e4", own, 0.8))
    return lines, verdicts


def scale_table(results):
    small, large = (("kerasps", "lazy_adam", v, SCALE_PS) for v in SCALE_VOCABS)
    lines = ["| vocab | ps tasks | table + Adam slots GiB | steps/s | vs 1e5 rows | CPU ms/step "
             "| created in s | RSS after creation GiB | peak RSS GiB | placement imbalance |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratio = _paired_ratio(results, large, small)
    for key in (small, large):
        lines.append(
            f"| {key[2]:,} | {SCALE_PS} | {_gib(key[2] * DIM * 4 * 3):.2f} "
            f"| {_fmt(_med(results, key), 1)} | {_fmt(ratio) if key == large else ''} "
            f"| {_fmt(_med(results, key, 'cpu_ms_per_step'), 1)} "
            f"| {_fmt(_med(results, key, 'created_s'), 1)} "
            f"| {_fmt(_med(results, key, 'rss_created_gib'))} "
            f"| {_fmt(_med(results, key, 'peak_rss_gib'))} "
            f"| {_fmt(_med(results, key, 'imbalance'), 3)} |")
    return lines, [] if ratio is None else [("1e7 vs 1e5 rows, lazy Adam, 4 ps", ratio, 0.8)]


def _meta(args):
    from fit_throughput import _versions  # a sibling script: benchmarks/ is on sys.path

    return {"versions": _versions(), "python": sys.version.split()[0], "nproc": os.cpu_count(),
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "scale": args.scale, "load_before": os.getloadavg()[0]}


def report(results, meta):
    lines, verdicts = (scale_table if meta["scale"] else matrix_table)(results)
    v = meta["versions"]
    lines += ["", "Targets: " + "; ".join(
        f"{name}: {value:.2f} ({'meets' if value >= target else 'MISSES'} >= {target})"
        for name, value, target in verdicts) + ".", "",
        f"Median of {meta['repeats']} interleaved repeats (ratios paired within a repeat), "
        f"{meta['steps']} timed steps after a {meta['warmup']}-step warm-up `fit`, "
        f"steps_per_execution {SPE}. tensorflow {v['tensorflow']}, keras {v['keras']}, "
        f"tf_keras {v['tf-keras']}, python {meta['python']}; nproc {meta['nproc']}; "
        f"load average {meta['load_before']:.2f} -> {meta.get('load_after', 0):.2f}."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("SYSTEM", "OPTIMIZER", "VOCAB"),
                        help="run one configuration in this process and print a JSON line")
    parser.add_argument("--ps", type=int, default=2, help="ps tasks and shards (with --one)")
    parser.add_argument("--scale", action="store_true",
                        help="1e7 rows over 4 ps tasks against 1e5 rows, lazy Adam")
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=None,
                        help="default all (adagrad with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps (default 100; 400 with --scale)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps (default 40; 200 with --scale)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="default 3 (1 with --quick, 5 with --scale)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 20 timed steps, 1 repeat, vocab 2e4, Adagrad")
    parser.add_argument("--no-anchor", action="store_true",
                        help="no tf_keras rows (the default when tf_keras is not installed)")
    parser.add_argument("--timeout", type=float, default=900, help="per-run timeout (s)")
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved run")
    args = parser.parse_args(argv)
    # One 1e7-row run against one 1e5-row run differs by +-30% from run to run on
    # 2 cores at 100 steps: the scale target takes longer runs and more repeats.
    args.steps = args.steps or (20 if args.quick else 400 if args.scale else 100)
    args.warmup = args.warmup or (20 if args.quick else 200 if args.scale else 40)
    args.repeats = args.repeats or (1 if args.quick else 5 if args.scale else 3)
    args.optimizers = args.optimizers or (["adagrad"] if args.quick else list(OPTIMIZERS))
    if args.quick:
        args.vocabs = [v for v in args.vocabs if v <= 20_000] or [20_000]
    systems = tuple(s for s in SYSTEMS if s != "tf_keras" or not (
        args.no_anchor or importlib.util.find_spec("tf_keras") is None))

    if args.one:
        system, optimizer, vocab = args.one
        if system not in SYSTEMS or optimizer not in OPTIMIZERS:
            parser.error(f"--one takes a system in {SYSTEMS} and an optimizer in "
                         f"{tuple(OPTIMIZERS)}. Received: {system!r}, {optimizer!r}")
        record = run_one(system, optimizer, int(float(vocab)), args.ps, args.steps,
                         args.warmup)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(report(saved["results"], saved["meta"]))
        return 0

    meta = _meta(args)
    plan = ([("kerasps", "lazy_adam", v, SCALE_PS) for v in SCALE_VOCABS] if args.scale
            else matrix_plan(sorted(args.vocabs), args.optimizers, systems))
    print(f"# embedding_scaling: {len(plan)} configurations x {args.repeats} repeats; "
          f"{meta['versions']}", flush=True)
    results = []
    for repeat in range(args.repeats):
        for config in plan if repeat % 2 == 0 else plan[::-1]:
            record = {**_child(config, args.steps, args.warmup, args.timeout), "repeat": repeat}
            results.append(record)
            outcome = (f"FAILED: {record['error']}" if "error" in record else
                       f"{record['steps_per_s']:7.1f} steps/s  {record['cpu_ms_per_step']:6.1f} "
                       f"CPU ms/step  peak {record['peak_rss_gib']:.2f} GiB")
            print(f"  [{repeat}] {config[0]:8s} {config[1]:9s} {config[2]:>10,} ps={config[3]} "
                  f"{outcome}", flush=True)
    meta["load_after"] = os.getloadavg()[0]
    print()
    print(report(results, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
