"""keras-rs' `DistributedEmbedding` under kerasps: tables sharded on the ps tasks, each
trained by its `TableConfig.optimizer` as row updates, saved whole (`.weights.h5`,
`tf.train.Checkpoint`), exported without kerasps; dynamic tables (`DynamicTableConfig`)
that admit and evict ids."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.keras.layers import rs_tables
from kerasps.keras.trainer import recovery
from kerasps.params.variables import logical_variables
from kerasps.policy.tables import STAT_COLUMNS, STATE_COLUMNS
from tests.launched import run_with_deadline

keras_rs = pytest.importorskip("keras_rs")  # in the `test` extra: skipped only without it
from kerasps.keras.layers.rs_dynamic import DynamicTableLayer  # noqa: E402
from kerasps.layers import DynamicTableConfig  # noqa: E402

DEADLINE_S = 120  # a subprocess that trains for seconds and would hang without a fix

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


def build(configs, optimizer=None, dtype="int32"):
    """A keras-rs model: two tables, their lookups concatenated, one dense layer."""
    embedding = keras_rs.layers.DistributedEmbedding(configs, name="embedding")
    inputs = {name: keras.Input(shape=config.input_shape[1:], dtype=dtype, name=name,
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
    write."""
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


def run_program(program, *args, cwd):
    """Runs `python -c program args` in a fresh interpreter; fails the test with its
    stderr unless it succeeds."""
    result = run_with_deadline(program, *map(str, args), deadline=300, cwd=cwd,
                               what="the program")
    assert result.returncode == 0, result.stderr[-3000:]


def assert_served(model, tmp_path, expected):
    """`model.export` serves `expected` for the features in `tmp_path / "features.npz"`, in
    a clean interpreter that imports neither kerasps nor keras-rs, outside any strategy."""
    model.export(str(tmp_path / "saved_model"), verbose=False)
    run_program(SERVE, tmp_path / "saved_model", tmp_path / "features.npz",
                tmp_path / "served.npy", cwd=tmp_path)
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"), expected, rtol=1e-6, atol=1e-6)


def test_export_serves_without_kerasps_and_keras_rs(make_strategy, tmp_path):
    with two_shards(make_strategy).scope():
        model = build(feature_configs("adagrad", keras.optimizers.SGD(0.5)))
    for features, labels in BATCHES:
        model.train_on_batch(features, labels)
    features = {name: np.concatenate([f[name] for f, _ in BATCHES]) for name in ("item", "user")}
    expected = model.predict(features, verbose=0)
    np.savez(tmp_path / "features.npz", **features)
    assert_served(model, tmp_path, expected)


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

    def function(attribute):  # a classmethod (`TableConfig.from_config`): its function
        return getattr(attribute, "__func__", attribute)

    assert _keras_rs.installed()  # by the strategy
    installed = {s.attribute: function(vars(s.target)[s.attribute]) for s in _keras_rs.SEAMS}
    assert installed == {s.attribute: s.replacement for s in _keras_rs.SEAMS}
    own = {s.attribute: s.replacement.__wrapped__ for s in _keras_rs.SEAMS}
    hooks.uninstall()
    try:
        assert {s.attribute: function(vars(s.target)[s.attribute])
                for s in _keras_rs.SEAMS} == own
        assert not _keras_rs.installed()
    finally:
        hooks.install()
    assert _keras_rs.installed()


