"""A ps task lost mid-`fit` must not end the workers' repeated training input.

A scheduled function that fails, or is cancelled, while its `next(iterator)` waits for
an element cancels that worker's iterator for good (TensorFlow's `IteratorGetNext`
passes the function's cancellation on to the iterator), and the prefetch at the top of
the worker's per-device pipeline then reports the end of the sequence on every later
read. Two places start iterators again: the worker thread of TensorFlow's coordinator,
for a function it runs again after a failure it takes for a passing one, and `fit`, for
every worker's pipeline, once it goes on after a lost ps task."""

import contextlib
import re

import pytest

from tests.launched import launch, wait_until


def test_a_function_cancelled_while_it_reads_ends_its_iterator_until_restarted(make_strategy):
    """As TensorFlow's coordinator cancels the functions in flight after an error (a ps
    task lost, here a failing function on the other worker)."""
    import tensorflow as tf

    import kerasps
    from kerasps.runtime.input import per_worker

    strategy = make_strategy()
    coordinator = kerasps.ClusterCoordinator(strategy)

    def dataset_fn(context):
        dataset = tf.data.Dataset.from_tensor_slices(tf.range(1000)).repeat().batch(4)
        return kerasps.input.slowed(dataset, 3.0)

    dataset = coordinator.create_per_worker_dataset(kerasps.DatasetCreator(dataset_fn))
    iterator = dataset.persistent_iterator()

    @tf.function
    def read(iterator):
        return next(iterator)

    @tf.function
    def fail(fail):
        # Fails in 1 s: worker 0's `next`, whose element comes in 3 s, is waiting then.
        fail = tf.data.Dataset.from_tensors(fail).apply(
            lambda d: kerasps.input.slowed(d, 1.0)).get_single_element()
        tf.debugging.Assert(tf.logical_not(fail), ["a failing function"])
        return fail

    assert coordinator.schedule_on(0, read, (iterator,)).fetch().tolist() == [0, 1, 2, 3]
    cancelled = coordinator.schedule_on(0, read, (iterator,))
    coordinator.schedule_on(1, fail, (tf.constant(True),))
    with pytest.raises(tf.errors.InvalidArgumentError, match="a failing function"):
        coordinator.join()
    with pytest.raises(tf.errors.CancelledError):
        cancelled.fetch()
    # TensorFlow's behaviour, which kerasps works around: the repeated input has ended.
    with pytest.raises(tf.errors.OutOfRangeError):
        coordinator.schedule_on(0, read, (iterator,)).fetch()
    with contextlib.suppress(tf.errors.OutOfRangeError):  # raised by fetch() or here
        coordinator.join()

    per_worker.restart_persistent_iterators(coordinator._tf_coordinator)
    assert dataset.persistent_iterator() is iterator  # restarted in place
    assert coordinator.schedule_on(0, read, (iterator,)).fetch().tolist() == [0, 1, 2, 3]
    assert coordinator.schedule_on(0, read, (iterator,)).fetch().tolist() == [4, 5, 6, 7]


def test_a_function_run_again_after_a_passing_failure_reads_its_input_started_again(
        make_strategy):
    """TensorFlow's coordinator runs a function again, same arguments, after an error it
    takes for a passing one: the first two `UnavailableError`s from a ps task, which a
    lost ps task gives. One that failed while its `next(iterator)` waited had cancelled
    that iterator for good, so the second run found the end of the repeated input (the
    chaos job's "input ended ... after a restart", 1 ps kill in 3 in CI)."""
    import tensorflow as tf

    import kerasps
    from kerasps.backend import _tf

    strategy = make_strategy()
    coordinator = kerasps.ClusterCoordinator(strategy)

    def dataset_fn(context):  # worker w reads 1000 * w, 1000 * w + 1, ...
        dataset = tf.data.Dataset.range(1000 * context.input_pipeline_id, 10**6)
        return kerasps.input.slowed(dataset.batch(4), 3.0)

    dataset = coordinator.create_per_worker_dataset(kerasps.DatasetCreator(dataset_fn))
    iterator = dataset.persistent_iterator()
    with strategy.scope():
        calls = tf.Variable(0)

    @tf.function
    def read(iterator, fail_at_call):
        element = next(iterator)
        # Fails at once, while `next` waits for its element (3 s), with an error the
        # coordinator takes for a passing ps failure (`_is_ps_failure`: the text of one).
        call = calls.assign_add(1)
        tf.debugging.Assert(call != fail_at_call, [
            "GRPC error information from remote target /job:ps/replica:0/task:0: "
            "unknown device"])
        return element

    assert coordinator.schedule_on(0, read, (iterator, 0)).fetch().tolist() == [0, 1, 2, 3]
    restarted = []
    stop_observing = _tf.observe_worker_failures(restarted.append)
    try:
        # Run again on either worker (before: OutOfRangeError, End of sequence, on 0).
        again = coordinator.schedule_on(0, read, (iterator, 2)).fetch().tolist()
    finally:
        stop_observing()
    assert calls.numpy() == 3  # it failed once, then ran again
    assert restarted == [0]  # exact evaluation starts over on this news
    # Worker 0's input started again from its start, and goes on.
    after = coordinator.schedule_on(0, read, (iterator, 0)).fetch().tolist()
    assert (again, after) in [([0, 1, 2, 3], [4, 5, 6, 7]),  # run again on worker 0
                              ([1000, 1001, 1002, 1003], [0, 1, 2, 3])]  # or on 1


