"""Side-car evaluation: `kerasps.SidecarEvaluator` on checkpoint directories, and a real
`kerasps launch --evaluator` job."""

import json
import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasps
from kerasps.keras import evaluator as evaluator_lib
from kerasps.runtime.launch_env import TRAINING_FINISHED_ENV
from tests.launched import launch, process_gone, wait_until

X = np.linspace(0.0, 1.0, 128, dtype="float32").reshape(32, 4)
Y = X.sum(axis=1, keepdims=True)


def build(units=3):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    return model


def data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)


def train(model, filepath, epochs, initial_epoch=0, **checkpoint_options):
    """Trains `model` up to `epochs`, with a `ModelCheckpoint` to `filepath` every epoch."""
    model.fit(X, Y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(str(filepath), **checkpoint_options)])
    return model.evaluate(data(), verbose=0, return_dict=True)


def assert_metrics(evaluation, expected):
    assert set(evaluation.metrics) == set(expected)
    for name, value in expected.items():
        assert evaluation.metrics[name] == pytest.approx(value, rel=1e-5)


@pytest.fixture
def trained(tmp_path):
    """A model trained 2 epochs into tmp_path/ckpt/epoch-01.weights.h5 and -02, and its
    metrics after epoch 2."""
    model = build()
    metrics = train(model, tmp_path / "ckpt" / "epoch-{epoch:02d}.weights.h5", epochs=2,
                    save_weights_only=True)
    return model, tmp_path / "ckpt", metrics


def test_the_newest_checkpoint_is_evaluated_with_its_weights_then_the_next_one(trained):
    model, checkpoint_dir, after_2 = trained
    fresh = build()
    untrained = fresh.evaluate(data(), verbose=0, return_dict=True)
    evaluator = kerasps.SidecarEvaluator(fresh, data(), checkpoint_dir, max_evaluations=1,
                                         verbose=0)
    (evaluation,) = evaluator.run()
    assert evaluation.checkpoint == str(checkpoint_dir / "epoch-02.weights.h5")
    assert evaluation.step == 2  # training went past epoch 1: passed over
    assert_metrics(evaluation, after_2)
    assert evaluation.metrics["loss"] != pytest.approx(untrained["loss"], rel=1e-3)

    after_3 = train(model, checkpoint_dir / "epoch-{epoch:02d}.weights.h5", epochs=3,
                    initial_epoch=2, save_weights_only=True)
    (evaluation,) = evaluator.run()
    assert evaluation.step == 3
    assert_metrics(evaluation, after_3)
    assert [e.step for e in evaluator.evaluations] == [2, 3]


def test_a_file_rewritten_every_epoch_is_evaluated_again_until_training_finished(tmp_path):
    model, checkpoint_dir = build(), tmp_path / "ckpt"
    after_1 = train(model, checkpoint_dir / "model.keras", epochs=1)
    evaluator = kerasps.SidecarEvaluator(build(), (X, Y), checkpoint_dir, verbose=0,
                                         poll_interval=0.01, max_evaluations=1)
    (first,) = evaluator.run()
    after_2 = train(model, checkpoint_dir / "model.keras", epochs=2, initial_epoch=1)
    evaluator.max_evaluations = None
    evaluator_lib.mark_training_finished(checkpoint_dir)
    (second,) = evaluator.run()  # returns: training finished, nothing newer to evaluate
    assert [first.step, second.step] == [1, 2]  # no number in the name: the ordinal
    assert_metrics(first, after_1)
    assert_metrics(second, after_2)


@pytest.mark.slow  # three epochs with a double backup: ~25 s
def test_a_backup_directory_is_read_at_its_latest_backup(tmp_path):
    model = build()
    model.fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False,
                                         double_checkpoint=True)])
    assert "latest.weights.h5.bkp" in os.listdir(tmp_path)  # the previous one: not read
    evaluator_lib.mark_training_finished(tmp_path)
    (evaluation,) = kerasps.SidecarEvaluator(build(), data(), tmp_path, verbose=0).run()
    assert evaluation.checkpoint == str(tmp_path / "latest.weights.h5")
    assert_metrics(evaluation, model.evaluate(data(), verbose=0, return_dict=True))


