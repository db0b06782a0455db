"""keras-rs' `DistributedEmbedding` under kerasps: tables sharded on the ps tasks, each
trained by its `TableConfig.optimizer` as row updates, saved whole, exported without
kerasps."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.keras.layers import rs_tables
from kerasps.keras.trainer import recovery
from kerasps.params.variables import logical_variables

keras_rs = pytest.importorskip("keras_rs")  # in the `test` extra: skipped only without it

ROWS = 12
DIM = 3
# Distinct ids within a batch, different rows from batch to batch (some never touched).
BATCHES = [
    ({"item": np.array([0, 5, 3, 8], "int32"), "user": np.array([1, 2, 3, 4], "int32")},
     np.array([[1.0], [0.0], [0.5], [2.0]], "float32")),
    ({"item": np.array([2, 5, 9, 7], "int32"), "user": np.array([0, 2, 5, 6], "int32")},
     np.array([[0.2], [1.5], [-1.0], [0.3]], "float32")),
    ({"item": np.array([3, 1, 0, 10], "int32"), "user": np.array([7, 1, 3, 0], "int32")},
     np.array([[0.7], [0.1], [1.2], [-0.4]], "float32")),
]
UNTOUCHED_ITEMS = [4, 6, 11]


def two_shards(make_strategy):
    return make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))


def feature_configs(item_optimizer, user_optimizer="sgd", placement="auto"):
    items = keras_rs.layers.TableConfig(
        name="items", vocabulary_size=ROWS, embedding_dim=DIM, optimizer=item_optimizer,
        combiner="sum", placement=placement)
    users = keras_rs.layers.TableConfig(
        name="users", vocabulary_size=ROWS, embedding_dim=DIM, optimizer=user_optimizer,
        placement=placement)
    return {
        "item": keras_rs.layers.FeatureConfig(name="item", table=items, input_shape=(None,),
                                              output_shape=(None, DIM)),
        "user": keras_rs.layers.FeatureConfig(name="user", table=users, input_shape=(None,),
                                              output_shape=(None, DIM)),
    }


def build(configs, optimizer=None):
    """A keras-rs model: two tables, their lookups concatenated, one dense layer."""
    embedding = keras_rs.layers.DistributedEmbedding(configs, name="embedding")
    inputs = {name: keras.Input(shape=config.input_shape[1:], dtype="int32", name=name,
                                ragged=None in config.input_shape[1:])
              for name, config in configs.items()}
    outputs = embedding(inputs)
    merged = keras.layers.Concatenate(name="concat")([outputs[name] for name in sorted(outputs)])
    model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(merged), name="model")
    model.compile(optimizer or keras.optimizers.SGD(0.1), "mse")
    return model


def table(model, name):
    """A table's whole value, from its layer."""
    return model.get_layer("embedding").get_embedding_tables()[name].numpy()


def dense_weights(model):
    return [np.asarray(w) for w in model.get_layer("dense").get_weights()]


def local_copy(model, configs):
    """A single-process keras-rs model with `model`'s weights: keras-rs' own CPU path."""
    reference = build(configs)
    reference.set_weights(model.get_weights())
    return reference


# -- the tables' own optimizers --------------------------------------------------------------

