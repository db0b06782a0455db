"""Fault tolerance with real processes: `kerasps launch`, its restart agent, and
worker failures inside `fit`, `evaluate` and custom loops (SIGKILL, as a machine
loss would)."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest

from kerasps.runtime.ports import pick_port
from tests.launched import RunningJob, launch, process_gone, wait_until

pytestmark = pytest.mark.slow

# A chief training a small model on every worker's own stream, printing as it goes.
CHIEF_SETUP = """
    import itertools, sys
    import keras, tensorflow as tf, kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(OPTIMIZER, "mse", metrics=["mae"])

    def dataset_fn(context):
        x = tf.random.stateless_uniform((256, 4), [1, context.input_pipeline_id])
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    def say(*words):
        print(*words, flush=True)

"""

# A chief that trains 6 x 50 steps, then evaluates 120 batches, then runs a custom
# loop of 120 steps, printing progress so that the test can kill workers mid-call.
TRAINING_CHIEF = CHIEF_SETUP.replace("OPTIMIZER", "keras.optimizers.SGD(0.01)") + """
    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(  # "train batch N": N steps done in this fit
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)),
        on_test_batch_end=lambda batch, logs: say("eval batch", batch))
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=6, steps_per_epoch=50,
                        verbose=0, callbacks=[progress])
    say("iterations", int(model.optimizer.iterations.numpy()))
    say("reexecuted", sum(history.history.get("reexecuted_steps", [0])))

    say("evaluate started")
    logs = model.evaluate(kerasps.DatasetCreator(dataset_fn), steps=120, verbose=0,
                          callbacks=[progress], return_dict=True)
    say("evaluated", sorted(logs))

    coordinator = kerasps.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    with strategy.scope():
        steps = keras.Variable(0, dtype="int64", trainable=False)

    @tf.function
    def step(iterator):
        x, y = next(iterator)
        steps.assign_add(1)
        return tf.reduce_mean(model(x))

    say("custom loop started")
    results = []
    for i in range(120):
        results.append(coordinator.schedule(step, args=(iterator,)))
        if i % 10 == 9:
            say("custom step", i)
    coordinator.join()
    values = [r.fetch() for r in results]
    say("custom loop", len(values), "steps run", int(steps.numpy()))
"""


def test_worker_killed_mid_fit_evaluate_and_custom_loop_is_restarted_and_calls_finish(tmp_path):
    job = launch(tmp_path, TRAINING_CHIEF, "--workers", "2", "--ps", "1", "--max-restarts", "3")
    try:
        job.wait_for(r"\[chief 0\] train batch 80$")
        job.kill("worker 1")
        job.wait_for(r"\[launcher\] worker 1 exited with signal 9 \(SIGKILL\); restart 1 of 3")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        # Every requested step ran; steps that ran twice are counted, not hidden.
        assert iterations == 300 + reexecuted

        job.wait_for(r"\[chief 0\] eval batch 20$")
        job.kill("worker 0")
        job.wait_for(r"\[chief 0\] evaluated \['loss', 'mae'\]")

        job.wait_for(r"\[chief 0\] custom step 29$")
        job.kill("worker 1")
        done = job.wait_for(r"\[chief 0\] custom loop (\d+) steps run (\d+)")
        assert int(done.group(1)) == 120 and int(done.group(2)) >= 120
        assert job.finish() == 0, job.output()
        assert len(job.pids["worker 1"]) == 3 and len(job.pids["worker 0"]) == 2
    finally:
        job.close()


@pytest.mark.parametrize("back_after", [None, 3.0], ids=["gone_for_good", "back_after_3s"])
def test_worker_killed_mid_fit_without_an_agent(tmp_path, back_after):
    """Two `kerasps serve` workers and a ps; worker 1 is killed and, like a pod that
    Kubernetes restarts, comes back on its address `back_after` seconds later (or never)."""
    cluster = {kind: [f"localhost:{pick_port()}" for _ in range(n)]
               for kind, n in (("chief", 1), ("worker", 2), ("ps", 1))}

    def config(kind, index):
        return {"TF_CONFIG": json.dumps({"cluster": cluster,
                                         "task": {"type": kind, "index": index}})}

    def serve(kind, index):
        return subprocess.Popen(
            [sys.executable, "-m", "kerasps.cli", "serve"],
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **config(kind, index)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    servers = {f"{kind} {i}": serve(kind, i)
               for kind, n in (("worker", 2), ("ps", 1)) for i in range(n)}
    script = tmp_path / "chief.py"
    training_only = TRAINING_CHIEF.split('    say("evaluate started")')[0]
    script.write_text(textwrap.dedent(training_only))
    chief = RunningJob([sys.executable, str(script)], cwd=tmp_path, env=config("chief", 0))
    try:
        chief.wait_for(r"^train batch 80$")
        servers["worker 1"].kill()
        servers["worker 1"].wait()
        if back_after is not None:
            chief.wait_for(r"^train batch 81$")  # the chief goes on meanwhile
            time.sleep(back_after)  # the outage being modelled, not a synchronisation
            servers["worker 1"] = serve("worker", 1)
        iterations = int(chief.wait_for(r"^iterations (\d+)").group(1))
        reexecuted = int(chief.wait_for(r"^reexecuted (\d+)").group(1))
        assert iterations == 300 + reexecuted
        assert chief.finish() == 0, chief.output()
    finally:
        chief.close()
        for server in servers.values():
            server.kill()
            server.wait(30)


# Synchronous training: one update per global step, whatever the workers do.
SYNC_CHIEF = CHIEF_SETUP.replace("OPTIMIZER", "keras.optimizers.SGD(0.01)").replace(
    "kerasps.cluster.from_tf_config())",
    "kerasps.cluster.from_tf_config(), mode='MODE', backup_workers=BACKUPS)") + """
    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)))
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=6, steps_per_epoch=50,
                        verbose=0, callbacks=[progress])
    say("iterations", int(model.optimizer.iterations.numpy()))
    say("dropped", int(sum(history.history["dropped_gradients"])))
