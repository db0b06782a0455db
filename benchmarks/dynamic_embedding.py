"""`kerasps.layers.DynamicEmbedding` against the tables Keras 3 users have today.

Four parts, each configuration in its own subprocess on its own in-process
cluster of 2 workers and 2 ps tasks (`kerasps.cluster.in_process`; coordinator,
workers and ps tasks in one process, so its CPU time and RSS are the job's):

* ``quality``: a click stream over a growing vocabulary
  (`simulator.idstream.ZipfStream`: Zipf popularity over a sliding window of
  live ids, labels from a hidden per-id score plus noise), read once in order
  (`fit` of the first 90%, `shuffle=False`), then AUC on the held-out last
  10% (`predict`). Model: ids -> table(dim 8) -> Dense(1, sigmoid), Adagrad
  (kerasps' exact row updates for all three). Tables at the same number of
  rows C: ``dynamic`` (`DynamicEmbedding(capacity=C)`), ``hashed``
  (`keras.layers.Hashing(C)` + `Embedding(C)`, what Keras 3 users do today)
  and ``unbounded`` (`Embedding(distinct)`: a row for every id, the
  reference). Targets: dynamic > hashed, and within 0.005 AUC of unbounded.
* ``speed``: the same model with dim 16 and Dense(32) on that stream, Adagrad,
  steady state after a warm-up `fit` that fills the table: ``dynamic`` against
  ``hashed`` (a sharded fixed `Embedding(C)`), steps/s, CPU ms per step, rows
  admitted per step and the extra CPU per admitted id. Target: >= 0.9x.
* ``memory``: `DynamicEmbedding(32, capacity=1e6)` with Adagrad, fed batches
  of which half are ids never seen before, until `--memory-ids` distinct ids
  went through it (1e7 by default); RSS sampled as it runs. Targets: flat
  once the table is full, and growth within 1.2x of the arithmetic
  (`kerasps.tables.TableSpec.memory_bytes`: rows, slots, state, maps).
* ``faults``: `kerasps launch` 2 workers and 2 ps processes training a
  dynamic table with `BackupAndRestore(save_freq=10)`; ps 1 is SIGKILLed at
  step 75 and restarted; the job must finish with at most 10 steps rolled back
  and the table whole (rows, maps, counts agree; every key still served).

    python benchmarks/dynamic_embedding.py                     # all, small scale
    python benchmarks/dynamic_embedding.py --parts quality --examples 4e6
    python benchmarks/dynamic_embedding.py --parts memory --memory-ids 1e7
    python benchmarks/dynamic_embedding.py --one quality dynamic 10000   # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT_PREFIX = "DYNAMIC_EMBEDDING_RESULT "
TABLES = ("dynamic", "hashed", "unbounded")
NUM_WORKERS = 2
NUM_PS = 2
MEMORY_BASELINE_ROWS = 1024
SPEED_TARGET = 0.9  # dynamic / hashed steps/s, new ids arriving
# --quick: every part, at sizes that take seconds (the same code paths).
QUICK = {"rows": [1e3], "examples": 1e4, "distinct": 4e3, "window": 1.5e3, "chunk": 2048,
         "tables": ["dynamic", "hashed"], "batch": 64, "speed_rows": 1e3, "steps": 20,
         "warmup": 10, "repeats": 1, "memory_rows": 4096, "memory_ids": 2e4,
         "memory_batch": 512}


def _stream(args):
    from simulator.idstream import ZipfStream

    return ZipfStream(examples=int(args.examples), distinct=int(args.distinct),
                      window=int(args.window), exponent=args.exponent, chunk=args.chunk,
                      seed=args.seed)


def _stream_arrays(args):
    """The quality part's ids and labels: read from `--stream-file` where the parent drew
    them once for all its children, else drawn here."""
    import numpy as np

    if args.stream_file:
        with np.load(args.stream_file) as saved:
            return saved["ids"], saved["labels"]
    return _stream(args).arrays()


def auc(labels, scores):
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    import numpy as np

    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)
    positive = labels > 0.5
    n1, n0 = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)) if n1 and n0 else (
        float(np.nan))


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _trimmed_rss_mib():
    """RSS after glibc's `malloc_trim(0)` returned the memory its arenas hold free (`None`
    where there is no glibc): what the process uses, not what its allocator keeps."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _rss_mib()