def test_a_table_trains_with_its_own_optimizer_as_row_updates_on_its_ps_tasks(make_strategy):
    strategy = two_shards(make_strategy)
    with strategy.scope():
        model = build(feature_configs(keras.optimizers.SGD(0.0), keras.optimizers.Adagrad(0.5)),
                      keras.optimizers.Adam(0.05))
    layer = model.get_layer("embedding")
    items = layer._kerasps_tables.by_name["items"].layer.embeddings
    assert isinstance(items, kerasps.ShardedVariable) and items.num_shards == 2
    optimizers = rs_tables.table_optimizers(layer)
    assert [type(optimizers[name]).__name__ for name in ("items", "users")] == ["SGD", "Adagrad"]
    # The tables' slots sit next to their shards; the model's optimizer holds none of them.
    report = {r.name: r.ps_task for r in strategy.placement_report()}
    for i, shard in enumerate(layer._kerasps_tables.by_name["users"].layer.embeddings.shards):
        slot = f"{optimizers['users'].name}/embedding_users_embeddings_part_{i}_accumulator"
        assert report[slot] == report[shard.path]
    before_items, before_users = table(model, "items"), table(model, "users")
    before_dense = dense_weights(model)

    for features, labels in BATCHES:
        model.train_on_batch(features, labels)

    # The items table's learning rate is 0: it did not move, while the dense layer did.
    np.testing.assert_array_equal(table(model, "items"), before_items)
    assert all(np.abs(a - b).max() > 1e-4 for a, b in zip(dense_weights(model), before_dense))
    users = table(model, "users")
    touched = sorted({int(u) for features, _ in BATCHES for u in features["user"]})
    untouched = sorted(set(range(ROWS)) - set(touched))
    assert np.abs(users[touched] - before_users[touched]).min(axis=1).min() > 0
    np.testing.assert_array_equal(users[untouched], before_users[untouched])
    assert [int(optimizers[n].iterations.numpy()) for n in ("items", "users")] == [3, 3]
    assert int(model.optimizer.iterations.numpy()) == 3
    assert not [v.path for v in model.optimizer.variables if "embeddings" in v.path]


def _sum_rows(gradient):
    """A local tape's gradient of a table, as the summed update of each row."""
    dense = tf.math.unsorted_segment_sum(gradient.values, gradient.indices, ROWS).numpy()
    touched = np.zeros(ROWS, bool)
    touched[np.asarray(gradient.indices)] = True
    return dense, touched


def train_local_reference(model, batches, rule):
    """One process, keras-rs' own layer: the dense layer trained by an SGD like the kerasps
    model's, the items table by `rule(step, rows, gradient_rows, touched)` (numpy, in place),
    the users table by plain SGD(0.1)."""
    dense_optimizer = keras.optimizers.SGD(0.1)
    variables = {v.path: v for v in model.trainable_variables}
    items, users = variables["embedding/items/embeddings"], variables["embedding/users/embeddings"]
    others = [v for v in model.trainable_variables if v is not items and v is not users]
    for step, (features, labels) in enumerate(batches):
        with tf.GradientTape() as tape:
            predicted = model(features, training=True)
            loss = model.compute_loss(features, labels, predicted)
        gradients = dict(zip([v.path for v in model.trainable_variables],
                             tape.gradient(loss, model.trainable_variables)))
        dense_optimizer.apply([gradients[v.path] for v in others], others)
        rows = items.numpy()
        rule(step, rows, *_sum_rows(gradients[items.path]))
        items.assign(rows)
        user_rows, touched = _sum_rows(gradients[users.path])
        users.assign(users.numpy() - np.float32(0.1) * user_rows)


SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)


def sgd_rule(step, rows, gradient, touched):
    learning_rate = np.float32(SCHEDULE(step))
    rows[touched] = rows[touched] - learning_rate * gradient[touched]


