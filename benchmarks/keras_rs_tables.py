"""keras-rs' DCN on parameter servers: tables with their own optimizers against dense Adam.

The model is a DCN written with keras-rs (`keras_rs.layers.DistributedEmbedding`
with two tables, `users` and `items`, the items table shared by two features;
two `keras_rs.layers.FeatureCross`; Dense(64, relu), Dense(32, relu),
Dense(1, sigmoid); the model's optimizer Adam(1e-3)). The quality part's tables
have 200k and 50k rows; the speed part runs both tables at `--rows` (1e6 by
default) and at `--small-rows` (1e4). Every configuration runs in its own
subprocess on its own in-process cluster of 2 workers and 2 ps tasks
(`kerasps.cluster.in_process`; coordinator, workers and ps tasks in one process,
so its CPU time is the job's), each table split in 2 shards over the 2 ps tasks.

* ``speed``: random ids (uniform over each table), per-worker batch 256,
  `steps_per_execution=10`; one warm-up `fit`, then one timed `fit` of
  `--steps` steps: steps/s of the whole call and of the training loop alone
  (`on_train_begin` to `on_train_end`), CPU ms per step. Configurations:

  - ``adagrad``: kerasps, each table trained by its `TableConfig.optimizer`,
    `Adagrad(0.15, initial_accumulator_value=1e-4)`, as row updates on its ps
    tasks (the rows of the batch);
  - ``adam``: the same with keras-rs' default table optimizer (`"adam"`, lazy
    on the rows of the batch, as on TPU);
  - ``dense_adam``: the anchor, what keras-rs does off TPU today: its own
    CPU/GPU layer (kerasps' keras-rs seams uninstalled in that process, so each
    `TableConfig.optimizer` is ignored), under the same strategy: the tables are
    sharded on the ps tasks by the same partitioner and trained by the model's
    Adam, which (Keras' rule) moves every row and both slots each step.

  Per-table Adagrad and dense Adam also run at `--small-rows`: each one's rate
  at `--rows` over its own there. Ratios are taken within a repeat (the
  configurations run in alternating order) and their median reported.
  Targets: per-table Adagrad at `--rows` faster than dense Adam, and >= 0.8x
  its own rate at `--small-rows` (the table's size must not slow the step).
* ``quality``: a synthetic CTR stream (`ctr_stream`: Zipf-popular users and
  items, a click drawn from a hidden user-item affinity), tables of 200k users
  and 50k items, read once in order (`fit`, `shuffle=False`) on the first 90%,
  AUC on the held-out last 10% (`predict`). Table optimizers: per-table
  ``adagrad`` (as above) against keras-rs' default ``adam`` (lazy, Keras'
  default `learning_rate=0.001`), both under kerasps, and ``dense_adam``
  (keras-rs' own layer, the tables trained by the model's Adam) for reference.

    python benchmarks/keras_rs_tables.py                   # both parts (~5 min on 2 cores)
    python benchmarks/keras_rs_tables.py --quick           # smoke run: 3 short runs
    python benchmarks/keras_rs_tables.py --one speed adagrad 1000000    # one JSON line
    python benchmarks/keras_rs_tables.py --json benchmarks/records/keras_rs.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

RESULT_PREFIX = "KERAS_RS_RESULT "
NUM_WORKERS = 2
NUM_PS = 2
DIM = 16
HISTORY = 5  # item ids per example in the `history` feature (mean)
BATCH = 256  # per worker
SPE = 10
# The per-table Adagrad: the best of 8 settings (learning rate 0.01-0.5, initial
# accumulator 1e-6-0.1) on a stream of another seed (0); Keras' default accumulator (0.1)
# dwarfs a row's squared gradients here and trains the tables ~10x slower.
ADAGRAD_LR = 0.15
ADAGRAD_ACCUMULATOR = 1e-4
SPEED_CONFIGS = ("adagrad", "adam", "dense_adam")
QUALITY_CONFIGS = ("adagrad", "adam", "dense_adam")
ANCHOR = "dense_adam"
QUALITY_USERS = 200_000
QUALITY_ITEMS = 50_000


# -- the model ------------------------------------------------------------------------------
def _strategy():
    import kerasps

    return kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=NUM_WORKERS, num_ps=NUM_PS),
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=64 << 10, max_shards=NUM_PS))


def _table_optimizer(config, adagrad_lr=ADAGRAD_LR):
    import keras

    if config != "adagrad":
        return "adam"
    return keras.optimizers.Adagrad(adagrad_lr,
                                    initial_accumulator_value=ADAGRAD_ACCUMULATOR)


def build_dcn(config, users, items, adagrad_lr=ADAGRAD_LR):
    """The DCN, under the current scope. `dense_adam`: keras-rs' own layer (the caller
    has uninstalled kerasps' keras-rs seams), its tables trained by the model's Adam."""
    import keras
    import keras_rs

    def table(name, rows):
        return keras_rs.layers.TableConfig(
            name=name, vocabulary_size=rows, embedding_dim=DIM, combiner="mean",
            optimizer=_table_optimizer(config, adagrad_lr))

    user_table, item_table = table("users", users), table("items", items)
    feature = keras_rs.layers.FeatureConfig
    features = {
        "user": feature(name="user", table=user_table, input_shape=(None,),
                        output_shape=(None, DIM)),
        "item": feature(name="item", table=item_table, input_shape=(None,),
                        output_shape=(None, DIM)),
        "history": feature(name="history", table=item_table, input_shape=(None, HISTORY),
                           output_shape=(None, DIM)),
    }
    inputs = {name: keras.Input(f.input_shape[1:], dtype="int32", name=name)
              for name, f in features.items()}
    embedded = keras_rs.layers.DistributedEmbedding(features, name="embedding")(inputs)
    x0 = keras.layers.Concatenate()([embedded[name] for name in features])
    x1 = keras_rs.layers.FeatureCross()(x0, x0)
    x2 = keras_rs.layers.FeatureCross()(x0, x1)
    x = keras.layers.Dense(64, activation="relu")(x2)
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy",
                  steps_per_execution=SPE)
    return model


def _built(config, users, items, adagrad_lr=ADAGRAD_LR):
    """(strategy, model): `config` built on a fresh in-process cluster."""
    strategy = _strategy()
    if config == "dense_adam":
        from kerasps.backend import _keras_rs

        _keras_rs.uninstall()  # keras-rs' own CPU/GPU path: TableConfig.optimizer ignored
    with strategy.scope():
        model = build_dcn(config, users, items, adagrad_lr)
    layer = model.get_layer("embedding")
    on_ps = getattr(layer, "_kerasps_tables", None) is not None
    assert on_ps == (config != "dense_adam"), (config, on_ps)
    return strategy, model


def _tables_on_ps(strategy):
    return sorted({f"{r.name.split('/')[1]}:ps{r.ps_task}" for r in strategy.placement_report()
                   if r.name.startswith("embedding/") and "/part_" in r.name})


# -- speed ----------------------------------------------------------------------------------
def _random_ids_dataset_fn(users, items):
    def dataset_fn(context):
        import tensorflow as tf

        seed = context.input_pipeline_id

        def make(step):
            key = [seed, step]
            features = {
                "user": tf.random.stateless_uniform([BATCH], key, 0, users, tf.int32),
                "item": tf.random.stateless_uniform([BATCH], [seed + 7, step], 0, items,
                                                    tf.int32),
                "history": tf.random.stateless_uniform([BATCH, HISTORY], [seed + 13, step],
                                                       0, items, tf.int32),
            }
            labels = tf.cast((features["user"] + features["item"]) % 2, tf.float32)[:, None]
            return features, labels

        return tf.data.Dataset.range(2**62).map(make).prefetch(4)

    return dataset_fn


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_speed(config, rows, args):
    import gc

    import keras

    import kerasps

    strategy, model = _built(config, rows, rows, args.adagrad_lr)
    data = kerasps.DatasetCreator(_random_ids_dataset_fn(rows, rows))
    model.fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0)

    class LoopTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.begin = time.perf_counter()

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    timer = LoopTimer()
    gc.collect()
    cpu, start = _cpu_seconds(), time.perf_counter()
    history = model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0,
                        callbacks=[timer])
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    record = {"part": "speed", "config": config, "rows": rows, "steps": args.steps,
              "warmup": args.warmup, "steps_per_s": args.steps / seconds,
              "loop_steps_per_s": args.steps / (timer.end - timer.begin),
              "cpu_ms_per_step": 1000 * cpu / args.steps,
              "loss": float(history.history["loss"][-1]),
              "tables_on_ps": _tables_on_ps(strategy)}
    strategy.shutdown()
    return record


# -- quality --------------------------------------------------------------------------------
def ctr_stream(examples, users, items, seed=0, exponent=1.05, factors=4, scale=2.5):
    """A synthetic click stream: Zipf-popular users and items (`exponent`), each with
    hidden factors; a click is drawn with probability sigmoid(scale * (<u, i> + bias_u +
    bias_i) / sqrt(factors + 2)). Returns (features, labels) as numpy arrays; a user's
    `history` is HISTORY items they saw, drawn from the item popularity."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def zipf(n, size):
        weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
        ranks = rng.choice(n, size=size, p=weights / weights.sum())
        return rng.permutation(n)[ranks].astype("int32")  # popularity not tied to the id

    user = zipf(users, examples)
    item = zipf(items, examples)
    history = zipf(items, (examples, HISTORY))
    u_f, i_f = rng.normal(size=(users, factors)), rng.normal(size=(items, factors))
    u_b, i_b = rng.normal(size=users), rng.normal(size=items)
    logit = (np.einsum("nf,nf->n", u_f[user], i_f[item]) + u_b[user] + i_b[item]
             + 0.5 * np.einsum("nf,nf->n", u_f[user], i_f[history].mean(axis=1)))
    logit = scale * logit / np.sqrt(factors + 2)
    labels = (rng.random(examples) < 1 / (1 + np.exp(-logit))).astype("float32")
    return {"user": user, "item": item, "history": history}, labels


