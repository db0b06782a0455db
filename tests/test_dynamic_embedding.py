"""`kerasps.layers.DynamicEmbedding`: admission, eviction, training, concurrent inserts,
state (checkpoints, resharding, export, weights) and its policy arithmetic."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.keras.layers import table as table_lib
from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.params.variables import logical_variables
from kerasps.policy import tables
from tests.launched import run_with_deadline


def rows_of(layer):
    """{key: (row, last_seen, count)} of the rows in use."""
    state = layer.state.numpy()
    used = np.flatnonzero(state[:, tables.LAST_SEEN] >= 0)
    return {int(state[r, 0]): (int(r), int(state[r, 1]), int(state[r, 2])) for r in used}


def vector(layer, key):
    return layer(tf.constant([key], tf.int64)).numpy()[0]


def train(layer, batches):
    for batch in batches:
        layer(tf.constant(batch, tf.int64), training=True)


def id_model(layer, dim_in=1):
    inputs = keras.Input((dim_in,), dtype="int64")
    x = layer(inputs)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(x))


# -- the policy arithmetic ---------------------------------------------------------------
def test_tensorflow_hashes_are_the_policy_hashes():
    keys = np.array([0, 1, -1, 2**62, -2**63, 2**63 - 1, 123456789], np.int64)
    np.testing.assert_array_equal(table_lib.mix64(keys).numpy(), tables.mix64(keys))
    np.testing.assert_array_equal(table_lib.modulo(table_lib.mix64(keys), 7).numpy(),
                                  tables.partition_of(keys, 7))


@pytest.mark.parametrize("num_groups", [1, 3, 60, 500])
def test_rank_within_counts_the_earlier_members_of_each_group(num_groups):
    rng = np.random.default_rng(num_groups)
    for size in (0, 1, 17, 300):
        groups = rng.integers(0, num_groups, size)
        expected = [int(np.sum(groups[:i] == g)) for i, g in enumerate(groups)]
        got = table_lib.rank_within(tf.constant(groups, tf.int64), num_groups)
        assert got.dtype == tf.int64 and got.numpy().tolist() == expected


def test_partitions_spread_keys_evenly_and_ps_tasks_hold_runs_of_them():
    spec = tables.TableSpec(capacity=60_000, output_dim=8)
    assert spec.num_partitions == 60 and spec.rows_per_partition == 1000
    counts = np.bincount(spec.partition_of(np.arange(600_000)), minlength=60)
    assert counts.min() > 9_500 and counts.max() < 10_500
    assert tables.shards_of(60, 4) == [(0, 15), (15, 15), (30, 15), (45, 15)]
    assert tables.shards_of(3, 5) == [(0, 1), (1, 1), (2, 1)]
    tasks = spec.ps_task_of(np.arange(1000), 4)
    np.testing.assert_array_equal(tasks, spec.partition_of(np.arange(1000)) // 15)


def _measured_in_a_fresh_process(script: str, name: str) -> float:
    """Runs `script` (which can call `rss()`: this process's RSS in bytes after glibc
    returned its free memory) in a new interpreter; returns the number it printed after
    `name`."""
    rss = textwrap.dedent("""
        import ctypes
        def rss():
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
    """)
    done = subprocess.run([sys.executable, "-c", rss + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split(name)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, glibc")
def test_a_tables_constant_optimizer_slots_take_their_size_once():
    """Adagrad's accumulators of a table are made by one fill: Keras' `Constant` made two
    tensors of their size, and TensorFlow's CPU allocator kept the one freed (2.0x)."""
    ratio = _measured_in_a_fresh_process("""
        import keras, kerasps
        layer = kerasps.layers.DynamicEmbedding(32, capacity=500_000, name="t")
        layer.build((None, 1))
        before = rss()
        optimizer = keras.optimizers.Adagrad(initial_accumulator_value=0.25)
        optimizer.build(layer.trainable_variables)
        grown = rss() - before
        assert float(optimizer.variables[-1].numpy().min()) == 0.25
        print("RATIO", grown / (500_000 * 32 * 4))
    """, "RATIO")
    assert ratio < 1.3, ratio


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, glibc")
def test_memory_arithmetic_counts_a_map_key_as_tensorflows_table_takes_it():
    """A map key costs what TensorFlow's `MutableHashTable` takes for it, no less (the
    arithmetic once counted a flat map: 35.6 bytes a key against 43.6 measured)."""
    measured = _measured_in_a_fresh_process("""
        import numpy as np, tensorflow as tf
        table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
        keys = np.random.default_rng(0).integers(0, 2**62, 1_000_000)
        table.insert(keys[:10], keys[:10])
        before = rss()
        for start in range(0, len(keys), 100_000):
            table.insert(keys[start:start + 100_000], keys[start:start + 100_000])
        assert int(table.size()) == len(keys)
        print("PER_KEY", (rss() - before) / len(keys))
    """, "PER_KEY")
    counted = tables.TableSpec(capacity=1_000_000, output_dim=8).memory_bytes()["maps"] / 1e6
    assert measured <= counted <= 1.25 * measured, (measured, counted)


def test_memory_arithmetic_counts_rows_slots_and_maps():
    spec = tables.TableSpec(capacity=1_000_000, output_dim=16, min_count=2)
    memory = spec.memory_bytes(slots_per_row=1)
    assert memory["rows"] == memory["slots"] == 64_000_000
    assert memory["state"] == 24_000_000 and memory["sketch"] == 16_000_000
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity=0), "capacity=0"),
    (dict(capacity=-5), "capacity=-5"),
    (dict(min_count=0), "min_count=0"),
    (dict(probability=0.0), "probability=0.0"),
    (dict(probability=1.5), "probability=1.5"),
    (dict(eviction="fifo"), "eviction='fifo'"),
    (dict(num_partitions=3), "num_partitions=3"),
    (dict(steps_to_live=0), "steps_to_live=0"),
    (dict(combiner="max"), "combiner='max'"),
    (dict(embeddings_initializer="glorot_uniform"), "embeddings_initializer='glorot_uniform'"),
])
def test_bad_arguments_are_named(kwargs, message):
    arguments = dict(output_dim=4, capacity=16, **{k: v for k, v in kwargs.items()
                                                    if k != "capacity"})
    if "capacity" in kwargs:
        arguments["capacity"] = kwargs["capacity"]
    with pytest.raises(ValueError, match="Invalid value for argument") as info:
        DynamicEmbedding(**arguments)
    assert message in str(info.value)


