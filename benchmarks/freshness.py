"""Freshness against quality: how much a server loses by seeing training late.

A click stream whose vocabulary keeps moving (`simulator.idstream.ZipfStream`: a window of
live ids slides over a growing range, so new ids keep arriving and old ones stop being
seen; a click's label is the id's hidden score plus noise). A trainer (an in-process
cluster of 2 workers and 2 ps tasks; Embedding(distinct, 8) sharded over both, a sigmoid
unit; Adagrad) reads the stream in order, `CHUNK` clicks at a time, and publishes a
version after every chunk (`kerasps.callbacks.PublishDeltas`). Servers
(`kerasps.DeltaConsumer`s of those versions, one process) take them at different paces:

* **deltas every N**: applies the versions every N chunks (N = 1: as fresh as the
  trainer);
* **full every M**: loads the trainer's state every M chunks, as a server re-exported
  in full every M chunks would (the state a full export would hold: the versions up to
  then, applied at once);
* **frozen**: the base (the first full version, after the warm-up), never updated.

Each server predicts each chunk before the trainer trains on it (progressive
validation: the clicks of the next minutes, scored by what the server knows now); the
AUC of each chunk is printed as the mean over the run and over its last quarter, and
plotted over the run (`--plot`, docs/freshness.png by default). The bytes each server's
updates cost are counted from the published versions: a full version is the whole
table, a delta the rows that changed since the one before.

    pip install -e .
    python benchmarks/freshness.py                  # ~3 min on 2 cores; prints + plot
    python benchmarks/freshness.py --quick          # smoke run, no plot
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.dynamic_embedding import auc  # noqa: E402
from simulator.idstream import ZipfStream  # noqa: E402

CHUNK = 2048  # clicks a chunk: what a server scores between two of its chances to update
BATCH = 256  # per step: 8 steps a chunk
DIM = 8
PLOT = os.path.join(ROOT, "docs", "freshness.png")
RECORD = os.path.join(ROOT, "benchmarks", "records", "freshness.json")


def build(strategy, distinct):
    import keras

    with strategy.scope():
        ids = keras.Input((1,), dtype="int64")
        rows = keras.layers.Embedding(distinct, DIM, name="ids")(ids)
        click = keras.layers.Dense(1, activation="sigmoid", name="click")(
            keras.layers.Flatten()(rows))
        model = keras.Model(ids, click)
        model.compile(keras.optimizers.Adagrad(0.2), "binary_crossentropy")
    return model


def folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 24 chunks")
    parser.add_argument("--chunks", type=int, default=None, help="default 160 (24 quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="chunks trained before the base, default 20 (4 quick)")
    parser.add_argument("--deltas-every", type=int, nargs="+", default=None,
                        help="chunks between a server's delta updates, default 1 5")
    parser.add_argument("--full-every", type=int, default=None,
                        help="chunks between full loads, default 40 (8 quick)")
    parser.add_argument("--plot", default=PLOT, help=f"plot (default {PLOT}; none quick)")
    parser.add_argument("--json", default=RECORD, help=f"record (default {RECORD}; none quick)")
    args = parser.parse_args(argv)
    chunks = args.chunks or (24 if args.quick else 160)
    warmup = args.warmup or (4 if args.quick else 20)
    deltas_every = args.deltas_every or [1, 5]
    full_every = args.full_every or (8 if args.quick else 40)
    plot = None if args.quick and args.plot == PLOT else args.plot
    record = None if args.quick and args.json == RECORD else args.json
    for name, value in (("chunks", chunks), ("warmup", warmup), ("full-every", full_every),
                        *(("deltas-every", v) for v in deltas_every)):
        if value <= 0:
            parser.error(f"Invalid value for argument `--{name}`: expected a positive "
                         f"number. Received: --{name}={value}")
    if warmup >= chunks:
        parser.error(f"Invalid value for argument `--warmup`: expected fewer than "
                     f"--chunks={chunks}. Received: --warmup={warmup}")

    import kerasps

    # 250 new ids a chunk; an id is live for about 40 chunks.
    stream = ZipfStream(examples=chunks * CHUNK, distinct=10_000 + 250 * chunks,
                        window=10_000, chunk=CHUNK, seed=0)
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=2, num_ps=2),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    model = build(strategy, stream.distinct)
    directory = os.path.join(tempfile.mkdtemp(prefix="kerasps-freshness-"), "deltas")
    publisher = kerasps.callbacks.PublishDeltas(directory, model=model)

    servers = {f"deltas every {n}": n for n in deltas_every}
    servers[f"full every {full_every}"] = full_every
    servers["frozen"] = None
    consumers, aucs, updated_bytes = {}, {name: [] for name in servers}, dict.fromkeys(servers, 0)
    full_bytes = 0
    started = time.perf_counter()
    for c, ids in enumerate(stream.chunks()):
        labels = stream.labels(ids, c)
        x = ids.reshape(-1, 1)
        if c == warmup:  # the base: every server starts from it
            base = publisher.publish(full=True)
            full_bytes = folder_bytes(base)
            for name in servers:
                consumers[name] = kerasps.DeltaConsumer(directory)
                consumers[name].update()
        if c >= warmup:
            for name, consumer in consumers.items():
                scores = consumer.model.predict(x, batch_size=CHUNK, verbose=0)[:, 0]
                aucs[name].append(auc(labels, scores))
        for start in range(0, len(x), BATCH):
            model.train_on_batch(x[start:start + BATCH], labels[start:start + BATCH, None])
        if c < warmup:
            continue
        folder = publisher.publish()
        delta_bytes = folder_bytes(folder)
        trained = c + 1 - warmup  # chunks trained since the base
        for name, every in servers.items():
            if every is None or trained % every:
                continue
            consumers[name].update()
            # A delta server reads every delta; a full one reads the whole table.
            updated_bytes[name] += (full_bytes if name.startswith("full") else 0)
        for name in servers:
            if name.startswith("deltas"):
                updated_bytes[name] += delta_bytes
    elapsed = time.perf_counter() - started

    evaluated = chunks - warmup
    last = max(1, evaluated // 4)
    print(f"## Freshness: {chunks} chunks of {CHUNK} clicks ({evaluated} scored after a "
          f"{warmup}-chunk warm-up), {stream.distinct:,} ids, {stream.window:,} live at a "
          f"time; {elapsed:.0f} s\n")
    print("| server | updated every | AUC, mean | AUC, last quarter | MiB read per "
          "100 chunks |")
    print("|---|---|---:|---:|---:|")
    for name, every in servers.items():
        per_100 = updated_bytes[name] / 2**20 * 100 / evaluated
        print(f"| {name.split(' every')[0]} | "
              f"{'-' if every is None else f'{every} chunk(s) ({every * CHUNK // BATCH} steps)'}"
              f" | {statistics.fmean(aucs[name]):.4f} | {statistics.fmean(aucs[name][-last:]):.4f}"
              f" | {per_100:.1f} |")
    freshest = statistics.fmean(aucs[f"deltas every {min(deltas_every)}"])
    print(f"\nAUC lost to staleness (mean, against deltas every {min(deltas_every)}): "
          + ", ".join(f"{name} {freshest - statistics.fmean(aucs[name]):+.4f}"
                      for name in servers if name != f"deltas every {min(deltas_every)}"))
    if record:
        with open(record, "w") as file:
            command = ["python", "benchmarks/freshness.py", *(argv or sys.argv[1:])]
            json.dump({"command": " ".join(command),
                       "chunk": CHUNK, "batch": BATCH, "warmup": warmup, "chunks": chunks,
                       "ids": stream.distinct, "window": stream.window,
                       "table_mib": stream.distinct * DIM * 4 / 2**20,
                       "servers": {name: {"every": every, "auc": aucs[name],
                                          "mib_read": updated_bytes[name] / 2**20}
                                   for name, every in servers.items()}}, file, indent=1)
        print(f"record: {os.path.relpath(record, ROOT)}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(8, 4.5))
        steps = [(warmup + i) * CHUNK // BATCH for i in range(evaluated)]
        for name in servers:
            axis.plot(steps, aucs[name], label=name + (" chunks" if servers[name] else ""),
                      linewidth=1.2)
        axis.set_xlabel("training step")
        axis.set_ylabel(f"AUC of the next {CHUNK} clicks")
        axis.set_title("Servers updated by deltas, by full loads, and frozen at the base")
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(plot, dpi=110)
        print(f"\nplot: {os.path.relpath(plot, ROOT)}")


if __name__ == "__main__":
    main()