def lazy_adam_rule(slots, learning_rate=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Adam on the rows of the batch only (TPU embedding's `lazy_adam`, keras' formula)."""
    m, v = slots

    def rule(step, rows, gradient, touched):
        t = step + 1
        alpha = learning_rate * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
        g = gradient[touched].astype(np.float64)
        m[touched] += (g - m[touched]) * (1 - beta_1)
        v[touched] += (g * g - v[touched]) * (1 - beta_2)
        rows[touched] = rows[touched] - m[touched] * alpha / (np.sqrt(v[touched]) + epsilon)

    return rule


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_table_rows_match_a_local_reference_of_their_optimizers_rule(make_strategy, name):
    """SGD (with a learning-rate schedule) exactly; lazy Adam to rounding."""
    make = {"sgd": lambda: keras.optimizers.SGD(SCHEDULE),
            "adam": lambda: keras.optimizers.Adam(0.1)}[name]
    strategy = two_shards(make_strategy)
    with strategy.scope():
        model = build(feature_configs(make(), keras.optimizers.SGD(0.1)))
    reference = local_copy(model, feature_configs(make()))
    untouched_before = table(model, "items")[UNTOUCHED_ITEMS]

    for features, labels in BATCHES:
        model.train_on_batch(features, labels)
    slots = (np.zeros((ROWS, DIM)), np.zeros((ROWS, DIM)))
    train_local_reference(reference, BATCHES,
                          sgd_rule if name == "sgd" else lazy_adam_rule(slots))

    if name == "sgd":
        np.testing.assert_array_equal(table(model, "items"), table(reference, "items"))
    else:
        # float32 on the ps against float64 here: a step of 0.1 rounds to ~1e-6.
        np.testing.assert_allclose(table(model, "items"), table(reference, "items"),
                                   rtol=1e-5, atol=1e-5)
        adam = rs_tables.table_optimizers(model.get_layer("embedding"))["items"]
        whole = {v.path: v.numpy() for v in logical_variables(adam.variables)}
        # Lazy: the slots of rows no batch touched are still zero.
        momentum = whole[f"{adam.name}/embedding_items_embeddings_momentum"]
        np.testing.assert_allclose(momentum, slots[0], rtol=1e-5, atol=1e-7)
        assert not momentum[UNTOUCHED_ITEMS].any()
    np.testing.assert_array_equal(table(model, "items")[UNTOUCHED_ITEMS], untouched_before)
    # The other variables see the items' rows: as exact as they are.
    tolerance = {"rtol": 0, "atol": 0} if name == "sgd" else {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(table(model, "users"), table(reference, "users"), **tolerance)
    for actual, expected in zip(dense_weights(model), dense_weights(reference)):
        np.testing.assert_allclose(actual, expected, **tolerance)


# -- features as keras-rs declares them ------------------------------------------------------

def varied_configs(placement="auto"):
    """Multi-valued (dense and ragged) features, the three combiners, a shared table."""
    words = keras_rs.layers.TableConfig(name="words", vocabulary_size=ROWS, embedding_dim=DIM,
                                        optimizer=keras.optimizers.Adagrad(0.5),
                                        combiner="sqrtn", placement=placement)
    tags = keras_rs.layers.TableConfig(name="tags", vocabulary_size=ROWS, embedding_dim=DIM,
                                       optimizer="ftrl", combiner="mean", placement=placement)
    items = keras_rs.layers.TableConfig(name="items", vocabulary_size=ROWS, embedding_dim=DIM,
                                        optimizer="adam", combiner="sum", placement=placement)
    feature = keras_rs.layers.FeatureConfig
    return {
        "words": feature(name="words", table=words, input_shape=(None, None),
                         output_shape=(None, DIM)),
        "tags": feature(name="tags", table=tags, input_shape=(None, 3), output_shape=(None, DIM)),
        "item": feature(name="item", table=items, input_shape=(None,), output_shape=(None, DIM)),
        "basket": feature(name="basket", table=items, input_shape=(None, 2),
                          output_shape=(None, DIM)),
    }


VARIED = {
    "words": tf.ragged.constant([[1, 2, 3], [4], [5, 5], [2, 9, 1, 1]], dtype=tf.int32),
    "tags": np.array([[1, 2, 3], [0, 0, 9], [4, 5, 6], [3, 3, 3]], "int32"),
    "item": np.array([7, 8, 1, 0], "int32"),
    "basket": np.array([[1, 2], [2, 2], [0, 3], [8, 1]], "int32"),
}
VARIED_LABELS = np.array([[1.0], [0.0], [0.5], [2.0]], "float32")


def test_multi_valued_ragged_and_shared_features_look_up_and_train_as_keras_rs_does(
        make_strategy):
    strategy = two_shards(make_strategy)
    with strategy.scope():
        model = build(varied_configs(placement="sparsecore"))  # a model written for TPUs
    layer = model.get_layer("embedding")
    # One variable per table, the shared one too.
    assert sorted(layer._kerasps_tables.by_name) == ["items", "tags", "words"]
    assert sorted(v.path for v in logical_variables(layer.weights)) == [
        "embedding/items/embeddings", "embedding/tags/embeddings", "embedding/words/embeddings"]
    reference = local_copy(model, varied_configs())
    np.testing.assert_allclose(model.predict(VARIED, verbose=0),
                               reference.predict(VARIED, verbose=0), rtol=1e-6, atol=1e-6)
    before = {name: table(model, name) for name in ("items", "tags", "words")}

    def dataset_fn(context):
        return tf.data.Dataset.from_tensors((VARIED, VARIED_LABELS)).repeat()

    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=2, verbose=0)

    for name, feature_names in {"items": ("item", "basket"), "tags": ("tags",),
                                "words": ("words",)}.items():
        ids = set()
        for feature in feature_names:
            value = VARIED[feature]
            ids |= {int(i) for i in np.ravel(value.flat_values if hasattr(value, "flat_values")
                                             else value)}
        moved = np.abs(table(model, name) - before[name]).max(axis=1) > 0
        assert sorted(np.flatnonzero(moved)) == sorted(ids), name
    assert int(rs_tables.table_optimizers(layer)["items"].iterations.numpy()) == 2


# -- saved state -----------------------------------------------------------------------------

def whole_table_state(model):
    """Each table and each of its optimizer's variables, whole, by path."""
    layer = model.get_layer("embedding")
    state = {name: table(model, name) for name in ("items", "users")}
    for name, optimizer in rs_tables.table_optimizers(layer).items():
        for variable in logical_variables(optimizer.variables):
            state[f"{name}:{variable.path.split('/', 1)[1]}"] = np.asarray(variable.numpy())
    return state


def test_tables_and_their_optimizers_restore_into_another_number_of_shards(
        make_strategy, tmp_path):
    """`.weights.h5`: what `ModelCheckpoint(save_weights_only=True)` and `BackupAndRestore`
    write. (keras-rs' CPU layer keeps its tables in a dict, which `tf.train.Checkpoint`
    does not follow, with or without kerasps.)"""
    def configs():
        return feature_configs(keras.optimizers.Adam(0.1), keras.optimizers.Adagrad(0.5))

    with two_shards(make_strategy).scope():
        source = build(configs())
    for features, labels in BATCHES[:2]:
        source.train_on_batch(features, labels)
    path = str(tmp_path / "model.weights.h5")
    source.save_weights(path)
    with make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3)
                       ).scope():
        target = build(configs())
    target_items = target.get_layer("embedding")._kerasps_tables.by_name["items"].layer
    assert target_items.embeddings.num_shards == 3

    target.load_weights(path)

    expected, actual = whole_table_state(source), whole_table_state(target)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)
    # Training goes on alike.
    source.train_on_batch(*BATCHES[2])
    target.train_on_batch(*BATCHES[2])
    for key, value in whole_table_state(source).items():
        np.testing.assert_allclose(whole_table_state(target)[key], value, rtol=1e-6, atol=1e-7,
                                   err_msg=key)
    # keras-rs alone (one process, no kerasps state) loads the tables from the same file.
    local = build(configs())
    local.load_weights(path)
    assert not any(getattr(layer, "_kerasps_tables", None) for layer in local.layers)
    for name in ("items", "users"):
        np.testing.assert_array_equal(table(local, name), expected[name])


