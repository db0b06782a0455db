"""User errors inside scheduled functions, in custom loops and in `model.fit`.

TensorFlow's promise (`ClusterCoordinator.join`/`done`/`schedule`, and its
`fault_tolerance_test_base.testOneWorkerPreemptionWithCancellation`): an
error raised by a scheduled function is the user's, not a failure to recover
from. It is not retried; it comes out of the next `schedule`, `join` or
`done` as itself (here never as a `kerasps.PsTaskFailedError`); the
functions queued behind it are cancelled (their `fetch()` raises
`CancelledError`); and the coordinator works again afterwards.
"""

import os
import threading
import time
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps

DEADLINE_S = 60.0
# Bound on the wait of a held failing function, so that a worker never waits
# forever if a hold were not released (each iteration is a read from a ps task).
SPIN_LIMIT = 200_000


class Loop:
    """A coordinator with ps variables `hold` (while it is 1, failing functions wait),
    `release` (once it is 1, long functions end), `ran` (counts runs of `count`) and
    `attempts` (counts runs of failing functions)."""

    def __init__(self, strategy):
        self.coordinator = kerasps.ClusterCoordinator(strategy)
        with strategy.scope():
            self.hold = tf.Variable(0, name="hold")
            self.release = tf.Variable(0, name="release")
            self.ran = tf.Variable(0, name="ran")
            self.attempts = tf.Variable(0, name="attempts")
        self.count = tf.function(lambda: self.ran.assign_add(1))

    def failing(self, message="user error"):
        """A function that counts its attempt, waits while `hold` is set, then fails a
        `tf.debugging` assertion (on a value only known when it runs)."""
        hold = self.hold

        @tf.function
        def fail():
            [waited] = tf.while_loop(
                lambda i: tf.logical_and(hold.read_value() > 0, i < SPIN_LIMIT),
                lambda i: i + 1, [0])
            with tf.control_dependencies([self.attempts.assign_add(1), waited]):
                tf.debugging.assert_less(tf.random.uniform(()), -1.0, message=message)
            return tf.constant(0)

        return fail


@pytest.fixture
def loop(strategy):
    return Loop(strategy)


def test_a_failed_assertion_comes_out_of_join_as_itself_and_is_not_retried(loop):
    coordinator = loop.coordinator
    failing = coordinator.schedule(loop.failing(message="labels must be sorted"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="labels must be sorted") as info:
        coordinator.join()
    assert not isinstance(info.value, kerasps.PsTaskFailedError)
    with pytest.raises(tf.errors.InvalidArgumentError, match="labels must be sorted"):
        failing.fetch()
    assert int(loop.attempts.numpy()) == 1  # a user error is not a worker failure to retry
    assert coordinator.done()  # raised once, then cleared


def test_a_bad_shape_comes_out_of_done(loop):
    coordinator = loop.coordinator

    @tf.function
    def bad_matmul():
        rows = tf.random.uniform((), 3, 4, dtype=tf.int32)  # 3, known only at run time
        return tf.linalg.matmul(tf.ones([2, 5]), tf.ones(tf.stack([rows, 1])))

    coordinator.schedule(bad_matmul)
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(tf.errors.InvalidArgumentError, match="Matrix size-incompatible"):
        while not coordinator.done():
            assert time.monotonic() < deadline, "done() never raised the error"
            time.sleep(0.01)
    assert coordinator.done()


def test_the_error_comes_out_of_the_next_schedule(loop):
    coordinator = loop.coordinator
    noop = tf.function(lambda: tf.constant(1))
    failing = coordinator.schedule(loop.failing())
    with pytest.raises(tf.errors.InvalidArgumentError):
        failing.fetch()  # the function has failed; the next `schedule`s raise it
    deadline = time.monotonic() + DEADLINE_S
    with pytest.raises(tf.errors.InvalidArgumentError, match="user error"):
        while time.monotonic() < deadline:
            coordinator.schedule(noop)
    coordinator.join()  # the error was raised once: nothing left to raise
    assert int(loop.attempts.numpy()) == 1


def test_functions_queued_behind_an_error_are_cancelled_and_the_coordinator_recovers(loop):
    coordinator = loop.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda context: tf.data.Dataset.range(100).repeat()))

    release = loop.release

    @tf.function
    def busy():
        # Work far longer than the test (as in TensorFlow's own test): on the
        # coordinator it ends by being cancelled. The worker may not hear of the
        # cancellation (gRPC loses one now and then): it would go on running there
        # and hold every later function of its worker, so the test ends such a
        # straggler by `release` once the cancellations are checked.
        [x] = tf.while_loop(
            lambda x: tf.logical_and(x < 1e12, release.read_value() == 0),
            lambda x: x + tf.reduce_sum(
                tf.linalg.matmul(tf.ones([32, 32]), tf.ones([32, 32]))) * 1e-9, [0.0])
        return x

    @tf.function
    def read(iterator):
        return next(iterator)

    busy.get_concrete_function()
    # The failing function waits until the test releases it, so that every other
    # function is scheduled first: one runs on the other worker, the rest are queued.
    loop.hold.assign(1)
    failing = coordinator.schedule(loop.failing())
    queued = [coordinator.schedule(busy) for _ in range(10)]
    loop.hold.assign(0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="user error"):
        coordinator.join()
    with pytest.raises(tf.errors.InvalidArgumentError):
        failing.fetch()
    for remote in queued:
        with pytest.raises(tf.errors.CancelledError):
            remote.fetch()
    loop.release.assign(1)

    # The coordinator, its workers and their per-worker iterators work again.
    again = [coordinator.schedule(loop.count) for _ in range(4)]
    element = coordinator.schedule(read, args=(iterator,))
    coordinator.join()
    for remote in again:
        remote.fetch()
    assert int(loop.ran.numpy()) == 4
    assert 0 <= int(element.fetch()) < 100
    assert coordinator.done()