def test_float_ids_and_a_combiner_on_single_ids_are_refused():
    with pytest.raises(ValueError, match=r"inputs.dtype=float32"):
        DynamicEmbedding(4, capacity=8)(keras.Input((1,), dtype="float32"))
    with pytest.raises(ValueError, match=r"inputs.dtype=float32"):
        DynamicEmbedding(4, capacity=8)(tf.constant([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"one id per example.*combiner='mean'"):
        DynamicEmbedding(4, capacity=8, combiner="mean")(keras.Input((), dtype="int64"))
    with pytest.raises(ValueError, match=r"ragged ids need a combiner"):
        DynamicEmbedding(4, capacity=8)(tf.ragged.constant([[1, 2], [3]], tf.int64))


# -- one process ------------------------------------------------------------------------
def test_ids_get_rows_and_unknown_ids_read_zeros():
    layer = DynamicEmbedding(4, capacity=8, num_partitions=1, seed=1)
    first = layer(tf.constant([7, 2**62, -3, 7], tf.int64), training=True).numpy()
    np.testing.assert_array_equal(first[0], first[3])
    assert np.all(np.abs(first) <= 0.05) and np.all(first != 0)
    assert sorted(rows_of(layer)) == [-3, 7, 2**62]
    assert rows_of(layer)[7][2] == 2  # seen twice
    np.testing.assert_array_equal(vector(layer, 7), first[0])
    np.testing.assert_array_equal(vector(layer, 99), np.zeros(4))  # inference admits nothing
    assert 99 not in rows_of(layer)


def test_initial_values_depend_on_the_key_and_seed_only():
    a = DynamicEmbedding(3, capacity=16, num_partitions=2, seed=5)
    b = DynamicEmbedding(3, capacity=16, num_partitions=1, seed=5,
                         embeddings_initializer="uniform")
    train(a, [[1, 2, 3]])
    train(b, [[3], [2], [1]])
    for key in (1, 2, 3):
        np.testing.assert_array_equal(vector(a, key), vector(b, key))
    normal = DynamicEmbedding(2000, capacity=4, num_partitions=1,
                              embeddings_initializer=keras.initializers.RandomNormal(0, 1))
    values = normal(tf.constant([1], tf.int64), training=True).numpy()
    assert abs(values.mean()) < 0.1 and 0.9 < values.std() < 1.1
    truncated = DynamicEmbedding(2000, capacity=4, num_partitions=1,
                                 embeddings_initializer=keras.initializers.TruncatedNormal(0, 1))
    values = truncated(tf.constant([1], tf.int64), training=True).numpy()
    assert np.abs(values).max() <= 2.0  # within two standard deviations
    assert abs(values.mean()) < 0.1 and 0.8 < values.std() < 0.93  # 0.88 for N(0, 1) cut at 2


def test_string_ids_are_hashed_to_64_bit_keys():
    layer = DynamicEmbedding(4, capacity=8, num_partitions=1)
    out = layer(tf.constant(["a", "b", "a"]), training=True).numpy()
    np.testing.assert_array_equal(out[0], out[2])
    assert not np.array_equal(out[0], out[1])
    fingerprint = tf.bitcast(tf.fingerprint(tf.constant(["a"])), tf.int64).numpy()[0]
    assert fingerprint in rows_of(layer)


def test_combiners_on_dense_and_ragged_ids():
    layer = DynamicEmbedding(2, capacity=8, num_partitions=1, combiner="mean")
    train(layer, [[[1, 2, 3]]])
    single = DynamicEmbedding(2, capacity=8, num_partitions=1)
    single.build()
    single.set_weights(layer.get_weights())
    one, two, three = (vector(single, k) for k in (1, 2, 3))
    dense = layer(tf.constant([[1, 2], [3, 3]], tf.int64)).numpy()
    np.testing.assert_allclose(dense, [(one + two) / 2, three], rtol=1e-6)
    ragged = tf.ragged.constant([[1, 2, 3], [], [2]], tf.int64)
    np.testing.assert_allclose(layer(ragged).numpy(), [(one + two + three) / 3, [0, 0], two],
                               rtol=1e-6)
    for combiner, expected in (("sum", one + two + three),
                               ("sqrtn", (one + two + three) / np.sqrt(3))):
        other = DynamicEmbedding(2, capacity=8, num_partitions=1, combiner=combiner)
        other.build()
        other.set_weights(layer.get_weights())
        np.testing.assert_allclose(other(tf.ragged.constant([[1, 2, 3]], tf.int64)).numpy()[0],
                                   expected, rtol=1e-6)
    inputs = keras.Input((None,), dtype="int64", ragged=True)
    assert tuple(DynamicEmbedding(2, capacity=8, combiner="sum")(inputs).shape) == (None, 2)
    assert tuple(DynamicEmbedding(2, capacity=8)(keras.Input((3,), dtype="int64")).shape) == (
        None, 3, 2)


def test_min_count_admits_an_id_on_its_nth_occurrence():
    layer = DynamicEmbedding(4, capacity=64, num_partitions=1, min_count=3)
    train(layer, [[5], [5, 6]])
    assert rows_of(layer) == {}
    np.testing.assert_array_equal(vector(layer, 5), np.zeros(4))
    out = layer(tf.constant([5, 7, 7, 7], tf.int64), training=True).numpy()  # 3rd of 5, 7 x3
    assert sorted(rows_of(layer)) == [5, 7]
    assert np.all(out != 0)
    train(layer, [[6]])  # 2nd occurrence only
    assert 6 not in rows_of(layer)
    stats = layer.table_stats()
    assert stats["admitted"] == 2 and stats["lookups"] == 8


def test_the_admission_sketch_is_bounded_halved_and_the_simulators():
    from simulator.table import TableModel

    layer = DynamicEmbedding(2, capacity=256, num_partitions=1, min_count=2)
    layer.build()
    model = TableModel(layer.spec)
    assert layer.sketch.shape == model.sketch.shape == (1, 4, 256)
    for i in range(2):  # 200 singletons
        batch = np.arange(1000 * i, 1000 * i + 100)
        train(layer, [batch])
        model.lookup(batch)
    additions = layer.stats.numpy()[0, tables.SKETCH_ADDITIONS]
    admitted = len(rows_of(layer))  # a singleton whose 4 counters all collided
    assert additions + admitted == 200 and admitted <= 5
    np.testing.assert_array_equal(layer.sketch.numpy(), model.sketch)
    assert set(rows_of(layer)) == set(model.row_of) and additions == model.additions[0]
    train(layer, [np.arange(5000, 5100)])  # 300 >= 256 additions: halved
    model.lookup(np.arange(5000, 5100))
    assert layer.stats.numpy()[0, tables.SKETCH_ADDITIONS] == 0
    np.testing.assert_array_equal(layer.sketch.numpy(), model.sketch)
    assert layer.sketch.numpy().max() <= 1


def test_probability_admits_about_that_share():
    tf.random.set_seed(3)
    layer = DynamicEmbedding(2, capacity=1024, num_partitions=1, probability=0.25)
    train(layer, [np.arange(800)])
    assert 150 < len(rows_of(layer)) < 250


def test_lru_evicts_the_least_recently_seen_and_reused_rows_start_fresh():
    layer = DynamicEmbedding(2, capacity=4, num_partitions=1, seed=0)
    optimizer = keras.optimizers.Adagrad(1.0, initial_accumulator_value=0.25)
    train(layer, [[1, 2, 3, 4]])
    optimizer.build(layer.trainable_variables)
    (slot,) = optimizer.variables[2:]
    # Train ids 1..4 so that their rows and slots move.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([1, 2, 3, 4], tf.int64), training=True))
    optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
    assert not np.allclose(slot.numpy(), 0.25)
    train(layer, [[2], [3], [4]])  # 1 is now the least recent
    row_of_1 = rows_of(layer)[1][0]
    out = layer(tf.constant([9], tf.int64), training=True).numpy()[0]
    assert sorted(rows_of(layer)) == [2, 3, 4, 9]
    assert rows_of(layer)[9][0] == row_of_1  # the row was reused...
    fresh = DynamicEmbedding(2, capacity=4, num_partitions=1, seed=0)
    np.testing.assert_array_equal(out, fresh(tf.constant([9], tf.int64), training=True)[0])
    np.testing.assert_allclose(slot.numpy()[row_of_1], [0.25, 0.25])  # ...with a fresh slot
    assert layer.table_stats()["evicted"] == 1
    np.testing.assert_array_equal(vector(layer, 1), [0, 0])


def test_lfu_evicts_the_least_frequently_seen():
    layer = DynamicEmbedding(2, capacity=4, num_partitions=1, eviction="lfu")
    train(layer, [[1, 1, 1, 2, 3, 3, 4, 4]])
    train(layer, [[2], [9]])  # 1 seen thrice; 2, 3 and 4 twice, 2 the most recently
    rows = rows_of(layer)
    assert len(rows) == 4 and {1, 2, 9} <= set(rows)  # 3 or 4 went


def test_eviction_frees_old_rows_of_a_large_partition_by_sampling():
    layer = DynamicEmbedding(2, capacity=4096, num_partitions=1)
    train(layer, [np.arange(i, i + 512) for i in range(0, 4096, 512)])  # 8 ages
    train(layer, [np.arange(10_000, 10_032)])  # 32 rows to free: 512 sampled of 4096
    rows = rows_of(layer)
    freed = set(range(4096)) - set(rows)
    assert 28 <= len(freed) <= 32  # two draws may pick one row: an id waits for its next
    assert len(rows) == 4096 and len(set(range(10_000, 10_032)) & set(rows)) == len(freed)
    assert max(freed) < 2048  # the oldest of 16 draws: in the older half
    assert layer.table_stats()["evicted"] == len(freed)


def test_a_batch_never_evicts_its_own_ids():
    layer = DynamicEmbedding(2, capacity=4, num_partitions=1)
    out = layer(tf.constant([1, 2, 3, 4, 5, 6], tf.int64), training=True).numpy()
    assert sorted(rows_of(layer)) == [1, 2, 3, 4]
    np.testing.assert_array_equal(out[4:], np.zeros((2, 2)))


def test_steps_to_live_frees_the_rows_of_ids_not_seen_for_that_long():
    layer = DynamicEmbedding(2, capacity=8, num_partitions=1, steps_to_live=3)
    train(layer, [[1, 2], [2], [2], [2]])  # 1 last seen at step 0; now step 4
    np.testing.assert_array_equal(vector(layer, 1), [0, 0])  # expired: no row to read
    assert np.any(vector(layer, 2) != 0)
    train(layer, [[1]])  # looked up again: a fresh row
    assert rows_of(layer)[1][1] == 4 and rows_of(layer)[1][2] == 1
    assert layer.table_stats()["evicted"] == 1


def test_single_process_fit_reports_table_metrics_per_epoch():
    layer = DynamicEmbedding(4, capacity=32, num_partitions=1, name="items")
    model = id_model(layer)
    model.compile(keras.optimizers.Adagrad(0.1), "mse")
    ids = np.arange(64).reshape(-1, 1) % 40
    history = model.fit(ids, np.ones((64, 1)), batch_size=16, epochs=2, verbose=0)
    logs = history.history
    assert logs["items_rows_used"] == [32, 32]
    assert logs["items_admitted"][0] - logs["items_evicted"][0] == 32  # 40 ids, 32 rows
    assert logs["items_evicted"][1] > 0 and 0 < logs["items_hit_rate"][1] < 1


def test_weights_round_trip_and_rebuild_the_maps(tmp_path):
    layer = DynamicEmbedding(3, capacity=16, num_partitions=2, min_count=2)
    train(layer, [[1, 2, 3, 1, 2], [4, 5, 6, 3]])
    model = id_model(layer)
    copy = id_model(DynamicEmbedding(3, capacity=16, num_partitions=2, min_count=2))
    copy.set_weights(model.get_weights())
    for key in range(8):
        np.testing.assert_array_equal(vector(copy.layers[1], key), vector(layer, key))
    train(copy.layers[1], [[9, 9]])  # the free rows were rebuilt too
    assert len(rows_of(copy.layers[1])) == len(rows_of(layer)) + 1
    model.save_weights(tmp_path / "m.weights.h5")
    other = id_model(DynamicEmbedding(3, capacity=16, num_partitions=2, min_count=2))
    other.load_weights(tmp_path / "m.weights.h5")
    assert rows_of(other.layers[1]) == rows_of(layer)
    wrong = id_model(DynamicEmbedding(3, capacity=16, num_partitions=4, min_count=2))
    with pytest.raises(ValueError, match=r"stats"):
        wrong.load_weights(tmp_path / "m.weights.h5")
    model.compile("adagrad", "mse")
    model.train_on_batch(np.array([[1], [2]]), np.ones((2, 1)))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert rows_of(loaded.layers[1]) == rows_of(layer)
    assert loaded.layers[1].get_config() == layer.get_config()


def test_model_checkpoint_holds_the_table(tmp_path):
    layer = DynamicEmbedding(2, capacity=8, num_partitions=1, name="items")
    model = id_model(layer)
    model.compile(keras.optimizers.Adagrad(0.1), "mse")
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"),
                                                 save_weights_only=True)
    model.fit(np.arange(12).reshape(-1, 1), np.ones((12, 1)), batch_size=4, epochs=2,
              verbose=0, callbacks=[checkpoint])
    copy = id_model(DynamicEmbedding(2, capacity=8, num_partitions=1, name="items"))
    copy.load_weights(tmp_path / "e2.weights.h5")
    assert rows_of(copy.layers[1]) == rows_of(layer) and len(rows_of(layer)) == 8


# -- under the strategy ---------------------------------------------------------------
@pytest.fixture
def lazy_strategy(make_strategy):
    return make_strategy(sparse_updates="lazy")


def test_rows_spread_over_the_ps_tasks_by_key_hash(lazy_strategy):
    with lazy_strategy.scope():
        layer = DynamicEmbedding(4, capacity=64, num_partitions=4, name="spread")
        model = id_model(layer)
    report = lazy_strategy.placement_report()
    tasks = {r.name: r.ps_task for r in report if r.variable.startswith("spread/")}
    assert tasks["spread/rows/part_0"] == 0 and tasks["spread/rows/part_1"] == 1
    assert tasks["spread/state/part_1"] == 1
    assert layer.rows.shard_sizes == [32, 32]
    coordinator = kerasps.ClusterCoordinator(lazy_strategy)
    keys = np.arange(100, 140)

    @tf.function
    def look(ids):
        return lazy_strategy.run(lambda ids: layer(ids, training=True), args=(ids,))

    coordinator.schedule(look, args=(tf.constant(keys, tf.int64),))
    coordinator.join()
    rows = rows_of(layer)
    assert sorted(rows) == list(keys)
    expected = layer.spec.ps_task_of(keys, 2)
    for key, task in zip(keys, expected):
        assert (rows[key][0] >= 32) == bool(task)  # shard 1 holds rows 32..63
    records = [r for r in lazy_strategy.placement_report().tables if r.name == "spread"]
    assert [(r.ps_task, r.capacity, r.rows_used, r.admitted) for r in records] == [
        (task, 32, int((expected == task).sum()), int((expected == task).sum()))
        for task in (0, 1)]
    text = str(lazy_strategy.placement_report())
    assert "dynamic tables:" in text and "hit_rate" in text
    del model


def test_two_workers_inserting_the_same_new_ids_at_once_make_one_row_each(lazy_strategy):
    with lazy_strategy.scope():
        layer = DynamicEmbedding(2, capacity=4096, num_partitions=2)
        layer.build()
    coordinator = kerasps.ClusterCoordinator(lazy_strategy)

    @tf.function
    def insert(ids):
        return lazy_strategy.run(lambda ids: layer(ids, training=True), args=(ids,))

    # Consecutive functions (on the two workers at once) insert the same new ids.
    for step in range(300):
        base = (step // 2) * 8
        coordinator.schedule(insert, args=(tf.constant(np.arange(base, base + 8), tf.int64),))
    coordinator.join()
    rows = rows_of(layer)
    assert sorted(rows) == list(range(150 * 8))
    assert len({row for row, _, _ in rows.values()}) == len(rows)
    assert sum(int(m.size().numpy()) for m in layer._table.maps()) == len(rows)
    assert sum(rows[k][2] for k in rows) == 300 * 8  # each id counted twice
    assert layer.table_stats()["admitted"] == len(rows)


def sgd_steps(strategy, batches, labels):
    """Trains `id_model` with SGD one batch at a time; returns (model, vectors)."""
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        layer = DynamicEmbedding(3, capacity=64, num_partitions=4, seed=7)
        model = id_model(layer, dim_in=2)
        optimizer = keras.optimizers.SGD(0.5)
        optimizer.build(model.trainable_variables)

    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(ids, training=True) - y) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)

    if strategy is None:
        function = tf.function(step)
        for ids, y in zip(batches, labels):
            function(tf.constant(ids, tf.int64), tf.constant(y))
    else:
        coordinator = kerasps.ClusterCoordinator(strategy)

        @tf.function
        def scheduled(ids, y):
            strategy.run(step, args=(ids, y))

        for ids, y in zip(batches, labels):
            coordinator.schedule(scheduled, args=(tf.constant(ids, tf.int64), tf.constant(y)))
            coordinator.join()
    return model, {k: vector(layer, k) for k in range(12)}