def test_only_the_keras_rs_backend_module_reaches_into_keras_rs_private_code():
    import ast
    import pathlib

    from tests import sources

    root = pathlib.Path(kerasps.__file__).parent
    reaching = sorted(
        str(path.relative_to(root)) for path in root.rglob("*.py")
        for node in ast.walk(sources.parse(path))
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
    # Hybrid without backup workers drops nothing and logs no count (always 0).
    assert history.history.get("dropped_gradients") == {"sync": [0], "hybrid": None}[mode]
    optimizers = rs_tables.table_optimizers(model.get_layer("embedding"))
    updates = {"sync": 4, "hybrid": 8}[mode]
    assert [int(optimizers[n].iterations.numpy()) for n in ("items", "users")] == [updates] * 2
    # The model's optimizer holds no slot of a table.
    assert not [v.path for v in model.optimizer.variables if "embeddings" in v.path]



# -- tf.train.Checkpoint, .keras files -------------------------------------------------------

def test_a_tf_train_checkpoint_holds_the_tables_and_their_optimizers(make_strategy, tmp_path):
    """keras-rs keeps its tables' layers in a dict that TensorFlow's checkpoints do not
    follow (a keras-rs layer had no checkpoint dependency at all: a checkpoint held the
    dense layers only); `rs_tables` makes them, and their optimizers, dependencies."""
    def configs():
        return feature_configs(keras.optimizers.Adam(0.1), keras.optimizers.Adagrad(0.5))

    with two_shards(make_strategy).scope():
        source = build(configs())
    for features, labels in BATCHES[:2]:
        source.train_on_batch(features, labels)
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "checkpoint"))
    names = [name for name, _ in tf.train.list_variables(prefix)]
    assert [n for n in names if "kerasps_tables/tables/items/" in n]
    with make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3)
                       ).scope():
        target = build(configs())

    tf.train.Checkpoint(model=target).read(prefix).assert_existing_objects_matched()

    expected, actual = whole_table_state(source), whole_table_state(target)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)
    for a, b in zip(dense_weights(target), dense_weights(source)):
        np.testing.assert_array_equal(a, b)


def test_a_keras_file_loaded_under_the_scope_gives_the_models_optimizer_no_table_slot(
        make_strategy, tmp_path):
    with two_shards(make_strategy).scope():
        model = build(feature_configs("adagrad", keras.optimizers.SGD(0.5)),
                      keras.optimizers.Adam(0.05))
    for features, labels in BATCHES:
        model.train_on_batch(features, labels)
    assert not [v.path for v in model.optimizer.variables if "embeddings" in v.path]
    path = str(tmp_path / "model.keras")
    model.save(path)

    with two_shards(make_strategy).scope():
        loaded = keras.saving.load_model(path)

    assert not [v.path for v in loaded.optimizer.variables if "embeddings" in v.path]
    expected, actual = whole_table_state(model), whole_table_state(loaded)
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


# -- dynamic tables (`kerasps.layers.DynamicTableConfig`) ---------------------------------------

def dynamic_configs(item_optimizer=None, seed=7):
    """A dynamic `items` table (32 rows in 2 partitions) shared by a single-id and a
    multi-valued feature, a dynamic `frozen` table whose optimizer has learning rate 0,
    and a fixed `users` table."""
    items = DynamicTableConfig(
        name="items", vocabulary_size=32, embedding_dim=DIM, num_partitions=2, seed=seed,
        optimizer=item_optimizer or keras.optimizers.Adagrad(0.5, initial_accumulator_value=0.1),
        combiner="sum")
    frozen = DynamicTableConfig(name="frozen", vocabulary_size=32, embedding_dim=DIM,
                                num_partitions=2, seed=seed + 1,
                                optimizer=keras.optimizers.SGD(0.0))
    users = keras_rs.layers.TableConfig(name="users", vocabulary_size=ROWS, embedding_dim=DIM,
                                        optimizer="sgd")
    feature = keras_rs.layers.FeatureConfig
    return {
        "item": feature(name="item", table=items, input_shape=(None,),
                        output_shape=(None, DIM)),
        "basket": feature(name="basket", table=items, input_shape=(None, 2),
                          output_shape=(None, DIM)),
        "tag": feature(name="tag", table=frozen, input_shape=(None,), output_shape=(None, DIM)),
        "user": feature(name="user", table=users, input_shape=(None,), output_shape=(None, DIM)),
    }


