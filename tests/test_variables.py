"""Sharded variables: Keras layers, gradients, optimizers and lookups on shards."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps

IDS = np.array([[0, 9], [4, 5], [3, 3], [8, 1]], dtype="int32")
LABELS = np.array([[1.0], [0.0], [0.5], [2.0]], dtype="float32")


def build(num_rows=10):
    return keras.Sequential([
        keras.Input((2,), dtype="int32"),
        keras.layers.Embedding(num_rows, 3),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])


def copy_weights(source, target):
    """Copies layer by layer, through `ShardedVariable.assign` where sharded."""
    for src, dst in zip(source.layers, target.layers):
        for attr in ("embeddings", "kernel", "bias"):
            if hasattr(src, attr):
                getattr(dst, attr).assign(getattr(src, attr).numpy())


def train_dense_keras(model, optimizer, batches):
    """Single-process Keras, the embedding's gradient densified: Keras' dense rule."""
    for ids, labels in batches:
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(labels, model(ids)))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply([tf.convert_to_tensor(g) for g in gradients], model.trainable_variables)


# Adam on a shard is TensorFlow's fused `ResourceApplyAdam`: Keras' formula, rounded
# otherwise. After 3 steps at a learning rate of 0.1 it is ~2e-6 from Keras' float32 ops
# (and 3e-7 from the formula in float64, where Keras' ops are 2e-6 off). A row whose
# gradient nearly vanishes in a step can differ by ~1.6e-5 (seen once in CI, with weights
# drawn at random), so the weights are seeded and Adam's tolerance allows for rounding.
TOLERANCE = {"sgd": dict(rtol=1e-5, atol=1e-6), "adam": dict(rtol=1e-4, atol=1e-5)}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_on_shards_matches_single_process_keras(strategy, optimizer):
    keras.utils.set_random_seed(7)
    reference = build()
    make = {"sgd": lambda: keras.optimizers.SGD(0.5), "adam": lambda: keras.optimizers.Adam(0.1)}
    with strategy.scope():
        model = build()
        model.compile(make[optimizer](), "mse")
    assert isinstance(model.layers[0].embeddings, kerasps.ShardedVariable)
    copy_weights(reference, model)

    # Row 3 appears twice in a batch: single-process Keras 3 squares each
    # occurrence's gradient apart (an inexact Adam); kerasps sums them first.
    train_dense_keras(reference, make[optimizer](), [(IDS, LABELS)] * 3)
    for _ in range(3):
        model.train_on_batch(IDS, LABELS)

    np.testing.assert_allclose(model.layers[0].embeddings.numpy(),
                               reference.layers[0].embeddings.numpy(), **TOLERANCE[optimizer])
    np.testing.assert_allclose(model.layers[2].kernel.numpy(), reference.layers[2].kernel.numpy(),
                               **TOLERANCE[optimizer])
    # Rows no batch touched keep their initial value (updates were sparse).
    untouched = [2, 6, 7]
    np.testing.assert_array_equal(model.layers[0].embeddings.numpy()[untouched],
                                  reference.layers[0].embeddings.numpy()[untouched])


def test_the_gradients_sent_together_train_as_single_process_keras(strategy):
    # The small dense gradients of one ps task cross to it in one tensor, and each
    # update takes its own slice: a wrong offset or shape would train another
    # variable's gradient. A kernel above `PACKED_GRADIENT_BYTES` crosses apart.
    from kerasps.backend import _keras

    def deep():
        return keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(5), keras.layers.Dense(4),
            keras.layers.Dense(40), keras.layers.Dense(1024), keras.layers.Dense(1)])

    keras.utils.set_random_seed(11)
    reference = deep()
    with strategy.scope():
        model = deep()
        model.compile(keras.optimizers.SGD(0.05), "mse")
    model.set_weights(reference.get_weights())
    big = model.layers[3].kernel  # (40, 1024) in two shards of 80 KiB
    assert min(shard.numpy().nbytes for shard in big.shards) > _keras.PACKED_GRADIENT_BYTES
    x = np.random.default_rng(3).normal(size=(16, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    optimizer = keras.optimizers.SGD(0.05)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, reference(x)))
        gradients = tape.gradient(loss, reference.trainable_variables)
        optimizer.apply(gradients, reference.trainable_variables)
        model.train_on_batch(x, y)

    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gradients_made_on_their_ps_task_are_not_sent_to_the_worker_and_back():
    # Sync training averages the kept gradients on each variable's ps task: packing
    # them where the update is traced would send them to the worker and back.
    from kerasps.backend import _keras

    ps0, ps1 = ("/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0")
    with tf.Graph().as_default() as graph:
        with tf.device(ps0):
            a, b = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2, 2]))
        with tf.device(ps1):
            c = tf.Variable(tf.zeros([4]))
        with tf.device(ps0):
            on_ps = [tf.ones([3]), tf.ones([2, 2])]
        worker = [tf.ones([3]), tf.ones([2, 2]), tf.ones([4])]
        received = _keras._gradients_sent_together(list(zip(on_ps, [a, b])))
        assert [r() for r in received] == on_ps
        assert not [op for op in graph.get_operations() if op.type == "ConcatV2"]
        # Made where the step runs: a and b's in one tensor, c's alone on its task.
        received = _keras._gradients_sent_together(list(zip(worker, [a, b, c])))
        assert received[2]() is worker[2]
        with tf.device(ps0):
            unpacked = [r() for r in received[:2]]
        assert [u.shape for u in unpacked] == [g.shape for g in worker[:2]]
        (concat,) = [op for op in graph.get_operations() if op.type == "ConcatV2"]
        assert len(concat.inputs) == 3  # a's and b's gradients, and the axis


def test_custom_loop_gradient_tape_works_with_sharded_embeddings(strategy):
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.1)
    coordinator = kerasps.ClusterCoordinator(strategy)
    before = model.layers[0].embeddings.numpy()

    @tf.function
    def step(ids, labels):
        def replica_fn(ids, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(ids, training=True) - labels) ** 2)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        return strategy.run(replica_fn, args=(ids, labels))

    loss = coordinator.fetch(coordinator.schedule(step, args=(IDS, LABELS)))
    assert np.isfinite(loss)
    after = model.layers[0].embeddings.numpy()
    touched = sorted(set(IDS.ravel()))
    assert not np.allclose(before[touched], after[touched])
    np.testing.assert_array_equal(np.delete(before, touched, axis=0),
                                  np.delete(after, touched, axis=0))


def test_lookup_gathers_on_each_shard_instead_of_concatenating_the_table(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(1000, 8)
        layer.build((None,))
    graph = tf.function(layer).get_concrete_function(
        tf.TensorSpec((None,), tf.int32)).graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("ResourceGather") == 2  # one gather per shard, on its ps task
    concatenated = [op for op in graph.get_operations() if op.type == "ConcatV2"
                    and op.outputs[0].shape.rank == 2 and op.outputs[0].shape[0] == 1000]
    assert not concatenated


def test_lookup_returns_the_rows_of_the_whole_table(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(7, 2)
        layer.build((None,))
    table = np.arange(14, dtype="float32").reshape(7, 2)
    layer.embeddings.assign(table)
    ids = np.array([[6, 0], [3, 4]])
    np.testing.assert_array_equal(layer(ids).numpy(), table[ids])
    np.testing.assert_array_equal(keras.ops.take(layer.embeddings, [-1], axis=0).numpy(),
                                  table[[-1]])


@pytest.mark.parametrize("bad_id", [7, -8, 2**32 + 3])
def test_an_id_outside_the_table_raises_however_large(strategy, bad_id):
    # The ids go to the shards as int32: 2**32 + 3 must not become row 3.
    with strategy.scope():
        layer = keras.layers.Embedding(7, 2)
        layer.build((None,))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        layer(np.array([1, bad_id], dtype="int64")).numpy()


@pytest.mark.parametrize("lookup", ["dense", "dense_max_norm", "sparse", "safe_sparse"])
def test_tf_nn_embedding_lookups_of_a_sharded_variable_match_the_whole_table(strategy, lookup):
    table = np.arange(14, dtype="float32").reshape(7, 2) - 5
    with strategy.scope():
        variable = keras.Variable(table)
    assert isinstance(variable, kerasps.ShardedVariable)
    ids = tf.constant([[6, 0], [3, 3]])
    indices = [[0, 0], [0, 1], [1, 0], [1, 1]]
    sparse_ids = tf.sparse.SparseTensor(indices, tf.constant([6, 0, 3, 3], tf.int64), [2, 2])
    weights = tf.sparse.SparseTensor(indices, [1.0, 2.0, 1.0, 0.5], [2, 2])

    def run(params):
        if lookup == "dense":
            return tf.nn.embedding_lookup(params, ids)
        if lookup == "dense_max_norm":
            return tf.nn.embedding_lookup(params, ids, max_norm=3.0)
        if lookup == "sparse":
            return tf.nn.embedding_lookup_sparse(params, sparse_ids, weights, combiner="sum")
        return tf.nn.safe_embedding_lookup_sparse(params, sparse_ids, weights)

    def weighted_sum(result):  # a loss whose gradient differs from row to row
        return tf.reduce_sum(result * tf.reshape(
            tf.range(1.0, 1.0 + tf.cast(tf.size(result), tf.float32)), tf.shape(result)))

    with tf.GradientTape() as tape:  # eagerly on the coordinator
        result = run(variable)
        loss = weighted_sum(result)
    whole = tf.Variable(table)
    with tf.GradientTape() as whole_tape:
        expected = run(whole)
        whole_loss = weighted_sum(expected)
    np.testing.assert_allclose(result, expected, rtol=1e-6)
    # Each shard gets the rows of the whole table's gradient that it holds.
    gradients = tape.gradient(loss, variable.shards)
    np.testing.assert_allclose(
        np.concatenate([tf.convert_to_tensor(g).numpy() for g in gradients]),
        tf.convert_to_tensor(whole_tape.gradient(whole_loss, whole)).numpy(), rtol=1e-6)


def test_assign_splits_values_across_shards(strategy):
    with strategy.scope():
        variable = keras.Variable(initializer="zeros", shape=(5, 2), name="split_me")
    assert isinstance(variable, kerasps.ShardedVariable)
    value = np.arange(10, dtype="float32").reshape(5, 2)
    variable.assign(value)
    np.testing.assert_array_equal(variable.shards[0].numpy(), value[:3])
    np.testing.assert_array_equal(variable.shards[1].numpy(), value[3:])
    variable.assign_add(np.ones((5, 2), "float32"))
    np.testing.assert_array_equal(variable.numpy(), value + 1)
    assert variable.shard_sizes == [3, 2] and variable.shard_offsets == [0, 3]


def test_sharded_initialization_keeps_the_initializer_distribution(strategy):
    with strategy.scope():
        glorot = keras.Variable(initializer="glorot_uniform", shape=(400, 100), name="g")
        uniform = keras.Variable(initializer=keras.initializers.RandomUniform(-0.05, 0.05),
                                 shape=(400, 100), name="u")
    limit = np.sqrt(6 / (400 + 100))  # Glorot limit of the whole shape, not of a shard
    assert np.abs(glorot.numpy()).max() <= limit
    assert np.abs(glorot.numpy()).max() > 0.9 * limit
    assert np.abs(uniform.numpy()).max() <= 0.05
    assert not np.allclose(uniform.shards[0].numpy()[:10], uniform.shards[1].numpy()[:10])


def test_sharded_variable_has_no_single_handle(strategy):
    with strategy.scope():
        variable = keras.Variable(initializer="zeros", shape=(4, 2), name="nohandle")
    with pytest.raises(TypeError, match=r"sharded over 2 ps tasks"):
        variable.handle  # noqa: B018


def test_checkpoint_restores_into_a_different_number_of_shards(make_strategy, tmp_path):
    two = make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with two.scope():
        model = build(num_rows=9)
    table = np.random.default_rng(0).normal(size=(9, 3)).astype("float32")
    model.layers[0].embeddings.assign(table)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    one = make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3))
    with one.scope():
        restored = build(num_rows=9)
    assert restored.layers[0].embeddings.num_shards == 3
    tf.train.Checkpoint(model=restored).restore(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(restored.layers[0].embeddings.numpy(), table)


def test_optimizer_slots_of_shards_sit_next_to_them_and_make_a_whole_slot(strategy):
    with strategy.scope():
        model = build(num_rows=9)
        model.compile(keras.optimizers.Adam(0.1), "mse")
        model.optimizer.build(model.trainable_variables)
    table = model.layers[0].embeddings
    slots = [v for v in model.optimizer.variables if "embeddings_part" in v.name]
    assert len(slots) == 2 * table.num_shards  # momentum and velocity of each shard
    whole = {id(slot._kerasps_container): slot._kerasps_container for slot in slots}
    assert len(whole) == 2
    for slot in whole.values():
        assert isinstance(slot, kerasps.ShardedVariable)
        assert slot.shape == table.shape and slot.shard_sizes == table.shard_sizes
        assert [s.value.device for s in slot.shards] == [s.value.device for s in table.shards]
    # Named as Keras names the slots of an unsharded variable.
    prefix = f"{model.optimizer.name}/{table.path.replace('/', '_')}"
    assert sorted(slot.path for slot in whole.values()) == [f"{prefix}_momentum",
                                                            f"{prefix}_velocity"]
