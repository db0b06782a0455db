"""`kerasps.ray.cluster`: the worker and ps tasks as Ray actors on simulated Ray nodes.

One Ray cluster serves the module (`ray.cluster_utils.Cluster`: a head with no CPUs, so that
every task goes to the nodes added to it, and two 1-CPU nodes), every process of it on
loopback. A process's TensorFlow connects to one cluster: the chief of the Ray job is a
driver program of its own (`DRIVER`), run once for the module; it trains, kills its worker's
process mid-`fit`, shuts the job down and prints what it saw as JSON lines, which the tests
read. The same training runs under an in-process cluster in another process, beside it.
"""

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import types

import pytest

from tests.launched import add_ray_node, default_sigint

# Ray would serve its nodes on the machine's interface address and turn 127.0.0.1 given to
# `ray.init` into that address; with its multi-node support off, it stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 480  # one driver program; it takes about a minute and a half here

# The training both clusters run: one worker, a fixed seed and data.
TRAINING = """
    import json, os, signal, sys
    import numpy as np
    import keras, tensorflow as tf, kerasps

    def report(key, value):
        print("REPORT " + json.dumps({key: value}), flush=True)

    def build(strategy):
        keras.utils.set_random_seed(7)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    def dataset_fn(context):
        x = tf.random.stateless_uniform((64, 4), [1, context.input_pipeline_id])
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

    def train(strategy):
        model = build(strategy)
        history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=8,
                            verbose=0)
        report("loss", history.history["loss"])
        report("weights", [w.tolist() for w in model.get_weights()])
        return model

    def wait_for(path):  # a file the test makes once it did what the driver asked
        import time
        deadline = time.monotonic() + 120
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def fit_with_backup(model, on_batch):
        # 2 x 10 steps, a backup every 5: what a fault inside this fit may roll back.
        import tempfile
        history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=10,
                            verbose=0, callbacks=[
                                keras.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=5),
                                keras.callbacks.LambdaCallback(on_train_batch_end=on_batch)])
        return dict(iterations=int(model.optimizer.iterations.numpy()),
                    reexecuted=sum(history.history.get("reexecuted_steps", [0])),
                    rolled_back=sum(history.history.get("rolled_back_steps", [0])),
                    loss=history.history["loss"])
"""

IN_PROCESS = TRAINING + """
    train(kerasps.ParameterServerStrategy(kerasps.cluster.in_process(num_workers=1, num_ps=1)))
"""

DRIVER = TRAINING + """
    import tempfile, time
    import ray

    ray.init(address=sys.argv[1])
    resolver = kerasps.ray.cluster(num_workers=1, num_ps=1)
    report("tasks", [dict(resolver.info(t.task_type, t.index), name=t.name,
                          address=t.address, task_node_id=t.node_id) for t in resolver.tasks])
    report("spec", resolver.cluster_spec().as_dict())
    strategy = kerasps.ParameterServerStrategy(resolver)
    model = train(strategy)
    logs = model.evaluate(kerasps.DatasetCreator(dataset_fn), steps=4, verbose=0,
                          return_dict=True)
    report("evaluate", logs)
    x = np.random.default_rng(0).uniform(size=(16, 4)).astype("float32")
    report("predict", model.predict(x, batch_size=8, verbose=0).tolist())

    # The worker's process SIGKILLed mid-fit: Ray starts it again on its address.
    pid = resolver.pid("worker", 0)
    done = []

    def kill(batch, logs):
        done.append(batch)
        if len(done) == 5:
            os.kill(pid, signal.SIGKILL)

    before = int(model.optimizer.iterations.numpy())
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=10,
                        verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_end=kill)])
    report("killed", dict(
        pid=pid, pid_after=resolver.pid("worker", 0), batches=len(done),
        iterations=int(model.optimizer.iterations.numpy()) - before,
        reexecuted=sum(history.history.get("reexecuted_steps", [0])),
        address_after=resolver.cluster_spec().as_dict()["worker"][0]))

    # The ps task's process SIGKILLed mid-fit: Ray starts it again on its address, empty,
    # and the same fit restores its variables from the latest backup.
    model = build(strategy)
    ps_pid = resolver.pid("ps", 0)
    done = []

    def kill_ps(batch, logs):
        done.append(batch)
        if len(done) == 7:
            os.kill(ps_pid, signal.SIGKILL)

    fitted = fit_with_backup(model, kill_ps)
    report("ps_killed", dict(pid=ps_pid, pid_after=resolver.pid("ps", 0), **fitted))

    pids = [resolver.pid(t.task_type, t.index) for t in resolver.tasks]
    group = resolver.placement_group.id.hex()
    started = time.monotonic()
    resolver.shutdown()
    report("shutdown", dict(
        seconds=time.monotonic() - started, pids=pids, group=group,
        actors={a["ActorID"]: a["State"] for a in ray._private.state.actors().values()},
        groups={g: v["state"] for g, v in ray.util.placement_group_table().items()},
        connected=ray.is_initialized()))

    # A task whose restart budget is spent ends the running fit (one worker: it would wait
    # for the worker for good), as under `kerasps launch`.
    resolver = kerasps.ray.cluster(num_workers=1, num_ps=1, max_restarts=0)
    model = build(kerasps.ParameterServerStrategy(resolver))
    worker = resolver.tasks[0]
    pid, killed = resolver.pid("worker", 0), []

    def kill_for_good(batch, logs):
        if batch == 3 and not killed:
            killed.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

    try:
        model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=20, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=kill_for_good)])
        raised = None
    except kerasps.TaskFailedError as e:
        raised = str(e)
    report("budget_spent", dict(error=raised, seconds=time.monotonic() - killed[0],
                                node=worker.node_id, address=worker.address,
                                failure=resolver.failure))
    resolver.shutdown()
"""

