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
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ParameterServerStrategy": "kerasps.strategy",
    "ClusterCoordinator": "kerasps.coordinator",
    "RemoteValue": "kerasps.coordinator",
    "DatasetCreator": "kerasps.input",
    "InputContext": "kerasps.input",
    "InputOptions": "kerasps.input",
    "StepTraceRecorder": "kerasps.callbacks",
    "ShardedVariable": "kerasps.variables",
    "PsTaskFailedError": "kerasps.failures",
    "TaskFailedError": "kerasps.launch",
    "SidecarEvaluator": "kerasps.evaluator",
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