def test_sparse_training_on_two_ps_tasks_equals_one_process(make_strategy):
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 12, size=(4, 2)) for _ in range(8)]
    labels = [rng.normal(size=(4, 1)).astype("float32") for _ in range(8)]
    _, expected = sgd_steps(None, batches, labels)
    model, got = sgd_steps(make_strategy(), batches, labels)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)
    assert any(np.any(v != 0) for v in got.values())


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_fit_trains_with_eviction_and_logs_the_table(make_strategy, mode):
    strategy = make_strategy(sparse_updates="lazy", mode=mode)
    with strategy.scope():
        layer = DynamicEmbedding(4, capacity=128, num_partitions=2, name="items")
        model = id_model(layer)
        model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy",
                      steps_per_execution=5 if mode == "async" else 1)
    rng = np.random.default_rng(1)

    def dataset_fn(context):
        ids = rng.integers(0, 400, size=(4096, 1))
        labels = (ids % 2).astype("float32")
        return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(32).repeat()

    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=40,
                        verbose=0)
    logs = history.history
    assert logs["items_rows_used"][-1] == 128
    assert logs["items_admitted"][0] >= 128 and logs["items_evicted"][1] > 0
    assert 0.1 < logs["items_hit_rate"][1] < 0.6
    assert logs["loss"][1] < logs["loss"][0]
    rows = rows_of(layer)
    assert len(rows) == 128 and len({r for r, _, _ in rows.values()}) == 128
    stats = layer.table_stats()
    assert stats["admitted"] - stats["evicted"] == 128