# The node holding the ps task lost mid-`fit` (the test removes it when the driver says
# so): Ray places the ps task's bundle on the spare node, the task serves at a new address
# there, and the same `fit` reconnects to it and restores its variables from the backup.
NODE_LOSS = TRAINING + """
    import pathlib
    import ray

    ray.init(address=sys.argv[1])
    removed = pathlib.Path(sys.argv[2])
    resolver = kerasps.ray.cluster(num_workers=1, num_ps=1)
    ps = resolver.tasks[1]
    model = build(kerasps.ParameterServerStrategy(resolver))
    done = []

    def lose_node(batch, logs):
        done.append(batch)
        if len(done) == 7:
            report("remove", ps.node_id)
            wait_for(removed)

    fitted = fit_with_backup(model, lose_node)
    moved = resolver.tasks[1]
    report("node_lost", dict(
        before=dict(address=ps.address, node=ps.node_id),
        after=dict(address=moved.address, node=moved.node_id,
                   spec=resolver.cluster_spec().as_dict()["ps"][0],
                   actor_node=resolver.info("ps", 0)["node_id"]), **fitted))
    resolver.shutdown()
"""

# The node of worker 1 lost mid-`fit`, with no spare node: the pool goes on with worker 0;
# once the test adds a node, Ray places the worker's bundle there, the worker serves at a
# new address, and it rejoins the pool inside the same `fit`.
WORKER_NODE_LOSS = TRAINING + """
    import logging, pathlib, time
    import ray

    ray.init(address=sys.argv[1])
    control = pathlib.Path(sys.argv[2])
    resolver = kerasps.ray.cluster(num_workers=2, num_ps=1)
    worker = resolver.tasks[1]
    strategy = kerasps.ParameterServerStrategy(resolver)
    model = build(strategy)
    done = []

    class Pool(logging.Handler):  # the pool's changes, as kerasps logs them
        def __init__(self):
            super().__init__()
            self.changes = []

        def emit(self, record):
            self.changes.append(record.getMessage())

        def wait_for(self, change):
            deadline = time.monotonic() + 120
            while not any(m.startswith(change) for m in self.changes):
                assert time.monotonic() < deadline, (change, self.changes)
                time.sleep(0.05)

    pool = Pool()
    logging.getLogger("kerasps").addHandler(pool)

    def lose_node(batch, logs):
        done.append(batch)
        if len(done) == 5:
            report("remove", worker.node_id)
            wait_for(control / "removed")
            pool.wait_for("worker 1 left")  # epoch 1 ends with worker 0 alone

    def add_node(epoch, logs):
        if epoch == 2:  # epoch 2 ran on worker 0 alone: the node comes back for epoch 3
            report("add", True)
            wait_for(control / "added")
            pool.wait_for("worker 1 joined")

    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=10,
                        verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_end=lose_node, on_epoch_begin=add_node)])
    moved = resolver.tasks[1]
    report("worker_node_lost", dict(
        before=dict(address=worker.address, node=worker.node_id),
        after=dict(address=moved.address, node=moved.node_id),
        workers=history.history["workers"],
        iterations=int(model.optimizer.iterations.numpy()),
        reexecuted=sum(history.history.get("reexecuted_steps", [0])),
        loss=history.history["loss"]))
    resolver.shutdown()
"""

