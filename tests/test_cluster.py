"""Clusters of real processes: `kerasps serve` tasks wired by TF_CONFIG, and small machines."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import kerasps
from kerasps.runtime.ports import pick_port

DEADLINE = 240  # seconds: a hung cluster fails the test instead of the whole run


def run_python(code, env=None, timeout=DEADLINE):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_three_workers_on_two_cores_do_not_deadlock():
    # The custom loop of TensorFlow's tutorial hangs on 2 cores with TF's default
    # inter-op threads; kerasps' in-process servers get enough threads.
    out = run_python("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import keras, tensorflow as tf, kerasps
        strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(3, 2))
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                      keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.01)
        coordinator = kerasps.ClusterCoordinator(strategy)
        def dataset_fn(context):
            return tf.data.Dataset.from_tensors((tf.ones(4), tf.ones(1))).repeat().batch(8)
        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        @tf.function
        def step(iterator):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(replica, args=next(iterator))
        for _ in range(60):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        print("steps", int(optimizer.iterations.numpy()))
    """)
    assert "steps 60" in out


def test_in_process_servers_share_an_inter_op_pool_sized_for_all_their_tasks():
    # TensorFlow runs the ops of every server of a process on one inter-op pool
    # (`ComputePool`), sized by the first server started: the tasks of an in-process
    # cluster share it. Sized for one task (3 threads for 2 workers on 2 cores), the
    # pool's threads were all held by two workers' handlers, each waiting for a ps
    # task's answer that needed a free one: tests/test_errors.py hung 2 runs in 8,
    # and with it a whole CI run. Each task now brings the threads it would have
    # alone.
    out = run_python("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import kerasps
        kerasps.cluster.in_process(2, 2)
        def comm(tid):
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        print("POOL", sum(comm(t) == "tf_Compute" for t in os.listdir("/proc/self/task")))
    """)
    [pool] = [int(line.split()[1]) for line in out.splitlines() if line.startswith("POOL")]
    alone = kerasps.cluster.server_config("worker", 2).inter_op_parallelism_threads
    assert pool >= 4 * alone  # 2 workers and 2 ps


def test_in_process_runs_one_cluster_of_each_shape_however_often_asked():
    # Each in-process cluster of 2 workers and 2 ps holds ~450 threads that TensorFlow
    # cannot stop: a test suite asking for a cluster per test aborted its process after
    # some dozens ("Thread GrpcWorkerEnvPool creation via pthread_create() failed").
    out = run_python("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import keras, tensorflow as tf, kerasps
        def threads():
            return len(os.listdir("/proc/self/task"))
        def addresses(resolver):
            return sorted(sum(resolver.cluster_spec().as_dict().values(), []))
        first = kerasps.cluster.in_process(2, 2)
        started = threads()
        for _ in range(3):
            again = kerasps.cluster.in_process(2, 2)
            strategy = kerasps.ParameterServerStrategy(again)
            with strategy.scope():
                model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
                model.compile("sgd", "mse")
            model.fit(tf.data.Dataset.from_tensors((tf.ones((4, 2)), tf.ones((4, 1))))
                      .repeat(), steps_per_epoch=2, epochs=1, verbose=0)
            assert addresses(again) == addresses(first)
        other = kerasps.cluster.in_process(1, 2)
        assert not set(addresses(other)) & set(addresses(first))
        print("GROWTH", threads() - started)
    """)
    [growth] = [int(line.split()[1]) for line in out.splitlines() if line.startswith("GROWTH")]
    # A second cluster (1 worker, 2 ps) starts its own servers; 3 more of 2 x 2 did not.
    assert growth < 2 * 450