"""


def _on_arrival_in_hybrid(chief, mode):
    """In hybrid mode, the chief's first layer (of a dense model) updates on arrival."""
    if mode != "hybrid":
        return chief
    return chief.replace("    trained = itertools.count(1)", (
        "    kerasps.consistency.update_on_arrival(model.layers[0])\n"
        "    trained = itertools.count(1)"), 1)


@pytest.mark.parametrize("mode, backups", [("sync", 0), ("sync", 1), ("hybrid", 1)])
def test_worker_killed_mid_sync_fit_never_deadlocks_a_step(tmp_path, mode, backups):
    """A gradient lost with its worker is computed again by another worker (or the
    step completes from the others with a backup); every global step applies once."""
    chief = _on_arrival_in_hybrid(
        SYNC_CHIEF.replace("BACKUPS", str(backups)).replace("MODE", mode), mode)
    job = launch(tmp_path, chief, "--workers", "2", "--ps", "1", "--max-restarts", "3")
    try:
        job.wait_for(r"\[chief 0\] train batch 80$")
        job.kill("worker 1")
        job.wait_for(r"\[launcher\] worker 1 exited with signal 9 \(SIGKILL\); restart 1 of 3")
        assert int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1)) == 300
        dropped = int(job.wait_for(r"\[chief 0\] dropped (\d+)").group(1))
        assert dropped == 0 if backups == 0 else dropped > 0
        assert job.finish() == 0, job.output()
    finally:
        job.close()


# Exactly-once input: a visit counter (each visit moves an id's row by -1) over 1024 ids.
EXACTLY_ONCE_CHIEF = """
    import itertools, sys
    import keras, numpy as np, tensorflow as tf, kerasps

    ROWS, EPOCHS, BATCH = 1024, 3, 16
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.from_tf_config(),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    # With a backup directory (argv[1]), a lost ps task is recovered from its backups.
    backups = [keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=8)] if sys.argv[1:] else []
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,), dtype="int32"),
                                  keras.layers.Embedding(ROWS, 1, embeddings_initializer="zeros")])
        model.compile(keras.optimizers.SGD(1.0), loss=lambda y, p: tf.reduce_sum(p))

    def dataset_fn(context):
        ids = np.arange(ROWS, dtype="int32").reshape(-1, 1)
        dataset = tf.data.Dataset.from_tensor_slices((ids, np.zeros(ROWS))).shuffle(ROWS)
        # argv[2]: seconds each batch is held back (the workers wait in `next` for it).
        return kerasps.input.slowed(dataset.batch(BATCH), float(sys.argv[2]) if sys.argv[2:] else 0)

    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: print("train batch", next(trained), flush=True))
    history = model.fit(
        kerasps.DatasetCreator(dataset_fn, kerasps.InputOptions(exactly_once=True)),
        epochs=EPOCHS, verbose=0, callbacks=[progress, *backups])
    visits = -np.round(model.layers[0].embeddings.numpy()[:, 0]).astype(int)
    print("missed", int(np.clip(EPOCHS - visits, 0, None).sum()),
          "repeated", int(np.clip(visits - EPOCHS, 0, None).sum()),
          "reexecuted", sum(history.history.get("reexecuted_steps", [0])),
          "rolled back", sum(history.history.get("rolled_back_steps", [0])), flush=True)
"""


