"""Online training (issue 41): `kerasps.callbacks.PublishDeltas` publishes the rows that
changed, `kerasps.DeltaConsumer` applies them without a cluster.

The trained model has a fixed table (a sharded `Embedding`), a `DynamicEmbedding` small
enough to evict (capacity 32, ids up to 200: admissions and tombstones in most versions)
and dense layers. The consumer's rows are compared with the trainer's bit for bit, at
every version.
"""

import json
import os
import pickle
import shutil
import signal
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.keras import serving
from kerasps.keras.trainer import dispatch
from kerasps.policy import deltas
from tests.launched import run_with_deadline

FIXED, DYNAMIC = "fixed/embeddings", "dynamic/rows"
BATCH = np.stack([np.arange(24) % 64, np.arange(24) * 7 % 200], axis=1).astype("int64")


def build(strategy, optimizer="adagrad", num_partitions=2):
    with strategy.scope():
        ids = keras.Input((2,), dtype="int64")
        fixed = keras.layers.Embedding(64, 4, name="fixed")(ids[:, :1])
        dynamic = kerasps.layers.DynamicEmbedding(
            4, capacity=32 if num_partitions == 2 else 48, num_partitions=num_partitions,
            seed=1, name="dynamic")(ids[:, 1:])
        x = keras.layers.Flatten()(keras.layers.Concatenate()([fixed, dynamic]))
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(x))
        model.compile(optimizer, "mse")
    return model


def dataset_fn(input_context):
    rng = np.random.default_rng(input_context.input_pipeline_id)
    x = np.stack([rng.integers(0, 64, 2048), rng.integers(0, 200, 2048)], axis=1)
    return tf.data.Dataset.from_tensor_slices((x, (x[:, 0] % 2) * 1.0)).repeat().batch(8)


def trainer_state(model):
    """(fixed rows, dynamic keys sorted, their rows, dense weights) of the trainer."""
    layer = model.get_layer("dynamic")
    state, rows = layer.state.numpy(), layer.rows.numpy()
    occupied = state[:, 1] >= 0
    keys = state[occupied, 0]
    order = np.argsort(keys, kind="stable")
    head = model.get_layer("head")
    dense = [head.kernel.numpy(), head.bias.numpy()]
    return model.get_layer("fixed").embeddings.numpy(), keys[order], rows[occupied][order], dense


def consumer_state(consumer):
    keys, rows = consumer.items(DYNAMIC)
    weights = consumer.weights()
    return (consumer.rows(FIXED), keys, rows,
            [weights["head/kernel"], weights["head/bias"]])


def assert_same(expected, received, what):
    for name, a, b in zip(("fixed rows", "dynamic keys", "dynamic rows", "dense"),
                          expected, received):
        if name == "dense":
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=f"{what}: {name}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def published(cluster, tmp_path_factory):
    """A base and 50 deltas: a `fit` publishing every 3 steps (6 versions), then a custom
    loop publishing after each step (45 more); the trainer's state at each version from
    the end of the `fit` on (no step runs during those publishes), and its predictions
    of `BATCH` at the end."""
    strategy = kerasps.ParameterServerStrategy(
        cluster, variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    model = build(strategy)
    directory = tmp_path_factory.mktemp("published") / "deltas"
    publisher = kerasps.callbacks.PublishDeltas(directory, every_steps=3)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=6, verbose=0,
              callbacks=[publisher])
    fit_versions = list(publisher.published)
    states = {publisher.version: trainer_state(model)}
    rng = np.random.default_rng(7)
    for _ in range(45):
        x = np.stack([rng.integers(0, 64, 8), rng.integers(0, 200, 8)], axis=1)
        model.train_on_batch(x, (x[:, :1] % 2) * 1.0)
        publisher.publish()
        states[publisher.version] = trainer_state(model)
    return {"directory": directory, "states": states, "fit_versions": fit_versions,
            "versions": publisher.published, "final": trainer_state(model),
            "predictions": model.predict(BATCH, verbose=0)}


def copy_of(published, tmp_path):
    target = tmp_path / "deltas"
    shutil.copytree(published["directory"], target)
    return target


def folder(directory, version):
    return directory / deltas.version_name(version)