def run_quality(config, args):
    import numpy as np

    with np.load(args.stream_file) as saved:
        features = {name: saved[name] for name in ("user", "item", "history")}
        labels = saved["labels"]
    cut = int(len(labels) * 0.9)
    strategy, model = _built(config, QUALITY_USERS, QUALITY_ITEMS, args.adagrad_lr)
    train = {name: value[:cut] for name, value in features.items()}
    held_out = {name: value[cut:] for name, value in features.items()}
    start = time.perf_counter()
    history = model.fit(train, labels[:cut, None], batch_size=BATCH, epochs=1,
                        shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    scores = model.predict(held_out, batch_size=4096, verbose=0).ravel()
    record = {"part": "quality", "config": config, "auc": auc(labels[cut:], scores),
              "train_s": seconds, "examples": len(labels),
              "loss": float(history.history["loss"][-1]),
              "click_rate": float(labels.mean())}
    strategy.shutdown()
    return record


# -- orchestration --------------------------------------------------------------------------
def _child(args, part, config, rows=0, timeout=900):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", part, config, str(rows),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--adagrad-lr", str(args.adagrad_lr)]
    if args.stream_file:
        cmd += ["--stream-file", args.stream_file]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"part": part, "config": config, "rows": rows,
                "error": f"timed out after {timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"part": part, "config": config, "rows": rows,
            "error": f"exit {proc.returncode}:\n{tail}"}