def test_worker_killed_mid_exactly_once_fit_repeats_nothing_and_loses_its_fetched_batches(
        tmp_path):
    """tf.data service hands each element out once: the batches a killed worker had
    fetched (the one its running step read, and those its reader had requested
    ahead) are lost, never read twice; the step TensorFlow runs again elsewhere
    reads a new batch. Measured: 3 batches (48 ids) lost per kill."""
    job = launch(tmp_path, EXACTLY_ONCE_CHIEF, "--workers", "2", "--ps", "1",
                 "--max-restarts", "3")
    try:
        job.wait_for(r"\[chief 0\] train batch 80$")  # epoch 2 of 3 (64 steps each)
        job.kill("worker 1")
        job.wait_for(r"\[launcher\] worker 1 exited with signal 9 \(SIGKILL\); restart 1 of 3")
        counts = job.wait_for(r"\[chief 0\] missed (\d+) repeated (\d+) reexecuted (\d+)")
        missed, repeated = int(counts.group(1)), int(counts.group(2))
        assert repeated == 0
        assert missed <= 4 * 16  # the bound docs/guide/input.md states
        assert job.finish() == 0, job.output()
    finally:
        job.close()


def test_ps_killed_mid_exactly_once_fit_loses_only_the_rolled_back_and_fetched_batches(
        tmp_path):
    """Every function in flight when a ps task dies fails, and one that waited for its
    next element cancels its worker's reader for good: each worker's reader joins the
    epoch's tf.data service job again, so the epoch goes on with the ids nobody read.
    Lost: the batches of the steps rolled back to the backup (their ids are not read
    again) and those the cancelled readers had fetched. Before, every reader ended
    and the epoch stopped there (hundreds of ids missed)."""
    job = launch(tmp_path, EXACTLY_ONCE_CHIEF, "--workers", "2", "--ps", "2",
                 "--max-restarts", "3", args=[str(tmp_path / "backup"), "0.1"])
    try:
        job.wait_for(r"\[chief 0\] train batch 80$")  # epoch 2 of 3 (64 steps each)
        job.kill("ps 0")
        job.wait_for(r"\[launcher\] ps 0 exited with signal 9 \(SIGKILL\); restart 1 of 3")
        counts = job.wait_for(
            r"\[chief 0\] missed (\d+) repeated (\d+) reexecuted \d+ rolled back (\d+)")
        missed, repeated, rolled_back = map(int, counts.groups())
        assert job.finish() == 0, job.output()
        assert repeated == 0
        assert rolled_back <= 8  # the backup's `save_freq`
        assert missed <= (rolled_back + 2 * 4) * 16, job.output()
    finally:
        job.close()


def test_spent_restart_budget_ends_the_job_with_an_error_naming_the_task(tmp_path):
    job = launch(tmp_path, TRAINING_CHIEF, "--workers", "2", "--ps", "1", "--max-restarts", "0")
    try:
        job.wait_for(r"\[chief 0\] train batch 30$")
        job.kill("worker 1")
        job.wait_for(r"\[launcher\] ending the job: worker 1 exited with signal 9 \(SIGKILL\) "
                     r"and its restart budget is spent \(0 restarts\)")
        job.wait_for(r"\[chief 0\] kerasps.launch.TaskFailedError: The job failed: worker 1 "
                     r"exited with signal 9")
        assert job.finish() == 1
    finally:
        job.close()


def _port_is_free(address: str) -> bool:
    port = int(address.rsplit(":", 1)[1])
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
    return True


CLUSTER_CHIEF = """
    import json, os, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    print("args", sys.argv[1:], flush=True)
    print("cluster", json.dumps(config["cluster"]), flush=True)
    print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    if sys.argv[1:] == ["--wait"]:
        time.sleep(600)
"""


def _assert_nothing_left(job, cluster, processes):
    """Every task's process has ended and every port can be bound again."""
    pids = [pid for task_pids in job.pids.values() for pid in task_pids]
    assert len(pids) == processes and all(process_gone(pid) for pid in pids)
    assert all(wait_until(lambda a=a: _port_is_free(a), timeout=30)
               for tasks in cluster.values() for a in tasks)


def _cluster_of(job):
    return json.loads(job.wait_for(r"\[chief 0\] cluster (.*)$").group(1))