# -- exactness ----------------------------------------------------------------------
def test_a_base_and_50_deltas_give_the_trainers_rows_bit_for_bit(published):
    # `fit`: a full version at its start, one every 3 steps, one at its end.
    assert published["fit_versions"] == [(1, "full"), *((v, "delta") for v in range(2, 7))]
    assert [kind for _, kind in published["versions"]] == ["full"] + ["delta"] * 50
    directory = published["directory"]
    consumer = kerasps.DeltaConsumer(directory)
    manifests = [deltas.read_manifest(folder(directory, v)) for v in range(1, 52)]
    for version in range(1, 52):
        assert consumer.apply(folder(directory, version))
        assert consumer.version == version
        if version in published["states"]:
            assert_same(published["states"][version], consumer_state(consumer), f"v{version}")
    assert len(published["states"]) == 46
    # The dynamic table admitted ids after the base (empty at the base) and evicted some.
    dynamic = [next(t for t in m["tables"] if t["name"] == DYNAMIC) for m in manifests]
    assert dynamic[0]["count"] == 0 and len(published["final"][1]) == 32
    assert sum(t.get("tombstones", 0) for t in dynamic) > 0
    # A delta holds the rows of the batch, not the table (a step touches 8 rows of 64).
    fixed = [next(t for t in m["tables"] if t["name"] == FIXED) for m in manifests]
    assert fixed[0]["count"] == 64 and all(0 < t["count"] <= 8 for t in fixed[7:])
    # Its model predicts what the trainer's does.
    np.testing.assert_array_equal(consumer.model.predict(BATCH, verbose=0),
                                  published["predictions"])


def test_a_new_consumer_starts_from_the_latest_full_version(published, tmp_path):
    directory = copy_of(published, tmp_path)
    consumer = kerasps.DeltaConsumer(directory)
    assert consumer.update() == list(range(1, 52))
    assert consumer.update() == []
    assert_same(published["final"], consumer_state(consumer), "final")


@pytest.fixture(scope="module")
def adam_model(cluster):
    strategy = kerasps.ParameterServerStrategy(
        cluster, variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    return build(strategy, optimizer="adam")


def test_a_dense_rule_marks_every_row_and_a_custom_loop_publishes_by_a_call(
        adam_model, tmp_path):
    # Adam's exact update moves every row of the table (fused, on the ps task): each
    # delta holds every row. A publish with nothing changed is a delta of no rows.
    model = adam_model
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    x, y = BATCH[:8], np.ones([8, 1], "float32")
    publisher.publish()
    assert consumer.update() == [1]
    for _ in range(3):
        model.train_on_batch(x, y)
        publisher.publish()
        assert consumer.update() == [publisher.version]
        assert_same(trainer_state(model), consumer_state(consumer), f"v{publisher.version}")
    unchanged = deltas.read_manifest(publisher.publish())
    assert unchanged["kind"] == "delta"
    counts = {t["name"]: t["count"] for t in unchanged["tables"]}
    assert counts == {FIXED: 0, DYNAMIC: 0}
    assert consumer.update() == [publisher.version]
    manifest = deltas.read_manifest(folder(tmp_path / "d", 3))
    assert {t["name"]: t["count"] for t in manifest["tables"]}[FIXED] == 64


def test_full_every_float16_and_a_new_publisher_continue_the_chain(adam_model, tmp_path):
    model, x, y = adam_model, BATCH[8:16], np.zeros([8, 1], "float32")
    first = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    first.publish()
    model.train_on_batch(x, y)
    first.publish()
    # A new publisher (a restarted trainer) continues the numbering with a full version.
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model, full_every=2,
                                                dtype="float16")
    kinds = []
    for _ in range(3):
        model.train_on_batch(x, y)
        kinds.append(deltas.read_manifest(publisher.publish())["kind"])
    assert publisher.published == [(3, "full"), (4, "delta"), (5, "full")]
    assert kinds == ["full", "delta", "full"]
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    assert consumer.update() == [5]  # the latest full version
    fixed = model.get_layer("fixed").embeddings.numpy()
    np.testing.assert_array_equal(consumer.rows(FIXED), fixed.astype("float16").astype(
        "float32"))
    assert np.load(tmp_path / "d" / "v00000005" / "table_0.rows.npy").dtype == np.float16


