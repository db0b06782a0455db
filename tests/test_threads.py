"""The chief's threads: TensorFlow objects used from several threads at once never crash it.

The chief runs Python threads of its own beside TensorFlow's (the coordinator's
worker threads and failure handler): the elastic pool's watcher polls every
worker's liveness while `fit` schedules steps, builds input pipelines and, after
a failure, reconnects the eager context to restarted tasks. Issue 17, defect 4:
the chief died with SIGSEGV. Each test runs a chief in a subprocess, so that a
crash is an exit status, not the end of the test session.
"""

import os
import random
import subprocess
import sys

import pytest

POLLS_DURING_RECONNECTS = """
import threading
import kerasps
from kerasps.backend import _tf

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

POLL_DURING_A_BLOCKED_RECONNECT = """
import threading
import kerasps
from kerasps.backend import _tf
from tensorflow.python.eager import context

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=2, num_ps=1))
coordinator = kerasps.ClusterCoordinator(strategy)
entered, release = threading.Event(), threading.Event()
update = context.pywrap_tfe.TFE_ContextUpdateServerDef

def waits_for_a_worker_gone_for_good(*args):  # TensorFlow's first RPC blocks until it answers
    entered.set()
    release.wait()
    return update(*args)

context.pywrap_tfe.TFE_ContextUpdateServerDef = waits_for_a_worker_gone_for_good
reconnect = threading.Thread(target=_tf.reconnect_cluster, args=(coordinator._tf_coordinator,))
reconnect.start()
assert entered.wait(60)
answers = []
poll = threading.Thread(target=lambda: answers.append(coordinator.running_workers()),
                        daemon=True)
poll.start()
poll.join(30)  # a deadline: the poll must not wait for the reconnection
in_time = list(answers)
release.set()
reconnect.join()
print("answers before the reconnection ended", in_time)
print("DONE", in_time == [[0, 1]])
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

CLUSTER_PER_CASE = """
import sys
import keras, numpy as np, tensorflow as tf, kerasps

def dataset_fn(context):
    x = np.arange(64, dtype="float32").reshape(-1, 1) / 64
    return tf.data.Dataset.from_tensor_slices((x, (x > 0.5).astype("float32"))).repeat().batch(8)

def predict_fn(context):
    return tf.data.Dataset.from_tensor_slices(np.ones((6, 1), "float32")).batch(2)

for case in range(int(sys.argv[1])):  # each case asks for a cluster of its own
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=2, num_ps=2),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile("sgd", "binary_crossentropy", steps_per_execution=1 + case % 2)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=4, verbose=0)
    assert model.predict(kerasps.DatasetCreator(predict_fn), steps=3, verbose=0).shape == (6, 1)
    with open("/proc/self/status") as f:
        print("THREADS", next(line.split()[1] for line in f if line.startswith("Threads:")))
print("DONE", True)
"""

# A strategy made right after `iter()` of another's per-worker dataset: the iterators
# are built by closures in the earlier coordinator's threads, after `iter()` returned.
STRATEGY_AFTER_STRATEGY = """
import sys
import numpy as np, tensorflow as tf, kerasps

shapes = [(2, 2), (2, 1)][:int(sys.argv[2])]

def dataset_fn(context):
    return tf.data.Dataset.from_tensor_slices(np.ones((6, 1), "float32")).batch(2)

for case in range(int(sys.argv[1])):
    workers, ps = shapes[case % len(shapes)]
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=workers, num_ps=ps))
    coordinator = kerasps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(kerasps.DatasetCreator(dataset_fn)))
print("DONE", True)
"""

# Clusters of several shapes in one process, as in a test suite or a notebook: each
# case trains and predicts, and the objects of earlier cases die at random points,
# before or after the next strategy connects.
CASES_ON_CLUSTERS_OF_SEVERAL_SHAPES = """
import gc, random, sys
import keras, numpy as np, tensorflow as tf, kerasps

def dataset_fn(context):
    x = np.arange(64, dtype="float32").reshape(-1, 1) / 64
    return tf.data.Dataset.from_tensor_slices((x, (x > 0.5).astype("float32"))).repeat().batch(8)

def predict_fn(context):
    return tf.data.Dataset.from_tensor_slices(np.ones((6, 1), "float32")).batch(2)

random.seed(int(sys.argv[2]))
leftovers = []
for case in range(int(sys.argv[1])):
    workers, ps = random.choice([(2, 2), (2, 1), (1, 1), (3, 2)])
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=workers, num_ps=ps),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(ps) if ps > 1 else None)
    if random.random() < 0.5:
        leftovers.clear()
    if random.random() < 0.5:
        gc.collect()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile("sgd", "binary_crossentropy", steps_per_execution=1 + case % 2)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=4, verbose=0)
    outputs = model.predict(kerasps.DatasetCreator(predict_fn), steps=3, verbose=0)
    coordinator = kerasps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(kerasps.DatasetCreator(predict_fn)))
    leftovers += [model, strategy, coordinator, iterator, outputs]
print("DONE", True)
"""