# -- model.fit, evaluate, predict ----------------------------------------------------
def make_model(strategy, steps_per_execution=1):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,), dtype="int32"),
                                  keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.compile("adam", "mse", steps_per_execution=steps_per_execution)
    return model


def dataset(size, bad_from=None, batch_size=4):
    """`(ids, label)` batches; records from number `bad_from` on fail a check when read,
    that is inside the step that reads them."""

    def element(i):
        if bad_from is not None:
            tf.debugging.assert_less(i, tf.constant(bad_from, tf.int64), message="corrupt record")
        ids = tf.cast(tf.stack([i % 20, (i * 7) % 20]), tf.int32)
        return ids, tf.cast(i % 2, tf.float32)[None]

    return tf.data.Dataset.range(size).map(element).batch(batch_size)


def records(bad_from=None):
    """Endless training data for every worker (see `dataset`)."""
    return kerasps.DatasetCreator(lambda context: dataset(1_000_000, bad_from))


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_an_error_inside_a_training_step_comes_out_of_fit_and_fit_works_again(
        strategy, steps_per_execution):
    model = make_model(strategy, steps_per_execution)
    # Each worker reads its own copy: its 6th batch holds record 20.
    with pytest.raises(tf.errors.InvalidArgumentError, match="corrupt record") as info:
        model.fit(records(bad_from=20), epochs=2, steps_per_epoch=30, verbose=0)
    assert not isinstance(info.value, kerasps.PsTaskFailedError)
    before = int(model.optimizer.iterations.numpy())
    history = model.fit(records(), epochs=2, steps_per_epoch=12, verbose=0)
    assert len(history.history["loss"]) == 2
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) == before + 24


def test_an_error_inside_evaluate_and_predict_steps_comes_out_and_they_work_again(strategy):
    model = make_model(strategy)
    bad = dataset(64, bad_from=40, batch_size=8)  # batches 5 to 7 fail
    with pytest.raises(tf.errors.InvalidArgumentError, match="corrupt record"):
        model.evaluate(bad, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="corrupt record"):
        model.predict(bad.map(lambda x, y: x), verbose=0)
    ids = np.arange(32, dtype="int32").reshape(16, 2) % 20
    y = np.zeros((16, 1), "float32")
    assert np.isfinite(model.evaluate(ids, y, batch_size=4, verbose=0))
    assert model.predict(ids, batch_size=4, verbose=0).shape == (16, 1)


def test_an_id_out_of_a_sharded_embeddings_range_is_an_error_as_in_keras(strategy):
    model = make_model(strategy)  # the strategy splits the Embedding's table in two
    assert isinstance(model.layers[0].embeddings, kerasps.ShardedVariable)
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.predict(np.array([[25, 1]], "int32"), verbose=0)
    assert model.predict(np.array([[19, 1]], "int32"), verbose=0).shape == (1, 1)