def test_run_returns_when_the_launcher_says_training_finished(trained, tmp_path, monkeypatch):
    _, checkpoint_dir, after_2 = trained
    flag = tmp_path / "training_finished"
    monkeypatch.setenv(TRAINING_FINISHED_ENV, str(flag))
    assert not evaluator_lib.training_finished(checkpoint_dir)
    flag.write_text("")
    assert evaluator_lib.training_finished(checkpoint_dir)
    (evaluation,) = kerasps.SidecarEvaluator(build(), data(), checkpoint_dir, verbose=0).run()
    assert_metrics(evaluation, after_2)


def test_a_checkpoint_deleted_once_found_is_skipped(trained, caplog):
    _, checkpoint_dir, _ = trained
    newest = checkpoint_dir / "epoch-02.weights.h5"
    evaluator = kerasps.SidecarEvaluator(build(), data(), checkpoint_dir, verbose=0)
    find = evaluator._checkpoints

    def found_then_deleted():
        found = find()
        newest.unlink()  # the chief's retention policy got there first
        return found

    evaluator._checkpoints = found_then_deleted
    evaluator_lib.mark_training_finished(checkpoint_dir)  # run() returns after one round
    with caplog.at_level(logging.WARNING):
        evaluations = evaluator.run()
    assert f"Skipping checkpoint {newest}" in caplog.text
    assert [e.checkpoint for e in evaluations] == [str(checkpoint_dir / "epoch-01.weights.h5")]


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_a_half_written_checkpoint_is_skipped_and_read_again_once_complete(tmp_path, caplog,
                                                                          suffix):
    checkpoint_dir = tmp_path / "ckpt"
    options = {"save_weights_only": True} if suffix == ".weights.h5" else {}
    after_1 = train(build(), checkpoint_dir / f"epoch-{{epoch:02d}}{suffix}", epochs=1,
                    **options)
    complete = (checkpoint_dir / f"epoch-01{suffix}").read_bytes()
    partial = checkpoint_dir / f"epoch-07{suffix}"
    partial.write_bytes(complete[: len(complete) // 2])
    evaluator_lib.mark_training_finished(checkpoint_dir)  # each run() is one round
    evaluator = kerasps.SidecarEvaluator(build(), data(), checkpoint_dir, verbose=0)
    with caplog.at_level(logging.WARNING):
        (evaluation,) = evaluator.run()
    assert f"Skipping checkpoint {partial}: it was deleted or is not completely written" in (
        caplog.text)
    assert evaluation.step == 1

    partial.write_bytes(complete)  # the writer finishes
    (evaluation,) = evaluator.run()
    assert evaluation.step == 7
    assert_metrics(evaluation, after_1)


def test_a_checkpoint_of_another_model_is_an_error_naming_it(tmp_path):
    train(build(units=5), tmp_path / "epoch-{epoch}.weights.h5", epochs=1, save_weights_only=True)
    evaluator_lib.mark_training_finished(tmp_path)
    evaluator = kerasps.SidecarEvaluator(build(units=3), data(), tmp_path, verbose=0)
    with pytest.raises(ValueError, match=r"(?s)The checkpoint .*epoch-1\.weights\.h5 does not fit "
                                         r"the model.*shape"):
        evaluator.run()


def test_tf_train_checkpoints_are_read_with_their_counter_as_step(tmp_path):
    model = build()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    expected = model.evaluate(data(), verbose=0, return_dict=True)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(tmp_path),
                                         max_to_keep=2)
    manager.save(checkpoint_number=40)
    evaluator_lib.mark_training_finished(tmp_path)
    (evaluation,) = kerasps.SidecarEvaluator(build(), data(), tmp_path, verbose=0).run()
    assert evaluation.checkpoint == str(tmp_path / "ckpt-40")
    assert evaluation.step == 40
    assert_metrics(evaluation, expected)


def read_scalars(log_dir):
    """{tag: {step: value}} from the TensorBoard event files under `log_dir`."""
    scalars = {}
    for name in os.listdir(log_dir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(log_dir, name)):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    return scalars


def test_metrics_are_written_for_tensorboard_at_each_checkpoints_step(trained, tmp_path):
    model, checkpoint_dir, _ = trained
    evaluator_lib.mark_training_finished(checkpoint_dir)
    evaluator = kerasps.SidecarEvaluator(build(), data(), checkpoint_dir, verbose=0,
                                         log_dir=tmp_path / "logs")
    evaluator.run()
    train(model, checkpoint_dir / "epoch-{epoch:02d}.weights.h5", epochs=3, initial_epoch=2,
          save_weights_only=True)
    evaluator.run()
    scalars = read_scalars(tmp_path / "logs")
    assert set(scalars) == {"loss", "mae"}
    for name in ("loss", "mae"):
        assert scalars[name] == pytest.approx({e.step: e.metrics[name]
                                               for e in evaluator.evaluations}, rel=1e-5)
    assert set(scalars["loss"]) == {2, 3}


def test_each_run_prints_one_line_per_evaluation(trained, capsys):
    evaluator_lib.mark_training_finished(trained[1])
    kerasps.SidecarEvaluator(build(), data(), trained[1]).run()
    assert capsys.readouterr().out.startswith("Evaluated epoch-02.weights.h5 (step 2): loss: ")


def unbuilt():
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("change, name", [
    (dict(model="not a model"), "model"),
    (dict(model=unbuilt()), "model"),
    (dict(model=keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])), "model"),
    (dict(data=None), "data"),
    (dict(data=iter([(X, Y)])), "data"),
    (dict(data=(X,)), "data"),
    (dict(checkpoint_dir=""), "checkpoint_dir"),
    (dict(checkpoint_dir=None), "checkpoint_dir"),
    (dict(steps=0), "steps"),
    (dict(log_dir=3), "log_dir"),
    (dict(max_evaluations=-1), "max_evaluations"),
    (dict(max_evaluations=True), "max_evaluations"),
    (dict(poll_interval=0), "poll_interval"),
    (dict(poll_interval="1"), "poll_interval"),
    (dict(verbose=2), "verbose"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, change, name):
    arguments = {"model": build(), "data": data(), "checkpoint_dir": tmp_path, **change}
    with pytest.raises(ValueError, match=rf"Invalid value for argument `{name}`.*Received: "
                                         rf"{name}="):
        kerasps.SidecarEvaluator(**arguments)


def test_task_type_reads_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert kerasps.cluster.task_type() is None
    cluster = {"chief": ["c:1"], "worker": ["w:1"], "ps": ["p:1"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": "evaluator", "index": 0}}))
    assert kerasps.cluster.task_type() == "evaluator"
    assert kerasps.cluster.task_type(json.dumps({"cluster": cluster, "task": {
        "type": "worker", "index": 0}})) == "worker"
    with pytest.raises(ValueError, match="task.type"):
        kerasps.cluster.task_type(json.dumps({"cluster": cluster, "task": {"type": "boss"}}))


# One script for every task: the chief trains on the cluster with ModelCheckpoint, the
# evaluator evaluates each new checkpoint until the launcher says training finished.
JOB = """
    import sys
    import keras, numpy as np, tensorflow as tf, kerasps

    checkpoint_dir, log_dir = sys.argv[1], sys.argv[2]
    x = np.linspace(0.0, 1.0, 256, dtype="float32").reshape(64, 4)
    y = x.sum(axis=1, keepdims=True)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
        return model

    if kerasps.cluster.task_type() == "evaluator":
        evaluator = kerasps.SidecarEvaluator(
            build(), tf.data.Dataset.from_tensor_slices((x, y)).batch(16), checkpoint_dir,
            log_dir=log_dir, poll_interval=0.1)
        evaluations = evaluator.run()
        print("evaluator done, steps", [e.step for e in evaluations], flush=True)
    else:
        strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config())
        with strategy.scope():
            model = build()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16), epochs=3,
                  steps_per_epoch=4, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(
                      checkpoint_dir + "/epoch-{epoch}.weights.h5", save_weights_only=True)])
        print("chief done", flush=True)
"""


@pytest.mark.slow
def test_launched_evaluator_evaluates_the_chiefs_checkpoints_and_exits(tmp_path):
    checkpoint_dir, log_dir = tmp_path / "ckpt", tmp_path / "logs"
    job = launch(tmp_path, JOB, "--workers", "1", "--ps", "1", "--evaluator",
                 args=(str(checkpoint_dir), str(log_dir)))
    try:
        evaluator_pid = int(job.wait_for(r"\[launcher\] started evaluator 0 \(pid (\d+)\)")
                            .group(1))
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    output = job.output()
    assert "[chief 0] chief done" in output
    # The last checkpoint is evaluated after the chief has exited, then the evaluator stops.
    done = job.wait_for(r"\[evaluator 0\] evaluator done, steps \[(.*)\]")
    assert done.group(1).split(", ")[-1] == "3", output
    assert "[evaluator 0] Evaluated epoch-3.weights.h5 (step 3): loss: " in output
    assert "[launcher] evaluator 0 finished" in output
    assert os.listdir(log_dir)  # its TensorBoard events
    assert wait_until(lambda: process_gone(evaluator_pid))