def _speed_plan(args):
    """(config, rows per table): every configuration at `--rows`, per-table Adagrad and
    dense Adam at `--small-rows` (with `--quick`: those two at `--small-rows` only)."""
    if args.quick:
        return [(c, int(args.small_rows)) for c in ("adagrad", ANCHOR)]
    return ([(c, int(args.rows)) for c in SPEED_CONFIGS]
            + [(c, int(args.small_rows)) for c in ("adagrad", ANCHOR)])


def _median(values):
    return statistics.median(values) if values else None


def _fmt(x, digits=2):
    return "n/a" if x is None else f"{x:,.{digits}f}"


LABELS = {
    "adagrad": "per-table `Adagrad(0.15)` (kerasps, row updates)",
    "adam": "keras-rs' default `\"adam\"` per table (kerasps, lazy)",
    "dense_adam": "keras-rs' own layer, tables trained by the model's Adam (anchor)",
}


def summarize(results, args):
    """Medians per (config, rows) and the ratios paired within a repeat."""
    speed = [r for r in results if r["part"] == "speed" and "error" not in r]
    rows_big, rows_small = int(args.rows), int(args.small_rows)

    def runs(config, rows):
        return {r["repeat"]: r for r in speed if r["config"] == config and r["rows"] == rows}

    table = []
    for config, rows in _speed_plan(args):
        mine, anchor = runs(config, rows), runs(ANCHOR, rows)
        small = runs(config, rows_small)
        if not mine:
            continue
        paired = [mine[k]["steps_per_s"] / anchor[k]["steps_per_s"] for k in mine if k in anchor]
        loop_paired = [mine[k]["loop_steps_per_s"] / anchor[k]["loop_steps_per_s"]
                       for k in mine if k in anchor]
        over_small = [mine[k]["loop_steps_per_s"] / small[k]["loop_steps_per_s"]
                      for k in mine if k in small] if rows == rows_big else []
        table.append({
            "config": config, "rows": rows,
            "steps_per_s": _median([r["steps_per_s"] for r in mine.values()]),
            "loop_steps_per_s": _median([r["loop_steps_per_s"] for r in mine.values()]),
            "each_loop": sorted(round(r["loop_steps_per_s"], 1) for r in mine.values()),
            "cpu_ms_per_step": _median([r["cpu_ms_per_step"] for r in mine.values()]),
            "vs_anchor": _median(paired), "loop_vs_anchor": _median(loop_paired),
            "loop_vs_small": _median(over_small)})
    quality = {r["config"]: r for r in results if r["part"] == "quality" and "error" not in r}
    return table, quality