# The chaos job's model and input (benchmarks/chaos.py), each batch held back so that
# the workers' functions wait in `next(iterator)` when a ps task dies.
CHIEF = """
    import itertools, sys
    import keras, tensorflow as tf, kerasps

    backup_dir, spe, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.from_tf_config(),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        ids = keras.Input((4,), dtype="int32")
        x = keras.layers.Embedding(20_000, 16)(ids)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dense(32, activation="relu")(x)
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(keras.optimizers.Adam(0.001), "mse", steps_per_execution=spe)

    def dataset_fn(context):
        x = tf.random.stateless_uniform((4096, 4), [1, context.input_pipeline_id],
                                        maxval=20_000, dtype=tf.int32)
        y = tf.cast(tf.reduce_sum(x % 7, axis=1, keepdims=True), tf.float32) / 10.0
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
        return kerasps.input.slowed(dataset, seconds)

    def say(*words):
        print(*words, flush=True)

    trained = itertools.count(1)
    progress = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: say("train batch", next(trained)))
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=10)
    history = model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=STEPS * spe,
                        verbose=0, callbacks=[progress, backup])
    say("iterations", int(model.optimizer.iterations.numpy()))
    say("reexecuted", sum(history.history.get("reexecuted_steps", [0])))
"""

KILLS = 3
STEPS = 120  # functions (of `steps_per_execution` steps) in the fit
GAP = 15  # functions delivered before the first kill, and after each restore
TRAINED = re.compile(r"\[chief 0\] train batch (\d+)$")


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution, seconds_per_batch", [(1, 0.5), (4, 0.2)])
def test_ps_killed_repeatedly_mid_fit_never_ends_the_repeated_input(
        tmp_path, steps_per_execution, seconds_per_batch):
    job = launch(tmp_path, CHIEF.replace("STEPS", str(STEPS)), "--workers", "2", "--ps", "2",
                 "--max-restarts", str(KILLS),
                 args=[str(tmp_path / "backup"), str(steps_per_execution), str(seconds_per_batch)])

    def count(text):
        return sum(text in line for line in job.lines)

    def trained():
        return max((int(m.group(1)) for m in map(TRAINED.search, job.lines) if m), default=0)

    try:
        at = GAP
        for kill in range(KILLS):
            job.wait_for(rf"\[chief 0\] train batch {at}$")
            task = f"ps {kill % 2}"
            job.kill(task)
            job.wait_for(rf"\[launcher\] {task} exited with signal 9 \(SIGKILL\); "
                         rf"restart {kill // 2 + 1} of {KILLS}")
            assert wait_until(lambda k=kill: count("Restored the backup") > k, timeout=240), (
                job.output())
            at = trained() + GAP
        iterations = int(job.wait_for(r"\[chief 0\] iterations (\d+)").group(1))
        reexecuted = int(job.wait_for(r"\[chief 0\] reexecuted (\d+)").group(1))
        assert job.finish() == 0, job.output()
        assert count("lost their variables") == KILLS, job.output()
        ended = [line for line in job.lines if "although it is repeated" in line]
        assert not ended, (f"the input ended {len(ended)} time(s) in {KILLS} ps kills:\n"
                           + "\n".join(ended))
        assert iterations == STEPS * steps_per_execution + reexecuted
    finally:
        job.close()



def test_a_fit_after_one_that_failed_starts_its_input_pipelines_again(make_strategy):
    # A `fit` that ended by an error may leave a worker's iterator cancelled for good
    # (above); the next `fit` on the same input reads new pipelines, not that one.
    import keras
    import tensorflow as tf

    import kerasps

    class FailsAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stopped by the test")

    strategy = make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")

    def dataset_fn(context):
        return tf.data.Dataset.from_tensors((tf.ones((4, 1)), tf.ones((4, 1)))).repeat()

    data = kerasps.DatasetCreator(dataset_fn)
    model.fit(data, steps_per_epoch=4, verbose=0)
    (pipelines,) = [p for c, p in kerasps.ClusterCoordinator(strategy)._dataset_cache.items()
                    if c is data]
    finished = pipelines["train"].persistent_iterator()
    assert pipelines["train"].persistent_iterator() is finished  # kept between calls
    with pytest.raises(RuntimeError, match="stopped by the test"):
        model.fit(data, steps_per_epoch=8, verbose=0, callbacks=[FailsAtBatch()])
    failed = pipelines["train"].persistent_iterator()
    assert failed is not finished
    history = model.fit(data, steps_per_epoch=4, verbose=0)
    assert pipelines["train"].persistent_iterator() is not failed
    assert len(history.history["loss"]) == 1