def test_launch_gives_each_task_its_tf_config_and_ends_every_process_with_the_chief(tmp_path):
    job = launch(tmp_path, CLUSTER_CHIEF, "--workers", "3", "--ps", "2", "--gpus-per-worker",
                 "2", args=("a", "--b"))
    try:
        job.wait_for(r"\[chief 0\] args \['a', '--b'\]")
        cluster = _cluster_of(job)
        assert {k: len(v) for k, v in cluster.items()} == {"chief": 1, "worker": 3, "ps": 2}
        assert all(a.startswith("localhost:") for v in cluster.values() for a in v)
        job.wait_for(r"\[chief 0\] visible $")  # the chief gets no GPU
        assert job.finish() == 0
        _assert_nothing_left(job, cluster, processes=6)
    finally:
        job.close()


def test_gpus_are_split_between_workers():
    from kerasps.ops import launch as launch_lib

    spec = launch_lib.LaunchSpec(program=("train.py",), workers=2, ps=1, gpus_per_worker=2)
    cluster = launch_lib.make_cluster(spec, pick_port=iter(range(5000, 5100)).__next__)
    env = {t.name: launch_lib._environment(spec, cluster, t, {}, "report")
           for t in spec.tasks}
    assert env["worker 0"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["worker 1"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["ps 0"]["CUDA_VISIBLE_DEVICES"] == env["chief 0"]["CUDA_VISIBLE_DEVICES"] == ""
    assert json.loads(env["worker 1"]["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_ends_every_process_and_releases_the_ports(tmp_path, signum, code):
    job = launch(tmp_path, CLUSTER_CHIEF, "--workers", "2", args=("--wait",))
    try:
        cluster = _cluster_of(job)
        job.wait_for(r"\[launcher\] started chief 0")
        job.process.send_signal(signum)
        assert job.finish() == code
        _assert_nothing_left(job, cluster, processes=4)
    finally:
        job.close()


def test_launcher_killed_takes_its_tasks_with_it(tmp_path):
    job = launch(tmp_path, CLUSTER_CHIEF, "--workers", "2", args=("--wait",))
    try:
        _cluster_of(job)
        job.process.kill()
        job.finish()
        pids = [pid for task_pids in job.pids.values() for pid in task_pids]
        assert len(pids) == 4
        assert wait_until(lambda: all(process_gone(pid) for pid in pids), timeout=30)
    finally:
        job.close()


def test_ps_killed_mid_fit_raises_an_error_naming_the_ps_task(tmp_path):
    chief = TRAINING_CHIEF.split('    say("evaluate started")')[0].replace(
        "    history = model.fit(", "    try:\n        history = model.fit(").replace(
        "                        verbose=0, callbacks=[progress])",
        "                            verbose=0, callbacks=[progress])\n"
        "    except kerasps.PsTaskFailedError as e:\n"
        "        say('failed', e.ps_task, str(e))\n"
        "        raise SystemExit(3)").replace("epochs=6", "epochs=60")
    job = launch(tmp_path, chief, "--workers", "2", "--ps", "1", "--max-restarts", "1")
    try:
        job.wait_for(r"\[chief 0\] train batch 80$")
        job.kill("ps 0")
        failed = job.wait_for(r"\[chief 0\] failed (\d+) (.*)$")
        assert failed.group(1) == "0"
        assert "ps task 0 (/job:ps/replica:0/task:0) became unavailable during `fit`" in (
            failed.group(2))
        assert "BackupAndRestore" in failed.group(2)
        # A failed chief is restarted, whatever its exit status (as torchrun does).
        job.wait_for(r"\[launcher\] chief 0 exited with exit code 3; restart 1 of 1")
        job.process.send_signal(signal.SIGTERM)
        assert job.finish() == 143
    finally:
        job.close()


PS_RECOVERY_CHIEF = CHIEF_SETUP.replace("OPTIMIZER", "keras.optimizers.Adam(0.01)") + """
    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)))
    backup = keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=4, steps_per_epoch=50,
                        verbose=0, callbacks=[progress, backup])
    say("iterations", int(model.optimizer.iterations.numpy()))
    say("reexecuted", sum(history.history.get("reexecuted_steps", [0])))
    say("rolled back", sum(history.history.get("rolled_back_steps", [0])))
    say("loss finite", bool(tf.math.is_finite(history.history["loss"][-1])))
"""


@pytest.mark.parametrize("mode", ["async", "sync", "hybrid"])
def test_ps_killed_mid_fit_is_restored_from_the_backup_inside_the_same_fit(tmp_path, mode):
    chief = _on_arrival_in_hybrid(PS_RECOVERY_CHIEF.replace(
        "kerasps.cluster.from_tf_config())", f"kerasps.cluster.from_tf_config(), mode={mode!r})"),
        mode)
    job = launch(tmp_path, chief, "--workers", "2", "--ps", "2", "--max-restarts",
                 "2", args=[str(tmp_path / "backup")])
    try:
        job.wait_for(r"\[chief 0\] train batch 75$")
        job.kill("ps 1")
        job.wait_for(r"\[launcher\] ps 1 exited with signal 9 \(SIGKILL\); restart 1 of 2")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        rolled_back = int(job.wait_for(r"\[chief 0\] rolled back (\d+)").group(1))
        job.wait_for(r"\[chief 0\] loss finite True")
        assert job.finish() == 0, job.output()
        # The same fit went on from the backup: every requested step ran once on the
        # restored state, at most `save_freq` steps were run again.
        assert iterations == 200 + reexecuted
        assert 0 < rolled_back <= 10
        job.wait_for(r"lost their variables at epoch 2 ")  # every line, not the last 200
    finally:
        job.close()


# The same with a validation pass each epoch; epoch 2's waits after its first batch until
# the file argv[2] exists (the test kills a ps task meanwhile).
VALIDATION_CHIEF = PS_RECOVERY_CHIEF.replace("    trained = itertools.count(1)\n", """\
    import os, time

    class HeldValidation(keras.callbacks.Callback):
        epoch, held = 0, False

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_test_batch_end(self, batch, logs=None):
            if self.epoch == 1 and not self.held:
                self.held = True
                say("validating")
                deadline = time.monotonic() + 120
                while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
                    time.sleep(0.05)

    trained = itertools.count(1)
""").replace("verbose=0, callbacks=[progress, backup])",
             "verbose=0, callbacks=[progress, backup, HeldValidation()],\n"
             "                        validation_data=kerasps.DatasetCreator(dataset_fn), "
             "validation_steps=5)")


def test_ps_killed_during_fits_validation_pass_is_restored_inside_the_same_fit(tmp_path):
    # The validation pass ran outside `fit`'s recovery: the loss ended `fit` with
    # `PsTaskFailedError` (the soak's chief ended so twice, restarted by the launcher).
    marker = tmp_path / "killed"
    job = launch(tmp_path, VALIDATION_CHIEF, "--workers", "2", "--ps", "2", "--max-restarts",
                 "2", args=[str(tmp_path / "backup"), str(marker)])
    try:
        job.wait_for(r"\[chief 0\] validating$")
        job.kill("ps 1")
        job.wait_for(r"\[launcher\] ps 1 exited with signal 9 \(SIGKILL\); restart 1 of 2")
        marker.write_text("")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        job.wait_for(r"\[chief 0\] loss finite True")
        assert job.finish() == 0, job.output()
        assert iterations == 200 + reexecuted
        job.wait_for(r"lost their variables at epoch 2 ")
        assert not any(re.search(r"\[launcher\] chief 0 .*restart", line) for line in job.lines)
        assert not any("PsTaskFailedError" in line for line in job.lines), job.output()
    finally:
        job.close()


RESUMING_CHIEF = PS_RECOVERY_CHIEF.replace(
    "save_freq=10)", "save_freq=10, double_checkpoint=True)").replace(
    "    trained = itertools.count(1)\n",
    "    trained = itertools.count(1)\n"
    "    first = []\n"
    "    def on_batch(batch, logs):\n"
    "        if not first:\n"
    "            first.append(batch)\n"
    "            say('first batch', batch, 'iterations', int(model.optimizer.iterations.numpy()))\n"
    "        say('train batch', next(trained))\n").replace(
    "on_train_batch_end=lambda batch, logs: say(\"train batch\", next(trained)))",
    "on_train_batch_end=on_batch, on_epoch_begin=lambda epoch, logs: say(\n"
    "        'epoch', epoch, 'begins at iterations', int(model.optimizer.iterations.numpy())))")


def _recorded_progress(path):
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["kerasps_progress"])


@pytest.mark.parametrize("corrupt_latest", [False, True], ids=["latest", "corrupt_latest"])
def test_killed_coordinator_run_again_resumes_inside_the_epoch(tmp_path, corrupt_latest):
    """A chief killed with no restart left, run again by hand (a new launch)."""
    backup = tmp_path / "backup"
    options = ("--workers", "2", "--ps", "1")
    job = launch(tmp_path, RESUMING_CHIEF, *options, "--max-restarts", "0", args=[str(backup)])
    try:
        job.wait_for(r"\[chief 0\] train batch 75$")
        job.kill("chief 0")
        assert job.finish() == 128 + signal.SIGKILL
    finally:
        job.close()
    latest, previous = backup / "latest.weights.h5", backup / "latest.weights.h5.bkp"
    if corrupt_latest:
        latest.write_bytes(b"\x89HDF\r\n half a file")
    saved = _recorded_progress(previous if corrupt_latest else latest)
    assert saved["step"] > 0  # the backup is inside an epoch: Keras would restart it

    job = launch(tmp_path, RESUMING_CHIEF, *options, args=[str(backup)])
    try:
        first = job.wait_for(r"\[chief 0\] first batch (\d+) iterations (\d+)")
        assert int(first.group(1)) == saved["step"]
        steps_left = 200 - (50 * saved["epoch"] + saved["step"])
        job.wait_for(rf"\[chief 0\] train batch {steps_left}$")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        assert job.finish() == 0, job.output()
        assert f"train batch {steps_left + 1}" not in job.output()
        # `optimizer.iterations` went on from the backup's, never from zero.
        assert int(first.group(2)) > 50 * saved["epoch"] + saved["step"] - 1
        assert iterations >= 200
    finally:
        job.close()


def test_chief_killed_mid_fit_is_restarted_and_resumes_inside_the_epoch(tmp_path):
    job = launch(tmp_path, RESUMING_CHIEF, "--workers", "2", "--ps", "1", "--max-restarts", "1",
                 args=[str(tmp_path / "backup")])
    try:
        job.wait_for(r"\[chief 0\] train batch 75$")
        servers = {task: job.pid(task) for task in ("worker 0", "worker 1", "ps 0")}
        job.kill("chief 0")
        job.wait_for(r"\[launcher\] chief 0 exited with signal 9 \(SIGKILL\); restart 1 of 1")
        restarted = len(job.lines)
        # The new chief resumes from the backup inside epoch 2 (its step is not 0)...
        first = int(job.wait_for(r"\[chief 0\] first batch ([1-9]\d*) iterations").group(1))
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        assert job.finish() == 0, job.output()
        (restored,) = [int(line.rsplit(" ", 1)[1]) for line in job.lines[restarted:]
                       if line.startswith("[chief 0] epoch 1 begins at iterations ")]
        # ... on the servers that served the old one (none was restarted) ...
        assert {task: job.pids[task] for task in servers} == {
            task: [pid] for task, pid in servers.items()}
        address = job.wait_for(r"\[launcher\] started ps 0 at (\S+) ").group(1)
        job.wait_for(rf"\[ps 0\] kerasps serve: ps 0 serving at {address}$")
        assert len(job.pids["chief 0"]) == 2
        # ... and runs the steps the backup had not recorded, each once. At-least-once: the
        # backup holds its recorded steps and those applied before their results were
        # delivered (the ps ran them, the old chief had not seen them yet), which count twice.
        counts = [int(line.rsplit(" ", 1)[1]) for line in job.lines[restarted:]
                  if line.startswith("[chief 0] train batch ")]
        recorded = 50 + first
        assert max(counts) == 200 - recorded
        assert restored >= recorded
        assert iterations == restored + 200 - recorded
    finally:
        job.close()


FAILING_CHIEF = """
    import os, sys, time
    print("cluster", os.environ["TF_CONFIG"], flush=True)
    if sys.argv[1] == "exit":
        raise SystemExit(3)
    time.sleep(600)
"""


@pytest.mark.parametrize("how, status, exit", [
    ("exit", 3, r"exit code 3"), ("kill", 128 + signal.SIGKILL, r"signal 9 \(SIGKILL\)")])
def test_a_chief_failing_beyond_its_budget_ends_the_job_with_its_status(tmp_path, how, status,
                                                                         exit):
    job = launch(tmp_path, FAILING_CHIEF, "--workers", "1", "--ps", "1", "--max-restarts", "1",
                 args=(how,))
    try:
        def configs():
            return [json.loads(line.split(" cluster ", 1)[1]) for line in job.lines
                    if line.startswith("[chief 0] cluster ")]

        job.wait_for(r"\[chief 0\] cluster ")
        if how == "kill":
            job.kill("chief 0")
        job.wait_for(rf"\[launcher\] chief 0 exited with {exit}; restart 1 of 1")
        assert wait_until(lambda: len(configs()) == 2), job.output()
        if how == "kill":
            job.kill("chief 0")
        job.wait_for(rf"\[launcher\] ending the job: chief 0 exited with {exit} and its "
                     r"restart budget is spent \(1 restart\)")
        assert job.finish() == status
        first, again = configs()
        assert first == again  # the same address
        assert len(job.pids["chief 0"]) == 2
        started = [line for line in job.lines if line.startswith("[launcher] started chief 0")]
        assert started[1].endswith(" in the warm standby")
        _assert_nothing_left(job, first["cluster"], processes=4)
    finally:
        job.close()


STANDBY_SCRIPT = """
    import json, os, sys
    print(json.dumps({"name": __name__, "argv": sys.argv, "path": sys.path[0],
                      "config": os.environ.get("TF_CONFIG"), "stdin": sys.stdin.read(),
                      "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
    raise SystemExit(int(sys.argv[1]))
"""


def test_the_standby_runs_a_script_as_python_does_in_the_tasks_environment(tmp_path):
    script = tmp_path / "job" / "chief.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(STANDBY_SCRIPT))
    env = {**os.environ, "TF_CONFIG": '{"task": {"type": "chief"}}', "CUDA_VISIBLE_DEVICES": "3"}
    task = json.dumps({"argv": [str(script), "7"], "env": env})
    result = subprocess.run([sys.executable, "-m", "kerasps.ops.standby"], input=task + "\n",
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 7, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "name": "__main__", "argv": [str(script), "7"], "path": str(script.parent),
        "config": env["TF_CONFIG"], "stdin": "", "gpus": "3"}


def test_the_standby_runs_a_module_as_python_m_does(tmp_path):
    package = tmp_path / "kps_job"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "chief.py").write_text(textwrap.dedent(STANDBY_SCRIPT))
    env = {**os.environ, "TF_CONFIG": '{"task": {"type": "chief"}}'}
    task = json.dumps({"argv": ["-m", "kps_job.chief", "5"], "env": env})
    result = subprocess.run([sys.executable, "-m", "kerasps.ops.standby"], input=task + "\n",
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 5, result.stderr[-3000:]
    here = os.path.realpath(tmp_path)
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "name": "__main__", "argv": [os.path.join(here, "kps_job", "chief.py"), "5"],
        "path": here, "config": env["TF_CONFIG"], "stdin": "",
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


ELASTIC_FAILING_CHIEF = """
    import os, time
    from kerasps.ops import launch

    restarted = os.path.exists("started")
    open("started", "w").close()
    if restarted:  # connects when the test says so
        while not os.path.exists("connect"):
            time.sleep(0.05)
    launch.report_connected()  # what the strategy does once it has connected
    print("connected", flush=True)
    while not os.path.exists("done"):
        time.sleep(0.05)
"""


def test_a_restarted_chief_of_an_elastic_pool_finds_every_declared_worker_up(tmp_path):
    """TensorFlow's coordinator connects to every declared worker: those the pool had
    stopped start again for the new chief, and stop once it has connected."""
    job = launch(tmp_path, ELASTIC_FAILING_CHIEF, "--workers", "1:2", "--ps", "1")
    try:
        job.wait_for(r"\[launcher\] worker 1 leaves the pool \(1 of 2 workers wanted\)")
        assert wait_until(lambda: process_gone(job.pids["worker 1"][0]))
        job.kill("chief 0")
        job.wait_for(r"\[launcher\] worker 1 starts again for the restarted chief to connect")
        assert wait_until(lambda: len(job.pids["worker 1"]) == 2), job.output()
        stopped = len([line for line in job.lines if "worker 1 leaves the pool" in line])
        assert stopped == 1  # the new chief has not connected: worker 1 runs
        (tmp_path / "connect").touch()
        job.wait_for(r"\[launcher\] worker 1 leaves the pool")  # again
        assert wait_until(lambda: len([
            line for line in job.lines if "worker 1 leaves the pool" in line]) == 2)
        assert wait_until(lambda: process_gone(job.pids["worker 1"][1]))
        (tmp_path / "done").touch()
        assert job.finish() == 0, job.output()
    finally:
        job.close()


def _benchmark(name):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chaos_driver_reads_past_a_counter_line_cut_short():
    """A chief killed while writing, or two of its threads writing at once, leaves an `it`
    line with no counter: the driver once died on it (ValueError) in the middle of a soak."""
    chaos = _benchmark("chaos")
    job = types.SimpleNamespace(lines=[
        "[chief 0] it 1795650127.5 2159",
        "[chief 0] it 1795650127.6 ",
        "[chief 0] it 1795650127.7 log 1795650127.7 ps 1 is back",
        "[chief 0] phase 1795650130.1 restored 2150",
        "[chief 0] it 1795650131.0 2175"])
    events = chaos._chief_events(job)
    assert events["it"] == [(1795650127.5, 2159), (1795650131.0, 2175)]
    assert events["phase"] == [(1795650130.1, "restored 2150")]


# TensorFlow's own fault-tolerance scenarios (`fault_tolerance_test_base.py`), on a custom
# loop and on `fit`, with real processes. The test drives the chief through flag files.
SCENARIOS_CHIEF = CHIEF_SETUP.replace("OPTIMIZER", "keras.optimizers.Adam(0.01)") + """
    import pathlib, time
    import numpy as np

    flags = pathlib.Path(sys.argv[1])

    def wait_for_flag(name):
        deadline = time.monotonic() + 240
        while not (flags / name).exists():
            assert time.monotonic() < deadline, f"no flag {name}"
            time.sleep(0.05)

    coordinator = kerasps.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = keras.Variable(0, dtype="int64", trainable=False)

    @tf.function
    def step(iterator):
        x, _ = next(iterator)
        counter.assign_add(1)
        return tf.reduce_sum(model(x))

    # 1. Dataset creation on a worker that is down: its pipeline is built when it is back.
    say("creating datasets")
    wait_for_flag("worker-1-down")
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(60)]
    coordinator.join()
    say("created", len([r.fetch() for r in results]), int(counter.numpy()))

    # 2. Two workers preempted at once mid-loop: results of functions that finished before
    # are fetched after the failure, and so are variables on the ps.
    before = [coordinator.schedule(step, args=(iterator,)) for _ in range(20)]
    coordinator.join()
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(150)]
    say("scheduled", len(results))
    wait_for_flag("both-workers-killed")
    fetched = [r.fetch() for r in before]  # after the failure
    weights = model.layers[0].kernel.numpy()  # read from the ps after the failure
    say("fetched after failure", len(fetched), bool(np.isfinite(weights).all()))
    coordinator.join()
    say("two preempted", len([r.fetch() for r in results]), int(counter.numpy()))

    # 3. A worker failing again and again mid-fit.
    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)))
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=50,
                        verbose=0, callbacks=[progress])
    say("continuous failures", int(model.optimizer.iterations.numpy()),
        sum(history.history.get("reexecuted_steps", [0])))
"""


def test_tensorflow_fault_tolerance_scenarios_on_a_custom_loop_and_fit(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    job = launch(tmp_path, SCENARIOS_CHIEF, "--workers", "2", "--ps", "1", "--max-restarts", "9",
                 args=[str(flags)])

    def kill_and_wait_for_restart(task):
        restarts = len(job.pids.get(task, []))
        job.kill(task)
        assert wait_until(lambda: len(job.pids[task]) > restarts, timeout=120), job.output()

    try:
        job.wait_for(r"\[chief 0\] creating datasets")
        job.kill("worker 1")
        (flags / "worker-1-down").touch()
        created = job.wait_for(r"\[chief 0\] created (\d+) (\d+)")
        assert created.groups() == ("60", "60")
        assert len(job.pids["worker 1"]) == 2  # restarted, and its pipeline was built

        job.wait_for(r"\[chief 0\] scheduled 150")
        job.kill("worker 0")
        job.kill("worker 1")
        (flags / "both-workers-killed").touch()
        fetched = job.wait_for(r"\[chief 0\] fetched after failure (\d+) (\w+)")
        assert fetched.groups() == ("20", "True")
        done = job.wait_for(r"\[chief 0\] two preempted (\d+) (\d+)")
        assert int(done.group(1)) == 150 and int(done.group(2)) >= 230

        for at in (10, 40, 70):  # worker 0 dies again each time it is back
            job.wait_for(rf"\[chief 0\] train batch {at}$")
            kill_and_wait_for_restart("worker 0")
        continuous = job.wait_for(r"\[chief 0\] continuous failures (\d+) (\d+)")
        assert int(continuous.group(1)) == 150 + int(continuous.group(2))
        assert job.finish() == 0, job.output()
    finally:
        job.close()


def test_ps_lost_while_a_worker_failure_is_being_recovered(tmp_path):
    job = launch(tmp_path, PS_RECOVERY_CHIEF, "--workers", "2", "--ps", "1", "--max-restarts",
                 "2", args=[str(tmp_path / "backup")])
    try:
        job.wait_for(r"\[chief 0\] train batch 75$")
        job.kill("worker 1")
        job.kill("ps 0")
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        rolled_back = int(job.wait_for(r"\[chief 0\] rolled back (\d+)").group(1))
        assert job.finish() == 0, job.output()
        assert iterations == 200 + reexecuted and 0 < rolled_back <= 10
    finally:
        job.close()