# A driver that ends mid-`fit` without shutting its cluster down: Ctrl-C (SIGINT), or an
# exception it does not catch. It reports its tasks, then trains until it is stopped.
ENDED_MID_FIT = TRAINING + """
    import ray

    ray.init(address=sys.argv[1])
    resolver = kerasps.ray.cluster(num_workers=1, num_ps=1)
    report("job", dict(pids=[resolver.pid(t.task_type, t.index) for t in resolver.tasks],
                       addresses=[t.address for t in resolver.tasks],
                       group=resolver.placement_group.id.hex(),
                       actors=[a._actor_id.hex() for a in map(
                           lambda t: resolver.actor(t.task_type, t.index), resolver.tasks)]))
    model = build(kerasps.ParameterServerStrategy(resolver))

    def on_batch(batch, logs):
        if batch == 2:
            if sys.argv[2] == "exception":
                raise ValueError("a bug in the program")
            report("training", True)

    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1000, steps_per_epoch=10, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=on_batch)])
"""

# A program that never started Ray: `cluster` starts a local one, which stops with it.
LOCAL_RAY = """
    import json
    import kerasps, ray

    with kerasps.ray.cluster(num_workers=1, num_ps=1, placement="pack", init_kwargs=dict(
            num_cpus=2, include_dashboard=False)) as resolver:
        print("REPORT", json.dumps({"nodes": len({t.node_id for t in resolver.tasks}),
                                    "connected": ray.is_initialized()}))
    print("REPORT", json.dumps({"connected_after": ray.is_initialized()}))
"""


def _reports(output: str) -> dict:
    found = {}
    for line in output.splitlines():
        if line.startswith("REPORT "):
            found.update(json.loads(line[len("REPORT "):]))
    return found


_DRIVERS: list = []  # every program `_start` started: a failed test's are killed after it


def _start(program: str, *args, env=None) -> subprocess.Popen:
    output = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stop the program
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(program), *args],
                               stdout=output, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               env={**(os.environ if env is None else env), "PYTHONPATH": ROOT},
                               preexec_fn=default_sigint)
    process.output = output
    _DRIVERS.append(process)
    return process


def _finish(process: subprocess.Popen) -> dict:
    try:
        process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.output.seek(0)
    output = process.text = process.output.read()
    process.output.close()
    assert process.returncode == 0, output[-6000:]
    return _reports(output)


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