def test_exactly_once_input_of_one_spec_reads_on_a_second_cluster():
    # TensorFlow caches the tf.data service reader's uncompress function per element
    # spec, in the context of the cluster connected then: the second cluster's `fit`
    # failed with "Could not find required function definition
    # __inference_DataServiceDataset_uncompress_lambda_N".
    out = run_python("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import keras, numpy as np, kerasps
        x, y = np.ones((32, 2), "float32"), np.ones((32, 1), "float32")
        for workers in (1, 2):
            strategy = kerasps.ParameterServerStrategy(kerasps.cluster.in_process(workers, 1))
            with strategy.scope():
                model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
                model.compile("sgd", "mse")
            history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            print("EPOCHS", len(history.history["loss"]))
    """)
    assert out.count("EPOCHS 1") == 2


def test_in_process_sets_grpc_fail_fast_and_counts_tasks(cluster):
    assert os.environ["GRPC_FAIL_FAST"] == "use_caller"
    jobs = cluster.cluster_spec().as_dict()
    assert len(jobs["worker"]) == 2 and len(jobs["ps"]) == 2
    assert all(a.startswith("localhost:") for a in jobs["worker"] + jobs["ps"])


@pytest.mark.parametrize("kwargs, name", [({"num_workers": 0}, "num_workers"),
                                          ({"num_ps": -1}, "num_ps"),
                                          ({"num_workers": 1.5}, "num_workers")])
def test_in_process_rejects_bad_counts(kwargs, name):
    with pytest.raises(ValueError, match=rf"argument `{name}`.*Received: {name}="):
        kerasps.cluster.in_process(**kwargs)


# -- in_process() in a task of `kerasps launch` (no server starts: monkeypatched environment) ---
LAUNCHED_TF_CONFIG = json.dumps({
    "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"],
                "ps": ["localhost:4"]},
    "task": {"type": "chief", "index": 0}})


@pytest.fixture
def launched_chief(monkeypatch):
    """This process as `kerasps launch` makes its chief: TF_CONFIG and $KERASPS_TASK."""
    monkeypatch.setenv("TF_CONFIG", LAUNCHED_TF_CONFIG)
    monkeypatch.setenv("KERASPS_TASK", "chief 0")
    return monkeypatch


def test_in_process_in_a_launched_job_stops_it_naming_what_to_call(launched_chief, cluster):
    """A script that kept `in_process()` under `kerasps launch` trained on a cluster of its
    own while the launched servers sat idle (it only warned): it now raises, starting
    nothing, and says what to call instead."""
    from kerasps.runtime import cluster as cluster_lib

    servers = list(cluster_lib._SERVERS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a warning besides
        with pytest.raises(RuntimeError) as raised:
            kerasps.cluster.in_process(num_workers=2, num_ps=2)
    message = str(raised.value)
    assert message.startswith(
        "kerasps.cluster.in_process() was called in chief 0 of a `kerasps launch` job "
        "(TF_CONFIG: 2 workers, 1 ps tasks), so it started no cluster"), message
    assert "kerasps.cluster.resolve(num_workers=2, num_ps=2)" in message
    assert "kerasps.cluster.from_tf_config()" in message
    assert "under_launch='allow'" in message
    assert cluster_lib._SERVERS == servers


def test_in_process_in_a_launched_job_starts_its_cluster_when_told_it_is_meant(
        launched_chief, cluster):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = kerasps.cluster.in_process(num_workers=2, num_ps=2, under_launch="allow")
    assert resolver.cluster_spec().as_dict() == cluster.cluster_spec().as_dict()


def test_in_process_only_warns_where_tf_config_is_set_outside_kerasps_launch(
        launched_chief, cluster):
    launched_chief.delenv("KERASPS_TASK")  # a TF_CONFIG of the user's, or a TFJob's pod
    with pytest.warns(UserWarning, match=r"in_process\(\) was called in a process whose "
                                         r"TF_CONFIG names a cluster"):
        resolver = kerasps.cluster.in_process(num_workers=2, num_ps=2)
    assert resolver.cluster_spec().as_dict() == cluster.cluster_spec().as_dict()


def test_in_process_rejects_an_unknown_under_launch_value(launched_chief):
    with pytest.raises(ValueError, match=r"Invalid value for argument `under_launch`: "
                                         r"expected 'error' or 'allow'\. "
                                         r"Received: under_launch='yes'"):
        kerasps.cluster.in_process(num_workers=2, num_ps=2, under_launch="yes")


def test_serve_refuses_a_chief_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]},
        "task": {"type": "chief", "index": 0}}))
    with pytest.raises(ValueError, match=r"`task.type`.*Received: task.type='chief'"):
        kerasps.cluster.serve()


@pytest.mark.slow  # a cluster of real processes
def test_model_fit_on_a_cluster_of_real_processes_wired_by_tf_config(tmp_path):
    cluster = {
        "chief": [f"localhost:{pick_port()}"],
        "worker": [f"localhost:{pick_port()}" for _ in range(2)],
        "ps": [f"localhost:{pick_port()}"],
    }
    base_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    servers = []
    try:
        for task_type in ("worker", "ps"):
            for index in range(len(cluster[task_type])):
                env = {**base_env, "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": task_type, "index": index}})}
                servers.append(subprocess.Popen(
                    [sys.executable, "-m", "kerasps.cli", "serve"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        chief_env = {**base_env, "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": "chief", "index": 0}})}
        out = run_python("""
            import keras, tensorflow as tf, kerasps
            strategy = kerasps.ParameterServerStrategy(
                kerasps.cluster.from_tf_config(),
                variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
            with strategy.scope():
                model = keras.Sequential([keras.Input((1,), dtype="int32"),
                                          keras.layers.Embedding(100, 4),
                                          keras.layers.Flatten(), keras.layers.Dense(1)])
                model.compile("adam", "mse")
            def dataset_fn(context):
                ids = tf.data.Dataset.range(100).map(lambda i: tf.cast([i], tf.int32))
                return tf.data.Dataset.zip((ids, ids.map(lambda i: tf.cast(i % 2, "float32"))
                                            )).repeat().batch(10)
            history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2,
                                steps_per_epoch=10, verbose=0)
            devices = sorted({s.value.device for s in model.layers[0].embeddings.shards})
            print("iterations", int(model.optimizer.iterations.numpy()))
            print("devices", devices)
        """, env=chief_env)
        assert "iterations 20" in out
        assert "/job:ps/replica:0/task:0/device:CPU:0" in out
        # All servers are still serving: nothing crashed underneath the chief.
        assert all(p.poll() is None for p in servers)
    finally:
        for process in servers:
            process.kill()
            process.wait(timeout=30)


def test_a_reconnection_waits_for_a_moved_task_and_goes_to_its_new_address(monkeypatch,
                                                                            caplog):
    # A Ray actor restarted on another node serves at a new address; the resolver says so
    # some time after the task was lost. A reconnection waits for it and goes there.
    import socket

    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2

    from kerasps.backend import _tf

    listeners = []
    for _ in range(3):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listeners.append(listener)
    chief, worker, moved = (f"127.0.0.1:{s.getsockname()[1]}" for s in listeners)
    lost = f"127.0.0.1:{pick_port()}"  # nothing serves there
    old = {"chief": [chief], "worker": [worker], "ps": [lost]}
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec(old).as_cluster_def(), job_name="chief", task_index=0,
        protocol="grpc")
    asked = []

    class Resolver:  # the task's new address is known from the third look on
        def cluster_spec(self):
            asked.append(1)
            return tf.train.ClusterSpec(dict(old, ps=[moved]) if len(asked) >= 3 else old)

    monkeypatch.setattr(_tf, "_followed_resolver", Resolver())
    monkeypatch.setattr(_tf, "RECONNECT_POLL_S", 0.01)
    try:
        with caplog.at_level("WARNING", logger="kerasps"):
            updated = _tf._where_tasks_serve(server_def)
    finally:
        for listener in listeners:
            listener.close()
    assert len(asked) == 3
    assert tf.train.ClusterSpec(updated.cluster).as_dict() == dict(old, ps=[moved])
    assert (updated.job_name, updated.task_index) == ("chief", 0)
    assert tf.train.ClusterSpec(server_def.cluster).as_dict() == old  # not changed in place
    assert [r.getMessage() for r in caplog.records] == [
        f"ps 0 serves at {moved} now (was {lost}): reconnecting there."]
    assert _tf.moved_tasks(server_def, tf.train.ClusterSpec(old)) == {}


@pytest.mark.parametrize("moving", [False, True])
def test_only_a_cluster_whose_tasks_move_changes_how_tensorflow_connects(monkeypatch, moving):
    # TF_CONFIG and in-process clusters keep TensorFlow's own connections: each ps task
    # sees the workers and the chief, a reconnection goes to the addresses it knows. A
    # resolver whose tasks move (Ray's) shows each ps task the others and makes each
    # reconnection follow it.
    import tensorflow as tf
    from tensorflow.python.training import server_lib

    from kerasps.backend import _tf

    class Resolver:
        tasks_move = moving

        def cluster_spec(self):
            return tf.train.ClusterSpec({"chief": ["localhost:1"], "ps": ["localhost:2"]})

    monkeypatch.setattr(_tf, "_followed_resolver", None)
    monkeypatch.setattr(_tf, "_ps_see_ps", False)
    resolver = Resolver()
    _tf.follow_resolver(resolver)
    filters = server_lib.ClusterDeviceFilters()
    filters.set_device_filters("ps", 0, ["/job:worker", "/job:chief"])
    filters.set_device_filters("worker", 0, ["/job:ps", "/job:chief"])
    expected = ["/job:worker", "/job:chief"] + (["/job:ps"] if moving else [])
    assert filters._device_filters["ps"][0] == expected
    assert filters._device_filters["worker"][0] == ["/job:ps", "/job:chief"]
    assert _tf._followed_resolver is (resolver if moving else None)
