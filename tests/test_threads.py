"""The chief's threads: TensorFlow objects used from several threads at once never crash it.

The chief runs Python threads of its own beside TensorFlow's (the coordinator's
worker threads and failure handler): the elastic pool's watcher polls every
worker's liveness while `fit` schedules steps, builds input pipelines and, after
a failure, reconnects the eager context to restarted tasks. Issue 17, defect 4:
the chief died with SIGSEGV. Each test runs a chief in a subprocess, so that a
crash is an exit status, not the end of the test session.
"""

import os
import subprocess
import sys

import pytest

POLLS_DURING_RECONNECTS = """
import threading
import kerasps
from kerasps import _tf

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=2, num_ps=1))
coordinator = kerasps.ClusterCoordinator(strategy)
stop, polls = threading.Event(), [0]

def watch():  # what the pool watcher does, as fast as it can
    while not stop.is_set():
        assert coordinator.running_workers() == [0, 1]
        polls[0] += 1

watcher = threading.Thread(target=watch)
watcher.start()
for _ in range(100):  # what a recovery (or TensorFlow's failure handler) does
    _tf.reconnect_cluster(coordinator._tf_coordinator)
stop.set()
watcher.join()
print("DONE", polls[0] > 0)
"""

FIT_AND_EVALUATE = """
import sys
import keras, numpy as np, tensorflow as tf, kerasps

strategy = kerasps.ParameterServerStrategy(
    kerasps.cluster.in_process(num_workers=2, num_ps=2),
    variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))

def dataset_fn(context):
    x = tf.random.uniform((64, 8))
    return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, 1))).repeat().batch(8)

with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile("adam", "mse", steps_per_execution=3)
x = np.random.rand(40, 8).astype("float32")
for _ in range(int(sys.argv[1])):
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=6, verbose=0,
              validation_data=(x, x.sum(1)))
    model.evaluate(x, x.sum(1), verbose=0)
print("DONE", True)
"""


def run_chief(program, *args, timeout=600):
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", program, *args],
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, (
        f"the chief exited with status {result.returncode}:\n{result.stderr[-4000:]}")
    assert "DONE True" in result.stdout
    return result


def test_liveness_polls_during_context_updates_do_not_crash_the_chief():
    """TensorFlow's `check_alive` reads the worker cache that `update_server_def` frees
    and replaces: from two threads at once the chief died with SIGSEGV (6 runs in 6)."""
    run_chief(POLLS_DURING_RECONNECTS)


@pytest.mark.stress
def test_fit_and_evaluate_with_validation_and_the_pool_watcher_do_not_crash_the_chief():
    """The reported crash: `fit` with `validation_data` and `steps_per_execution`
    while the pool watcher polls, then `evaluate`, again and again."""
    run_chief(FIT_AND_EVALUATE, "40", timeout=1800)