# -- cheap: no Ray cluster ---------------------------------------------------------------------
def test_importing_kerasps_imports_no_ray():
    code = "import sys, kerasps; assert 'ray' not in sys.modules, 'ray imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_workers=0), "Received: num_workers=0"),
    (dict(num_ps=1.5), "Received: num_ps=1.5"),
    (dict(worker_resources={"num_gpus": 1}), "as Ray's placement groups do"),
    (dict(worker_resources={"CPU": -1}), "Received: worker_resources={'CPU': -1}"),
    (dict(ps_resources={"CPU": 1, "GPU": 1}), "asks Ray for no GPU"),
    (dict(worker_resources={"CPU": 0}), "cannot be empty"),
    (dict(placement="everywhere"), "Received: placement='everywhere'"),
    (dict(max_restarts=-2), "Received: max_restarts=-2"),
    (dict(placement_timeout_s=0), "Received: placement_timeout_s=0"),
    (dict(init_kwargs=["num_cpus"]), "Received: init_kwargs=['num_cpus']"),
])
def test_bad_arguments_raise_before_ray_is_imported(monkeypatch, kwargs, message):
    import kerasps.ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` would raise
    with pytest.raises(ValueError, match="Invalid value for argument") as raised:
        kerasps.ray.cluster(**kwargs)
    assert message in str(raised.value)


def test_without_ray_the_error_names_the_extra(monkeypatch):
    import kerasps.ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r'pip install "kerasps\[ray\]"'):
        kerasps.ray.cluster(num_workers=1, num_ps=1)


def test_an_unsupported_ray_version_is_refused(monkeypatch):
    import kerasps.ray

    old = types.ModuleType("ray")
    old.__version__ = "2.8.1"
    monkeypatch.setitem(sys.modules, "ray", old)
    with pytest.raises(RuntimeError, match=r"needs Ray 2\.9 or newer; this is Ray 2\.8\.1"):
        kerasps.ray.cluster(num_workers=1, num_ps=1)


FAIL_CHIEF = """
    import signal, threading, time
    from kerasps.runtime import launch_env

    def wait_for(done):
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)

    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("previous"))
    assert launch_env.install_chief_handler(anywhere=True)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    wait_for(lambda: seen)
    print("without a reason:", seen, launch_env.job_failed())
    try:  # raised wherever the main thread is, here as soon as the thread starts
        threading.Thread(target=launch_env.fail_chief, args=("ps 0 died",)).start()
        wait_for(lambda: False)
    except launch_env.TaskFailedError as e:
        print("raised:", e, "|", launch_env.job_failed())
"""


def test_fail_chief_raises_in_the_main_thread_and_other_sigterms_go_to_the_previous_handler():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(FAIL_CHIEF)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["without a reason: ['previous'] None",
                                          "raised: The job failed: ps 0 died. | ps 0 died"]


def test_a_node_that_registers_after_rays_own_wait_is_still_added(monkeypatch):
    """CI failed a test of simulated nodes at `add_node`: Ray waits a fixed 30 s for a new
    node to register, polling `services.get_node`, and two loaded cores took longer. A
    cluster whose wait is 0.2 s here and whose node registers after 0.5 s."""
    services = pytest.importorskip("ray._private.services")
    registered_at = time.monotonic() + 0.5

    def get_node(gcs_address, node_id):
        if time.monotonic() < registered_at:
            raise RuntimeError("RPC error: Deadline Exceeded")
        return {"node_id": node_id}

    class Cluster:  # `Cluster.add_node` -> `Node.__init__`'s wait, in short
        def add_node(self, **node_args):
            start = time.monotonic()
            while True:
                try:
                    return services.get_node("gcs", "node 1")
                except RuntimeError:
                    if time.monotonic() - start > 0.2:
                        raise Exception("The current node timed out during startup.") from None
                time.sleep(0.05)

    monkeypatch.setattr(services, "get_node", get_node)
    with pytest.raises(Exception, match="timed out during startup"):
        Cluster().add_node(num_cpus=1)
    assert add_ray_node(Cluster()) == {"node_id": "node 1"}
    assert services.get_node is get_node  # Ray's own again


# A task's server whose port another process took between the pick and the start (the CI
# machine's kernel gave picked ports to the starting actors' outgoing connections).
TAKEN_PORT = """
    import json, socket, sys
    from kerasps.runtime import ray_server
    from kerasps.runtime.ports import pick_port

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = f"127.0.0.1:{holder.getsockname()[1]}"
    ps = f"127.0.0.1:{pick_port()}"
    task = ray_server.TaskServer({"worker": [taken], "ps": [ps]}, "worker", 0, cpus=1,
                                 hide_gpus=True)
    host, port = task.address.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=10).close()  # it serves there
    print("REPORT", json.dumps({"taken": taken, "address": task.address}), flush=True)
"""


def test_a_task_whose_port_another_process_took_serves_at_another_port_of_its_host():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(TAKEN_PORT)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["address"].startswith("127.0.0.1:") and report["address"] != report["taken"]
    assert (f"kerasps: worker 0 could not serve at {report['taken']} (another process took "
            f"the port); serving at {report['address']} instead.") in result.stdout


def test_a_ray_drivers_output_is_split_into_its_own_lines_and_its_actors():
    from kerasps.ops.console import RayActorLines

    lines = RayActorLines()
    # An actor's line inside the chief's progress bar's line, and one cut in two chunks.
    assert lines.split(b"Epoch 1/2\n\r 1/10 \xe2\x94\x81(worker 0 pid=12) serving\n"
                       b"(raylet) a note\n(ps 1 pid=3, ip=10.0.0.3) hel") == [
        (None, b"Epoch 1/2\n\r 1/10 \xe2\x94\x81"), ("worker 0", b"serving\n"),
        (None, b"(raylet) a note\n")]
    assert lines.split(b"lo\nloss (mse") == [("ps 1", b"hello\n"), (None, b"loss ")]
    assert lines.split(b")\n(work") == [(None, b"(mse)\n")]
    assert lines.split(b"er 11 pid=9) z\n") == [("worker 11", b"z\n")]
    assert lines.split(b"(ps 0 pid=4) last", final=True) == [("ps 0", b"last")]


def test_under_launch_with_the_ray_engine_resolve_makes_the_jobs_ray_cluster(monkeypatch):
    import kerasps
    from kerasps.ops import launch_spec
    from kerasps.runtime import ray_cluster

    spec = launch_spec.LaunchSpec(program=("train.py",), workers=3, ps=2, max_restarts=1,
                                  engine="ray", address="auto", gpus_per_worker=1)
    assert spec.tasks == [launch_spec.Task("chief", 0)]  # Ray starts the others
    env = launch_spec._environment(spec, {}, spec.tasks[0], {"TF_CONFIG": "{}"}, "/scratch")
    assert "TF_CONFIG" not in env and env["RAY_COLOR_PREFIX"] == "0"
    made = []
    monkeypatch.setattr(ray_cluster, "cluster", lambda **kwargs: made.append(kwargs) or "ray")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert kerasps.cluster.resolve() == "ray"
    assert made == [dict(num_workers=3, num_ps=2, max_restarts=1, address="auto",
                         worker_resources={"CPU": 1, "GPU": 1}, announce=True)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(engine="spark"), "expected one of ['local', 'ray']. Received: engine='spark'"),
    (dict(address="auto"), "Received: address='auto' with engine='local'"),
    (dict(engine="ray", evaluator=True), "Received: evaluator=True with engine='ray'"),
    (dict(engine="ray", workers=3, min_workers=1),
     "Received: min_workers=1 with engine='ray'"),
])
def test_a_launch_spec_refuses_what_the_ray_engine_cannot_run(kwargs, message):
    from kerasps.ops import launch_spec

    with pytest.raises(ValueError, match="Invalid value for argument") as raised:
        launch_spec.LaunchSpec(program=("train.py",), **kwargs)
    assert message in str(raised.value)


def test_a_chief_that_reports_a_spent_budget_ends_the_launched_job(tmp_path):
    """Under the ray engine the chief (the Ray driver) learns that an actor is dead for
    good, writes why to the launcher's report file and fails: the launcher ends the job
    rather than restart it (a chief failing without a report is restarted)."""
    import io

    from kerasps.ops import launch

    pytest.importorskip("ray")  # the ray engine checks it is installed
    script = tmp_path / "chief.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        report = os.environ["KERASPS_LAUNCH_REPORT"]
        if os.path.exists(report + ".once"):
            open(report, "w").write("worker 0 (Ray actor) died and its restart budget is spent")
        open(report + ".once", "w").close()
        sys.exit(1)
    """))
    out = io.StringIO()
    spec = launch.LaunchSpec(program=(str(script),), engine="ray", max_restarts=3)
    assert launch.Launcher(spec, out=out).run() == 1
    lines = out.getvalue().splitlines()
    assert "[launcher] chief 0 exited with exit code 1; restart 1 of 3" in lines, lines
    assert lines[-1] == ("[launcher] ending the job: worker 0 (Ray actor) died and its restart "
                         "budget is spent"), lines


# -- slow: a Ray cluster of simulated nodes ------------------------------------------------------
@pytest.fixture(scope="module")
def ray_nodes():
    """A Ray cluster of a head without CPUs and two 1-CPU nodes, this process connected."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        nodes = [add_ray_node(cluster) for _ in range(2)]
        ray.init(address=cluster.address)
        yield types.SimpleNamespace(address=cluster.address, head=cluster.head_node.node_id,
                                    nodes=[node.node_id for node in nodes], cluster=cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def all_resources_back(request):
    """After each test on `ray_nodes`: its driver programs ended (killed if the test failed
    before they did) and every CPU of the cluster free again within a deadline, so that what
    a test left holding resources fails that test, not the next ones (which Ray could not
    place)."""
    yield
    while _DRIVERS:
        driver = _DRIVERS.pop()
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    if "ray_nodes" not in request.fixturenames:
        return
    import ray

    deadline = time.monotonic() + 60
    while (free := ray.available_resources().get("CPU", 0)) < (
            total := ray.cluster_resources().get("CPU", 0)):
        assert time.monotonic() < deadline, (
            f"{total - free} of the cluster's {total} CPUs still held 60 s after the test: "
            f"actors {[a for a in ray._private.state.actors().values() if a['State'] != 'DEAD']}"
            f", placement groups {ray.util.placement_group_table()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(ray_nodes):
    """The driver program's reports, and the in-process run's (run beside it)."""
    in_process = _start(IN_PROCESS)
    driver = _start(DRIVER, ray_nodes.address)
    return types.SimpleNamespace(driver=_finish(driver), in_process=_finish(in_process))


@pytest.mark.slow
def test_tasks_land_on_distinct_nodes_and_fit_evaluate_predict_work(ray_nodes, runs):
    tasks = runs.driver["tasks"]
    assert [task["name"] for task in tasks] == ["worker 0", "ps 0"]
    assert sorted(task["node_id"] for task in tasks) == sorted(ray_nodes.nodes)  # spread
    assert [task["task_node_id"] for task in tasks] == [task["node_id"] for task in tasks]
    spec = runs.driver["spec"]
    assert spec["worker"] == [tasks[0]["address"]] and spec["ps"] == [tasks[1]["address"]]
    assert len(spec["chief"]) == 1 and spec["chief"][0].startswith("127.0.0.1:")
    for task in tasks:  # one CPU each, no GPU asked: TensorFlow's pools and devices follow
        assert task["intra_op_threads"] == 1 and task["inter_op_threads"] == 2
        assert task["gpus"] == 0 and task["cuda_visible_devices"] == ""
    loss = runs.driver["loss"]
    assert loss[-1] < loss[0] / 2, loss
    assert set(runs.driver["evaluate"]) == {"loss"}
    predictions = runs.driver["predict"]
    assert len(predictions) == 16 and all(len(p) == 1 for p in predictions)


@pytest.mark.slow
def test_a_one_worker_fit_equals_the_same_fit_on_an_in_process_cluster(runs):
    import numpy as np

    np.testing.assert_allclose(runs.driver["loss"], runs.in_process["loss"], rtol=1e-6)
    for ray_weight, in_process_weight in zip(runs.driver["weights"], runs.in_process["weights"],
                                             strict=True):
        np.testing.assert_allclose(ray_weight, in_process_weight, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_worker_process_killed_mid_fit_is_restarted_on_its_address_and_every_step_runs(runs):
    killed = runs.driver["killed"]
    assert killed["pid_after"] != killed["pid"]  # Ray started the actor again
    assert killed["address_after"] == runs.driver["tasks"][0]["address"]
    assert killed["batches"] == 20
    # Every requested step ran; a step run again is counted, not hidden.
    assert killed["iterations"] == 20 + killed["reexecuted"]


@pytest.mark.slow
def test_a_ps_process_killed_mid_fit_is_restored_from_the_backup_inside_the_same_fit(runs):
    killed = runs.driver["ps_killed"]
    assert killed["pid_after"] != killed["pid"]
    # The same fit went on from the backup: every requested step ran once on the restored
    # state, at most `save_freq` steps were run again.
    assert killed["iterations"] == 20 + killed["reexecuted"]
    assert 0 < killed["rolled_back"] <= 5
    assert all(math.isfinite(loss) for loss in killed["loss"])


@pytest.mark.slow
def test_shutdown_leaves_no_actor_placement_group_process_or_port(ray_nodes, runs):
    shutdown = runs.driver["shutdown"]
    assert shutdown["actors"] and set(shutdown["actors"].values()) == {"DEAD"}
    assert shutdown["groups"][shutdown["group"]] == "REMOVED"
    for pid in shutdown["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert [t["address"] for t in runs.driver["tasks"] if _listening(t["address"])] == []
    assert shutdown["connected"]  # the driver's own `ray.init`: its Ray is its own to stop


@pytest.mark.slow
def test_a_task_whose_restart_budget_is_spent_ends_the_fit_naming_it(runs):
    spent = runs.driver["budget_spent"]
    assert spent["seconds"] < 20, spent  # not a wait for good
    assert spent["error"] is not None, spent
    assert spent["error"].startswith("The job failed: worker 0 (Ray actor at "
                                     f"{spent['address']} on node {spent['node'][:8]}) died "
                                     "and its restart budget is spent (0 restarts of "
                                     "max_restarts=0)"), spent
    assert spent["failure"] in spent["error"]


@pytest.mark.slow
def test_a_local_ray_started_for_the_program_stops_with_its_cluster():
    pytest.importorskip("ray")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    process = _start(LOCAL_RAY, env=env)
    reports = _finish(process)
    assert reports == {"nodes": 1, "connected": True, "connected_after": False}


@pytest.mark.slow
def test_resources_ray_cannot_place_raise_within_the_deadline_and_leave_nothing(ray_nodes):
    import ray

    import kerasps.ray

    before = set(ray.util.placement_group_table())
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        kerasps.ray.cluster(num_workers=1, num_ps=1, worker_resources={"CPU": 2},
                            placement_timeout_s=2)
    assert time.monotonic() - started < 15
    message = str(raised.value)
    assert "1 worker task(s) of {'CPU': 2}" in message and "'CPU': 2.0" in message, message
    groups = ray.util.placement_group_table()
    assert {groups[g]["state"] for g in set(groups) - before} == {"REMOVED"}


@pytest.mark.slow
def test_a_placement_group_of_ones_own_must_have_a_bundle_per_task_and_no_resources(ray_nodes):
    import ray

    import kerasps.ray

    group = ray.util.placement_group([{"CPU": 0.5}] * 3)
    # Created before it is removed: Ray can keep for good the bundles of a group removed
    # while their creation is under way (here the next tests found 1.5 CPUs held).
    ray.get(group.ready(), timeout=60)
    try:
        with pytest.raises(ValueError, match="has 3 bundles for 1 workers and 1 ps tasks"):
            kerasps.ray.cluster(num_workers=1, num_ps=1, placement=group)
        with pytest.raises(ValueError, match="Received: worker_resources={'CPU': 1}"):
            kerasps.ray.cluster(num_workers=2, num_ps=1, placement=group,
                                worker_resources={"CPU": 1})
    finally:
        ray.util.remove_placement_group(group)


@pytest.mark.slow
def test_a_start_that_fails_kills_the_actors_it_made(ray_nodes):
    import ray

    import kerasps.ray

    before = set(ray._private.state.actors())
    with pytest.raises(RuntimeError, match="did not start within start_timeout_s=0.5"):
        kerasps.ray.cluster(num_workers=1, num_ps=1, start_timeout_s=0.5)
    actors = ray._private.state.actors()
    made = set(actors) - before
    assert len(made) == 2 and {actors[a]["State"] for a in made} == {"DEAD"}


LAUNCHED = """
    import json
    import kerasps
    import keras, tensorflow as tf

    def dataset_fn(context):
        x = tf.random.stateless_uniform((64, 4), [1, context.input_pipeline_id])
        return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, 1))).repeat().batch(8)

    resolver = kerasps.cluster.resolve()  # unchanged: the job's Ray cluster under --engine ray
    print("REPORT", json.dumps({"resolver": type(resolver).__name__, "tasks": [
        [t.name, t.address, resolver.pid(t.task_type, t.index)] for t in resolver.tasks]}))
    strategy = kerasps.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=5,
                        verbose=2)
    print("REPORT", json.dumps({"loss": history.history["loss"]}))
"""


@pytest.mark.slow
def test_kerasps_launch_with_the_ray_engine_trains_prints_task_lines_and_leaves_nothing(
        ray_nodes, runs, tmp_path):
    import ray

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LAUNCHED))
    result = subprocess.run(
        [sys.executable, "-m", "kerasps.cli", "launch", "--engine", "ray", "--address",
         ray_nodes.address, "--workers", "1", "--ps", "1", "--max-restarts", "0", str(script)],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    lines = output.splitlines()
    reports = _reports("\n".join(line.removeprefix("[chief 0] ") for line in lines))
    assert reports["resolver"] == "RayClusterResolver"
    (worker, worker_address, worker_pid), (ps, ps_address, ps_pid) = reports["tasks"]
    assert (worker, ps) == ("worker 0", "ps 0")
    # Each actor's line reaches the console with its task's prefix, as kerasps launch's.
    assert f"[worker 0] kerasps serve: worker 0 serving at {worker_address}" in lines, output
    assert f"[ps 0] kerasps serve: ps 0 serving at {ps_address}" in lines, output
    assert "[chief 0] Epoch 2/2" in lines and not [line for line in lines if "pid=" in line]
    assert lines[-1] == "[launcher] chief 0 finished with exit code 0", output
    assert reports["loss"][-1] < reports["loss"][0]

    def gone():
        actors = [a for a in ray._private.state.actors().values() if a["Pid"] in (worker_pid,
                                                                                   ps_pid)]
        return ({a["State"] for a in actors} == {"DEAD"} and
                not any(_alive(pid) for pid in (worker_pid, ps_pid)) and
                not any(_listening(a) for a in (worker_address, ps_address)))

    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), ray._private.state.actors()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_ray_and_tensorflow_import_in_either_order():
    pytest.importorskip("ray")
    orders = {"ray first": "import ray, tensorflow", "tensorflow first": "import tensorflow, ray"}
    check = ("; import kerasps.ray, sys; assert kerasps.ray.cluster; "
             "print(sorted(m for m in ('ray', 'tensorflow') if m in sys.modules))")
    processes = {name: subprocess.Popen([sys.executable, "-c", code + check],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**os.environ, "PYTHONPATH": ROOT})
                 for name, code in orders.items()}
    for name, process in processes.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, (name, output[-3000:])
        assert output.splitlines()[-1] == "['ray', 'tensorflow']", (name, output[-3000:])


def _wait_for_report(process, key, deadline_s=TIMEOUT_S):
    """Polls a running driver's output for its report `key` until `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        process.output.seek(0)
        found = _reports(process.output.read())
        if key in found:
            return found[key]
        assert process.poll() is None, f"the driver ended without reporting {key!r}"
        time.sleep(0.2)
    raise AssertionError(f"the driver did not report {key!r} within {deadline_s} s")


