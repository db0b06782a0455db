"""The elastic worker pool: workers joining and leaving a running `fit`, with real processes.

`kerasps launch --workers MIN:MAX` declares MAX workers, runs MIN once the chief
has connected, and resizes on `kerasps.launch.request_workers(n)`; the chief's
`fit` logs each change and holds training below `min_workers`.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kerasps.runtime.ports import pick_port
from tests.launched import RunningJob, launch

pytestmark = pytest.mark.slow

# A chief that asks for 2 workers at its 40th step and for 1 again at its 120th.
ELASTIC_CHIEF = """
    import itertools, time
    import keras, tensorflow as tf, kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config(), mode="MODE")
    print("min_workers", strategy.pool.min_workers, "of", strategy.pool.max_workers, flush=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")

    def dataset_fn(context):
        x = tf.random.stateless_uniform((256, 4), [1, context.input_pipeline_id])
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)

    trained = itertools.count(1)
    coordinator = kerasps.ClusterCoordinator(strategy)

    def on_batch(batch, logs):
        n = next(trained)
        print("train batch", n, flush=True)
        if n in RESIZE:  # resize, and go on once the pool has that size
            kerasps.launch.request_workers(RESIZE[n])
            deadline = time.monotonic() + 120
            while len(coordinator.running_workers()) != RESIZE[n]:
                assert time.monotonic() < deadline, "the pool was not resized in 120s"
                time.sleep(0.1)

    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=4, steps_per_epoch=60,
                        verbose=0, callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_end=on_batch)])
    print("iterations", int(model.optimizer.iterations.numpy()),
          "reexecuted", sum(history.history.get("reexecuted_steps", [0])), flush=True)
    print("workers per epoch", history.history["workers"], flush=True)
"""


@pytest.mark.parametrize("mode", ["async", "sync", "hybrid"])
def test_workers_join_and_leave_a_running_fit(tmp_path, mode):
    """In sync and hybrid mode a global step takes a gradient per declared worker: while
    one runs, it computes them all. Before, a step's functions queued for a worker that
    had left waited for it: no step ran (hybrid, 2 runs in 2)."""
    chief = ELASTIC_CHIEF.replace("RESIZE", "{40: 2, 130: 1}").replace("MODE", mode)
    job = launch(tmp_path, chief, "--workers", "1:2", "--ps", "1", "--max-restarts", "1")
    try:
        job.wait_for(r"\[chief 0\] min_workers 1 of 2$")
        # Both declared workers start (the coordinator connects to each), then one leaves.
        job.wait_for(r"\[launcher\] worker 1 leaves the pool \(1 of 2 workers wanted\)")
        job.wait_for(r"\[chief 0\] .*worker 1 left: 1 of 2 workers running")
        job.wait_for(r"\[launcher\] worker 1 joins the pool \(2 of 2 workers wanted\)")
        job.wait_for(r"\[chief 0\] .*worker 1 joined: 2 of 2 workers running")
        job.wait_for(r"\[launcher\] worker 1 leaves the pool \(1 of 2 workers wanted\)")
        done = job.wait_for(r"\[chief 0\] iterations (\d+) reexecuted (\d+)")
        # Not a step lost: every requested step ran (those run twice are counted).
        assert int(done.group(1)) == 240 + int(done.group(2))
        job.wait_for(r"\[chief 0\] workers per epoch \[\d, \d, \d, 1\]")
        assert job.finish() == 0, job.output()
        # A worker the launcher stopped is not a failure: no restart was spent on it.
        assert "restart 1 of 1" not in job.output()
    finally:
        job.close()


def test_below_min_workers_fit_holds_then_fails_naming_the_missing_workers(tmp_path):
    """Two `kerasps serve` workers, `min_workers=2`: one killed for good holds training,
    then `fit` raises `TooFewWorkersError` after `min_workers_timeout`."""
    cluster = {kind: [f"localhost:{pick_port()}" for _ in range(n)]
               for kind, n in (("chief", 1), ("worker", 2), ("ps", 1))}

    def config(kind, index):
        return {"TF_CONFIG": json.dumps({"cluster": cluster,
                                         "task": {"type": kind, "index": index}})}

    servers = [subprocess.Popen([sys.executable, "-m", "kerasps.cli", "serve"],
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                     **config(kind, i)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for kind, i in (("worker", 0), ("worker", 1), ("ps", 0))]
    script = tmp_path / "chief.py"
    script.write_text(textwrap.dedent(ELASTIC_CHIEF.replace("RESIZE", "{}").replace(
        'mode="MODE")', "min_workers=2, min_workers_timeout=4)")))
    chief = RunningJob([sys.executable, str(script)], cwd=tmp_path, env=config("chief", 0))
    try:
        chief.wait_for(r"^train batch 30$")
        servers[1].kill()
        servers[1].wait()
        chief.wait_for(r"worker 1 left: 1 of 2 workers running")
        chief.wait_for(r"Holding training: 1 of the 2 workers needed")
        error = chief.wait_for(r"TooFewWorkersError: Only 1 of 2 workers have answered.*"
                               r"workers not answering: \[1\]")
        assert "min_workers_timeout=4s" in error.string
        assert chief.finish() != 0
    finally:
        chief.close()
        for server in servers:
            server.kill()
            server.wait(30)
