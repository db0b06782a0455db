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

TensorFlow's log lines (its start-up notices, `failed call to cuInit` on a machine
without a GPU, its servers' and sessions' INFO lines) do not reach the user: importing
kerasps sets `TF_CPP_MIN_LOG_LEVEL=3` unless the environment sets it (a value the user
set wins), and drops the lines TensorFlow prints as it is imported, after kerasps.
`KERASPS_TF_LOGS=1` shows them all (`kerasps.backend.tf_logs`). Once keras-rs is
imported too, kerasps' keras-rs hooks are installed (each defers to keras-rs' own code
outside a kerasps scope), so that a `.keras` file holding a kerasps dynamic table loads
with no strategy made. In a task of a
`kerasps launch` job, Ctrl-C (an uncaught `KeyboardInterrupt`) ends the process without a
traceback (`kerasps.runtime.launch_env.quiet_interrupts`).

The modules live in one folder per layer (see docs/architecture.md). The public
modules with a short name (`kerasps.cluster`, `kerasps.launch` ...) are small files of
this folder (`kerasps/cluster.py`) that re-export the public names of the module where
they live (`kerasps.runtime.cluster`); every module has that one name.
"""

from kerasps.backend import imports as _imports

__version__ = "0.1.0"

# Public name -> the module it is read from (a class or function), or None for a public
# module of this folder (`kerasps/cluster.py`), imported on first use.
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
    "DeltaConsumer": "kerasps.keras.serving",
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
    "ray": None,  # Ray itself is imported by `kerasps.ray.cluster` only
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = _imports.lazy_attributes(__name__, _LAZY)


def __dir__():
    return __all__


import sys as _sys  # noqa: E402

from kerasps.backend import tf_logs as _tf_logs  # noqa: E402
from kerasps.runtime import launch_env as _launch_env  # noqa: E402


def _install_keras_rs_hooks():
    if "kerasps.backend._keras_rs" in _sys.modules:
        return  # keras-rs is imported by kerasps' hooks, which install themselves next
    from kerasps.keras import hooks

    hooks.install_keras_rs()


_tf_logs.quiet()
_launch_env.quiet_interrupts()  # under `kerasps launch`: Ctrl-C ends a task without a traceback
# A `.keras` file holding a kerasps dynamic table loads in a program that imported kerasps,
# strategy or not: kerasps' keras-rs hooks are installed with keras-rs.
_imports.after_import("keras_rs", _install_keras_rs_hooks)