def markdown(table, quality, meta, args):
    lines = []
    if table:
        lines += [
            f"### Speed: the DCN, 2 tables of {int(args.rows):,} (and {int(args.small_rows):,}) "
            f"rows x {DIM}, per-worker batch {BATCH}, spe {SPE}, {args.steps} timed steps, "
            f"median of {args.repeats}", "",
            "| tables trained by | rows per table | steps/s (whole `fit`) | steps/s (loop) "
            "| loop runs | CPU ms/step | vs dense Adam, same rows (whole / loop) "
            f"| loop vs {int(args.small_rows):,} rows |",
            "|---|---:|---:|---:|---|---:|---:|---:|"]
        for row in table:
            lines.append(
                f"| {LABELS[row['config']]} | {row['rows']:,} | {_fmt(row['steps_per_s'], 1)} "
                f"| {_fmt(row['loop_steps_per_s'], 1)} | {row['each_loop']} "
                f"| {_fmt(row['cpu_ms_per_step'], 1)} "
                f"| {_fmt(row['vs_anchor'])} / {_fmt(row['loop_vs_anchor'])} "
                f"| {_fmt(row['loop_vs_small'])} |")
        lines.append("")
    if quality:
        sample = next(iter(quality.values()))
        lines += [
            f"### Quality: AUC on the held-out last 10% of {sample['examples']:,} synthetic "
            f"clicks ({QUALITY_USERS:,} users, {QUALITY_ITEMS:,} items, click rate "
            f"{sample['click_rate']:.3f}), one pass in order", "",
            "| tables trained by | AUC | vs keras-rs' default | last loss | train s |",
            "|---|---:|---:|---:|---:|"]
        base = quality.get("adam", {}).get("auc")
        for config in QUALITY_CONFIGS:
            r = quality.get(config)
            if r:
                lines.append(f"| {LABELS[config]} | {r['auc']:.4f} "
                             f"| {_fmt(r['auc'] - base if base else None, 4)} "
                             f"| {r['loss']:.4f} | {r['train_s']:.0f} |")
        lines.append("")
    lines.append(f"Versions {meta['versions']}; nproc {meta['nproc']}; load average "
                 f"{meta['load_before']} -> {meta.get('load_after')}; "
                 f"{meta.get('seconds', 0):.0f} s.")
    return "\n".join(lines)


