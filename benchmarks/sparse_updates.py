"""Step rate against embedding table size, with and without sparse updates.

    python benchmarks/sparse_updates.py [--steps 200] [--vocabs 20000,2000000]

One in-process cluster (2 workers, 2 ps); a model Embedding(vocab, 32) sharded
in two, Flatten, Dense(1); per-worker batch 64 of uniformly drawn ids; `model.fit`
steps per second after a warm-up `fit`. Configurations: Adagrad (exact sparse
updates, the default), Adam with `sparse_updates="lazy"`, and both with Keras'
dense update (the sparse path switched off) for comparison.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasps  # noqa: E402
from kerasps import sparse  # noqa: E402

DIM, BATCH = 32, 64
CONFIGS = [  # name, optimizer, sparse_updates, sparse path on
    ("adagrad (exact, default)", "adagrad", "exact", True),
    ("adagrad, Keras dense update", "adagrad", "exact", False),
    ("adam (lazy)", "adam", "lazy", True),
    ("adam, Keras dense update (default)", "adam", "exact", True),
]


def dataset_fn(vocab):
    def fn(context):
        ids = tf.data.Dataset.random(seed=context.input_pipeline_id).map(
            lambda x: (tf.reshape(x % vocab, [1]), tf.cast(x % 2, tf.float32)))
        return ids.batch(BATCH, drop_remainder=True).repeat().prefetch(2)

    return fn


def measure(cluster, vocab, optimizer, mode, steps):
    strategy = kerasps.ParameterServerStrategy(
        cluster, variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2),
        sparse_updates=mode)
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int64"),
                                  keras.layers.Embedding(vocab, DIM), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.get({"class_name": optimizer,
                                            "config": {"learning_rate": 0.01}}), "mse")
    data = kerasps.DatasetCreator(dataset_fn(vocab))
    model.fit(data, epochs=1, steps_per_epoch=20, verbose=0)  # warm-up: tracing
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return steps / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocabs", default="20000,2000000")
    args = parser.parse_args()
    vocabs = [int(v) for v in args.vocabs.split(",")]
    cluster = kerasps.cluster.in_process(num_workers=2, num_ps=2)
    update_rows = sparse.update_rows
    print(f"| config | {' | '.join(f'vocab {v:,} steps/s' for v in vocabs)} | ratio |")
    print(f"|---|{'---:|' * len(vocabs)}---:|")
    for name, optimizer, mode, on in CONFIGS:
        sparse.update_rows = update_rows if on else (lambda *args, **kwargs: False)
        rates = [measure(cluster, vocab, optimizer, mode, args.steps) for vocab in vocabs]
        print(f"| {name} | {' | '.join(f'{r:.1f}' for r in rates)} | "
              f"{rates[-1] / rates[0]:.2f} |", flush=True)
    sparse.update_rows = update_rows


if __name__ == "__main__":
    main()