def test_an_error_raised_by_a_callback_comes_out_of_fit_and_fit_works_again(strategy):
    model = make_model(strategy)

    class Refuse(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise ValueError("the callback refused batch 3")

    with pytest.raises(ValueError, match="refused batch 3"):
        model.fit(records(), epochs=1, steps_per_epoch=10, verbose=0, callbacks=[Refuse()])
    history = model.fit(records(), epochs=1, steps_per_epoch=10, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize("method", ["predict_on_batch", "test_on_batch", "train_on_batch"])
def test_an_error_in_an_on_batch_step_is_raised_once_and_the_next_call_works(strategy, method):
    model = make_model(strategy)
    call = getattr(model, method)
    bad, good = np.array([[25, 1]], "int32"), np.array([[19, 1]], "int32")
    args = () if method == "predict_on_batch" else (np.zeros((1, 1), "float32"),)
    with pytest.raises(tf.errors.InvalidArgumentError):
        call(bad, *args)
    again = None
    try:
        call(good, *args)
    except tf.errors.InvalidArgumentError as error:
        again = error
    if again is not None:
        # A failure without a traceback: pytest formats tracebacks with `ast`, which
        # Python 3.11.7 may break on while TensorFlow threads use it (INTERNALERROR).
        pytest.fail(f"the next call raised the failed call's error again: {again.message[:80]}",
                    pytrace=False)
    assert model.predict(good, verbose=0).shape == (1, 1)


# -- tracebacks ---------------------------------------------------------------------------
KERASPS = os.path.dirname(os.path.abspath(kerasps.__file__)) + os.sep


class Stop(keras.callbacks.Callback):
    """Raises `error` at the end of the 3rd batch (Ctrl-C, or the user's own error)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise self.error

    on_test_batch_end = on_predict_batch_end = on_train_batch_end


def frames(error) -> list:
    """`(file, function)` of each frame of `error`'s traceback, outermost first."""
    return [(frame.f_code.co_filename, frame.f_code.co_name)
            for frame, _ in traceback.walk_tb(error.__traceback__)]


def interrupted(model, method, error):
    """The exception that leaves `model.<method>(...)` when a callback raises `error`."""
    ids = np.arange(64, dtype="int32").reshape(32, 2) % 20
    calls = {
        "fit": lambda: model.fit(records(), epochs=1, steps_per_epoch=10, verbose=0,
                                 callbacks=[Stop(error)]),
        "evaluate": lambda: model.evaluate(ids, np.zeros((32, 1), "float32"), batch_size=4,
                                           verbose=0, callbacks=[Stop(error)]),
        "predict": lambda: model.predict(ids, batch_size=4, verbose=0, callbacks=[Stop(error)]),
    }
    with pytest.raises(type(error)) as info:
        calls[method]()
    return info.value


@pytest.mark.parametrize("method, error", [("fit", KeyboardInterrupt()),
                                           ("evaluate", ValueError("refused")),
                                           ("predict", KeyboardInterrupt())])
def test_an_exception_out_of_fit_shows_the_users_frames_and_none_of_kerasps(strategy, method,
                                                                          error):
    """Ctrl-C in `fit` printed 20 lines of kerasps' trainer (recovery, dispatch, `_tf`);
    as Keras filters its own frames, the user sees the call and their callback."""
    raised = interrupted(make_model(strategy), method, error)
    assert raised is error
    assert [function for _, function in frames(raised)] == [
        "interrupted", "<lambda>", "on_train_batch_end"], frames(raised)  # the call, the callback
    assert not [file for file, _ in frames(raised) if file.startswith(KERASPS)]


def test_an_error_raised_inside_kerasps_shows_only_the_users_call(strategy):
    model = make_model(strategy)
    with pytest.raises(tf.errors.InvalidArgumentError, match="corrupt record") as info:
        model.fit(records(bad_from=20), epochs=1, steps_per_epoch=30, verbose=0)
    assert frames(info.value) == [
        (__file__, "test_an_error_raised_inside_kerasps_shows_only_the_users_call")]


def test_keras_traceback_filtering_decides_whether_kerasps_frames_are_shown(strategy):
    model = make_model(strategy)
    filtered = interrupted(model, "fit", KeyboardInterrupt())
    keras.config.disable_traceback_filtering()
    try:
        raw = interrupted(model, "fit", KeyboardInterrupt())
    finally:
        keras.config.enable_traceback_filtering()
    assert not [file for file, _ in frames(filtered) if file.startswith(KERASPS)]
    files = [file for file, _ in frames(raw)]
    assert os.path.join(KERASPS, "keras", "trainer", "training.py") in files, files
    assert frames(raw)[0] == frames(filtered)[0] and frames(raw)[-1] == frames(filtered)[-1]


class CtrlCInALockWait(keras.callbacks.Callback):
    """Ctrl-C as CPython delivers it to a thread getting a contended lock back in
    `Condition.wait` (after being woken, another thread holding the lock): the lock is not
    acquired, and the `with` block's exit raises `RuntimeError` in the middle of the
    `KeyboardInterrupt` (a `kerasps launch` chief printed that traceback, 1 run in ~20)."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            lock = threading.Lock()
            try:
                raise KeyboardInterrupt  # the acquire in `_acquire_restore`, interrupted
            finally:
                lock.release()  # `Condition.__exit__`: "release unlocked lock"


@pytest.mark.parametrize("filtering", [True, False])
def test_ctrl_c_that_breaks_a_locks_release_leaves_fit_as_a_keyboard_interrupt(
        strategy, filtering):
    model = make_model(strategy)
    if not filtering:
        keras.config.disable_traceback_filtering()
    try:
        with pytest.raises(BaseException) as info:
            model.fit(records(), epochs=1, steps_per_epoch=10, verbose=0,
                      callbacks=[CtrlCInALockWait()])
    finally:
        keras.config.enable_traceback_filtering()
    assert type(info.value) is KeyboardInterrupt, repr(info.value)
