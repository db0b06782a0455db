"""Sparse (touched-rows) optimizer updates of sharded embedding tables, and the lazy mode."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from tests.test_variables import build, copy_weights, train_dense_keras

# Batches with repeated ids (a row looked up twice in one batch) and rows that
# one batch touches and the next does not.
BATCHES = [
    (np.array([[0, 9], [4, 4], [3, 3], [8, 1]], "int32"),
     np.array([[1.0], [0.0], [0.5], [2.0]], "float32")),
    (np.array([[2, 2], [5, 9], [2, 6], [7, 7]], "int32"),
     np.array([[0.0], [1.0], [-1.0], [0.5]], "float32")),
    (np.array([[9, 9], [9, 1], [4, 0], [3, 8]], "int32"),
     np.array([[2.0], [0.5], [1.0], [0.0]], "float32")),
]

EXACT_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    # The learning rate of a schedule is computed each step from `iterations`.
    "sgd_decaying": lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
        0.5, decay_steps=1, decay_rate=0.5)),
    "ftrl": lambda: keras.optimizers.Ftrl(0.5, l1_regularization_strength=0.01,
                                          l2_regularization_strength=0.01, beta=0.1),
}
LAZY_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.1),
    "adamw": lambda: keras.optimizers.AdamW(0.1, weight_decay=0.05),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.1, amsgrad=True),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(0.1, momentum=0.5,
                                                                  centered=True),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "ftrl_shrinkage": lambda: keras.optimizers.Ftrl(
        0.5, l2_shrinkage_regularization_strength=0.1),
}


def assert_same_weights(model, reference):
    for layer, expected_layer in zip(model.layers, reference.layers):
        for attr in ("embeddings", "kernel", "bias"):
            if hasattr(layer, attr):
                np.testing.assert_allclose(getattr(layer, attr).numpy(),
                                           getattr(expected_layer, attr).numpy(),
                                           rtol=1e-5, atol=1e-6, err_msg=attr)


def step_graph(strategy, optimizer_fn, num_rows=1000):
    """The graph of one training step of a model whose table is sharded in two."""
    with strategy.scope():
        model = build(num_rows)
        optimizer = optimizer_fn()
        optimizer.build(model.trainable_variables)
    assert model.layers[0].embeddings.shard_sizes == [num_rows // 2] * 2

    @tf.function
    def step(ids, labels):
        def replica_fn(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(ids) - labels) ** 2)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(gradients, model.trainable_variables)

        strategy.run(replica_fn, args=(ids, labels))

    graph = step.get_concrete_function(tf.TensorSpec((None, 2), tf.int32),
                                       tf.TensorSpec((None, 1), tf.float32)).graph
    return graph


def table_sized_ops(graph, num_rows=1000, dim=3):
    """Ops computing a whole shard of the table (or of a slot): dense updates do."""
    return [op.type for op in graph.get_operations()
            if any(tuple(out.shape) == (num_rows // 2, dim)
                   for out in op.outputs if out.shape.rank == 2)]


def shard_slot(optimizer, table, slot):
    """A slot of a sharded table, its shards concatenated in row order."""
    by_name = {v.name: v.numpy() for v in optimizer.variables}
    return np.concatenate([by_name[f"{shard.path.replace('/', '_')}_{slot}"]
                           for shard in table.shards])


@pytest.mark.parametrize("name", sorted(EXACT_OPTIMIZERS))
def test_exact_row_updates_match_dense_keras(strategy, name):
    reference = build()
    with strategy.scope():
        model = build()
        model.compile(EXACT_OPTIMIZERS[name](), "mse")
    assert strategy.sparse_updates == "exact"
    assert isinstance(model.layers[0].embeddings, kerasps.ShardedVariable)
    copy_weights(reference, model)

    train_dense_keras(reference, EXACT_OPTIMIZERS[name](), BATCHES)
    for ids, labels in BATCHES:
        model.train_on_batch(ids, labels)

    assert_same_weights(model, reference)


@pytest.mark.parametrize("name,mode", [("sgd", "exact"), ("adagrad", "exact"),
                                       *[(name, "lazy") for name in sorted(LAZY_OPTIMIZERS)]])
def test_row_updates_never_compute_a_whole_shard(make_strategy, name, mode):
    strategy = make_strategy(
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2),
        sparse_updates=mode)
    make = {**EXACT_OPTIMIZERS, **LAZY_OPTIMIZERS}[name]

    assert table_sized_ops(step_graph(strategy, make)) == []


@pytest.mark.parametrize("name", ["adam", "rmsprop_centered_momentum", "sgd_nesterov"])
def test_optimizers_without_an_exact_row_update_stay_dense_by_default(strategy, name):
    graph = step_graph(strategy, LAZY_OPTIMIZERS[name])

    assert "ReadVariableOp" in table_sized_ops(graph)


def test_the_gradient_of_a_lookup_reaches_each_shard_as_one_update_per_row(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(10, 3)
        layer.build((None,))
    ids = tf.constant([[1, 1, 7], [7, 7, 2]])

    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids))
    gradients = tape.gradient(loss, layer.trainable_variables)

    assert all(isinstance(g, tf.IndexedSlices) for g in gradients)
    assert sorted(gradients[0].indices.numpy()) == [1, 2]  # rows 1 and 2 of shard 0
    assert gradients[1].indices.numpy().tolist() == [2]  # row 7 is row 2 of shard 1
    np.testing.assert_array_equal(tf.convert_to_tensor(gradients[1]).numpy()[2], [3, 3, 3])


def numpy_lazy_adam(table, batches, row_gradients, lr, weight_decay=0.0,
                    beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """LazyAdam (TF1, TFA): only the batch's rows and their slots move."""
    table = table.copy()
    m, v = np.zeros_like(table), np.zeros_like(table)
    for t, ids in enumerate(batches, start=1):
        rows, grads = row_gradients(ids)
        table[rows] -= table[rows] * weight_decay * lr
        m[rows] += (grads - m[rows]) * (1 - beta_1)
        v[rows] += (grads**2 - v[rows]) * (1 - beta_2)
        alpha = lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
        table[rows] -= alpha * m[rows] / (np.sqrt(v[rows]) + epsilon)
    return table, m, v