TWO_LOOKUPS_FIT = r"""
import json, sys

import keras
import numpy as np
import tensorflow as tf

import kerasps
from kerasps.layers import DynamicEmbedding

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(2, 2))
with strategy.scope():
    items = keras.Input((1,), dtype="int64", name="item")
    tags = keras.Input((1,), dtype="int64", name="tag")
    first = DynamicEmbedding(4, capacity=64, num_partitions=2, name="items")
    second = (first if sys.argv[1] == "one layer called twice"
              else DynamicEmbedding(4, capacity=64, num_partitions=2, name="tags"))
    x = keras.layers.Concatenate()([keras.layers.Flatten()(first(items)),
                                    keras.layers.Flatten()(second(tags))])
    model = keras.Model([items, tags], keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.Adagrad(0.1), "mse")


def dataset_fn(context):
    ids = np.random.default_rng(context.input_pipeline_id).integers(0, 300, size=(4096, 2))
    return tf.data.Dataset.from_tensor_slices(
        ((ids[:, :1], ids[:, 1:]), (ids[:, 0] % 2).astype("float32"))).batch(8).repeat()


for _ in range(3):
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=100, verbose=0)
print(json.dumps({"clock": first.stats.numpy()[:, 0].tolist()}))
"""
DEADLINE_S = 120  # the fits take seconds; each hung within 100 steps before its fix


