"""The strategy: variables on ps tasks, placement policies, the placement report."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps


def ps_task(variable):
    spec = tf.DeviceSpec.from_string(variable.value.device)
    assert spec.job == "ps", variable.value.device
    return spec.task


def test_keras_layer_and_optimizer_variables_live_on_ps_tasks(make_strategy):
    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
    for variable in model.variables + model.optimizer.variables:
        assert tf.DeviceSpec.from_string(variable.value.device).job == "ps"
    assert {ps_task(v) for v in model.trainable_variables} == {0, 1}


def test_partitioned_variable_becomes_shards_on_different_ps_tasks(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(11, 4)
        layer.build((None,))
    table = layer.embeddings
    assert isinstance(table, kerasps.ShardedVariable)
    assert table.shape == (11, 4)
    assert [tuple(s.shape) for s in table.shards] == [(6, 4), (5, 4)]
    assert sorted(ps_task(s) for s in table.shards) == [0, 1]
    # Layers track the shards: gradients and optimizers see real variables.
    assert layer.trainable_variables == table.shards


def test_small_variables_stay_whole_under_min_size_partitioner(make_strategy):
    strategy = make_strategy(variable_partitioner=kerasps.partitioners.MinSizePartitioner(
        min_shard_bytes=1024, max_shards=2))
    with strategy.scope():
        big = keras.layers.Embedding(1000, 4)  # 16 kB: two shards
        big.build((None,))
        small = keras.layers.Dense(3)  # 48 bytes: whole
        small.build((None, 4))
    assert isinstance(big.embeddings, kerasps.ShardedVariable)
    assert not isinstance(small.kernel, kerasps.ShardedVariable)


def _placed(strategy):
    with strategy.scope():
        keras.Variable(np.zeros((1000, 10), "float32"), name="big")
        for i in range(3):
            keras.Variable(np.zeros((10,), "float32"), name=f"small{i}")
    return {r.name: r.ps_task for r in strategy.placement_report()}


def test_round_robin_alternates_ps_tasks_in_creation_order(make_strategy):
    placed = _placed(make_strategy(placement="round_robin"))
    assert [placed[n] for n in ("big", "small0", "small1", "small2")] == [0, 1, 0, 1]


@pytest.mark.parametrize("placement", ["round_robin", "greedy"])
def test_an_optimizers_learning_rate_is_on_the_ps_task_of_its_iterations(
        make_strategy, placement):
    # Every variable's update reads both, on the variable's ps task: together they
    # are sent there as one tensor (round_robin alone would split them).
    strategy = make_strategy(placement=placement)
    with strategy.scope():
        keras.Variable(np.zeros((10,), "float32"), name="before")
        optimizer = keras.optimizers.Adam(0.1)
        after = [keras.Variable(np.zeros((10,), "float32"), name=f"after{i}") for i in range(2)]
    by_name = {v.name: v for v in optimizer.variables}
    assert ps_task(by_name["learning_rate"]) == ps_task(by_name["iteration"])
    # The policy goes on as before for the variables that follow.
    assert {ps_task(v) for v in after} == {0, 1}


def test_greedy_puts_each_variable_on_the_least_loaded_ps(make_strategy):
    strategy = make_strategy(placement="greedy")
    placed = _placed(strategy)
    assert [placed[n] for n in ("big", "small0", "small1", "small2")] == [0, 1, 1, 1]
    loads = strategy.placement_report().bytes_per_ps()
    assert loads == [40_000, 120]


def test_callable_placement_decides_the_ps_task(make_strategy):
    calls = []

    def on_last_ps(name, shape, dtype, num_ps):
        calls.append((name, tuple(shape), dtype, num_ps))
        return num_ps - 1

    placed = _placed(make_strategy(placement=on_last_ps))
    assert set(placed.values()) == {1}
    assert ("big", (1000, 10), "float32", 2) in calls


def test_callable_placement_returning_a_bad_index_is_rejected(make_strategy):
    strategy = make_strategy(placement=lambda name, shape, dtype, num_ps: 7)
    with strategy.scope(), pytest.raises(ValueError, match=r"`placement`.*Received: 7"):
        keras.Variable(np.zeros((2,), "float32"), name="v")


@pytest.mark.parametrize("placement", ["fastest", 3, None])
def test_unknown_placement_is_rejected_before_connecting(cluster, placement):
    with pytest.raises(ValueError, match=r"argument `placement`.*Received: placement="):
        kerasps.ParameterServerStrategy(cluster, placement=placement)


def test_bad_partitioner_is_rejected(cluster):
    with pytest.raises(ValueError,
                       match=r"`variable_partitioner`.*Received: variable_partitioner=4"):
        kerasps.ParameterServerStrategy(cluster, variable_partitioner=4)


def test_resolver_without_ps_or_worker_is_rejected():
    no_ps = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["localhost:1"]}), rpc_layer="grpc")
    with pytest.raises(ValueError, match=r"at least one `ps` task"):
        kerasps.ParameterServerStrategy(no_ps)
    with pytest.raises(ValueError,
                       match=r"argument `cluster_resolver`.*Received: cluster_resolver='x'"):
        kerasps.ParameterServerStrategy("x")


def test_optimizer_slots_sit_next_to_their_shard(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 3)])
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
    records = strategy.placement_report()
    by_name = {r.name: r for r in records}
    shards = [r for r in records if "/part_" in r.name]
    assert [r.shard for r in shards] == [0, 1]
    for shard in shards:
        slots = [r for r in records if r.name.startswith("adam") and (
            r.name.endswith(f"part_{shard.shard}_momentum")
            or r.name.endswith(f"part_{shard.shard}_velocity"))]
        assert len(slots) == 2, records  # momentum and velocity
        assert {s.ps_task for s in slots} == {shard.ps_task}
        assert all(s.shape == shard.shape for s in slots)
    assert by_name[shards[0].name].variable == shards[0].name.rsplit("/part_", 1)[0]


def test_placement_report_lists_every_shard_and_prints_a_table(strategy):
    with strategy.scope():
        layer = keras.layers.Embedding(8, 2, name="items")
        layer.build((None,))
    report = strategy.placement_report()
    records = [r for r in report if r.variable.endswith("items/embeddings")]
    assert [(r.shape, r.bytes) for r in records] == [((4, 2), 32), ((4, 2), 32)]
    assert sorted(r.ps_task for r in records) == [0, 1]
    text = str(report)
    assert text.splitlines()[0].split() == ["name", "shape", "dtype", "bytes", "ps_task"]
    assert "items/embeddings/part_1" in text
    assert text.splitlines()[-1].startswith("bytes per ps task: ps0=")
    assert report.to_dicts()[0].keys() == {"name", "variable", "shard", "shape", "dtype",
                                           "bytes", "ps_task"}


def test_keras_outside_a_kerasps_scope_is_unchanged(strategy):
    # kerasps hooks are installed (a strategy exists); plain Keras must not notice.
    variable = keras.Variable(np.ones((100, 2), "float32"))
    assert type(variable) is keras.Variable
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert not hasattr(model, "_kerasps_functions")
    assert model.distribute_strategy is tf.distribute.get_strategy()


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_workers=3), r"`min_workers`.*declared workers \(2\).*Received: min_workers=3"),
    (dict(min_workers_timeout=-1), r"`min_workers_timeout`.*Received: timeout=-1"),
])
def test_bad_worker_pool_bounds_are_refused_before_connecting(make_strategy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_strategy(**kwargs)


def test_min_workers_defaults_to_the_launchers_setting(make_strategy, monkeypatch):
    monkeypatch.setenv("KERASPS_MIN_WORKERS", "2")
    assert make_strategy().pool.min_workers == 2
    monkeypatch.delenv("KERASPS_MIN_WORKERS")
    assert make_strategy().pool == kerasps.membership.PoolSpec(max_workers=2)


VARIABLES_BEFORE_THE_STRATEGY = """
import warnings
import keras, numpy as np, tensorflow as tf, kerasps

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=1, num_ps=1))
print("WARNING", *[str(w.message) for w in caught if "created before" in str(w.message)])
for use in (model.get_weights, lambda: model.weights[0] + 1,
            lambda: model.predict(np.zeros((2, 3)), verbose=0)):
    try:
        use()
        print("USABLE")
    except RuntimeError as error:
        print("ERROR", str(error).replace("\\n", " "))