SERVE = r"""
import sys

import numpy as np
import tensorflow as tf

exported = tf.saved_model.load(sys.argv[1])
features = dict(np.load(sys.argv[2]))
served = exported.serve(features).numpy()
assert not [m for m in sys.modules if m.startswith(("kerasps", "keras_rs"))]
np.save(sys.argv[3], served)
"""


def test_export_serves_without_kerasps_and_keras_rs(make_strategy, tmp_path):
    with two_shards(make_strategy).scope():
        model = build(feature_configs("adagrad", keras.optimizers.SGD(0.5)))
    for features, labels in BATCHES:
        model.train_on_batch(features, labels)
    features = {name: np.concatenate([f[name] for f, _ in BATCHES]) for name in ("item", "user")}
    expected = model.predict(features, verbose=0)
    model.export(str(tmp_path / "saved_model"), verbose=False)
    np.savez(tmp_path / "features.npz", **features)
    # A clean interpreter that imports neither kerasps nor keras-rs, outside any strategy.
    result = subprocess.run(
        [sys.executable, "-c", SERVE, str(tmp_path / "saved_model"),
         str(tmp_path / "features.npz"), str(tmp_path / "served.npy")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"), expected, rtol=1e-6, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer,message", [
    (lambda: keras.optimizers.RMSprop(0.1), "keras-rs trains tables with `SGD`, `Adagrad`"),
    (lambda: "rmsprop", "keras-rs names a table's optimizer"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "without `momentum`"),
    (lambda: keras.optimizers.Adam(amsgrad=True), "without `amsgrad`"),
    (lambda: keras.optimizers.Adagrad(clipnorm=1.0), "without `clipnorm`"),
])
def test_an_optimizer_keras_rs_does_not_train_tables_with_raises(strategy, optimizer, message):
    made = optimizer()
    with strategy.scope(), pytest.raises(ValueError) as raised:
        keras_rs.layers.DistributedEmbedding(feature_configs(made))
    text = str(raised.value)
    assert text.startswith("Invalid value for argument `optimizer` of table 'items'")
    assert message in text and "Received: optimizer=" in text


def test_a_feature_naming_no_table_or_two_tables_of_one_name_raise(strategy):
    configs = feature_configs("sgd")
    configs["item"].table = "items"
    with strategy.scope(), pytest.raises(ValueError, match=(
            r"Invalid value for argument `table` of feature 'item': it names no table.*"
            r"Received: table='items'")):
        keras_rs.layers.DistributedEmbedding(configs)
    configs = feature_configs("sgd")
    configs["user"].table.name = "items"
    with strategy.scope(), pytest.raises(ValueError, match="two different tables are named"):
        keras_rs.layers.DistributedEmbedding(configs)


def test_ids_outside_their_table_raise_naming_the_feature_and_the_ids(strategy):
    with strategy.scope():
        model = build(feature_configs("sgd"))
    features = {"item": np.array([0, ROWS, 3, -1], "int32"),
                "user": np.array([1, 2, 3, 4], "int32")}
    before = table(model, "items")
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        model.train_on_batch(features, BATCHES[0][1])
    text = str(raised.value)
    assert ("Invalid value for argument `inputs`: the ids of feature `item` look up table "
            f"`items` of vocabulary_size={ROWS}, so each must lie in [0, {ROWS})") in text
    assert f"Received: ids outside it:] [{ROWS} -1]" in text
    np.testing.assert_array_equal(table(model, "items"), before)


def test_outside_a_kerasps_scope_keras_rs_is_its_own():
    layer = keras_rs.layers.DistributedEmbedding(feature_configs(keras.optimizers.RMSprop()))
    assert getattr(layer, "_kerasps_tables", None) is None
    with pytest.raises(ValueError, match="made under a kerasps strategy's scope"):
        rs_tables.table_optimizers(layer)


def test_ps_recovery_renews_and_restores_the_tables_optimizers_too(strategy):
    with strategy.scope():
        model = build(feature_configs(keras.optimizers.Adam(0.1), "adagrad"))
    state = {id(v) for v in recovery._state_variables(model)}
    for optimizer in rs_tables.table_optimizers(model.get_layer("embedding")).values():
        assert optimizer.variables and all(id(v) in state for v in optimizer.variables)


def test_a_custom_loop_hands_each_table_to_its_optimizer(strategy):
    with strategy.scope():
        model = build(feature_configs(keras.optimizers.SGD(0.0), "sgd"))
        optimizer = keras.optimizers.SGD(0.1)
    coordinator = kerasps.ClusterCoordinator(strategy)
    features, labels = BATCHES[0]
    before = table(model, "items")

    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features, training=True) - labels) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))

        strategy.run(replica_fn)

    coordinator.schedule(step)
    coordinator.join()
    np.testing.assert_array_equal(table(model, "items"), before)
    assert not [v.path for v in optimizer.variables if "embeddings" in v.path]
    users = rs_tables.table_optimizers(model.get_layer("embedding"))["users"]
    assert int(users.iterations.numpy()) == 1 and int(optimizer.iterations.numpy()) == 1