def dynamic_batches(context=None, count=4096, batch=8):
    """Ids from 0 to 400 (far more than the tables' rows) and a 12-row fixed table."""
    rng = np.random.default_rng(0 if context is None else context.input_pipeline_id)
    features = {"item": rng.integers(0, 400, count), "basket": rng.integers(0, 400, (count, 2)),
                "tag": rng.integers(0, 400, count), "user": rng.integers(0, ROWS, count)}
    labels = (features["item"] % 2).astype("float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch).repeat()


def dynamic_layer(model, name):
    return model.get_layer("embedding")._kerasps_tables.by_name[name].layer


def used_rows(layer):
    """{key: row} of the rows in use, and the rows' values."""
    state = layer.state.numpy()
    used = np.flatnonzero(state[:, STATE_COLUMNS.index("last_seen")] >= 0)
    return {int(state[r, 0]): int(r) for r in used}, layer.rows.numpy()


@pytest.mark.slow  # the default run's longest: ~20 s
def test_a_dynamic_table_admits_evicts_and_trains_with_its_own_optimizer_in_fit(make_strategy):
    strategy = two_shards(make_strategy)
    with strategy.scope():
        model = build(dynamic_configs(), keras.optimizers.Adam(0.01), dtype="int64")
    items, frozen = dynamic_layer(model, "items"), dynamic_layer(model, "frozen")
    assert isinstance(items, DynamicTableLayer)
    assert any(layer is items for layer in model._flatten_layers())  # ps recovery renews it
    devices = [shard.value.device for shard in items.rows.shards]  # a shard per ps task
    assert [d.split("/task:")[1][0] for d in devices] == ["0", "1"] and "/job:ps/" in devices[0]
    optimizers = rs_tables.table_optimizers(model.get_layer("embedding"))
    steps, epochs = 40, 2

    history = model.fit(kerasps.DatasetCreator(dynamic_batches), epochs=epochs,
                        steps_per_epoch=steps, verbose=0)

    logs = history.history
    # Unseen ids get rows, and rows are freed for them once the table is full.
    assert logs["items_rows_used"][-1] == 32 and logs["items_evicted"][-1] > 0
    stats = items.table_stats()
    assert stats["admitted"] > 32 and stats["admitted"] - stats["evicted"] == 32
    # One training lookup per step on each shard, for the two features of the table.
    assert (items.stats.numpy()[:, STAT_COLUMNS.index("clock")] == steps * epochs).all()
    # The table's own optimizers train the rows: `frozen`'s (learning rate 0) leaves each
    # row at the initial values of its id, `items`' Adagrad moves them.
    keys, rows = used_rows(frozen)
    initial = frozen._table.initial_rows(tf.constant(sorted(keys), tf.int64)).numpy()
    np.testing.assert_array_equal(rows[[keys[k] for k in sorted(keys)]], initial)
    keys, rows = used_rows(items)
    initial = items._table.initial_rows(tf.constant(sorted(keys), tf.int64)).numpy()
    assert np.abs(rows[[keys[k] for k in sorted(keys)]] - initial).max() > 1e-3
    assert [int(optimizers[n].iterations.numpy()) for n in ("frozen", "items", "users")] == [
        steps * epochs] * 3
    assert not [v.path for v in model.optimizer.variables if "embedding" in v.path]
    # A row given to a new id has its own optimizer's slot reset: Adagrad's accumulators
    # of the rows that lookups now give to new ids start at initial_accumulator_value.
    adagrad = optimizers["items"]
    accumulator = next(v for v in logical_variables(adagrad.variables)
                       if v.path.endswith("_accumulator"))
    # (`>=`: a float32 accumulator gets no bigger from a gradient element below ~6e-5)
    used = accumulator.numpy()[list(keys.values())]
    assert (used >= 0.1).all() and (used > 0.1).mean() > 0.5
    new_ids = tf.constant([10**12 + i for i in range(4)], tf.int64)
    for _ in range(items._table.protected_steps + 2):  # until the fit's rows may go
        items.look_up([(new_ids, None)], training=True)
    keys, _ = used_rows(items)
    reused = [keys[int(k)] for k in new_ids.numpy()]
    np.testing.assert_allclose(accumulator.numpy()[reused], 0.1)


def test_a_full_dynamic_table_frees_no_row_that_a_gradient_in_flight_may_update(
        make_strategy):
    """Why eviction looked as if it never ran with a table's own optimizer: a table under a
    strategy frees no row looked up in its last `4 x workers` training lookups (a gradient
    in flight may still update it), so a short run of new ids into a full table evicts
    nothing. Outside a strategy the window is 0. The same with the model's optimizer
    training a `kerasps.layers.DynamicEmbedding`: the optimizer has nothing to do with it."""
    strategy = make_strategy()
    table = DynamicTableConfig(name="items", vocabulary_size=8, embedding_dim=2,
                               num_partitions=1, optimizer="adagrad")
    with strategy.scope():
        own = build({"item": keras_rs.layers.FeatureConfig(
            name="item", table=table, input_shape=(None,), output_shape=(None, 2))},
            dtype="int64")
        plain_layer = kerasps.layers.DynamicEmbedding(2, capacity=8, num_partitions=1)
        ids = keras.Input((), dtype="int64")
        plain = keras.Model(ids, keras.layers.Dense(1)(plain_layer(ids)))
        plain.compile(keras.optimizers.Adagrad(0.1), "mse")
    window = 4 * strategy.num_workers
    curves = []
    for model, layer in ((own, dynamic_layer(own, "items")), (plain, plain_layer)):
        assert layer._table.protected_steps == window
        evicted = []
        for step in range(window + 3):
            new_ids = np.arange(8) + 8 * step  # a full table of new ids at every step
            model.train_on_batch({"item": new_ids} if model is own else new_ids,
                                 np.zeros((8, 1), "float32"))
            evicted.append(layer.table_stats()["evicted"])
        curves.append(evicted)
    # Rows admitted at the first lookup may go at lookup `window + 2`, all 8 at once; the
    # rows admitted then are protected in turn.
    assert curves[0] == curves[1] == [0] * (window + 1) + [8] * 2


SHARED_TABLE_FIT = r"""
import json, sys

import keras
import keras_rs
import numpy as np
import tensorflow as tf

import kerasps
from kerasps.layers import DynamicTableConfig

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(2, 2))
items = DynamicTableConfig(name="items", vocabulary_size=64, embedding_dim=4,
                           num_partitions=2, optimizer="adagrad")
tags = DynamicTableConfig(name="tags", vocabulary_size=64, embedding_dim=4, num_partitions=2)
feature = keras_rs.layers.FeatureConfig
configs = {"item": feature(name="item", table=items, input_shape=(None,),
                           output_shape=(None, 4)),
           "basket": feature(name="basket", table=items, input_shape=(None, 3),
                             output_shape=(None, 4)),
           "tag": feature(name="tag", table=tags, input_shape=(None,), output_shape=(None, 4))}
with strategy.scope():
    inputs = {name: keras.Input(c.input_shape[1:], dtype="int64", name=name)
              for name, c in configs.items()}
    outputs = keras_rs.layers.DistributedEmbedding(configs, name="embedding")(inputs)
    merged = keras.layers.Concatenate()([outputs[name] for name in sorted(outputs)])
    model = keras.Model(inputs, keras.layers.Dense(1)(merged))
    model.compile(keras.optimizers.SGD(0.1), "mse")


def dataset_fn(context):
    rng = np.random.default_rng(context.input_pipeline_id)
    features = {"item": rng.integers(0, 300, 4096), "basket": rng.integers(0, 300, (4096, 3)),
                "tag": rng.integers(0, 300, 4096)}
    return tf.data.Dataset.from_tensor_slices(
        (features, (features["item"] % 2).astype("float32"))).batch(8).repeat()


runs = int(sys.argv[1])
for _ in range(runs):
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=100, verbose=0)
layer = model.get_layer("embedding")._kerasps_tables.by_name["items"].layer
print(json.dumps({"clock": layer.stats.numpy()[:, 0].tolist(), **layer.table_stats()}))
"""


@pytest.mark.slow  # the default run's longest: a chief process, repeated steps: ~25 s
def test_two_features_sharing_a_dynamic_table_train_without_hanging(tmp_path):
    """Two features of one dynamic table and a second dynamic table, two workers, two ps
    tasks: two deadlocks, each within 100 steps in every run tried.

    * Looked up once per feature, a step held the table's lock on one ps task while
      waiting for the release of its other lookup's lock on the other (TensorFlow's
      automatic control dependencies chain the releases of a step's locks,
      `ConsumeMutexLock`, across ps tasks in program order), and two workers waited for
      each other. The table is now looked up once per step for all its features
      (`DynamicTableLayer.look_up`).
    * All the tables' locks on a ps task were one mutex (`tf.CriticalSection()` made
      eagerly), and a step looking up two tables could wait for itself, even on one
      process. Each lock now has a mutex of its own (`kerasps.keras.layers.table`).

    Its own process: a deadlock would hold the locks of the shared cluster's ps tasks for
    the rest of the session. The deadline is the subprocess' timeout."""
    runs = 3
    result = run_with_deadline(SHARED_TABLE_FIT, str(runs), deadline=DEADLINE_S, cwd=tmp_path,
                               what=f"{runs} fits of 100 steps")
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stdout.splitlines()[-1])
    assert stats["clock"] == [100 * runs] * 2  # one lookup per step on each ps task
    assert stats["admitted"] - stats["evicted"] == 64 and stats["evicted"] > 0


