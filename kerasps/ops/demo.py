"""The main job: a small recommendation model trained on an in-process cluster.

Users and items are ids drawn with a long tail (a few are popular, most are
rare, as in real logs). Some users click on anything and some items are clicked
by everyone; which ones is hidden in the ids, so the model can only learn it
through its embeddings.
The user table is large enough to be sharded over the ps tasks, and Adam
updates it lazily (`sparse_updates="lazy"`): each step moves only the rows of
the batch and their slots, so a step costs the same whatever the table's size.
"""

from __future__ import annotations

import dataclasses
import time

import keras
import tensorflow as tf

import kerasps

NUM_USERS = 100_000
NUM_ITEMS = 20_000


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of `kerasps demo`."""

    workers: int = 2
    ps: int = 2
    epochs: int = 3
    steps_per_epoch: int = 50
    batch_size: int = 256
    steps_per_execution: int = 5
    placement: str = "round_robin"
    verbose: int = 1


def clicks_dataset_fn(batch_size: int):
    """Returns a `dataset_fn(input_context)` of endless synthetic click logs."""

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(batch_size)
        seed = 1000 + input_context.input_pipeline_id  # each worker draws its own logs

        def example(i):
            u, v = tf.unstack(tf.random.stateless_uniform([2], [seed, i]))
            user = tf.cast(NUM_USERS * u**3, tf.int64)  # long-tailed popularity
            item = tf.cast(NUM_ITEMS * v**3, tf.int64)
            click = tf.cast((user % 5 == 0) | (item % 3 == 0), tf.float32)
            return {"user": user, "item": item}, click

        return (tf.data.Dataset.range(1 << 40).map(example, num_parallel_calls=2)
                .batch(batch, drop_remainder=True).prefetch(2))

    return dataset_fn


def build_model() -> keras.Model:
    """User and item embeddings, their product and a small MLP, predicting a click."""
    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    u = keras.layers.Embedding(NUM_USERS, 16, name="user_embedding")(user)
    v = keras.layers.Embedding(NUM_ITEMS, 16, name="item_embedding")(item)
    x = keras.layers.Concatenate()([u, v, u * v])
    x = keras.layers.Dense(64, activation="relu")(x)
    click = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    return keras.Model({"user": user, "item": item}, click, name="recommender")


def run(config: DemoConfig = DemoConfig(), print_fn=print) -> dict:
    """Trains the demo model and returns its final evaluation metrics."""
    resolver = kerasps.cluster.in_process(num_workers=config.workers, num_ps=config.ps)
    strategy = kerasps.ParameterServerStrategy(
        resolver,
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=config.ps),
        placement=config.placement,
        sparse_updates="lazy",
    )
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="binary_crossentropy",
            metrics=["accuracy", keras.metrics.AUC(name="auc")],
            steps_per_execution=config.steps_per_execution,
        )
    print_fn(f"Cluster: {config.workers} workers, {config.ps} ps tasks (in-process, gRPC on "
             f"localhost). Placement: {config.placement}.\n")
    print_fn(strategy.placement_report())
    print_fn("")
    start = time.perf_counter()
    history = model.fit(
        kerasps.DatasetCreator(clicks_dataset_fn(config.batch_size)),
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        verbose=config.verbose,
    )
    elapsed = time.perf_counter() - start
    steps = config.epochs * config.steps_per_epoch
    metrics = model.evaluate(kerasps.DatasetCreator(clicks_dataset_fn(config.batch_size)),
                             steps=10, verbose=0, return_dict=True)
    print_fn(f"\nTrained {steps} steps in {elapsed:.1f}s ({steps / elapsed:.1f} steps/s, "
             f"{steps * config.batch_size / elapsed:,.0f} examples/s).")
    print_fn("Final metrics (model.evaluate on 10 new batches of synthetic clicks): "
             + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    print_fn("Per-epoch loss: " + ", ".join(f"{v:.4f}" for v in history.history["loss"]))
    return metrics