@pytest.mark.slow  # the default run's longest: repeated until a deadlock would show: ~25 s each
@pytest.mark.parametrize("model,lookups_per_step", [("two layers", 1),
                                                    ("one layer called twice", 2)])
def test_two_training_lookups_in_one_step_do_not_deadlock_two_workers(model, lookups_per_step,
                                                                        tmp_path):
    """Two workers, two ps tasks, two training lookups of tables spanning both per step.

    * Two layers: each shard's lock is a mutex of its own. Made eagerly, every
      `tf.CriticalSection()` of a ps task was one mutex, and a step could wait for itself.
    * One layer called twice: a lookup's locks wait for the previous lookup of the table
      in the step (`Table._after_previous_lookup`). TensorFlow releases a step's locks in
      program order across ps tasks, so a worker holding its second lookup's lock on one
      ps task waited for its first lookup's on the other, held by another worker waiting
      for the first worker's.

    A deadlock would hang the session's shared cluster: the fits run in a subprocess whose
    timeout is the deadline."""
    result = run_with_deadline(TWO_LOOKUPS_FIT, model, deadline=DEADLINE_S, cwd=tmp_path,
                               what=f"3 fits of 100 steps with {model}")
    assert result.returncode == 0, result.stderr[-3000:]
    clock = json.loads(result.stdout.splitlines()[-1])["clock"]
    assert clock == [300 * lookups_per_step] * 2  # each training lookup reached both ps


# -- state across layouts -------------------------------------------------------------
def trained_on_two_ps(strategy):
    with strategy.scope():
        layer = DynamicEmbedding(3, capacity=32, num_partitions=2, min_count=2, name="t")
        model = id_model(layer)
        model.compile(keras.optimizers.Adagrad(0.3), "mse")
    ids = np.array([[i % 23] for i in range(256)])
    model.fit(ids, np.ones((256, 1)), batch_size=16, epochs=1, verbose=0,
              steps_per_epoch=16)
    return model, layer


@pytest.mark.slow  # the default run's longest: clusters of 1 and 3 ps tasks: ~20 s
def test_a_checkpoint_restores_exactly_into_another_number_of_ps_tasks(tmp_path, strategy):
    model, layer = trained_on_two_ps(strategy)
    slot_before = model.optimizer.variables
    path = str(tmp_path / "two.weights.h5")
    model.save_weights(path)
    single = id_model(DynamicEmbedding(3, capacity=32, num_partitions=2, min_count=2,
                                       name="t"))
    single.compile(keras.optimizers.Adagrad(0.3), "mse")
    single.optimizer.build(single.trainable_variables)
    single.load_weights(path)
    target = single.layers[1]
    assert rows_of(target) == rows_of(layer)
    for key in range(30):
        np.testing.assert_array_equal(vector(target, key), vector(layer, key))
    np.testing.assert_array_equal(target.sketch.numpy(), layer.sketch.numpy())
    whole_slots = [v for v in logical_variables(slot_before)]
    accumulator = [v for v in whole_slots if "rows" in v.path][0]
    single_accumulator = [v for v in single.optimizer.variables if "rows" in v.path][0]
    np.testing.assert_array_equal(single_accumulator.numpy(), accumulator.numpy())
    # ...and back into two ps tasks, through a tf.train.Checkpoint.
    prefix = tf.train.Checkpoint(model=single, optimizer=single.optimizer).write(
        str(tmp_path / "one"))
    with strategy.scope():
        again = id_model(DynamicEmbedding(3, capacity=32, num_partitions=2, min_count=2,
                                          name="t"))
        again.compile(keras.optimizers.Adagrad(0.3), "mse")
        again.optimizer.build(again.trainable_variables)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).read(prefix).expect_partial()
    assert rows_of(again.layers[1]) == rows_of(layer)
    for key in range(30):
        np.testing.assert_array_equal(vector(again.layers[1], key), vector(layer, key))
    train(again.layers[1], [[500, 501, 500, 501]])  # its maps and free rows work
    assert {500, 501} <= set(rows_of(again.layers[1]))