# Keras makes a coordinator when a model compiles under a strategy; a later strategy
# stops it, and the first strategy's model must still train.
EARLIER_STRATEGY_TRAINS_ON = """
import keras, numpy as np, kerasps

cluster = kerasps.cluster.in_process(num_workers=2, num_ps=2)
models = []
for _ in range(2):
    strategy = kerasps.ParameterServerStrategy(cluster)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    models.append(model)
x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
for model in reversed(models):
    model.train_on_batch(x, y)
    model.fit(x, y, epochs=1, verbose=0)
print("DONE", True)
"""

# Resources of a cluster's first connection deleted while the process is connected to
# it again, after another cluster: sync mode's gradient queues and a user's queue.
RESOURCES_OF_AN_EARLIER_CONNECTION = """
import gc, keras, numpy as np, tensorflow as tf, kerasps

first = kerasps.cluster.in_process(num_workers=1, num_ps=1)
other = kerasps.cluster.in_process(num_workers=2, num_ps=1)
strategy = kerasps.ParameterServerStrategy(first, mode="sync")
with tf.device("/job:ps/replica:0/task:0"):
    queue = tf.queue.FIFOQueue(1, tf.int32, shapes=[])
with strategy.scope():  # sync mode keeps a row update's gradients in queues on the ps
    model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(10, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.arange(8).reshape(-1, 1), np.ones((8, 1)), batch_size=4, steps_per_epoch=2,
          verbose=0)
kerasps.ParameterServerStrategy(other)
kerasps.ParameterServerStrategy(first)
del queue, model, strategy
gc.collect()
print("DONE", True)
"""

PREDICT_AGAIN_AND_AGAIN = """
import keras, numpy as np, tensorflow as tf, kerasps

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=2, num_ps=2))
with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])

def threads():
    return int(next(l for l in open("/proc/self/status") if l.startswith("Threads")).split()[1])

def dataset_fn(context):
    return tf.data.Dataset.from_tensor_slices(np.ones((6, 1), "float32")).batch(2)

model.predict(kerasps.DatasetCreator(dataset_fn), steps=3, verbose=0)
before = threads()
for _ in range(20):
    model.predict(kerasps.DatasetCreator(dataset_fn), steps=3, verbose=0)
    model.predict(np.ones((4, 1), "float32"), verbose=0)
print("threads added", threads() - before)
print("DONE", threads() - before < 20)  # 80 before the fix: 2 per call
"""


def run_chief(program, *args, timeout=600, env=None):
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", program, *args],
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    assert result.returncode == 0, (
        f"the chief exited with status {result.returncode}:\n{result.stderr[-4000:]}")
    assert "DONE True" in result.stdout
    return result


def test_liveness_polls_during_context_updates_do_not_crash_the_chief():
    """TensorFlow's `check_alive` reads the worker cache that `update_server_def` frees
    and replaces: when the pool's polls used it, the chief died with SIGSEGV (6 runs
    in 6). Polls now connect to the workers' ports and leave the context alone."""
    run_chief(POLLS_DURING_RECONNECTS)


def test_liveness_polls_answer_while_a_reconnection_waits_for_a_worker():
    """TensorFlow's failure handler reconnects with `update_server_def`, which waits until
    every worker answers: a poll serialised behind it never returned while a worker was
    gone for good, and neither did `fit` (its watcher thread is joined at the end)."""
    run_chief(POLL_DURING_A_BLOCKED_RECONNECT, timeout=300)


def test_a_coordinator_collected_in_its_worker_thread_holding_the_queue_lock_stops(
        make_strategy):
    """A default run hung for good in a strategy's constructor: a `ClusterCoordinator`,
    collected as a cycle inside its own worker thread while `_CoordinatedClosureQueue.get`
    held the queue's lock, ran TensorFlow's `__del__` there, whose `stop` waited for that
    lock; so did `stop_every_coordinator` in the main thread. The collection is played here
    by calling `__del__` with the lock held."""
    import threading
    import time

    from kerasps.backend import _tf

    strategy = make_strategy()
    coordinator = _tf.running_coordinator(strategy)
    queue = coordinator._cluster.closure_queue
    returned = threading.Event()

    def worker_thread_collecting():
        with queue._queue_lock:  # as `get` holds it when an allocation starts a collection
            coordinator.__del__()
        returned.set()

    threading.Thread(target=worker_thread_collecting, daemon=True).start()
    assert returned.wait(30), "__del__ waited for the queue lock its own thread held"
    deadline = time.monotonic() + 30
    while queue._should_process_closures:  # stopped once the lock is free
        assert time.monotonic() < deadline, "the collected coordinator's cluster never stopped"
        time.sleep(0.01)


COORDINATOR_COLLECTED_AT_EXIT = """
import gc
import kerasps
from kerasps.backend import _tf

strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=1, num_ps=1))
gc.disable()  # the cycle is left to the collection the interpreter makes as it exits
cycle = [_tf.running_coordinator(strategy)]
cycle.append(cycle)
del cycle
print("DONE True")
"""