def layer_state(model):
    """The embedding layer's whole variables and its tables' optimizers', by path."""
    layer = model.get_layer("embedding")
    state = {v.path: v.numpy() for v in logical_variables(layer.weights)}
    if getattr(layer, "_kerasps_tables", None) is not None:
        for name, optimizer in rs_tables.table_optimizers(layer).items():
            for variable in logical_variables(optimizer.variables):
                state[f"{name}:{variable.path.split('/', 1)[1]}"] = variable.numpy()
    return state


def dynamic_batch_list(count=12):
    return list(dynamic_batches(count=8 * count).take(count).as_numpy_iterator())


@pytest.mark.slow  # the default run's longest: restores under 3 layouts: ~20 s
def test_dynamic_tables_restore_from_weights_files_and_checkpoints_into_other_layouts(
        make_strategy, tmp_path):
    with two_shards(make_strategy).scope():
        source = build(dynamic_configs(), dtype="int64")
    batches = dynamic_batch_list()
    for features, labels in batches:
        source.train_on_batch(features, labels)
    expected = layer_state(source)
    assert dynamic_layer(source, "items").table_stats()["evicted"] > 0
    path = str(tmp_path / "model.weights.h5")
    source.save_weights(path)
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "checkpoint"))
    probe = batches[0][0]
    predicted = source.predict(probe, verbose=0)

    # Another partitioner (3 shards of the fixed table), from the weights file...
    three = make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(3))
    with three.scope():
        target = build(dynamic_configs(seed=99), dtype="int64")
    target.load_weights(path)
    actual = layer_state(target)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value, err_msg=key)
    np.testing.assert_allclose(target.predict(probe, verbose=0), predicted, rtol=1e-6)
    # ...and from the checkpoint.
    with three.scope():
        again = build(dynamic_configs(seed=99), dtype="int64")
    tf.train.Checkpoint(model=again).read(prefix).assert_existing_objects_matched()
    for key, value in layer_state(again).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    # One process, no strategy (one shard per table): the same tables and predictions.
    local = build(dynamic_configs(), dtype="int64")
    local.load_weights(path)
    for key, value in layer_state(local).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    np.testing.assert_allclose(local.predict(probe, verbose=0), predicted, rtol=1e-6)