def test_ftrls_first_step_moves_every_row_and_publishes_them(make_strategy, tmp_path):
    # Keras' Ftrl moves every row to its closed form at its first step (kerasps runs it
    # dense then), and only the batch's rows after.
    strategy = make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    model = build(strategy, optimizer="ftrl")
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    publisher.publish()
    counts = []
    for _ in range(2):
        model.train_on_batch(BATCH[:8], np.ones([8, 1], "float32"))
        manifest = deltas.read_manifest(publisher.publish())
        counts.append({t["name"]: t["count"] for t in manifest["tables"]}[FIXED])
        consumer.update()
        assert_same(trainer_state(model), consumer_state(consumer), f"v{publisher.version}")
    assert counts == [64, 8]


@pytest.mark.parametrize("optimizer, sparse_updates, counts", [
    ("adagrad", "exact", [8, 4]),  # the rows of each batch's distinct ids
    ("adagrad", "lazy", [8, 4]),
    ("adam", "exact", [64, 64]),  # Keras' Adam moves every row (its momentum)
])
def test_an_unsharded_table_publishes_its_changed_rows_not_the_whole_table(
        make_strategy, optimizer, sparse_updates, counts, tmp_path):
    # The strategy's default: no partitioner, each table whole on one ps task. Its rows
    # are tracked and published like a sharded table's (before: written whole in every
    # version); its update stays Keras' own, bit for bit, in either mode.
    strategy = make_strategy(sparse_updates=sparse_updates)
    model, untracked = build(strategy, optimizer), build(strategy, optimizer)
    untracked.set_weights(model.get_weights())
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    assert not isinstance(model.get_layer("fixed").embeddings,
                          kerasps.ShardedVariable)
    publisher.publish()
    published = []
    for x in (BATCH[:8], BATCH[8:12]):
        for trained in (model, untracked):
            trained.train_on_batch(x, np.ones([len(x), 1], "float32"))
        manifest = deltas.read_manifest(publisher.publish())
        published.append({t["name"]: t["count"] for t in manifest["tables"]}.get(FIXED))
        consumer.update()
        assert_same(trainer_state(model), consumer_state(consumer), f"v{publisher.version}")
    assert published == counts
    np.testing.assert_array_equal(model.get_layer("fixed").embeddings.numpy(),
                                  untracked.get_layer("fixed").embeddings.numpy())


def test_a_model_of_no_kerasps_strategy_publishes_its_tables_whole(tmp_path):
    # Nothing flags rows outside a kerasps strategy: its tables are dense weights.
    ids = keras.Input((1,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(
        keras.layers.Embedding(10, 2, name="table")(ids))))
    model.compile("sgd", "mse")
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    publisher.publish()
    model.train_on_batch(np.array([[3]]), np.ones([1, 1]))
    manifest = deltas.read_manifest(publisher.publish())
    assert manifest["tables"] == []
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    consumer.update()
    np.testing.assert_array_equal(consumer.weights()["table/embeddings"],
                                  model.get_layer("table").embeddings.numpy())


# -- faults ---------------------------------------------------------------------------
def test_a_gap_is_refused_naming_the_version_expected(published, tmp_path):
    directory = copy_of(published, tmp_path)
    consumer = kerasps.DeltaConsumer(directory)
    for version in range(1, 8):
        consumer.apply(folder(directory, version))
    shutil.rmtree(folder(directory, 8))
    with pytest.raises(ValueError, match=r"expected version 8 .*Received: version 9, a delta "
                                         r"of version 8"):
        consumer.update()
    assert consumer.version == 7
    assert_same(published["states"][7], consumer_state(consumer), "after the gap")


def test_a_repeated_version_is_done(published, tmp_path):
    directory = published["directory"]
    consumer = kerasps.DeltaConsumer(directory)
    for version in range(1, 8):
        assert consumer.apply(folder(directory, version))
    assert not consumer.apply(folder(directory, 7))
    assert not consumer.apply(folder(directory, 1))
    assert consumer.version == 7
    assert_same(published["states"][7], consumer_state(consumer), "repeated")