@pytest.mark.slow  # the default run's longest: ~20 s
def test_export_serves_without_kerasps_and_unknown_ids_read_zeros(tmp_path, strategy):
    model, layer = trained_on_two_ps(strategy)
    model.export(str(tmp_path / "served"), verbose=False)
    expected = model.predict(np.array([[3], [999]]), verbose=0)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tensorflow as tf
        served = tf.saved_model.load({str(tmp_path / "served")!r})
        print(served.serve(tf.constant([[3], [999]], tf.int64)).numpy().ravel().tolist())
        assert "kerasps" not in sys.modules
    """)
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300, check=True)
    served = np.array(eval(result.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(served, expected.ravel(), rtol=1e-5)
    bias = model.layers[-1].bias.numpy()[0]
    np.testing.assert_allclose(served[1], bias, rtol=1e-5)  # 999: the zero vector


def test_get_and_set_weights_move_between_layouts(strategy):
    model, layer = trained_on_two_ps(strategy)
    weights = layer.get_weights()
    assert [w.shape for w in weights] == [(32, 3), (32, 3), (2, 8), (2, 4, 64)]
    single = DynamicEmbedding(3, capacity=32, num_partitions=2, min_count=2)
    single.build()
    single.set_weights(weights)
    assert rows_of(single) == rows_of(layer)
    with strategy.scope():
        back = DynamicEmbedding(3, capacity=32, num_partitions=2, min_count=2)
        back.build()
    back.set_weights(single.get_weights())
    assert rows_of(back) == rows_of(layer)
    assert back.rows.num_shards == 2


# -- restores into 3 ps tasks, 1 process; a `.keras` saved untrained; layer weights ---------
def table_model(optimizer="adam"):
    """ids -> a 6-partition table (2 and 3 ps tasks hold different runs of partitions)."""
    inputs = keras.Input((1,), dtype="int64")
    layer = DynamicEmbedding(3, capacity=48, num_partitions=6, min_count=2, seed=3, name="t")
    x = keras.layers.Flatten()(layer(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.get(optimizer), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def table_state(model):
    """Per key: (row, [key, last_seen, count], vector, each row slot's values); and the
    table's per-partition counters, sketch and totals."""
    layer = model.layers[1]
    state, rows = layer.state.numpy(), layer.rows.numpy()
    slots = sorted((v.path.split("/", 1)[1], v.numpy()) for v in
                   logical_variables(model.optimizer.variables)
                   if "rows" in v.path)
    used = np.flatnonzero(state[:, tables.LAST_SEEN] >= 0)
    keys = {int(state[r, tables.KEY]): (int(r), state[r].tolist(), rows[r].tolist(),
                                        [(name, s[r].tolist()) for name, s in slots])
            for r in used}
    stats = layer.table_stats()
    return {"keys": keys, "stats": layer.stats.numpy().tolist(),
            "sketch": layer.sketch.numpy().tolist(), "slots": [n for n, _ in slots],
            "totals": [stats[k] for k in ("rows_used", "lookups", "hits", "admitted",
                                          "evicted")]}


def assert_same_table(got, expected):
    assert got["slots"] == expected["slots"] and len(got["slots"]) == 2
    assert set(got["keys"]) == set(expected["keys"])
    for key, value in expected["keys"].items():
        assert got["keys"][key] == value, key
    for part in ("stats", "sketch", "totals"):
        assert got[part] == expected[part], part


# Runs in a process of its own: an in-process cluster of 3 ps tasks (the session's
# cluster has 2). Loads what the test wrote in `sys.argv[1]`; writes what it read.
THREE_PS = """
import pickle, sys
import keras, numpy as np, tensorflow as tf, kerasps
sys.path.insert(0, sys.argv[2])
from tests.test_dynamic_embedding import table_model, table_state

d = sys.argv[1]
strategy = kerasps.ParameterServerStrategy(
    kerasps.cluster.in_process(num_workers=1, num_ps=3), sparse_updates="lazy")
coordinator = kerasps.ClusterCoordinator(strategy)
out = {}

def training_lookup(layer, keys):
    @tf.function
    def look(ids):
        return strategy.run(lambda ids: layer(ids, training=True), args=(ids,))
    coordinator.schedule(look, args=(tf.constant(keys, tf.int64),))
    coordinator.join()

def maps(layer):
    return [int(m.size().numpy()) for m in layer._table.maps()]

for how in ("h5", "checkpoint"):
    with strategy.scope():
        model = table_model()
    if how == "h5":
        model.load_weights(d + "/two.weights.h5")
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
            d + "/two").expect_partial()
    layer = model.layers[1]
    out[how] = {"table": table_state(model), "maps": maps(layer),
                "shards": layer.rows.num_shards}
    # Its maps and free rows work. The trained rows are protected from eviction for 4
    # lookups (the last ones trained on can fill a partition): 5 lookups admit both.
    for _ in range(5):
        training_lookup(layer, [1000, 1000, 1001, 1001])
    out[how]["after"] = sorted(table_state(model)["keys"])

with strategy.scope():
    model = keras.saving.load_model(d + "/untrained.keras")
layer = model.layers[1]
out["untrained"] = {"shards": layer.rows.num_shards, "maps": maps(layer),
                    "used": int((layer.state.numpy()[:, 1] >= 0).sum())}
keys = np.arange(16)
training_lookup(layer, np.repeat(keys, 2))
out["untrained"]["after"] = sorted(table_state(model)["keys"])
out["untrained"]["free"] = [s.free_count.numpy().tolist() for s in layer._table.shards]

weights = list(np.load(d + "/layer_weights.npz").values())
with strategy.scope():
    other = kerasps.layers.DynamicEmbedding(3, capacity=48, num_partitions=6, min_count=2)
    other.build()
other.set_weights(weights)
out["weights"] = {"equal": all(np.array_equal(a, b) for a, b in zip(other.get_weights(),
                                                                     weights)),
                  "maps": maps(other), "shards": other.rows.num_shards}
pickle.dump(out, open(d + "/three.pkl", "wb"))
print("done")
"""


@pytest.fixture(scope="module")
def on_two_ps(cluster, tmp_path_factory):
    """A table trained on the session's 2 ps tasks, saved every way, and what a process
    with 3 ps tasks read back of it (`THREE_PS`)."""
    path = tmp_path_factory.mktemp("tables")
    strategy = kerasps.ParameterServerStrategy(cluster, sparse_updates="lazy")
    with strategy.scope():
        model = table_model()
    ids = np.array([[i * 7 % 61] for i in range(512)])  # 61 ids for 48 rows: evictions
    model.fit(ids, np.ones((512, 1)), batch_size=16, epochs=1, verbose=0, steps_per_epoch=32)
    model.save_weights(str(path / "two.weights.h5"))
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(path / "two"))
    np.savez(path / "layer_weights.npz", *model.layers[1].get_weights())
    table_model().save(str(path / "untrained.keras"))  # no strategy, never trained
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", THREE_PS, str(path), root],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    with open(path / "three.pkl", "rb") as f:
        three = pickle.load(f)
    return model, table_state(model), three, path


