"""Side-car evaluation: a task beside the training cluster that evaluates each new checkpoint.

Training never waits for evaluation: the chief writes checkpoints, and an
`evaluator` task (`kerasps launch --evaluator`, or TFJob's `Evaluator` replica)
loads each new one into a plain Keras model and evaluates it on its own data:

    model = build_model()                          # same architecture, no strategy
    if kerasps.cluster.task_type() == "evaluator":
        model.compile(loss="mse", metrics=["mae"])
        kerasps.SidecarEvaluator(model, eval_dataset, "ckpt", log_dir="logs/eval").run()
    else:                                          # the chief
        ...  # build and compile under the strategy's scope
        model.fit(..., callbacks=[keras.callbacks.ModelCheckpoint(
            "ckpt/epoch-{epoch:02d}.weights.h5", save_weights_only=True)])
        kerasps.evaluator.mark_training_finished("ckpt")

What it reads, in `checkpoint_dir` (not its subdirectories):

* `*.weights.h5` and `*.keras` files, what `keras.callbacks.ModelCheckpoint`
  writes (one file per epoch, or one file rewritten every epoch) and what Keras 3's
  `keras.callbacks.BackupAndRestore` writes (`latest.weights.h5` in its backup
  directory);
* `tf.train.Checkpoint` checkpoints (`ckpt-3.index` and its data files, as
  `tf.train.CheckpointManager` writes them) saved as `tf.train.Checkpoint(model=model)`.

A checkpoint is new when its path, size or status change time (written, renamed
into place) is one not evaluated yet. Each round evaluates the newest new checkpoint
and passes over older new ones (training went past them, as TensorFlow's
`checkpoints_iterator` does). One that cannot be read because it was deleted or
is still being written is skipped with a warning, and the next newest is tried (a
file rewritten later is read again); one that can be read but does not fit the
model raises `ValueError` naming it. Files are copied before they are read: HDF5
locks the files it opens, and the chief must never find its next checkpoint
locked by the evaluator.

The step of a checkpoint (the x axis of its TensorBoard summaries) is the first
number in its file name, `3` for `epoch-03.weights.h5` or `ckpt-3`: put `{epoch}` in
the `ModelCheckpoint` file name. A name without a number gets the evaluation's
ordinal (1, 2, ...).

When it stops: after `max_evaluations` evaluations, or once training has finished
and the newest checkpoint is evaluated. Training has finished when the marker file
`TRAINING_FINISHED` is in `checkpoint_dir` (the chief writes it with
`mark_training_finished(checkpoint_dir)` after its last checkpoint; a marker left
by an earlier run stops the evaluator at once, so train each run into a new
directory), or, under `kerasps launch`, when the chief has exited with status 0.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import numbers
import os
import re
import shutil
import tempfile
import time
import warnings
import zipfile

from kerasps.policy._validation import positive_int
from kerasps.runtime.launch_env import TRAINING_FINISHED_ENV

__all__ = ["SidecarEvaluator", "Evaluation", "mark_training_finished", "training_finished",
           "FINISHED_MARKER"]

FINISHED_MARKER = "TRAINING_FINISHED"
_KERAS_SUFFIXES = (".weights.h5", ".keras")
_TF_SUFFIX = ".index"  # a tf.train.Checkpoint prefix's index file
_BEING_WRITTEN = ".partial."  # `fit`'s backups are written under this name, then renamed

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluated checkpoint.

    Attributes:
        checkpoint: its path (the prefix of a `tf.train.Checkpoint`).
        step: its step: the first number in its name, else the evaluation's ordinal.
        metrics: `model.evaluate`'s results, metric name to float.
    """

    checkpoint: str
    step: int
    metrics: dict


@dataclasses.dataclass(frozen=True, order=True)
class _Version:
    """A checkpoint as it is on disk at one moment, ordered oldest first by its status
    change time: a file renamed into place (an atomic save) is new although its contents
    were written earlier."""

    ctime_ns: int
    path: str
    size: int


def mark_training_finished(checkpoint_dir) -> str:
    """Tells the side-car evaluators of `checkpoint_dir` that no checkpoint will follow.

    Call it on the chief after the last checkpoint is written; evaluators evaluate the
    newest checkpoint and stop. Returns the marker's path.
    """
    checkpoint_dir = _directory(checkpoint_dir)
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, FINISHED_MARKER)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write("training finished\n")
    os.replace(temporary, path)
    return path


