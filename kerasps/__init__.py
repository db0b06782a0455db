"""kerasps: parameter-server training for Keras 3 on TensorFlow.

Port TensorFlow parameter-server code by changing imports:

    import keras, kerasps

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=2, num_ps=2),
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=2))
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile("adam", "mse", steps_per_execution=10)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=5, steps_per_epoch=20)

Attributes are imported lazily: `kerasps.placement`, `kerasps.partitioners`,
`kerasps.consistency`, `kerasps.membership`, `kerasps.tables` and `kerasps.trace`
are pure Python, and importing them (as `simulator` does) does not import TensorFlow.

The modules live in one folder per layer (see docs/architecture.md); the flat names
programs import (`kerasps.cluster`, `kerasps.launch`, `kerasps.trainer.dispatch` ...)
are aliases of the modules in those folders: `import kerasps.cluster` gives the very
module object `kerasps.runtime.cluster`, so patching either name patches both.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "ParameterServerStrategy": "kerasps.strategy",
    "ClusterCoordinator": "kerasps.runtime.coordinator",
    "RemoteValue": "kerasps.runtime.coordinator",
    "DatasetCreator": "kerasps.runtime.input",
    "InputContext": "kerasps.runtime.input",
    "InputOptions": "kerasps.runtime.input",
    "StepTraceRecorder": "kerasps.keras.callbacks",
    "ShardedVariable": "kerasps.params.variables",
    "PsTaskFailedError": "kerasps.policy.failures",
    "TaskFailedError": "kerasps.runtime.launch_env",
    "SidecarEvaluator": "kerasps.keras.evaluator",
    "cluster": None,
    "partitioners": None,
    "placement": None,
    "trace": None,
    "sparse": None,
    "callbacks": None,
    "evaluator": None,
    "input": None,
    "consistency": None,
    "data_service": None,
    "membership": None,
    "launch": None,
    "layers": None,
    "tables": None,
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name not in _LAZY and f"kerasps.{name}" in _MOVED:
        # A flat module name (`kerasps.variables`): an attribute of the package once any
        # code has imported the module, as when the module lived at that name.
        if _MOVED[f"kerasps.{name}"] in sys.modules:
            value = globals()[name] = importlib.import_module(f"kerasps.{name}")
            return value
    if name not in _LAZY:
        raise AttributeError(f"module 'kerasps' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:
        value = importlib.import_module(f"kerasps.{name}")
    else:
        value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


# The flat module names of kerasps before the layer folders, and where each lives now.
# A name under an alias (`kerasps.trainer.dispatch`) maps to the same name under its
# target (`kerasps.keras.trainer.dispatch`).
_MOVED = {
    **{f"kerasps.{name}": f"kerasps.policy.{name}" for name in (
        "_validation", "consistency", "failures", "membership", "partitioners", "placement",
        "restarts", "tables", "trace")},
    **{f"kerasps.{name}": f"kerasps.backend.{name}" for name in ("_keras", "_tf")},
    **{f"kerasps.{name}": f"kerasps.runtime.{name}" for name in (
        "cluster", "coordinator", "data_service", "input")},
    **{f"kerasps.{name}": f"kerasps.params.{name}" for name in ("sparse", "variables")},
    **{f"kerasps.{name}": f"kerasps.keras.{name}" for name in (
        "callbacks", "evaluator", "layers", "trainer")},
    **{f"kerasps.{name}": f"kerasps.ops.{name}" for name in (
        "cli", "console", "demo", "launch", "manifests", "standby")},
}


def _moved_to(name):
    for old, new in _MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself (one module object)."""

    def find_spec(self, name, path=None, target=None):
        new = _moved_to(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        return importlib.util.spec_from_loader(
            name, self, origin=real.origin, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(_moved_to(spec.name))
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has just stamped the alias's spec on the module; give it back
        # its own, so that `module.__spec__.name` stays the module's real name.
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name):
        """For `python -m kerasps.cli`: runs the real module's code as `__main__`."""
        real = importlib.util.find_spec(_moved_to(name))
        return real.loader.get_code(real.name)


if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Aliases())