def test_a_table_trained_on_two_ps_restores_exactly_into_three_and_into_one_process(
        on_two_ps):
    model, expected, three, path = on_two_ps
    assert expected["totals"][4] > 0 and len(expected["keys"]) > 40  # evicted, nearly full
    keys = np.array(sorted(expected["keys"]))
    per_task = np.bincount(model.layers[1].spec.ps_task_of(keys, 3), minlength=3).tolist()
    for how in ("h5", "checkpoint"):
        assert three[how]["shards"] == 3
        assert_same_table(three[how]["table"], expected)
        assert three[how]["maps"] == per_task  # keys re-hashed to their new tasks
        assert {1000, 1001} <= set(three[how]["after"])  # its maps and free rows work
    # ...into one process, without a strategy.
    single = table_model()
    single.load_weights(str(path / "two.weights.h5"))
    assert_same_table(table_state(single), expected)
    restored = table_model()
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        str(path / "two")).expect_partial()
    assert_same_table(table_state(restored), expected)
    assert [int(m.size().numpy()) for m in restored.layers[1]._table.maps()] == [len(keys)]
    train(restored.layers[1], [[1000, 1000]])
    assert 1000 in table_state(restored)["keys"]


def test_a_restore_that_cannot_be_exact_raises_naming_the_variable(on_two_ps, tmp_path):
    model, _, _, path = on_two_ps
    for kwargs, name in [({"num_partitions": 4}, "t/stats"), ({"capacity": 96}, "t/rows")]:
        inputs = keras.Input((1,), dtype="int64")
        layer = DynamicEmbedding(3, **{"capacity": 48, "num_partitions": 6, "min_count": 2,
                                       "name": "t", **kwargs})
        other = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(
            layer(inputs))))
        with pytest.raises(ValueError, match=name):
            other.load_weights(str(path / "two.weights.h5"))


def test_a_keras_file_saved_before_training_loads_under_2_and_3_ps_and_none(
        on_two_ps, make_strategy):
    _, _, three, path = on_two_ps
    assert three["untrained"]["shards"] == 3 and three["untrained"]["used"] == 0
    assert three["untrained"]["maps"] == [0, 0, 0]
    assert three["untrained"]["after"] == list(range(16))  # each key admitted, once
    assert sum(map(sum, three["untrained"]["free"])) == 48 - 16
    strategy = make_strategy(sparse_updates="lazy")
    with strategy.scope():
        model = keras.saving.load_model(str(path / "untrained.keras"))
    layer = model.layers[1]
    assert layer.rows.num_shards == 2 and not table_state(model)["keys"]
    coordinator = kerasps.ClusterCoordinator(strategy)

    @tf.function
    def look(ids):
        return strategy.run(lambda ids: layer(ids, training=True), args=(ids,))

    coordinator.schedule(look, args=(tf.constant(np.repeat(np.arange(16), 2), tf.int64),))
    coordinator.join()
    assert sorted(table_state(model)["keys"]) == list(range(16))
    history = model.fit(np.arange(64).reshape(-1, 1) % 20, np.ones((64, 1)), batch_size=8,
                        epochs=1, verbose=0, steps_per_epoch=8)
    assert np.isfinite(history.history["loss"][0])
    plain = keras.saving.load_model(str(path / "untrained.keras"))
    assert plain.layers[1].rows.num_shards == 1
    train(plain.layers[1], [np.repeat(np.arange(16), 2)])
    assert sorted(table_state(plain)["keys"]) == list(range(16))