def _strategy():
    import kerasps

    return kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=NUM_WORKERS, num_ps=NUM_PS),
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=64 << 10, max_shards=NUM_PS))


def _table_model(table, rows, distinct, dim, hidden=0, min_count=1):
    import keras

    import kerasps

    inputs = keras.Input((1,), dtype="int64")
    if table == "dynamic":
        x = kerasps.layers.DynamicEmbedding(dim, capacity=rows, min_count=min_count,
                                            name="items")(inputs)
    elif table == "hashed":
        x = keras.layers.Embedding(rows, dim)(keras.layers.Hashing(rows)(inputs))
    else:
        x = keras.layers.Embedding(distinct, dim)(inputs)
    x = keras.layers.Flatten()(x)
    if hidden:
        x = keras.layers.Dense(hidden, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))


# -- the parts (in the child process) ---------------------------------------------------------
def run_quality(table, rows, args):
    import keras
    import numpy as np

    ids, labels = _stream_arrays(args)
    cut = int(len(ids) * 0.9)
    strategy = _strategy()
    with strategy.scope():
        model = _table_model(table, rows, int(args.distinct), 8, min_count=args.min_count)
        model.compile(keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    start = time.perf_counter()
    history = model.fit(ids[:cut, None], labels[:cut], batch_size=args.batch, epochs=1,
                        shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    scores = model.predict(ids[cut:, None], batch_size=4096, verbose=0).ravel()
    record = {"part": "quality", "table": table, "rows": rows, "auc": auc(labels[cut:], scores),
              "train_s": seconds, "examples": len(ids), "distinct_seen": len(np.unique(ids)),
              "tail_distinct": len(np.unique(ids[cut:])),
              "tail_unseen": float(1 - (set_member(ids[cut:], ids[:cut])).mean())}
    if table == "dynamic":
        record["min_count"] = args.min_count
        record.update({k: history.history[f"items_{k}"][-1] for k in (
            "rows_used", "admitted", "evicted", "hit_rate")})
    strategy.shutdown()
    return record


def set_member(values, pool):
    import numpy as np

    return np.isin(values, pool)


def _fresh_ids_dataset_fn(hot, batch, fresh_share):
    """Per-worker batches: `fresh_share` of each batch are ids never drawn before, the rest
    Zipf-distributed over `hot` ids."""

    def dataset_fn(context):
        import tensorflow as tf

        worker = context.input_pipeline_id
        fresh = int(batch * fresh_share)

        def make(step):
            ranks = tf.random.stateless_uniform([batch - fresh, 1], [worker, step], 0, 1,
                                                tf.float64)
            old = tf.cast(tf.math.floor(hot ** ranks), tf.int64)  # log-uniform: heavy head
            new = (tf.cast(step, tf.int64) * NUM_WORKERS + worker) * fresh + tf.range(
                fresh, dtype=tf.int64)[:, None] + 10**12
            ids = tf.concat([old, new], 0)
            return ids, tf.cast(ids % 2, tf.float32)

        return tf.data.Dataset.range(2**62).map(make).prefetch(4)

    return dataset_fn


def run_speed(table, rows, args):
    import keras

    import kerasps

    strategy = _strategy()
    with strategy.scope():
        model = _table_model(table, rows, 0, 16, hidden=32)
        model.compile(keras.optimizers.Adagrad(0.05), "binary_crossentropy",
                      steps_per_execution=args.spe)
    data = kerasps.DatasetCreator(_fresh_ids_dataset_fn(rows * 4, args.batch, args.fresh))
    warmup = max(args.warmup, int(2 * rows / (args.batch * args.fresh)))  # fills the table
    model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)
    cpu, start = time.process_time(), time.perf_counter()
    history = model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
    seconds = time.perf_counter() - start
    record = {"part": "speed", "table": table, "rows": rows, "steps": args.steps,
              "warmup": warmup, "steps_per_s": args.steps / seconds,
              "cpu_ms_per_step": 1000 * (time.process_time() - cpu) / args.steps}
    if table == "dynamic":
        record.update(admitted_per_step=history.history["items_admitted"][-1] / args.steps,
                      evicted_per_step=history.history["items_evicted"][-1] / args.steps,
                      hit_rate=history.history["items_hit_rate"][-1])
    strategy.shutdown()
    return record


def run_memory(rows, args):
    import keras

    import kerasps

    dim, batch, fresh = 32, args.memory_batch, 0.5
    strategy = _strategy()
    rss_before = _rss_mib()
    with strategy.scope():
        layer = kerasps.layers.DynamicEmbedding(dim, capacity=rows, name="items")
        inputs = keras.Input((1,), dtype="int64")
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(
            keras.layers.Flatten()(layer(inputs))))
        model.compile(keras.optimizers.Adagrad(0.05), "binary_crossentropy",
                      steps_per_execution=10)
    rss_built = _rss_mib()
    data = kerasps.DatasetCreator(_fresh_ids_dataset_fn(rows, batch, fresh))
    per_step = batch * fresh
    steps = int(args.memory_ids / per_step)
    samples = []
    start = time.perf_counter()

    def sample(epoch, logs):
        stats = layer.table_stats()
        rss = _rss_mib()  # before the trim: what the process held
        samples.append({"t": time.perf_counter() - start, "epoch": epoch, "rss_mib": rss,
                        "rss_trimmed_mib": _trimmed_rss_mib(),
                        "rows_used": stats["rows_used"], "admitted": stats["admitted"],
                        "evicted": stats["evicted"]})

    epochs = 20
    model.fit(data, epochs=epochs, steps_per_epoch=max(10, steps // epochs), verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=sample)])
    arithmetic = layer.spec.memory_bytes(slots_per_row=1)
    full = [s for s in samples if s["rows_used"] >= rows]
    record = {"part": "memory", "rows": rows, "dim": dim, "steps": steps,
              "distinct_ids": steps * per_step, "rss_before_mib": rss_before,
              "rss_built_mib": rss_built, "samples": samples,
              "arithmetic_mib": {k: v / 2**20 for k, v in arithmetic.items()},
              "seconds": time.perf_counter() - start}
    if full:
        record["rss_full_first_mib"] = full[0]["rss_mib"]
        record["rss_full_last_mib"] = full[-1]["rss_mib"]
        record["growth_over_arithmetic"] = (max(s["rss_mib"] for s in full) - rss_before) / (
            arithmetic["total"] / 2**20)
    strategy.shutdown()
    return record


FAULT_CHIEF = """
import itertools, sys, time
import keras, numpy as np, tensorflow as tf, kerasps
from kerasps.policy import tables

def say(*words):
    print(*words, flush=True)

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config(),
                                           sparse_updates="lazy")
with strategy.scope():
    inputs = keras.Input((1,), dtype="int64")
    layer = kerasps.layers.DynamicEmbedding(8, capacity=256, num_partitions=4, name="items")
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Flatten()(layer(inputs))))
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy")

def dataset_fn(context):
    ids = tf.random.stateless_uniform((4096, 1), [1, context.input_pipeline_id], 0, 600,
                                      tf.int64)
    labels = tf.cast(ids % 2, tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(16)

trained = itertools.count(1)
start = time.perf_counter()
progress = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: say(
    "train batch", next(trained), time.perf_counter() - start))
backup = keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)
history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=4, steps_per_epoch=50,
                    verbose=0, callbacks=[progress, backup])
state = layer.state.numpy()
used = np.flatnonzero(state[:, tables.LAST_SEEN] >= 0)
served = np.array_equal(layer(tf.constant(state[used, 0], tf.int64)).numpy(),
                        layer.rows.numpy()[used])
stats = layer.table_stats()
say("RESULT", {"iterations": int(model.optimizer.iterations.numpy()),
               "reexecuted": sum(history.history.get("reexecuted_steps", [0])),
               "rolled_back": sum(history.history.get("rolled_back_steps", [0])),
               "rows_used": len(used),
               "maps": sum(int(m.size().numpy()) for m in layer._table.maps()),
               "served": bool(served), "balance": stats["admitted"] - stats["evicted"] == len(used),
               "hit_rate": history.history["items_hit_rate"]})
"""


def run_faults(args):
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "chief.py")
        with open(script, "w") as f:
            f.write(FAULT_CHIEF)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        process = subprocess.Popen(
            [sys.executable, "-m", "kerasps.cli", "launch", "--workers", "2", "--ps", "2",
             "--max-restarts", "2", script, os.path.join(tmp, "backup")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines, pids, killed_at = [], {}, {}
        for line in process.stdout:
            lines.append(line.rstrip())
            started = re.search(r"\[launcher\] started (\w+ \d+) at \S+ \(pid (\d+)\)", line)
            if started:
                pids[started.group(1)] = int(started.group(2))
            batch = re.search(r"\[chief 0\] train batch (\d+) (\S+)", line)
            if batch and int(batch.group(1)) == 75 and not killed_at:
                os.kill(pids["ps 1"], 9)
                killed_at = {"step": 75, "t": float(batch.group(2))}
        code = process.wait()
    result = next((eval(line.split("RESULT ", 1)[1]) for line in lines if "RESULT " in line),
                  None)
    record = {"part": "faults", "exit": code, "killed": killed_at, "result": result,
              "tail": lines[-5:] if result is None else []}
    if code != 0 or result is None:
        record["error"] = f"exit {code}:\n" + "\n".join(lines[-15:])
    return record


# -- orchestration ----------------------------------------------------------------------
def _child(args, part, table=None, rows=None, timeout=3600):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", part, table or "-",
           str(rows or 0), *_forwarded(args)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(["nice", "-n", str(args.nice), *cmd], capture_output=True, text=True,
                          timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"part": part, "table": table, "rows": rows,
            "error": f"exit {proc.returncode}:\n{tail}"}


def _forwarded(args):
    out = []
    for name in ("examples", "distinct", "window", "exponent", "chunk", "min_count", "seed",
                 "batch", "steps", "warmup", "spe", "fresh", "memory_rows", "memory_ids",
                 "memory_batch"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + (["--stream-file", args.stream_file] if args.stream_file else [])


def _fmt(x, digits=3):
    return "" if x is None else f"{x:,.{digits}f}"


def report(results, args):
    lines = []
    quality = [r for r in results if r["part"] == "quality" and "error" not in r]
    if quality:
        sample = quality[0]
        lines += [f"### Quality: AUC on the held-out last 10% of {sample['examples']:,} clicks "
                  f"({sample['distinct_seen']:,} distinct ids seen; {args.distinct:,.0f} in the "
                  f"vocabulary, {args.window:,.0f} live at a time, Zipf {args.exponent}; "
                  f"{sample['tail_unseen']:.1%} of the tail's clicks on ids never trained on)",
                  "", f"| rows C | dynamic (min_count={args.min_count}) | hashed "
                  "| unbounded (a row per id) | dynamic - hashed "
                  "| dynamic - unbounded | dynamic hit rate (last epoch) | evicted |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        verdicts = []
        for rows in sorted({r["rows"] for r in quality if r["table"] != "unbounded"}):
            got = {r["table"]: r for r in quality if r["rows"] == rows or r["table"] == "unbounded"}
            d, h, u = (got.get(t, {}).get("auc") for t in TABLES)
            lines.append(f"| {rows:,} | {_fmt(d, 4)} | {_fmt(h, 4)} | {_fmt(u, 4)} "
                         f"| {_fmt(d - h if d and h else None, 4)} "
                         f"| {_fmt(d - u if d and u else None, 4)} "
                         f"| {_fmt(got.get('dynamic', {}).get('hit_rate'))} "
                         f"| {got.get('dynamic', {}).get('evicted', 0):,.0f} |")
            if d and h:
                verdicts.append(f"C={rows:,}: dynamic {'beats' if d > h else 'DOES NOT beat'} "
                                f"hashed ({d - h:+.4f})")
            if d and u:
                verdicts.append(f"C={rows:,}: within 0.005 of unbounded: "
                                f"{'yes' if d - u >= -0.005 else 'NO'} ({d - u:+.4f})")
        lines += ["", "Targets: " + "; ".join(verdicts) + ".", ""]
    speed = [r for r in results if r["part"] == "speed" and "error" not in r]
    if speed:
        lines += ["### Speed: steady state, new ids arriving", "",
                  "| table | rows | steps/s (median) | runs | CPU ms/step | admitted/step "
                  "| ratio to hashed (paired median) | extra CPU per admitted id (us) |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]
        for rows in sorted({r["rows"] for r in speed}):
            by = {t: [r for r in speed if r["table"] == t and r["rows"] == rows]
                  for t in ("dynamic", "hashed")}
            ratios = [d["steps_per_s"] / h["steps_per_s"]
                      for d, h in zip(by["dynamic"], by["hashed"])]
            cpu = {t: statistics.median([r["cpu_ms_per_step"] for r in v]) if v else None
                   for t, v in by.items()}
            admitted = statistics.median([r["admitted_per_step"] for r in by["dynamic"]]) if (
                by["dynamic"]) else None
            for t in ("dynamic", "hashed"):
                runs = by[t]
                if not runs:
                    continue
                extra = ((cpu["dynamic"] - cpu["hashed"]) * 1000 / admitted
                         if t == "dynamic" and admitted and cpu["hashed"] else None)
                each = ", ".join(_fmt(r["steps_per_s"], 1) for r in runs)
                lines.append(
                    f"| {t} | {rows:,} | {statistics.median(r['steps_per_s'] for r in runs):.1f} "
                    f"| {each} | {cpu[t]:.2f} "
                    f"| {_fmt(admitted, 1) if t == 'dynamic' else ''} "
                    f"| {_fmt(statistics.median(ratios), 2) if t == 'dynamic' and ratios else ''} "
                    f"| {_fmt(extra, 1)} |")
            if ratios:
                ratio = statistics.median(ratios)
                verdict = ("meets" if ratio >= SPEED_TARGET
                           else f"MISSES by {(SPEED_TARGET - ratio) / SPEED_TARGET:.0%}")
                lines += ["", f"Target at {rows:,} rows: dynamic / hashed steps/s {ratio:.2f} "
                          f"(target >= {SPEED_TARGET}: {verdict})."]
        lines.append("")
    memory = [r for r in results if r["part"] == "memory" and "error" not in r]
    baseline = next((r for r in memory if r["rows"] == MEMORY_BASELINE_ROWS), None)
    for r in memory:
        if r is baseline:
            continue
        a = r["arithmetic_mib"]
        table_rss = table_arithmetic = None
        table_trimmed = None
        if baseline is not None and "rss_full_last_mib" in r:
            full = [s for s in r["samples"] if s["rows_used"] >= r["rows"]]
            table_rss = max(s["rss_mib"] for s in full) - baseline["samples"][-1]["rss_mib"]
            if full[-1].get("rss_trimmed_mib") and baseline["samples"][-1].get("rss_trimmed_mib"):
                table_trimmed = max(s["rss_trimmed_mib"] for s in full) - (
                    baseline["samples"][-1]["rss_trimmed_mib"])
            table_arithmetic = a["total"] - baseline["arithmetic_mib"]["total"]
        lines += [f"### Memory: {r['distinct_ids']:,} distinct ids through "
                  f"DynamicEmbedding({r['dim']}, capacity={r['rows']:,}), Adagrad", "",
                  f"RSS before the model {r['rss_before_mib']:.0f} MiB, after building it "
                  f"{r['rss_built_mib']:.0f} MiB; arithmetic {a['total']:.0f} MiB (rows "
                  f"{a['rows']:.0f}, slots {a['slots']:.0f}, state {a['state']:.0f}, maps "
                  f"{a['maps']:.0f}, free rows {a['free_rows']:.0f}). The table's RSS (the "
                  f"largest once full, less the end of the same run with a table of "
                  f"{MEMORY_BASELINE_ROWS:,} rows): {_fmt(table_rss, 0)} MiB, "
                  f"{_fmt(table_rss / table_arithmetic if table_rss else None, 2)}x its "
                  f"arithmetic (target <= 1.2); after `malloc_trim(0)` at each sample (both "
                  f"runs): {_fmt(table_trimmed, 0)} MiB, "
                  f"{_fmt(table_trimmed / table_arithmetic if table_trimmed else None, 2)}x. "
                  f"RSS once full: "
                  f"{_fmt(r.get('rss_full_first_mib'), 0)} -> "
                  f"{_fmt(r.get('rss_full_last_mib'), 0)} MiB; {r['seconds']:.0f} s.", "",
                  "| t (s) | rows used | admitted | evicted | RSS MiB | after malloc_trim |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {s['t']:.0f} | {s['rows_used']:,} | {s['admitted']:,} | {s['evicted']:,} "
                  f"| {s['rss_mib']:.0f} | {_fmt(s.get('rss_trimmed_mib'), 0)} |"
                  for s in r["samples"]]
        lines.append("")
    for r in results:
        if r["part"] == "faults":
            lines += ["### Faults: ps 1 SIGKILLed at step 75 of 200 (restarted), "
                      "`BackupAndRestore(save_freq=10)`", "",
                      f"```\n{json.dumps(r, indent=1)}\n```", ""]
    for r in results:
        if "error" in r:
            lines.append(f"FAILED {r['part']} {r.get('table')} {r.get('rows')}: {r['error']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["quality", "speed", "memory", "faults"],
                        choices=["quality", "speed", "memory", "faults"])
    parser.add_argument("--one", nargs=3, metavar=("PART", "TABLE", "ROWS"))
    parser.add_argument("--rows", type=float, nargs="+", default=[5e3, 2e4],
                        help="table rows C of the quality part")
    parser.add_argument("--examples", type=float, default=2e6)
    parser.add_argument("--distinct", type=float, default=4e5)
    parser.add_argument("--window", type=float, default=1e5)
    parser.add_argument("--exponent", type=float, default=1.1)
    parser.add_argument("--chunk", type=int, default=8192,
                        help="ids drawn per chunk of the stream (the window moves once a chunk)")
    parser.add_argument("--stream-file", help=argparse.SUPPRESS)
    parser.add_argument("--min-count", type=int, default=1,
                        help="quality: the dynamic table's admission (`min_count`)")
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES,
                        help="quality: the tables to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=256, help="per-worker batch")
    parser.add_argument("--speed-rows", type=float, default=1e5)
    parser.add_argument("--steps", type=int, default=400, help="timed steps of the speed part")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--spe", type=int, default=1, help="steps_per_execution (speed)")
    parser.add_argument("--fresh", type=float, default=0.25,
                        help="share of never-seen ids per batch (speed)")
    parser.add_argument("--repeats", type=int, default=3, help="speed repeats")
    parser.add_argument("--memory-rows", type=float, default=1e6)
    parser.add_argument("--memory-ids", type=float, default=1e7)
    parser.add_argument("--memory-batch", type=int, default=4096)
    parser.add_argument("--nice", type=int, default=5)
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: every part at a tiny size (a 1,000-row table, "
                             "10,000 clicks; dynamic and hashed; one speed repeat; the "
                             "memory run without its baseline)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)

    if args.one:
        part, table, rows = args.one[0], args.one[1], int(float(args.one[2]))
        record = {"quality": lambda: run_quality(table, rows, args),
                  "speed": lambda: run_speed(table, rows, args),
                  "memory": lambda: run_memory(rows, args)}[part]()
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    results = []

    def note(record):
        results.append(record)
        brief = {k: v for k, v in record.items() if k not in ("samples", "arithmetic_mib")}
        print("  ", json.dumps(brief)[:300], flush=True)

    print(f"# dynamic_embedding: parts {args.parts}; load {os.getloadavg()[0]:.2f}", flush=True)
    if "quality" in args.parts:
        with tempfile.TemporaryDirectory(prefix="kerasps-stream-") as directory:
            import numpy as np

            start = time.perf_counter()
            ids, labels = _stream(args).arrays()
            args.stream_file = os.path.join(directory, "stream.npz")
            np.savez(args.stream_file, ids=ids, labels=labels)
            del ids, labels
            print(f"   the stream drawn in {time.perf_counter() - start:.0f} s", flush=True)
            for rows in [int(r) for r in args.rows]:
                for table in ("dynamic", "hashed"):
                    if table in args.tables:
                        note(_child(args, "quality", table, rows))
            if "unbounded" in args.tables:
                note(_child(args, "quality", "unbounded", int(args.distinct)))
            args.stream_file = None
    if "speed" in args.parts:
        for repeat in range(args.repeats):
            for table in ("hashed", "dynamic") if repeat % 2 == 0 else ("dynamic", "hashed"):
                note(_child(args, "speed", table, int(args.speed_rows)))
    if "memory" in args.parts:
        # The same run with a table of 1,024 rows: what the process takes besides the table.
        for rows in ((MEMORY_BASELINE_ROWS,) if not args.quick else ()) + (
                int(args.memory_rows),):
            note(_child(args, "memory", "-", rows, timeout=7200))
    if "faults" in args.parts:
        note(run_faults(args))
    print(f"# load after {os.getloadavg()[0]:.2f}\n")
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