def test_the_keras_rs_seams_install_and_put_back_keras_rs_own_functions(strategy):
    from kerasps.backend import _keras_rs
    from kerasps.keras import hooks

    assert _keras_rs.installed()  # by the strategy
    installed = {s.attribute: vars(s.target)[s.attribute] for s in _keras_rs.SEAMS}
    assert installed == {s.attribute: s.replacement for s in _keras_rs.SEAMS}
    own = {s.attribute: s.replacement.__wrapped__ for s in _keras_rs.SEAMS}
    hooks.uninstall()
    try:
        assert {s.attribute: vars(s.target)[s.attribute] for s in _keras_rs.SEAMS} == own
        assert not _keras_rs.installed()
    finally:
        hooks.install()
    assert _keras_rs.installed()


def test_only_the_keras_rs_backend_module_reaches_into_keras_rs_private_code():
    import ast
    import pathlib

    root = pathlib.Path(kerasps.__file__).parent
    reaching = sorted(
        str(path.relative_to(root)) for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(name.startswith("keras_rs.src") for name in (
            [node.module or ""] if isinstance(node, ast.ImportFrom)
            else [alias.name for alias in node.names])))
    assert reaching == ["backend/_keras_rs.py"]


def test_a_table_the_partitioner_leaves_whole_still_trains_lazily_with_its_own_optimizer(
        make_strategy):
    with make_strategy().scope():  # no partitioner: each table one variable on one ps task
        model = build(feature_configs(keras.optimizers.SGD(0.0), keras.optimizers.Adam(0.1)))
    before_items, before_users = table(model, "items"), table(model, "users")
    for features, labels in BATCHES:
        model.train_on_batch(features, labels)
    np.testing.assert_array_equal(table(model, "items"), before_items)
    touched = sorted({int(u) for features, _ in BATCHES for u in features["user"]})
    moved = np.abs(table(model, "users") - before_users).max(axis=1) > 0
    assert np.flatnonzero(moved).tolist() == touched
    adam = rs_tables.table_optimizers(model.get_layer("embedding"))["users"]
    momentum = next(v for v in adam.variables if v.path.endswith("_momentum")).numpy()
    assert not momentum[sorted(set(range(ROWS)) - set(touched))].any()  # lazy