def test_a_corrupted_file_is_refused_and_nothing_changes(published, tmp_path):
    directory = copy_of(published, tmp_path)
    consumer = kerasps.DeltaConsumer(directory)
    for version in range(1, 8):
        consumer.apply(folder(directory, version))
    damaged = folder(directory, 8) / "table_1.rows.npy"
    good = damaged.read_bytes()
    damaged.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"Bad checksum of .*table_1\.rows\.npy.*expected "
                                         r"sha256 [0-9a-f]{64}\. Received: sha256 [0-9a-f]{64}"):
        consumer.update()
    assert consumer.version == 7
    assert_same(published["states"][7], consumer_state(consumer), "after the refusal")
    damaged.write_bytes(good)
    consumer.update()
    assert_same(published["final"], consumer_state(consumer), "final")


def test_a_consumer_stopped_mid_apply_applies_the_version_again(published, monkeypatch):
    directory = published["directory"]
    consumer = kerasps.DeltaConsumer(directory)
    consumer.apply(folder(directory, 1))
    apply = serving._Dynamic.apply

    def stopped(self, *args):  # the fixed table is applied, the dynamic one half
        apply(self, *args)
        raise KeyboardInterrupt("stopped mid-apply")

    monkeypatch.setattr(serving._Dynamic, "apply", stopped)
    with pytest.raises(KeyboardInterrupt):
        consumer.apply(folder(directory, 2))
    monkeypatch.undo()
    assert consumer.version == 1
    assert consumer.update() == list(range(2, 52))
    assert_same(published["final"], consumer_state(consumer), "final")
    np.testing.assert_array_equal(consumer.model.predict(BATCH, verbose=0),
                                  published["predictions"])


def test_a_partial_version_is_never_visible(tmp_path):
    with pytest.raises(RuntimeError):
        with deltas.VersionWriter(tmp_path, 1, None, deltas.FULL) as writer:
            with open(writer.path("dense.npz"), "wb") as file:
                file.write(b"half")
            raise RuntimeError("killed mid-publish")
    assert os.listdir(tmp_path) == []
    # A publisher killed outright leaves its temporary folder: no version to a reader,
    # removed by the next publisher.
    (tmp_path / f"{deltas.TEMPORARY_PREFIX}v00000001-x").mkdir()
    assert deltas.versions(tmp_path) == []
    assert deltas.remove_temporaries(tmp_path) == [f"{deltas.TEMPORARY_PREFIX}v00000001-x"]


@pytest.mark.parametrize("every", [{"every_steps": 3}, {"every_seconds": 0.001}, {}])
def test_a_publishing_fit_reads_no_batch_logs_for_the_publisher(every, tmp_path):
    # A hook on a batch's end makes `fit` read the metrics' results on the ps tasks a few
    # times a second (5.6% of a fit's steps/s publishing every 30 s, issue 41); a publisher
    # reads no logs, so it needs none.
    publisher = kerasps.callbacks.PublishDeltas(tmp_path, **every)
    assert not dispatch.reads_batch_logs(keras.callbacks.CallbackList([publisher]))
    assert dispatch.reads_batch_logs(keras.callbacks.CallbackList([
        publisher, keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: 0)]))


def test_arguments_are_checked_keras_style(tmp_path):
    with pytest.raises(ValueError, match=r"`every_steps`.*Received: every_steps=0"):
        kerasps.callbacks.PublishDeltas(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match=r"`dtype`.*Received: dtype='int8'"):
        kerasps.callbacks.PublishDeltas(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="no model"):
        kerasps.callbacks.PublishDeltas(tmp_path).publish()
    consumer = kerasps.DeltaConsumer(tmp_path)
    assert consumer.update() == []
    (tmp_path / "v00000002").mkdir()
    (tmp_path / "v00000002" / "manifest.json").write_text(json.dumps({
        "format": deltas.FORMAT, "version": 2, "applies_to": 1, "kind": "delta",
        "files": {}}))
    with pytest.raises(ValueError, match="No full version .* to start from"):
        consumer.update()


