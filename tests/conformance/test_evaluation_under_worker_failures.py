"""The worker kills of tf_keras' evaluation tests: results stay exact when workers die.

Sources (keras-team/tf-keras): tf_keras/distribute/parameter_server_evaluation_test.py
(`testModelEvaluatePrototype`) and parameter_server_exact_evaluation_test.py
(`testDistributedModelEvaluation`). Both kill workers 0 and 1
and start them again while the evaluation runs, then assert exact results. Here a
`kerasps launch` job (2 workers, 1 ps, separate processes) runs the chief below; the test
SIGKILLs both workers at a point the chief reports, the launcher restarts them, and the
chief prints what it computed. The in-process halves of these cases are in
`test_parameter_server_evaluation.py`.

Marked `slow` (a multi-process job: about a minute on 2 cores); `.ci/run` runs it.
"""

import pytest

from tests.conformance.support import fail_without_traceback
from tests.launched import launch

pytestmark = pytest.mark.slow

CHIEF = """
    import keras, numpy as np, tensorflow as tf, kerasps

    strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
    coordinator = kerasps.ClusterCoordinator(strategy)

    def say(*words):
        print(*words, flush=True)

    # testModelEvaluatePrototype: 128 shards of range(1024), each evaluated by one
    # scheduled function (slowed, so that the workers die while they run).
    @tf.function
    def shard_mean(total_shards, shard_id):
        values = kerasps.input.slowed(
            tf.data.Dataset.range(1024).shard(total_shards, shard_id), 0.005)
        total = tf.constant(0, tf.int64)
        count = tf.constant(0, tf.int64)
        for value in values:
            total += value
            count += 1
        return tf.cast(total, tf.float64) / tf.cast(count, tf.float64)

    shards = tf.constant(128, tf.int64)
    results = [coordinator.schedule(shard_mean, args=(shards, tf.constant(i, tf.int64)))
               for i in range(128)]
    means = []
    for i, result in enumerate(results):
        means.append(float(result.fetch()))
        say("prototype fetched", i)
    say("prototype mean", sum(means) / len(means))

    # testDistributedModelEvaluation: a model that always predicts 1, on labels whose
    # accuracy is known; every example must be counted once.
    class AlwaysTrue(keras.Model):
        def call(self, x, training=False):
            return tf.cast(x >= 0, tf.float32)

    class ExampleCount(keras.metrics.Metric):
        def __init__(self, name="examples", **kwargs):
            super().__init__(name=name, **kwargs)
            self.count = self.add_variable(shape=(), initializer="zeros", name="count")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.count.assign_add(tf.cast(tf.shape(y_pred)[0], self.dtype))

        def result(self):
            return self.count * 1.0

    batch, shards, per_shard = 8, 8, 4
    examples = batch * shards * per_shard
    y = np.zeros(examples)
    for shard in range(shards):
        trues = shard
        for b in np.where(np.arange(examples // batch) % shards == shard)[0]:
            n = min(trues, batch)
            y[b * batch:(b + 1) * batch] = np.r_[np.ones(n), np.zeros(batch - n)]
            trues -= n
    dataset = kerasps.input.slowed(
        tf.data.Dataset.from_tensor_slices((np.arange(examples), y)).batch(batch), 0.15)
    with strategy.scope():
        model = AlwaysTrue()
        # Accuracy() (exact equality, as the source has): the string "accuracy" picks
        # categorical accuracy for these 1-D predictions.
        model.compile(loss="mae", metrics=[keras.metrics.Accuracy(), ExampleCount()])
    progress = keras.callbacks.LambdaCallback(
        on_test_batch_end=lambda batch, logs: say("eval batch", batch))
    logs = model.evaluate(dataset, verbose=0, return_dict=True, callbacks=[progress])
    say("evaluated", repr(logs["accuracy"]), repr(logs["loss"]), repr(logs["examples"]),
        "expected", repr(sum(range(shards)) / examples), examples)
"""


def kill_both_workers(job):
    job.kill("worker 0")
    job.kill("worker 1")


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """Runs the chief, killing both workers once during each evaluation; returns the
    prototype's mean and the evaluation's numbers."""
    job = launch(tmp_path_factory.mktemp("job"), CHIEF, "--workers", "2", "--ps", "1",
                 "--max-restarts", "4")
    try:
        job.wait_for(r"\[chief 0\] prototype fetched 10$")
        kill_both_workers(job)
        mean = float(job.wait_for(r"\[chief 0\] prototype mean (\S+)").group(1))
        job.wait_for(r"\[chief 0\] eval batch 4$")
        kill_both_workers(job)
        done = job.wait_for(r"\[chief 0\] evaluated (\S+) (\S+) (\S+) expected (\S+) (\d+)")
        assert job.finish() == 0, job.output()
        assert len(job.pids["worker 0"]) == len(job.pids["worker 1"]) == 3, job.output()
        accuracy, loss, counted, expected, examples = (float(g) for g in done.groups())
        return {"mean": mean, "accuracy": accuracy, "loss": loss, "counted": counted,
                "expected": expected, "examples": examples}
    finally:
        job.close()


def test_functions_evaluating_shards_give_exact_results_across_worker_restarts(killed_twice):
    """testModelEvaluatePrototype: every shard's function ran to its end, once counted."""
    assert killed_twice["mean"] == 511.5


def test_evaluate_counts_every_example_once_across_worker_restarts(killed_twice):
    """testDistributedModelEvaluation with its worker kills. A restarted worker reads its
    shard again from the start (296 examples of 256 were counted, 3 runs in 3): the
    evaluation starts over instead. (testDistributedMetrics' closures return metric
    weights that the coordinator adds up: exact across restarts for the reason the
    prototype above is.)"""
    results = killed_twice
    if results["counted"] != results["examples"]:
        fail_without_traceback(f"{results['counted']} examples counted, "
                               f"{results['examples']} in the dataset")
    assert results["accuracy"] == pytest.approx(results["expected"])
    assert results["loss"] == pytest.approx(1 - results["expected"])