def test_a_coordinator_collected_as_the_interpreter_exits_lets_the_chief_exit():
    """CI's default run failed on a chief that never exited: a coordinator collected while
    the interpreter finalised started its stop thread, which never runs then, and
    `Thread.start` waited for it for good (3 runs in 3 here)."""
    run_chief(COORDINATOR_COLLECTED_AT_EXIT, timeout=120)


@pytest.mark.stress
def test_fit_and_evaluate_with_validation_and_the_pool_watcher_do_not_crash_the_chief():
    """The reported crash: `fit` with `validation_data` and `steps_per_execution`
    while the pool watcher polls, then `evaluate`, again and again."""
    run_chief(FIT_AND_EVALUATE, "40", timeout=1800)


@pytest.mark.stress
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads in /proc")
def test_a_process_asking_for_a_cluster_per_case_does_not_run_out_of_threads():
    """A port of tf_keras' tests asks for an in-process cluster per case, in one process:
    servers TensorFlow cannot stop piled up (~450 threads per 2 x 2 cluster) until it
    could start no thread and aborted (here at the 12th to 70th cluster, with the
    per-process map count or the machine's process ids the limit). Now the cluster is
    the one of its shape; each new strategy's connection still adds about 7 of
    TensorFlow's threads (3 `tf_Compute`, 4 unnamed; Python's stay 4), which kerasps
    cannot stop (docs/limitations.md): 30 clusters, under 15 threads each after the
    first 5."""
    threads = [int(line.split()[1]) for line in run_chief(
        CLUSTER_PER_CASE, "30", timeout=1200).stdout.splitlines()
        if line.startswith("THREADS ")]
    assert len(threads) == 30
    assert (threads[-1] - threads[4]) / 25 < 15, threads


@pytest.mark.slow  # the default run's longest: predict again and again: ~30 s
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads in /proc")
def test_predict_called_again_and_again_adds_no_threads():
    """A long process (a notebook, a test suite) calls `predict` again and again: each
    call traced a new function, and a worker keeps a thread for every function that
    read an iterator in its inter-op threads (TensorFlow's `BackgroundWorker` of the
    `IteratorGetNext`-like kernels), 2 per call here (80 for these 40 calls)."""
    run_chief(PREDICT_AGAIN_AND_AGAIN)


@pytest.mark.parametrize("shapes", [1, 2])
def test_a_strategy_made_while_the_last_one_builds_iterators_does_not_crash_the_chief(shapes):
    """The reported SIGSEGV (issue 30): a new strategy resets the eager context while the
    earlier coordinator's threads still build the per-worker iterators of an `iter()`
    that returned, and a call there reads a freed remote device
    (`TensorHandle::DeviceName`). Before the earlier coordinators were stopped and
    waited for: SIGSEGV at the first switch to a cluster of another shape (3 runs in
    3), SIGABRT at exit on one shape (3 in 3)."""
    run_chief(STRATEGY_AFTER_STRATEGY, "20", str(shapes))


@pytest.mark.stress
def test_cases_on_clusters_of_several_shapes_in_one_process_do_not_crash_the_chief():
    """A test suite's or a notebook's history: 40 cases, each training and predicting on
    an in-process cluster of one of four shapes, earlier cases' objects dying before or
    after the next strategy connects. Before: SIGSEGV at the second case (2 seeds in 2).
    Each run draws another history: its seed is in the failure's message, and
    `KERASPS_STRESS_SEED=N` runs that history again."""
    seed = int(os.environ.get("KERASPS_STRESS_SEED", random.randrange(1, 1 << 16)))
    try:
        run_chief(CASES_ON_CLUSTERS_OF_SEVERAL_SHAPES, "40", str(seed), timeout=1200)
    except (AssertionError, subprocess.TimeoutExpired) as e:
        raise AssertionError(f"KERASPS_STRESS_SEED={seed}: {e}") from None


def test_resources_of_an_earlier_connection_to_the_same_cluster_are_deleted_safely():
    """The SIGSEGV at a test session's exit (issue 30): a queue made in a cluster's first
    connection, deleted once the process is connected to that cluster again after
    another, ran TensorFlow's delete op on the freed device of the first context (the
    device's incarnation is valid again, so TensorFlow's check passes). glibc fills
    freed memory here (`MALLOC_PERTURB_`), so that reading it crashes every time:
    SIGSEGV in 3 runs of 3 before; such resources are now left alone."""
    run_chief(RESOURCES_OF_AN_EARLIER_CONNECTION, timeout=300, env={"MALLOC_PERTURB_": "165"})


def test_a_model_of_an_earlier_strategy_on_the_same_cluster_trains_on():
    """A new strategy stops every coordinator before it connects, Keras' own too (made
    when a model compiles): the earlier strategy gets a new one. Before, its model's
    `train_on_batch` waited forever on the stopped one."""
    run_chief(EARLIER_STRATEGY_TRAINS_ON, timeout=300)