LOAD_IN_A_FRESH_PROGRAM = r"""
import sys

import keras
import numpy as np

import kerasps

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(1, 1))
assert "kerasps.keras.layers.rs_dynamic" not in sys.modules
with strategy.scope():
    loaded = keras.saving.load_model(sys.argv[1])
table = loaded.get_layer("embedding")._kerasps_tables.by_name["items"]
assert type(table.config) is kerasps.layers.DynamicTableConfig, type(table.config)
np.testing.assert_allclose(loaded.predict(dict(np.load(sys.argv[2])), verbose=0),
                           np.load(sys.argv[3]), rtol=1e-6)
"""


# A program that imports kerasps and makes no strategy (a notebook looking at a model).
LOAD_WITHOUT_A_STRATEGY = r"""
import sys

import keras
import numpy as np

import kerasps
import keras_rs  # noqa: F401  (Keras finds keras-rs' layers once it is imported)

loaded = keras.saving.load_model(sys.argv[1])
tables = [feature.table for feature in keras.tree.flatten(
    loaded.get_layer("embedding")._feature_configs)]
assert kerasps.layers.DynamicTableConfig in map(type, tables), tables
np.testing.assert_allclose(loaded.predict(dict(np.load(sys.argv[2])), verbose=0),
                           np.load(sys.argv[3]), rtol=1e-6)
"""