def _versions():
    found = {}
    for dist in ("tensorflow", "keras", "keras-rs", "kerasps"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["speed", "quality"],
                        choices=["speed", "quality"])
    parser.add_argument("--one", nargs=3, metavar=("PART", "CONFIG", "ROWS"))
    parser.add_argument("--rows", type=float, default=1e6, help="rows per table (speed)")
    parser.add_argument("--small-rows", type=float, default=1e4,
                        help="rows per table of the size anchor (speed)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 400)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 60)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--examples", type=float, default=None,
                        help="clicks of the quality stream (default 4e5; 2e4 with --quick)")
    parser.add_argument("--adagrad-lr", type=float, default=ADAGRAD_LR,
                        help="the per-table Adagrad's learning rate (quality)")
    parser.add_argument("--seed", type=int, default=1, help="of the quality stream")
    parser.add_argument("--stream-file", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: per-table Adagrad and dense Adam at --small-rows, 1 "
                             "repeat of 60 steps; quality: per-table Adagrad on 2e4 clicks")
    parser.add_argument("--json", help="also write all results to this file")
    args = parser.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 400)
    args.warmup = args.warmup or (20 if args.quick else 60)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.examples = int(args.examples or (2e4 if args.quick else 4e5))

    if args.one:
        part, config, rows = args.one[0], args.one[1], int(float(args.one[2]))
        record = run_speed(config, rows, args) if part == "speed" else run_quality(config, args)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    meta = {"versions": _versions(), "seed": args.seed, "adagrad_lr": args.adagrad_lr,
            "adagrad_accumulator": ADAGRAD_ACCUMULATOR, "nproc": len(os.sched_getaffinity(0)),
            "load_before": round(os.getloadavg()[0], 2), "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "rows": int(args.rows),
            "small_rows": int(args.small_rows), "examples": args.examples,
            "batch": BATCH, "spe": SPE, "dim": DIM}
    print(f"# keras_rs: {NUM_WORKERS} workers, {NUM_PS} ps; {meta['versions']}; load "
          f"{meta['load_before']}", flush=True)
    start = time.perf_counter()
    results = []

    def note(record):
        results.append(record)
        print("  ", json.dumps(record)[:400], flush=True)

    if "speed" in args.parts:
        plan = _speed_plan(args)
        for repeat in range(args.repeats):
            for config, rows in plan if repeat % 2 == 0 else plan[::-1]:
                record = _child(args, "speed", config, rows)
                record["repeat"] = repeat
                note(record)
    if "quality" in args.parts:
        import numpy as np

        with tempfile.TemporaryDirectory(prefix="kerasps-ctr-") as directory:
            features, labels = ctr_stream(args.examples, QUALITY_USERS, QUALITY_ITEMS,
                                          seed=args.seed)
            args.stream_file = os.path.join(directory, "stream.npz")
            np.savez(args.stream_file, labels=labels, **features)
            for config in QUALITY_CONFIGS[:1] if args.quick else QUALITY_CONFIGS:
                note(_child(args, "quality", config))
            args.stream_file = None
    meta["load_after"] = round(os.getloadavg()[0], 2)
    meta["seconds"] = time.perf_counter() - start
    table, quality = summarize(results, args)
    print()
    print(markdown(table, quality, meta, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "table": table,
                       "quality": quality}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
