"""The Keras seams (`kerasps.backend._keras.SEAMS`): `install` replaces each attribute of
the table, `uninstall` puts back Keras' own objects, and Keras then behaves as if kerasps
had never been imported."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from kerasps.backend import _keras
from kerasps.keras import hooks

ABSENT = object()  # the target has no attribute of that name of its own


def own(seam):
    """What the seam's target holds itself under the seam's name (not inherited)."""
    return vars(seam.target).get(seam.attribute, ABSENT)


@pytest.fixture
def keras_alone():
    """Keras without kerasps for the test; kerasps installed again after it if it was."""
    was_installed = _keras.installed()
    hooks.uninstall()
    yield
    hooks.uninstall()
    if was_installed:
        hooks.install()


def test_each_seam_is_a_documented_function_of_the_backend_replacing_one_attribute():
    places = [(id(seam.target), seam.attribute) for seam in _keras.SEAMS]
    assert len(set(places)) == len(places)
    replacements = [seam.replacement for seam in _keras.SEAMS]
    assert len({id(r) for r in replacements}) == len(replacements)
    for seam in _keras.SEAMS:
        function = seam.replacement
        assert getattr(_keras, function.__name__) is function, function
        assert function.__doc__.startswith("Replaces `"), function.__name__
        assert f"{seam.attribute}`" in function.__doc__.split("\n")[0], function.__name__


def test_install_replaces_each_attribute_and_uninstall_puts_back_the_same_objects(keras_alone):
    before = {seam: own(seam) for seam in _keras.SEAMS}
    resolved = {seam: getattr(seam.target, seam.attribute) for seam in _keras.SEAMS}
    assert [seam.attribute for seam, value in resolved.items()
            if getattr(value, "__module__", None) == _keras.__name__] == []  # Keras' own
    assert "__new__" not in vars(_keras.KerasTFVariable)  # one that Keras does not have

    hooks.install()
    assert _keras.installed()
    assert [seam.attribute for seam in _keras.SEAMS if own(seam) is not seam.replacement] == []

    hooks.uninstall()
    assert not _keras.installed()
    assert [seam.attribute for seam in _keras.SEAMS if own(seam) is not before[seam]] == []
    assert [seam.attribute for seam in _keras.SEAMS
            if getattr(seam.target, seam.attribute) is not resolved[seam]] == []
    # Deleting `__new__` leaves CPython's `tp_new` calling it: a variable is made as before.
    assert keras.Variable(np.ones(2, "float32"), name="after_uninstall").numpy().tolist() == [
        1.0, 1.0]


def test_install_twice_then_uninstall_once_restores_keras(keras_alone):
    before = {seam: own(seam) for seam in _keras.SEAMS}
    hooks.install()
    hooks.install()
    assert [seam.attribute for seam in _keras.SEAMS if own(seam) is not seam.replacement] == []
    hooks.uninstall()
    assert [seam.attribute for seam in _keras.SEAMS if own(seam) is not before[seam]] == []
    hooks.uninstall()  # not installed: nothing to do
    assert [seam.attribute for seam in _keras.SEAMS if own(seam) is not before[seam]] == []


AS_IF_NEVER_IMPORTED = r"""
import os
import sys
import tempfile

import keras
import numpy as np
from keras.src import backend as keras_backend
from keras.src.backend.tensorflow import numpy as tf_numpy
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.layers.layer import Layer
from keras.src.models.model import Model
from keras.src.saving import saving_lib
from keras.src.utils import tracking

# Every Keras object a seam may replace an attribute of (checked against the table below).
TARGETS = (keras_backend.Variable, tracking.Tracker, Layer, tf_optimizer.TFOptimizer,
           saving_lib, Model, tf_numpy, tf_trainer.TensorFlowTrainer)


def attributes():
    return [dict(vars(target)) for target in TARGETS]


def program(directory):
    # A plain Keras program: each seam's Keras path (variables, metrics, optimizer
    # slots and updates, weights files, get/set_weights, take, the training loops).
    keras.utils.set_random_seed(1)
    x = np.random.RandomState(0).rand(64, 3).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [3.0]], "float32") > 3).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.AdamW(0.01), "binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")])  # no uid
    results = [model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history,
               model.evaluate(x, y, batch_size=8, verbose=0),
               model.predict(x, batch_size=8, verbose=0),
               model.train_on_batch(x[:8], y[:8]), model.test_on_batch(x[:8], y[:8]),
               model.predict_on_batch(x[:8])]
    path = os.path.join(directory, "plain.weights.h5")
    model.save_weights(path)
    copy = keras.models.clone_model(model)
    copy.compile(keras.optimizers.AdamW(0.01), "binary_crossentropy")
    copy.optimizer.build(copy.trainable_variables)
    copy.load_weights(path)
    copy.set_weights(copy.get_weights())
    variable = keras.Variable(np.arange(6, dtype="float32").reshape(3, 2))
    variable.assign_add(np.ones((3, 2), "float32"))
    variable.assign_sub(np.full((3, 2), 0.5, "float32"))
    results += [copy.get_weights(), keras.ops.take(variable, [2, 0], axis=0)]
    return keras.tree.map_structure(lambda v: np.asarray(v).tolist(), results)


with tempfile.TemporaryDirectory() as directory:
    first = program(directory)
    before = attributes()

    assert "kerasps" not in sys.modules
    import kerasps
    from kerasps.backend import _keras
    from kerasps.keras import hooks

    assert [s for s in _keras.SEAMS if not any(s.target is t for t in TARGETS)] == []
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(1, 1),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    assert [s for s in _keras.SEAMS if vars(s.target).get(s.attribute) is not s.replacement] == []
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Embedding(8, 2),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.compile("adam", "mse")
    model.fit(np.arange(16).reshape(-1, 1) % 8, np.ones((16, 1)), batch_size=4, epochs=1,
              verbose=0)
    assert type(model.layers[0].embeddings).__name__ == "ShardedVariable"

    hooks.uninstall()
    after = attributes()
    missing = object()
    changed = [f"{getattr(target, '__name__', target)}.{name}"
               for target, was, now in zip(TARGETS, before, after)
               for name in set(was) | set(now)
               if was.get(name, missing) is not now.get(name, missing)]
    assert changed == [], changed
    second = program(directory)
    assert second == first, (first, second)
print("DONE", True)
"""


@pytest.mark.slow  # the default run's longest: ~17-19 s
def test_after_uninstall_keras_behaves_as_if_kerasps_was_never_imported():
    """A plain Keras program gives the same results before kerasps is imported and after
    a strategy installed it and `uninstall` took it out, and every attribute of the
    seams' targets is the object it was (none added, none left behind)."""
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", AS_IF_NEVER_IMPORTED],
                            capture_output=True, text=True, timeout=500,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "DONE True" in result.stdout