@pytest.mark.parametrize("weight_decay", [None, 0.05])
def test_lazy_adam_matches_a_hand_computed_lazy_adam(make_strategy, weight_decay):
    strategy = make_strategy(
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2),
        sparse_updates="lazy")
    coefficients = np.linspace(-1.0, 1.0, 3 * 2 * 4, dtype="float32").reshape(4, 2, 3)
    with strategy.scope():
        layer = keras.layers.Embedding(10, 3)
        layer.build((None, 2))
        optimizer = (keras.optimizers.AdamW(0.1, weight_decay=weight_decay) if weight_decay
                     else keras.optimizers.Adam(0.1))
        optimizer.build(layer.trainable_variables)
    initial = layer.embeddings.numpy()
    coordinator = kerasps.ClusterCoordinator(strategy)

    @tf.function
    def step(ids):
        def replica_fn(ids):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids) * coefficients)
            gradients = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(gradients, layer.trainable_variables)

        strategy.run(replica_fn, args=(ids,))

    for ids, _ in BATCHES:
        coordinator.join()
        coordinator.schedule(step, args=(ids,))
    coordinator.join()

    def row_gradients(ids):
        rows = np.unique(ids)
        return rows, np.stack([coefficients[ids == r].sum(axis=0) for r in rows])

    table, m, v = numpy_lazy_adam(initial, [ids for ids, _ in BATCHES], row_gradients,
                                  lr=0.1, weight_decay=weight_decay or 0.0)
    np.testing.assert_allclose(layer.embeddings.numpy(), table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(shard_slot(optimizer, layer.embeddings, "momentum"), m,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(shard_slot(optimizer, layer.embeddings, "velocity"), v,
                               rtol=1e-5, atol=1e-7)
    # Row 6 was touched by the second batch only: its slots kept their values
    # through the third step (the dense rule would have decayed them).
    assert m[6].any() and v[6].any()


def test_unsharded_variables_keep_keras_updates_in_lazy_mode(make_strategy):
    strategy = make_strategy(
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(min_shard_bytes=1 << 20),
        sparse_updates="lazy")
    reference = build()
    reference.compile(keras.optimizers.Adam(0.1), "mse")
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(0.1), "mse")
    assert not isinstance(model.layers[0].embeddings, kerasps.ShardedVariable)
    copy_weights(reference, model)

    for ids, labels in BATCHES:
        reference.train_on_batch(ids, labels)
        model.train_on_batch(ids, labels)

    assert_same_weights(model, reference)


def test_unknown_mode_is_refused(make_strategy):
    with pytest.raises(ValueError, match=r"Invalid value for argument `sparse_updates`: "
                                         r"expected one of 'exact', 'lazy'\. "
                                         r"Received: sparse_updates='dense'"):
        make_strategy(sparse_updates="dense")