@pytest.mark.slow  # saves, loads and exports under 3 layouts: ~20 s
def test_a_dynamic_table_stays_dynamic_in_keras_files_and_exports(make_strategy, tmp_path):
    with two_shards(make_strategy).scope():
        model = build(dynamic_configs(), dtype="int64")
    batches = dynamic_batch_list(4)
    for features, labels in batches:
        model.train_on_batch(features, labels)
    probe = {name: np.concatenate([value, value[:2] + 10**9])  # ids no table has seen
             for name, value in batches[0][0].items()}
    probe["user"] = probe["user"] % ROWS
    expected = model.predict(probe, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with two_shards(make_strategy).scope():
        loaded = keras.saving.load_model(path)
    table = loaded.get_layer("embedding")._kerasps_tables.by_name["items"]
    assert isinstance(table.config, DynamicTableConfig) and isinstance(
        table.layer, DynamicTableLayer)
    saved, made = table.config.get_config(), dynamic_configs()["item"].table.get_config()
    assert saved.pop("optimizer")["class_name"] == made.pop("optimizer")["class_name"]
    assert saved == made and saved["kerasps_dynamic_table"]["seed"] == 7
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, rtol=1e-6)

    np.savez(tmp_path / "features.npz", **probe)
    np.save(tmp_path / "expected.npy", expected)
    # A fresh program loads it without importing `DynamicTableConfig` first, under a
    # strategy or with none (before, keras-rs failed with `TableConfig.__init__() got an
    # unexpected keyword argument 'kerasps_dynamic_table'` where no strategy was made).
    for program in (LOAD_IN_A_FRESH_PROGRAM, LOAD_WITHOUT_A_STRATEGY):
        run_program(program, path, tmp_path / "features.npz", tmp_path / "expected.npy",
                    cwd=tmp_path)
    assert_served(model, tmp_path, expected)


@pytest.mark.parametrize("arguments,message", [
    (dict(vocabulary_size=0), "`vocabulary_size` of table 'items': expected a positive"),
    (dict(embedding_dim=2.5), "`embedding_dim` of table 'items': expected a positive"),
    (dict(num_partitions=3), "`num_partitions` of table 'items': it must divide "
                             "`vocabulary_size` (32"),
    (dict(min_count=0), "`min_count` of table 'items': it must be a positive integer"),
    (dict(probability=1.5), "`probability` of table 'items': it must be in (0, 1]"),
    (dict(eviction="fifo"), "`eviction` of table 'items': expected one of 'lru', 'lfu'"),
    (dict(steps_to_live=-1), "`steps_to_live` of table 'items': it must be a positive"),
    (dict(initializer="orthogonal"), "`initializer` of table 'items': a dynamic table"),
    (dict(combiner="max"), "`combiner` of table 'items': expected one of"),
    (dict(seed="1"), "`seed` of table 'items': expected an integer or None"),
])
def test_bad_dynamic_table_options_raise_naming_the_argument(arguments, message):
    argument = next(iter(arguments))
    options = {"name": "items", "vocabulary_size": 32, "embedding_dim": 4, **arguments}
    with pytest.raises(ValueError) as raised:
        DynamicTableConfig(**options)
    text = str(raised.value)
    assert text.startswith(f"Invalid value for argument {message.split(':')[0]}"), text
    assert message in text and f"Received: {argument}={arguments[argument]!r}" in text


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_a_dynamic_table_reduces_its_features_as_keras_rs_embed_reduce_does(combiner):
    """One process: single ids, dense and ragged multi-valued ids, sparse ids, with and
    without weights, looked up together, against keras-rs' `EmbedReduce` of the same
    rows."""
    layer = DynamicTableConfig(name="t", vocabulary_size=64, embedding_dim=DIM,
                               num_partitions=1, combiner=combiner, seed=1).make_layer()
    layer.build((None,))
    single = np.array([10**12, 7, 3], "int64")
    dense = np.array([[1, 5], [7, 7], [3, 9]], "int64")
    ragged = tf.ragged.constant([[1, 5, 9], [7], [3, 3]], dtype=tf.int64)
    sparse = tf.sparse.from_dense(tf.constant([[2, 0], [9, 1], [0, 0]], tf.int64))
    features = [
        (single, None), (single, np.array([0.5, 2.0, 1.0], "float32")),
        (dense, None), (dense, np.array([[1.0, 3.0], [0.5, 0.5], [2.0, 0.0]], "float32")),
        (ragged, None), (ragged, tf.ragged.constant([[1.0, 2.0, 0.5], [3.0], [1.0, 1.0]])),
        (sparse, None),
    ]
    layer.look_up([(tf.constant([10**12, 1, 2, 3, 5, 7, 9], tf.int64), None)], training=True)
    row_of, rows = used_rows(layer)
    to_rows = np.vectorize(row_of.get)
    reference = keras_rs.layers.EmbedReduce(64, DIM, combiner=combiner)
    reference.build((None, 2))
    reference.embeddings.assign(rows)

    together = layer.look_up(features)

    for (ids, weights), got in zip(features, together):
        if isinstance(ids, tf.RaggedTensor):
            rows_ids = ids.with_flat_values(to_rows(ids.flat_values.numpy()))
        elif isinstance(ids, tf.SparseTensor):
            rows_ids = tf.SparseTensor(ids.indices, to_rows(ids.values.numpy()), ids.dense_shape)
        else:
            rows_ids = to_rows(ids)
        expected = reference(rows_ids) if weights is None else reference(rows_ids, weights)
        np.testing.assert_allclose(got.numpy(), np.asarray(expected), rtol=1e-6, atol=1e-7)
        alone = layer.look_up([(ids, weights)])[0]
        np.testing.assert_allclose(alone.numpy(), got.numpy(), rtol=1e-6)