@pytest.mark.slow
def test_a_node_holding_a_ps_task_lost_mid_fit_its_task_moves_and_fit_restores_it(
        ray_nodes, tmp_path):
    # A third node is the spare one Ray places the lost node's bundle on.
    cluster = ray_nodes.cluster
    spare = add_ray_node(cluster)
    removed = tmp_path / "removed"
    driver = _start(NODE_LOSS, ray_nodes.address, str(removed))
    node_id = _wait_for_report(driver, "remove")
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node)
    removed.touch()
    reports = _finish(driver)
    lost = reports["node_lost"]
    assert lost["before"]["node"] == node_id
    # The ps task serves on another node, at another address, and the resolver says so.
    assert lost["after"]["node"] == lost["after"]["actor_node"] != node_id
    assert lost["after"]["address"] == lost["after"]["spec"] != lost["before"]["address"]
    # The same fit went on from the backup: every requested step ran on the restored state.
    assert lost["iterations"] == 20 + lost["reexecuted"]
    assert 0 < lost["rolled_back"] <= 5
    assert all(math.isfinite(loss) for loss in lost["loss"])
    lines = driver.text.splitlines()
    assert sum("Restored the backup" in line for line in lines) == 1, driver.text[-6000:]
    assert any(f"ps 0 serves at {lost['after']['address']} now (was "
               f"{lost['before']['address']})" in line for line in lines), driver.text[-6000:]
    if spare in cluster.worker_nodes:
        cluster.remove_node(spare)