with strategy.scope():
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
print("FRESH", fresh.get_weights()[0].shape)
"""


def test_a_keras_variable_made_before_the_strategy_connects_raises_a_clear_error():
    """Issue 17, defect 5: connecting to the cluster resets TensorFlow's eager context
    (TensorFlow's own strategy does the same), so variables made before it are gone; using
    one raised `InvalidArgumentError: Client for target /job:localhost/... not found`."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", VARIABLES_BEFORE_THE_STRATEGY],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = [line for line in result.stdout.splitlines()
             if line.startswith(("WARNING", "ERROR", "USABLE", "FRESH"))]
    assert result.returncode == 0, result.stderr[-3000:]
    assert lines[0].startswith("WARNING") and "sequential/dense/kernel" in lines[0], lines
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 3, lines
    for line in errors:
        assert "'sequential/dense/" in line and "created before" in line, line
        assert "Create the strategy first" in line, line
    assert lines[-1] == "FRESH (3, 2)"


def test_arguments_keep_the_positions_they_had_before_measure_staleness(cluster):
    # `measure_staleness` came last of all; a call that passes the older arguments by
    # position reaches the same parameters as before it existed.
    strategy = kerasps.ParameterServerStrategy(
        cluster, None, "greedy", "lazy", "sync", 1, None, 30.0, 2, 60.0)
    assert (strategy.sparse_updates, strategy.mode, strategy.backup_workers) == (
        "lazy", "sync", 1)
    assert strategy.step_timeout == 30.0
    assert (strategy.pool.min_workers, strategy.pool.timeout) == (2, 60.0)
    assert strategy.measure_staleness is True