# A keras-rs model trained by a launched job: per-table optimizers on two ps tasks.
PS_KILL_CHIEF = """
    import itertools, sys
    import keras, keras_rs, numpy as np, tensorflow as tf, kerasps

    ROWS, DIM = 10_000, 8
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.from_tf_config(),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        items = keras_rs.layers.TableConfig(name="items", vocabulary_size=ROWS, embedding_dim=DIM,
                                            optimizer=keras.optimizers.Adagrad(0.1))
        users = keras_rs.layers.TableConfig(name="users", vocabulary_size=ROWS, embedding_dim=DIM,
                                            optimizer="sgd")
        configs = {name: keras_rs.layers.FeatureConfig(name=name, table=table, input_shape=(None,),
                                                       output_shape=(None, DIM))
                   for name, table in (("item", items), ("user", users))}
        inputs = {name: keras.Input(shape=(), dtype="int32", name=name) for name in configs}
        outputs = keras_rs.layers.DistributedEmbedding(configs, name="embedding")(inputs)
        merged = keras.layers.Concatenate()([outputs["item"], outputs["user"]])
        model = keras.Model(inputs, keras.layers.Dense(1)(merged))
        model.compile(keras.optimizers.Adam(0.01), "mse")

    def dataset_fn(context):
        ids = tf.random.stateless_uniform((4096, 2), [1, context.input_pipeline_id],
                                          maxval=ROWS, dtype=tf.int32)
        labels = tf.cast(ids[:, :1] % 7, tf.float32) / 7
        dataset = tf.data.Dataset.from_tensor_slices(
            ({"item": ids[:, 0], "user": ids[:, 1]}, labels)).repeat().batch(64)
        return kerasps.input.slowed(dataset, 0.05)

    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: print("train batch", next(trained), flush=True))
    backup = keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=150,
                        verbose=0, callbacks=[progress, backup])
    print("iterations", int(model.optimizer.iterations.numpy()),
          "reexecuted", sum(history.history.get("reexecuted_steps", [0])), flush=True)
"""


@pytest.mark.slow
def test_a_keras_rs_model_goes_on_after_a_ps_task_is_killed_mid_fit(tmp_path):
    """The tables, their own optimizers' slots and the dense layers come back from the
    backup on the restarted ps task, and `fit` runs every step."""
    from tests.launched import launch

    job = launch(tmp_path, PS_KILL_CHIEF, "--workers", "2", "--ps", "2", "--max-restarts", "2",
                 args=[str(tmp_path / "backup")])
    try:
        job.wait_for(r"\[chief 0\] train batch 30$")
        job.kill("ps 0")
        job.wait_for(r"\[launcher\] ps 0 exited with signal 9 \(SIGKILL\); restart 1 of 2")
        done = job.wait_for(r"\[chief 0\] iterations (\d+) reexecuted (\d+)")
        assert job.finish() == 0, job.output()
        assert any("Restored the backup" in line for line in job.lines), job.output()
        # Recovered inside the same `fit`, by the same chief: every step ran once on the
        # restored state, and the History counts each applied twice. (Before, a backup
        # that failed half-way left its file open, the next failed with `OSError`, and
        # the launcher restarted the chief, whose History could not count the first's.)
        assert not any("chief 0 exited" in line for line in job.lines), job.output()
        assert int(done.group(1)) == 150 + int(done.group(2))
    finally:
        job.close()