def test_layer_weights_round_trip_between_2_and_3_ps_and_one_process(on_two_ps, strategy):
    model, expected, three, _ = on_two_ps
    layer = model.layers[1]
    weights = layer.get_weights()
    keys = np.array(sorted(expected["keys"]))
    assert three["weights"] == {
        "equal": True, "shards": 3,
        "maps": np.bincount(layer.spec.ps_task_of(keys, 3), minlength=3).tolist()}
    layer.set_weights(weights)  # onto itself: nothing changes
    for got, want in zip(layer.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    assert sum(int(m.size().numpy()) for m in layer._table.maps()) == len(keys)
    single = DynamicEmbedding(3, capacity=48, num_partitions=6, min_count=2, seed=3)
    single.build()
    single.set_weights(weights)
    for got, want in zip(single.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    for key in keys[:10]:
        np.testing.assert_array_equal(vector(single, key), vector(layer, key))
    with pytest.raises(ValueError, match=r"state"):
        single.set_weights([weights[0], weights[1][:40], *weights[2:]])


# -- a ps task killed mid-fit (real processes) ----------------------------------------
TABLE_RECOVERY_CHIEF = """
    import itertools, sys
    import keras, numpy as np, tensorflow as tf, kerasps
    from kerasps.policy import tables

    def say(*words):
        print(*words, flush=True)

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config(),
                                               sparse_updates="lazy")
    with strategy.scope():
        inputs = keras.Input((1,), dtype="int64")
        layer = kerasps.layers.DynamicEmbedding(8, capacity=256, num_partitions=4,
                                                name="items")
        x = keras.layers.Flatten()(layer(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(x))
        model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy")

    def dataset_fn(context):
        ids = tf.random.stateless_uniform((4096, 1), [1, context.input_pipeline_id], 0, 600,
                                          tf.int64)
        return tf.data.Dataset.from_tensor_slices((ids, tf.cast(ids % 2, tf.float32))).repeat(
            ).batch(16)

    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)))
    backup = keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=4, steps_per_epoch=50,
                        verbose=0, callbacks=[progress, backup])
    say("iterations", int(model.optimizer.iterations.numpy()))
    say("reexecuted", sum(history.history.get("reexecuted_steps", [0])))
    say("rolled back", sum(history.history.get("rolled_back_steps", [0])))
    state = layer.state.numpy()
    used = np.flatnonzero(state[:, tables.LAST_SEEN] >= 0)
    keys = state[used, tables.KEY]
    sizes = [int(m.size().numpy()) for m in layer._table.maps()]
    vectors = layer(tf.constant(keys, tf.int64)).numpy()
    stats = layer.table_stats()
    say("rows", len(used), "maps", sum(sizes), "distinct", len(set(keys.tolist())))
    say("served", bool(np.array_equal(vectors, layer.rows.numpy()[used])))
    say("balance", stats["admitted"] - stats["evicted"] == len(used))
    say("hit rate", history.history["items_hit_rate"][-1])
"""


@pytest.mark.slow
def test_a_ps_killed_mid_fit_gets_its_table_back_from_the_backup(tmp_path):
    from tests.launched import launch

    job = launch(tmp_path, TABLE_RECOVERY_CHIEF, "--workers", "2", "--ps", "2",
                 "--max-restarts", "2", args=[str(tmp_path / "backup")])
    try:
        job.wait_for(r"\[chief 0\] train batch 75$")
        job.kill("ps 1")
        job.wait_for(r"\[launcher\] ps 1 exited with signal 9 \(SIGKILL\); restart 1 of 2")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        rolled_back = int(job.wait_for(r"\[chief 0\] rolled back (\d+)").group(1))
        rows = job.wait_for(r"\[chief 0\] rows (\d+) maps (\d+) distinct (\d+)")
        assert rows.group(1) == rows.group(2) == rows.group(3) == "256"
        job.wait_for(r"\[chief 0\] served True")
        job.wait_for(r"\[chief 0\] balance True")
        hit_rate = float(job.wait_for(r"\[chief 0\] hit rate (\S+)").group(1))
        assert job.finish() == 0, job.output()
        assert iterations == 200 + reexecuted and 0 < rolled_back <= 10
        assert 0.3 < hit_rate < 0.6  # 256 of 600 ids: the table kept working
        job.wait_for(r"lost their variables at epoch 2 ")
    finally:
        job.close()


def test_the_simulators_table_model_predicts_the_layers_hit_rate_and_churn():
    from simulator.idstream import ZipfStream
    from simulator.table import predict_load

    stream = ZipfStream(examples=150_000, distinct=100_000, window=25_000, chunk=10_000)
    arguments = dict(capacity=2000, output_dim=4, num_partitions=4, min_count=2)
    predicted = predict_load(tables.TableSpec(**arguments), stream.chunks(), 500, num_ps=2,
                             warmup_steps=100)
    layer = DynamicEmbedding(**arguments)
    look = tf.function(lambda ids: layer(ids, training=True))
    ids = np.concatenate(list(stream.chunks()))
    for step in range(len(ids) // 500):
        if step == 100:
            start = layer.table_stats()
        look(tf.constant(ids[step * 500:(step + 1) * 500]))
    end = layer.table_stats()
    steps = len(ids) // 500 - 100
    measured = {k: end[k] - start[k] for k in ("lookups", "hits", "admitted", "evicted")}
    assert predicted.hit_rate == pytest.approx(measured["hits"] / measured["lookups"], abs=0.01)
    assert predicted.admitted_per_step == pytest.approx(measured["admitted"] / steps, rel=0.1)
    assert predicted.evicted_per_step == pytest.approx(measured["evicted"] / steps, rel=0.1)


def test_a_table_with_steps_to_live_predicts_inside_a_traced_function():
    # Reported with keras-rs' DynamicTableConfig(steps_to_live=2): a lookup outside
    # training, traced (predict, evaluate, a serving function), failed to build:
    # `tf.where` took the expired rows' -1 as int32 beside the map's int64 rows.
    layer = DynamicEmbedding(2, capacity=8, num_partitions=1, steps_to_live=2)
    train(layer, [[1, 2], [2], [2], [2]])  # 1 last seen at step 0: expired by now
    lookup = tf.function(lambda ids: layer(ids, training=False))
    out = lookup(tf.constant([1, 2], tf.int64)).numpy()
    np.testing.assert_array_equal(out[0], [0, 0])  # expired: no row to read
    np.testing.assert_array_equal(out[1], vector(layer, 2))
    assert np.any(out[1] != 0)