# -- fit with BackupAndRestore, hybrid mode --------------------------------------------------

def batches_fn(context):
    """The three batches, over and over (each worker from its own start)."""
    shift = context.input_pipeline_id % len(BATCHES)
    order = BATCHES[shift:] + BATCHES[:shift]
    features = {name: np.stack([f[name] for f, _ in order]) for name in ("item", "user")}
    labels = np.stack([labels for _, labels in order])
    return tf.data.Dataset.from_tensor_slices((features, labels)).repeat()


class FailAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("preempted")


class StateAtTrainBegin(keras.callbacks.Callback):
    """The tables and their optimizers' variables once the callbacks before it ran
    `on_train_begin` (`BackupAndRestore` restores there)."""

    def on_train_begin(self, logs=None):
        self.state = whole_table_state(self.model)


def test_backup_and_restore_resumes_fit_with_the_tables_and_their_optimizers_slots(
        make_strategy, tmp_path):
    def configs():
        return feature_configs(keras.optimizers.Adam(0.1), keras.optimizers.Adagrad(0.5))

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with two_shards(make_strategy).scope():
        model = build(configs(), keras.optimizers.Adam(0.05))
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(kerasps.DatasetCreator(batches_fn), epochs=4, steps_per_epoch=3, verbose=0,
                  callbacks=[backup, FailAtEpoch(2)])
    saved = whole_table_state(model)  # as the backup of epoch 1's end holds it
    adam = rs_tables.table_optimizers(model.get_layer("embedding"))["items"]
    assert int(adam.iterations.numpy()) == 6
    assert np.abs(saved["items:embedding_items_embeddings_momentum"]).max() > 0

    # A new model, another number of shards: fit restores the backup and goes on.
    with make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3)
                       ).scope():
        resumed = build(configs(), keras.optimizers.Adam(0.05))
    fresh = whole_table_state(resumed)
    restored = StateAtTrainBegin()
    epochs_run = []
    resumed.fit(kerasps.DatasetCreator(batches_fn), epochs=4, steps_per_epoch=3, verbose=0,
                callbacks=[backup, restored, keras.callbacks.LambdaCallback(
                    on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])

    assert epochs_run == [2, 3]
    assert sorted(restored.state) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(restored.state[key], value, err_msg=key)
        if key.endswith(("_momentum", "_velocity", "_accumulator")) or ":" not in key:
            assert not np.array_equal(fresh[key], value), key  # restored, not left as made
    optimizers = rs_tables.table_optimizers(resumed.get_layer("embedding"))
    assert [int(optimizers[n].iterations.numpy()) for n in ("items", "users")] == [12, 12]
    assert int(resumed.optimizer.iterations.numpy()) == 12


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_sync_and_hybrid_modes_hand_the_tables_gradients_to_their_own_optimizers(
        make_strategy, mode):
    """Sync: each global step's mean gradient of a table, once. Hybrid: each worker's row
    update as it arrives (`kerasps.backend._keras.apply_uncounted`), two per global step."""
    strategy = make_strategy(mode=mode,
                             variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        model = build(feature_configs(keras.optimizers.SGD(0.0), keras.optimizers.Adagrad(0.5)),
                      keras.optimizers.SGD(0.1))
    before_items, before_users = table(model, "items"), table(model, "users")
    before_dense = dense_weights(model)

    history = model.fit(kerasps.DatasetCreator(batches_fn), epochs=1, steps_per_epoch=4,
                        verbose=0)

    np.testing.assert_array_equal(table(model, "items"), before_items)  # learning rate 0
    moved = np.abs(table(model, "users") - before_users).max(axis=1) > 0
    touched = sorted({int(u) for features, _ in BATCHES for u in features["user"]})
    assert np.flatnonzero(moved).tolist() == touched
    assert all(np.abs(a - b).max() > 1e-4 for a, b in zip(dense_weights(model), before_dense))
    assert int(model.optimizer.iterations.numpy()) == 4  # global steps
    assert history.history["dropped_gradients"] == [0]
    optimizers = rs_tables.table_optimizers(model.get_layer("embedding"))
    updates = {"sync": 4, "hybrid": 8}[mode]
    assert [int(optimizers[n].iterations.numpy()) for n in ("items", "users")] == [updates] * 2
    # The model's optimizer holds no slot of a table.
    assert not [v.path for v in model.optimizer.variables if "embeddings" in v.path]

