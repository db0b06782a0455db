"""Online training: the size and cost of publishing the rows that changed.

An in-process cluster of 2 workers and 2 ps tasks; a model Embedding(rows, 16) (2
shards, one per ps task) -> Flatten -> Dense(1), SGD (row updates). Three parts:

* **bytes**: a full version against deltas with 0.1%, 1% and 10% of the rows changed
  (one `train_on_batch` over that many distinct ids, then `PublishDeltas.publish()`);
  each delta against the bound "ids + rows" (8 + 64 bytes a row): the rest is its
  manifest, the `.npy` headers and the dense weights;
* **time**: `publish()` of a delta of 1% of the rows, and a `kerasps.DeltaConsumer`
  (its model built from the published config, no cluster) applying it; medians of
  `--repeats`;
* **training**: `fit` steps/s with `PublishDeltas(every_seconds=30)` against no
  callback (same model, warmed up; medians of `--repeats` alternating runs), and the
  time those fits spent in the publishes (the training thread waits for them).

    python benchmarks/online.py                 # 1e6 rows (~5 min on 2 cores)
    python benchmarks/online.py --quick         # smoke run: 1e5 rows, 1 s publishes

Targets: a delta within 1.05x of ids + rows plus a fixed header; publish
and apply of 1% of 1e6 rows under 2 s each; steps/s with publishing every 30 s at
least 0.95x of none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

DIM = 16
FRACTIONS = (0.001, 0.01, 0.1)


def folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def build(strategy, rows):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int64"),
                                  keras.layers.Embedding(rows, DIM), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def touch(model, rng, rows, count):
    """One step whose batch holds `count` distinct ids: those rows change."""
    import numpy as np

    ids = rng.choice(rows, size=count, replace=False).reshape(-1, 1)
    model.train_on_batch(ids, np.ones([count, 1], "float32"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1e5 rows, 1 s publishes")
    parser.add_argument("--rows", type=int, default=None, help="default 1e6 (1e5 quick)")
    parser.add_argument("--repeats", type=int, default=None, help="default 4 (1 quick)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timed fit length, default 90 (4 quick)")
    parser.add_argument("--every-seconds", type=float, default=None,
                        help="publish interval in the training part, default 30 (1 quick)")
    args = parser.parse_args(argv)
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    repeats = args.repeats or (1 if args.quick else 4)
    seconds = args.seconds or (4.0 if args.quick else 90.0)
    every = args.every_seconds or (1.0 if args.quick else 30.0)

    import numpy as np
    import tensorflow as tf

    import kerasps
    from kerasps.policy import deltas

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=2, num_ps=2),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    model = build(strategy, rows)
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="kerasps-online-")
    publisher = kerasps.callbacks.PublishDeltas(os.path.join(work, "deltas"), model=model)

    # -- bytes ----------------------------------------------------------------------
    full = publisher.publish()
    full_bytes = folder_bytes(full)
    table_bytes = rows * DIM * 4
    print(f"## Bytes: a {rows:,} x {DIM} float32 table ({table_bytes / 2**20:.1f} MiB)\n")
    print("| version | rows | bytes | / full | / (ids + rows) | over ids + rows |")
    print("|---|---|---|---|---|---|")
    print(f"| full | {rows:,} | {full_bytes:,} | 1.000 | - | - |")
    touch(model, rng, rows, max(1, rows // 1000))  # the first step traces
    publisher.publish()
    for fraction in FRACTIONS:
        count = max(1, int(rows * fraction))
        touch(model, rng, rows, count)
        delta = publisher.publish()
        size = folder_bytes(delta)
        bound = count * (8 + DIM * 4)
        print(f"| delta {fraction:.1%} | {count:,} | {size:,} | {size / full_bytes:.4f} | "
              f"{size / bound:.4f} | {size - bound:,} |")

    # -- time -------------------------------------------------------------------------
    count = max(1, rows // 100)
    consumer = kerasps.DeltaConsumer(os.path.join(work, "deltas"))
    started = time.perf_counter()
    consumer.update()
    load_s = time.perf_counter() - started
    publish_s, apply_s = [], []
    for _ in range(repeats):
        touch(model, rng, rows, count)
        started = time.perf_counter()
        publisher.publish()
        publish_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        consumer.update()
        apply_s.append(time.perf_counter() - started)
    exact = np.array_equal(consumer.rows(model.layers[0].embeddings.path),
                           model.layers[0].embeddings.numpy())
    print(f"\n## Time: 1% of {rows:,} rows ({count:,}), median of {repeats}\n")
    print("| what | seconds |")
    print("|---|---|")
    print(f"| publish (a delta) | {statistics.median(publish_s):.3f} |")
    print(f"| apply (consumer with its Keras model) | {statistics.median(apply_s):.3f} |")
    print(f"| the consumer's first load (base + deltas so far) | {load_s:.3f} |")
    print(f"\nConsumer rows equal to the trainer's: {exact}")

    # -- training ---------------------------------------------------------------------
    def dataset_fn(input_context):
        # Ids drawn afresh at every step (an online stream: ~30% of the rows change
        # between two publishes 30 s apart here), not a few thousand read again and again.
        ids = tf.data.Dataset.random(seed=input_context.input_pipeline_id).map(
            lambda r: (tf.reshape(r % rows, [1]), tf.ones([1], tf.float32)))
        return ids.batch(64)

    data = kerasps.DatasetCreator(dataset_fn)
    steps_probe = 50
    model.fit(data, epochs=1, steps_per_epoch=steps_probe, verbose=0)  # warm-up
    started = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps_probe, verbose=0)
    rate = steps_probe / (time.perf_counter() - started)
    steps = max(20, int(rate * seconds))
    timed = {"none": [], "publishing": []}
    trainer_publisher = kerasps.callbacks.PublishDeltas(os.path.join(work, "fit"),
                                                        every_seconds=every)
    model.fit(data, epochs=1, steps_per_epoch=steps_probe, verbose=0,
              callbacks=[trainer_publisher])  # warm-up: traced with the tracking
    versions = len(trainer_publisher.published)
    # The time `fit` spends in the publisher's publishes (the training thread waits for
    # them): a direct measure, where the steps/s ratio carries the machine's noise.
    publishing_s = []
    publish = trainer_publisher.publish

    def timed_publish(*args, **kwargs):
        started = time.perf_counter()
        try:
            return publish(*args, **kwargs)
        finally:
            publishing_s.append(time.perf_counter() - started)

    trainer_publisher.publish = timed_publish
    # In turns, each repeat in the other order (ABBA): a drift of the machine over the
    # run (steps/s fell 185 -> 132 over 7 identical fits in one run here) weighs on both.
    for repeat in range(repeats):
        for name in ("none", "publishing")[::1 if repeat % 2 == 0 else -1]:
            callbacks = [trainer_publisher] if name == "publishing" else []
            started = time.perf_counter()
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
            timed[name].append(steps / (time.perf_counter() - started))
    published = trainer_publisher.published[versions:]
    versions = len(published)
    changed = [sum(t["count"] for t in deltas.read_manifest(os.path.join(
        work, "fit", deltas.version_name(v)))["tables"]) for v, kind in published
        if kind == deltas.DELTA]
    none, publishing = (statistics.median(timed[k]) for k in ("none", "publishing"))
    print(f"\n## Training: fit of {steps} steps, publishing every {every:g} s against none "
          f"(median of {repeats})\n")
    print("| run | steps/s |")
    print("|---|---|")
    print(f"| no callback | {none:.1f} |")
    print(f"| PublishDeltas(every_seconds={every:g}) | {publishing:.1f} |")
    print(f"\nsteps/s publishing / none: {publishing / none:.3f} "
          f"({versions} versions published in the timed runs, a median "
          f"{statistics.median(changed or [0]):,.0f} rows each)")
    fit_s = sum(steps / rate for rate in timed["publishing"])
    print(f"time the publishing fits spent in publishes: {sum(publishing_s):.2f} s of "
          f"{fit_s:.1f} s ({sum(publishing_s) / fit_s:.1%}; each "
          f"{min(publishing_s):.2f}-{max(publishing_s):.2f} s)")


if __name__ == "__main__":
    main()