def training_finished(checkpoint_dir) -> bool:
    """Whether training into `checkpoint_dir` has finished (for custom evaluation loops):
    the marker of `mark_training_finished` is there, or `kerasps launch` said so."""
    flag = os.environ.get(TRAINING_FINISHED_ENV)
    return (os.path.exists(os.path.join(_directory(checkpoint_dir), FINISHED_MARKER))
            or bool(flag) and os.path.exists(flag))


class SidecarEvaluator:
    """Evaluates each new checkpoint of a training job, beside it.

    Args:
        model: a built and compiled `keras.Model` of the trained architecture, outside
            any distribution strategy; each checkpoint's weights are loaded into it.
        data: what it is evaluated on: a `tf.data.Dataset` or `keras.utils.PyDataset`
            of `(x, y)` or `(x, y, sample_weight)` batches, or such a tuple of arrays.
            Not an iterator: it is read once per checkpoint.
        checkpoint_dir: the directory the chief writes its checkpoints to (it may not
            exist yet).
        steps: batches per evaluation (default: all of `data`).
        log_dir: if given, one TensorBoard scalar per metric (`loss`, `mae`, ...) is
            written there for each evaluation, at the checkpoint's step.
        max_evaluations: stop after this many evaluations (default: when training
            has finished, see `kerasps.evaluator`).
        poll_interval: seconds between looks at `checkpoint_dir` when nothing is new.
        verbose: 1 prints one line per evaluation, 0 is silent.
    """

    def __init__(self, model, data, checkpoint_dir, *, steps=None, log_dir=None,
                 max_evaluations=None, poll_interval=1.0, verbose=1):
        import keras

        if not isinstance(model, keras.Model):
            raise ValueError("Invalid value for argument `model`: expected a `keras.Model`. "
                             f"Received: model={model!r}")
        if not model.built:
            raise ValueError("Invalid value for argument `model`: it must be built, to load "
                             "checkpoints into (give it an `Input` or call `build`). "
                             f"Received: model={model!r}")
        if not model.compiled:
            raise ValueError("Invalid value for argument `model`: it must be compiled, with "
                             f"the loss and metrics to evaluate. Received: model={model!r}")
        if (data is None or isinstance(data, collections.abc.Iterator)
                or isinstance(data, tuple) and len(data) not in (2, 3)):
            raise ValueError("Invalid value for argument `data`: expected a dataset or a "
                             "`PyDataset` that can be read once per checkpoint, or a tuple "
                             f"`(x, y)` or `(x, y, sample_weight)`. Received: data={data!r}")
        self.model = model
        self.data = data
        self.checkpoint_dir = _directory(checkpoint_dir)
        self.steps = positive_int("steps", steps, allow_none=True)
        self.log_dir = None if log_dir is None else _directory(log_dir, "log_dir")
        self.max_evaluations = positive_int("max_evaluations", max_evaluations,
                                            allow_none=True)
        if (isinstance(poll_interval, bool) or not isinstance(poll_interval, numbers.Real)
                or not poll_interval > 0):
            raise ValueError("Invalid value for argument `poll_interval`: it must be a "
                             f"positive number of seconds. Received: poll_interval="
                             f"{poll_interval!r}")
        self.poll_interval = float(poll_interval)
        if verbose not in (0, 1):
            raise ValueError("Invalid value for argument `verbose`: expected 0 or 1. "
                             f"Received: verbose={verbose!r}")
        self.verbose = verbose
        self.evaluations: list[Evaluation] = []
        self._seen: set[_Version] = set()
        self._writer = None

    def run(self) -> list[Evaluation]:
        """Evaluates new checkpoints until `max_evaluations` or the end of training.

        Returns:
            The `Evaluation`s of this call, oldest first (`self.evaluations` holds all).
        """
        start = len(self.evaluations)
        while True:
            finished = training_finished(self.checkpoint_dir)  # before looking: no later ones
            self._evaluate_newest()
            done = len(self.evaluations) - start
            if self.max_evaluations is not None and done >= self.max_evaluations:
                break
            if finished:
                if not done:
                    logger.warning("Training finished before any checkpoint in %s could be "
                                   "evaluated.", self.checkpoint_dir)
                break
            time.sleep(self.poll_interval)
        if self._writer is not None:
            self._writer.flush()
        return self.evaluations[start:]

    # -- one round ---------------------------------------------------------------------
    def _checkpoints(self) -> list[_Version]:
        """The checkpoints in the directory now, oldest first."""
        try:
            entries = list(os.scandir(self.checkpoint_dir))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            if _BEING_WRITTEN in entry.name:
                continue
            if entry.name.endswith(_KERAS_SUFFIXES):
                path = entry.path
            elif entry.name.endswith(_TF_SUFFIX):
                path = entry.path[:-len(_TF_SUFFIX)]
            else:
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:  # deleted since the listing
                continue
            if entry.is_file():
                found.append(_Version(stat.st_ctime_ns, path, stat.st_size))
        return sorted(found)

    def _evaluate_newest(self):
        """Evaluates the newest new checkpoint that can be read; passes over the others."""
        new = [v for v in self._checkpoints() if v not in self._seen]
        self._seen.update(new)
        for version in reversed(new):
            try:
                self._load(version)
            except Exception as e:  # sorted below: unreadable, or not this model's
                if not (_unreadable(e) or self._changed(version)):
                    raise ValueError(f"The checkpoint {version.path} does not fit the model "
                                     f"given to `SidecarEvaluator`: {e}") from e
                logger.warning("Skipping checkpoint %s: it was deleted or is not completely "
                               "written (%s: %s).", version.path, type(e).__name__, e)
                continue
            self._evaluate(version.path)
            return

    def _changed(self, version: _Version) -> bool:
        """Whether the checkpoint was deleted or rewritten since it was listed."""
        index = version.path + ("" if version.path.endswith(_KERAS_SUFFIXES) else _TF_SUFFIX)
        try:
            stat = os.stat(index)
        except FileNotFoundError:
            return True
        return (stat.st_ctime_ns, stat.st_size) != (version.ctime_ns, version.size)

    def _load(self, version: _Version):
        with warnings.catch_warnings():
            # The evaluation model needs no optimizer state.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            if version.path.endswith(_KERAS_SUFFIXES):
                # Read a copy: HDF5 locks the files it opens, and the chief must never find
                # its next checkpoint locked by the evaluator.
                with tempfile.TemporaryDirectory(prefix="kerasps-evaluator-") as directory:
                    copy = shutil.copyfile(
                        version.path, os.path.join(directory, os.path.basename(version.path)))
                    if self._changed(version):
                        raise _Rewritten("it changed while it was copied")
                    self.model.load_weights(copy)
                return
            import tensorflow as tf

            status = tf.train.Checkpoint(model=self.model).restore(version.path)
            status.expect_partial()
            try:
                status.assert_existing_objects_matched()
            except AssertionError as e:
                raise ValueError(f"it has no values for some of the model's variables "
                                 f"(saved as `tf.train.Checkpoint(model=model)`?): {e}") from None

    def _evaluate(self, path: str):
        step = _step_of(path, default=len(self.evaluations) + 1)
        x, y, sample_weight = (self.data + (None,))[:3] if isinstance(self.data, tuple) else (
            self.data, None, None)
        logs = self.model.evaluate(x, y, sample_weight=sample_weight, steps=self.steps,
                                   verbose=0, return_dict=True)
        metrics = {name: float(value) for name, value in logs.items()}
        evaluation = Evaluation(path, step, metrics)
        self.evaluations.append(evaluation)
        if self.verbose:
            shown = " - ".join(f"{name}: {value:.4g}" for name, value in metrics.items())
            print(f"Evaluated {os.path.basename(path)} (step {step}): {shown}", flush=True)
        if self.log_dir is not None:
            self._summarize(evaluation)

    def _summarize(self, evaluation: Evaluation):
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default():
            for name, value in evaluation.metrics.items():
                tf.summary.scalar(name, value, step=evaluation.step)
        self._writer.flush()


class _Rewritten(OSError):
    """A checkpoint file changed while it was read."""


def _unreadable(error: Exception) -> bool:
    """Whether `error` says a checkpoint's bytes could not be read (missing, truncated)."""
    if isinstance(error, (OSError, EOFError, zipfile.BadZipFile)):
        return True
    import tensorflow as tf

    return isinstance(error, tf.errors.OpError)


def _step_of(path: str, default: int) -> int:
    name = os.path.basename(path)
    for suffix in _KERAS_SUFFIXES:
        name = name.removesuffix(suffix)
    number = re.search(r"\d+", name)
    return int(number.group()) if number else default


def _directory(value, name: str = "checkpoint_dir") -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"Invalid value for argument `{name}`: expected a directory path. "
                         f"Received: {name}={value!r}")
    return value