@pytest.mark.slow
def test_a_consumer_process_killed_mid_apply_leaves_the_versions_whole(published, tmp_path):
    directory = copy_of(published, tmp_path)
    before = {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    program = textwrap.dedent(f"""
        import os, signal, sys
        import kerasps
        from kerasps.keras import serving
        apply = serving._Dynamic.apply
        def killed(self, *args):
            apply(self, *args)
            if consumer_version[0] == 9:  # applying version 10: the dynamic table done
                os.kill(os.getpid(), signal.SIGKILL)
        consumer_version = [None]
        serving._Dynamic.apply = killed
        consumer = kerasps.DeltaConsumer({str(directory)!r})
        for v in range(1, 52):
            consumer_version[0] = consumer.version
            consumer.apply(os.path.join({str(directory)!r}, "v%08d" % v))
        print("not killed")
    """)
    done = run_with_deadline(program, deadline=240, cwd=os.getcwd(),
                             what="a consumer killed mid-apply")
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before
    consumer = kerasps.DeltaConsumer(directory)
    assert consumer.update() == list(range(1, 52))
    assert_same(published["final"], consumer_state(consumer), "final")


def test_a_restored_backup_makes_the_next_version_full(make_strategy, tmp_path):
    # kerasps' ps recovery puts every variable back to the backup, on the tasks that
    # survived too: rows the consumer received since are newer than the trainer's, and
    # no flag says which. (The same with a ps task SIGKILLed mid-publish under `kerasps
    # launch`: tests/test_online_faults.py.)
    from kerasps.keras.trainer import recovery
    from kerasps.policy.failures import Progress

    strategy = make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    model = build(strategy)
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    callback = keras.callbacks.BackupAndRestore(tmp_path / "backup")
    callback.set_model(model)
    backup = recovery.Backup(callback)
    y = np.ones([8, 1], "float32")
    model.train_on_batch(BATCH[:8], y)
    publisher.publish()
    with backup.recording(lambda: Progress(0, 1)):
        backup.save()
    for start in (8, 16):  # rows the backup does not hold
        model.train_on_batch(BATCH[start:start + 8], y)
        publisher.publish()
    assert consumer.update() == [1, 2, 3]
    assert recovery.restore_lost_state(model, backup, []) == Progress(0, 1)
    model.train_on_batch(BATCH[:8], y)
    assert deltas.read_manifest(publisher.publish())["kind"] == "full"
    assert publisher.published == [(1, "full"), (2, "delta"), (3, "delta"), (4, "full")]
    assert consumer.update() == [4]
    assert_same(trainer_state(model), consumer_state(consumer), "after the restore")
    model.train_on_batch(BATCH[8:16], y)
    assert deltas.read_manifest(publisher.publish())["kind"] == "delta"
    consumer.update()
    assert_same(trainer_state(model), consumer_state(consumer), "a delta after it")


# Runs in a process of its own: in-process clusters of 1 and 3 ps tasks (the session's
# has 2), the table in 3 shards (64 rows: 22, 21, 21; 32 and 32 on the session's). A
# trainer restored from argv[1]'s checkpoint onto 1 ps task publishes to
# argv[2] (a new publisher on the directory: a full version, then deltas), saves its
# checkpoint; one restored from that onto 3 ps tasks does the same. The trainer's state
# at each version goes to argv[1]/states.pkl.
OTHER_SHAPES = """
import pickle, sys
import numpy as np, kerasps
sys.path.insert(0, sys.argv[3])
from tests.test_online import BATCH, build, trainer_state

checkpoint, directory, states = sys.argv[1] + "/2.weights.h5", sys.argv[2], {}
y = np.ones([8, 1], "float32")
for num_ps in (1, 3):
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=1, num_ps=num_ps),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3))
    model = build(strategy, num_partitions=6)
    model.load_weights(checkpoint)
    publisher = kerasps.callbacks.PublishDeltas(directory, model=model)
    publisher.publish()
    states[publisher.version] = (num_ps, trainer_state(model))
    for start in (0, 8, 16):
        model.train_on_batch(BATCH[start:start + 8], y)
        publisher.publish()
        states[publisher.version] = (num_ps, trainer_state(model))
    checkpoint = f"{sys.argv[1]}/{num_ps}.weights.h5"
    model.save_weights(checkpoint)
    print(num_ps, "ps:", model.get_layer("fixed").embeddings.num_shards, "shards", flush=True)
pickle.dump(states, open(sys.argv[1] + "/states.pkl", "wb"))
"""


@pytest.mark.slow  # the default run's longest: two more processes with 1 and 3 ps tasks: ~30 s
def test_a_consumer_goes_on_with_trainers_restored_onto_1_and_3_ps_tasks(strategy, tmp_path):
    # Ids are global (a shard's offset + its row; a dynamic table's keys), so versions of
    # trainers with other numbers of ps tasks apply to one copy of the tables.
    model = build(strategy, num_partitions=6)
    directory = tmp_path / "deltas"
    publisher = kerasps.callbacks.PublishDeltas(directory, model=model)
    consumer = kerasps.DeltaConsumer(directory)
    publisher.publish()
    y = np.ones([8, 1], "float32")
    for start in (8, 16):
        model.train_on_batch(BATCH[start:start + 8], y)
        publisher.publish()
    assert consumer.update() == [1, 2, 3]
    assert_same(trainer_state(model), consumer_state(consumer), "2 ps tasks")
    model.save_weights(tmp_path / "2.weights.h5")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = run_with_deadline(OTHER_SHAPES, str(tmp_path), str(directory), root,
                             deadline=240, cwd=root, what="trainers on 1 and 3 ps tasks")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 ps: 3 shards" in done.stdout and "3 ps: 3 shards" in done.stdout, done.stdout
    states = pickle.load(open(tmp_path / "states.pkl", "rb"))
    assert sorted(states) == list(range(4, 12))
    for version in range(4, 12):
        assert consumer.apply(folder(directory, version))
        num_ps, state = states[version]
        kind = deltas.read_manifest(folder(directory, version))["kind"]
        assert kind == ("full" if version in (4, 8) else "delta"), version
        assert_same(state, consumer_state(consumer), f"v{version} ({num_ps} ps, {kind})")


def dynamic_items(layer):
    """A `DynamicEmbedding`'s (keys, rows), sorted by key."""
    state, rows = layer.state.numpy(), layer.rows.numpy()
    occupied = state[:, 1] >= 0
    order = np.argsort(state[occupied, 0], kind="stable")
    return state[occupied, 0][order], rows[occupied][order]


def test_keras_rs_tables_publish_their_changed_rows(strategy, tmp_path):
    # A keras-rs `DistributedEmbedding`: a fixed table (its `EmbedReduce` is an
    # `Embedding`) and two dynamic tables (`DynamicTableConfig`, empty at the base: ids
    # admitted in the deltas), each trained by its own optimizer on the ps tasks as row
    # updates; the consumer builds keras-rs' own layer from the config.
    pytest.importorskip("keras_rs")
    from tests import test_keras_rs as rs

    with strategy.scope():
        model = rs.build(rs.dynamic_configs(), dtype="int64")
    publisher = kerasps.callbacks.PublishDeltas(tmp_path / "d", model=model)
    consumer = kerasps.DeltaConsumer(tmp_path / "d")
    base = deltas.read_manifest(publisher.publish())
    assert {t["name"].split("/")[1]: t["count"] for t in base["tables"]} == {
        "users": 12, "items": 0, "frozen": 0}
    assert consumer.update() == [1]
    batches = iter(rs.dynamic_batches())
    for _ in range(2):
        features, labels = next(batches)
        model.train_on_batch(features, labels)
        manifest = deltas.read_manifest(publisher.publish())
        counts = {t["name"].split("/")[1]: t["count"] for t in manifest["tables"]}
        assert counts["users"] <= 8  # the batch's rows, not the table's 12
        assert consumer.update() == [publisher.version]
        for name in ("items", "frozen"):
            layer = rs.dynamic_layer(model, name)
            for a, b in zip(consumer.items(layer.rows.path), dynamic_items(layer)):
                np.testing.assert_array_equal(a, b, err_msg=f"v{publisher.version} {name}")
        np.testing.assert_array_equal(consumer.rows("embedding/users/embeddings"),
                                      rs.table(model, "users"))
        for a, b in zip(consumer.weights().values(), rs.dense_weights(model)):
            np.testing.assert_array_equal(a, b)
    assert counts["items"] > 0 and len(dynamic_items(rs.dynamic_layer(model, "items"))[0]) == 32
    np.testing.assert_array_equal(consumer.model.predict(features, verbose=0),
                                  model.predict(features, verbose=0))
