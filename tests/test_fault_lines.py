"""What a fault prints (issue 38): a few plain lines per fault, on the chief and in the
whole job's output, not TensorFlow's error blocks and tracebacks.

The guide's example (docs/guide/fault-tolerance.md: `kerasps launch --workers 2 --ps 1
--max-restarts 3 train.py`, a `BackupAndRestore(save_freq=5)` fit of 3 epochs of 200
steps, `verbose=2`), with one task SIGKILLed in epoch 2 as `kill -9` would: a worker, the
ps task or the chief. A ps kill printed some 170 lines on the chief before (TensorFlow's
`ERROR:tensorflow:Remote function on worker ... failed with UnavailableError()` blocks,
`Detected at node` stacks, `Exception ignored in: <function Executor.__del__ ...>`
tracebacks, `AbortedError: Unable to find a context_id`).
"""

import re

import pytest

from tests.launched import launch

pytestmark = pytest.mark.slow

TRAIN = """
    import os, sys
    import keras, numpy as np, tensorflow as tf, kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse")

    def dataset_fn(input_context):
        x = np.random.default_rng(input_context.input_pipeline_id).random((256, 8), "float32")
        return tf.data.Dataset.from_tensor_slices((x, x.sum(1))).repeat().batch(32)

    class KillHere(keras.callbacks.Callback):  # says once when the test may kill a task
        def on_train_batch_end(self, batch, logs=None):
            flag = os.path.join(sys.argv[1], "said")
            if self.epoch == 1 and batch == 30 and not os.path.exists(flag):
                open(flag, "w").close()
                print("job: kill now", flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    history = model.fit(
        kerasps.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=200, verbose=2,
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(sys.argv[1], "backup"),
                                                    save_freq=5), KillHere()])
    print("job: done", history.history.get("rolled_back_steps"),
          history.history.get("reexecuted_steps"), flush=True)
"""

# The lines a run without a fault prints too: Keras' epoch lines (verbose=2), the
# program's own (`job: ...`), a task's start.
PROGRESS = re.compile(r"^\[(chief|worker|ps) \d+\] (Epoch \d+/\d+|\d+/\d+ - .*|job: .*"
                      r"|kerasps serve: \w+ \d+ serving at \S+)$")
LAUNCHER = re.compile(r"^\[launcher\] (started .*|chief 0 finished with exit code 0)$")

# At most this many lines per fault on the chief. Measured: a worker kill prints 2 (it
# stopped answering, naming TensorFlow's messages' file; it is back after N s), a ps kill 5
# (each worker's step runs again: 2; the ps task lost its variables; the backup restored in
# N s; the steps run twice), a chief kill 0 (the launcher says it). Before, 6, 125 and 0,
# with TensorFlow's `ERROR:tensorflow:` blocks. One line of slack (a third "ran twice" for
# the next epoch's steps, say); the job's output adds the launcher's own line about the
# task ("exited with signal 9 (SIGKILL); restart 1 of 3") and a little slack.
CHIEF_BOUND = 6
JOB_BOUND = 8


@pytest.mark.parametrize("task", ["worker 0", "ps 0", "chief 0"])
def test_a_killed_task_costs_the_job_a_few_plain_lines(tmp_path, task):
    job = launch(tmp_path, TRAIN, "--workers", "2", "--ps", "1", "--max-restarts", "3",
                 args=[str(tmp_path)], env={"TF_CPP_MIN_LOG_LEVEL": None})  # a user's
    try:
        job.wait_for(r"\[chief 0\] job: kill now$")
        killed_at = len(job.lines)
        job.kill(task)
        job.wait_for(r"\[chief 0\] job: done ")
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    after = job.lines[killed_at:]
    unexpected = [line for line in after if not PROGRESS.match(line)
                  and not LAUNCHER.match(line)]
    chief = [line for line in unexpected if line.startswith("[chief 0] ")]
    shown = "\n".join(job.lines)
    print(f"{task}: {len(chief)} chief line(s), {len(unexpected)} job line(s):\n"
          + "\n".join(unexpected))
    assert len(chief) <= CHIEF_BOUND, shown
    assert len(unexpected) <= JOB_BOUND, shown
    assert not [line for line in after if "Traceback" in line or "ERROR:" in line
                or re.search(r"\] [EWF]\d{4} ", line)], shown