@pytest.mark.slow
def test_a_workers_node_lost_then_a_node_added_the_pool_shrinks_and_grows_back_in_one_fit(
        ray_nodes, tmp_path):
    cluster = ray_nodes.cluster
    while len(cluster.worker_nodes) < 3:  # one 1-CPU node per task, none to spare
        add_ray_node(cluster)
    driver = _start(WORKER_NODE_LOSS, ray_nodes.address, str(tmp_path))
    node_id = _wait_for_report(driver, "remove")
    cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_id))
    (tmp_path / "removed").touch()
    _wait_for_report(driver, "add")
    add_ray_node(cluster)
    (tmp_path / "added").touch()
    reports = _finish(driver)
    lost = reports["worker_node_lost"]
    assert lost["after"]["node"] != node_id
    assert lost["after"]["address"] != lost["before"]["address"]
    # Epochs 1 and 2 ended with worker 0 alone; worker 1 was back, at its new address,
    # for epoch 3.
    assert lost["workers"] == [1, 1, 2], lost
    assert lost["iterations"] == 30 + lost["reexecuted"]
    assert all(math.isfinite(loss) for loss in lost["loss"])
    lines = driver.text.splitlines()
    left = [i for i, line in enumerate(lines) if "worker 1 left" in line]
    joined = [i for i, line in enumerate(lines) if "worker 1 joined" in line]
    assert left and joined and left[0] < joined[-1], driver.text[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c", "exception"])
def test_a_driver_ended_mid_fit_leaves_no_actor_placement_group_process_or_port(ray_nodes,
                                                                               how):
    import signal

    import ray

    driver = _start(ENDED_MID_FIT, ray_nodes.address, how)
    job = _wait_for_report(driver, "job")
    if how == "ctrl_c":
        _wait_for_report(driver, "training")
        driver.send_signal(signal.SIGINT)
    driver.wait(timeout=TIMEOUT_S)
    driver.output.seek(0)
    output = driver.output.read()
    assert driver.returncode != 0, output[-3000:]
    if how == "exception":
        assert "ValueError: a bug in the program" in output, output[-3000:]
    deadline = time.monotonic() + 60  # Ray reports its actors' deaths a moment later
    while time.monotonic() < deadline:
        states = {i: ray._private.state.actors(actor_id=i).get("State") for i in job["actors"]}
        if set(states.values()) == {"DEAD"}:
            break
        time.sleep(0.2)
    assert set(states.values()) == {"DEAD"}, states
    assert ray.util.placement_group_table()[job["group"]]["state"] == "REMOVED"
    for pid in job["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert [address for address in job["addresses"] if _listening(address)] == []
