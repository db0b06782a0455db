"""Publishing the rows that changed: `kerasps.callbacks.PublishDeltas`.

A publisher tracks the changed rows of a model's tables on their ps tasks
(`kerasps.params.changes`) and writes versions (`kerasps.policy.deltas`): a full
one first, then deltas holding, per table, the ids whose rows changed since the
previous version and their rows now, and the dense weights whole.

* A fixed table is a `keras.layers.Embedding` whose `embeddings` is a
  `kerasps.ShardedVariable` (a keras-rs `TableConfig` table's `EmbedReduce` is one):
  its shards' flags give the changed rows, published by global id (shard offset +
  row), so a consumer does not depend on the number of ps tasks.
* A `kerasps.layers.DynamicEmbedding` (a keras-rs `DynamicTableConfig` table's layer
  is one): the flags of its rows on each ps task (set by row updates, admissions and
  evictions) give the rows to read, with their keys; the keys published before from a
  row that now holds another key, or none, and that no row holds now, are tombstones.
  The publisher remembers, per row, the key it last published from it (on the chief:
  9 bytes a row).
* Every other weight of the model is dense: written whole in each version.
"""

from __future__ import annotations

import json
import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf

from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.keras.trainer import recovery
from kerasps.keras.trainer.steps import forget_step_functions
from kerasps.params import changes as changes_lib
from kerasps.params import variables as variables_lib
from kerasps.policy import deltas
from kerasps.policy.tables import KEY, LAST_SEEN

__all__ = ["PublishDeltas"]

_LOG = logging.getLogger("kerasps")
PAYLOAD_DTYPES = (None, "float16")


def _positive(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value <= 0):
        raise ValueError(f"Invalid value for argument `{name}`: expected None or a positive "
                         f"number. Received: {name}={value!r}")
    return value


class _FixedTable:
    """A `keras.layers.Embedding`'s table, sharded (flags per shard) or on one ps task."""

    kind = "fixed"

    def __init__(self, variable):
        self.variable = variable
        self.name = variable.path
        sharded = isinstance(variable, variables_lib.ShardedVariable)
        self.shards = variable.shards if sharded else [variable]
        self.offsets = variable.shard_offsets if sharded else [0]
        self.track()

    def track(self, renew=False):
        self.changes = [changes_lib.track(shard, renew) for shard in self.shards]

    def tracked(self) -> bool:
        return all(changes_lib.changes_of(s) is c for s, c in zip(self.shards, self.changes))

    def describe(self):
        return {"name": self.name, "kind": self.kind, "shape": list(self.variable.shape),
                "dtype": keras.backend.standardize_dtype(self.variable.dtype)}

    def read(self, full: bool) -> dict:
        ids, rows = [], []
        for offset, changes in zip(self.offsets, self.changes):
            local, (values,) = changes.take(everything=full)
            ids.append(local + offset)
            rows.append(values)
        ids, rows = np.concatenate(ids), np.concatenate(rows)
        return {"ids": None if full else ids, "rows": rows, "count": len(ids)}


class _DynamicTable:
    """A `DynamicEmbedding`: flags on each shard's rows; keys and tombstones by row."""

    kind = "dynamic"

    def __init__(self, layer):
        self.layer = layer
        self.table = layer._table
        self.name = layer.rows.path
        self.variables = {id(v) for v in self.table.variables}
        # The key last published from each row of each shard, and whether there is one.
        self.published = [(np.zeros(s.size, np.int64), np.zeros(s.size, bool))
                          for s in self.table.shards]
        self.track()

    def track(self, renew=False):
        self.changes = [changes_lib.track(shard.variables["rows"], renew)
                        for shard in self.table.shards]
        self.table._functions.clear()  # eager lookups' functions trace the flags in

    def tracked(self) -> bool:
        return all(changes_lib.changes_of(s.variables["rows"]) is c
                   for s, c in zip(self.table.shards, self.changes))

    def describe(self):
        spec = self.table.spec
        return {"name": self.name, "kind": self.kind, "layer": self.layer.name,
                "output_dim": spec.output_dim, "capacity": spec.capacity,
                "num_partitions": spec.num_partitions,
                "dtype": keras.backend.standardize_dtype(self.table.rows.dtype)}

    def read(self, full: bool) -> dict:
        keys, rows, gone = [], [], []
        for shard, changes, (published, has) in zip(self.table.shards, self.changes,
                                                    self.published):
            local, (vectors, state) = changes.take(
                [shard.variables["rows"], shard.variables["state"]], everything=full)
            occupied = state[:, LAST_SEEN] >= 0
            current = state[:, KEY]
            if full:
                has[:] = False
            else:
                was = has[local]
                moved = was & (~occupied | (published[local] != current))
                gone.append(published[local][moved])
            published[local] = current
            has[local] = occupied
            keys.append(current[occupied])
            rows.append(vectors[occupied])
        keys, rows = np.concatenate(keys), np.concatenate(rows)
        tombstones = None
        if not full:
            # A key freed from one row and admitted to another since is no tombstone.
            gone = np.unique(np.concatenate(gone))
            tombstones = gone[~np.isin(gone, keys)]
        return {"keys": keys, "rows": rows, "tombstones": tombstones, "count": len(keys)}


class PublishDeltas(keras.callbacks.Callback):
    """Publishes a model's changed embedding rows, as versions a server applies in order.

    The first publish is full (every row of every table, every weight); each later
    one is a delta: per table, the ids whose rows changed since the previous version
    and their rows now; for a `kerasps.layers.DynamicEmbedding`, the keys whose rows
    changed (admitted ones included) and the keys it no longer holds (tombstones);
    and the model's other weights whole. Which rows changed is tracked where they
    are, on their ps tasks, as the optimizer updates them: nothing is scanned and
    nothing more crosses per step.

    Each version is a folder `directory/v00000001` ... with a `manifest.json` (its
    number, the version it applies to, the sha256 of each file), written elsewhere
    first and made visible by one rename: a reader never sees part of one.
    `kerasps.DeltaConsumer` loads and applies them, without a cluster.

    ```python
    model.fit(kerasps.DatasetCreator(fn), epochs=10, steps_per_epoch=100,
              callbacks=[kerasps.callbacks.PublishDeltas("deltas/", every_steps=50)])
    ```

    In a custom loop, make the publisher before the first step (so that the step
    traces the tracking in) and call `publish()`:

    ```python
    publisher = kerasps.callbacks.PublishDeltas("deltas/", model=model)
    for step in range(steps):
        ...
        if step % 50 == 0:
            publisher.publish()
    ```

    Args:
        directory: where the versions go (made if missing). A publisher that finds
            versions there continues their numbering, with a full version.
        every_steps: publish after this many training steps (batches), during `fit`.
        every_seconds: publish once this many seconds passed since the last publish,
            during `fit`.
        full_every: make every `full_every`-th version a full one (`None`: only the
            first), so that a consumer can start from a recent base.
        dtype: `None` (the model's dtypes) or `"float16"`: rows and floating weights
            written as float16 (half the bytes; the consumer casts them back, so its
            rows are no longer bit for bit the trainer's).
        model: the model, for calls outside `fit` (`fit` sets it).

    With neither `every_steps` nor `every_seconds`, `fit` publishes at the end of each
    epoch; every `fit` publishes at its end. Under `fit` the model's step functions
    are traced again once, with the tracking in them.
    """

    def __init__(self, directory, every_steps=None, every_seconds=None, full_every=None,
                 dtype=None, model=None):
        super().__init__()
        self.directory = os.fspath(directory)
        self.every_steps = _positive("every_steps", every_steps)
        self.every_seconds = _positive("every_seconds", every_seconds)
        self.full_every = _positive("full_every", full_every)
        if dtype not in PAYLOAD_DTYPES:
            raise ValueError(f"Invalid value for argument `dtype`: expected None or 'float16'. "
                             f"Received: dtype={dtype!r}")
        self.dtype = dtype
        if self.every_steps is None and self.every_seconds is None:
            self.on_train_batch_begin = keras.callbacks.Callback.on_train_batch_begin.__get__(
                self)
        self.version = None  # the last version written
        self.published = []  # (version, kind) of this publisher's versions
        self._tables = None
        self._model = None
        self._full_next = True
        self._since_full = 0
        self._steps_at_publish = 0
        self._steps_before_epoch = 0
        self._time_at_publish = None
        if model is not None:
            self.set_model(model)

    # -- the model ------------------------------------------------------------------
    def set_model(self, model):
        super().set_model(model)
        if model is not self._model:
            self._model = model
            self._tables = None
            self._full_next = True
        self._prepare()

    def _prepare(self):
        if self._tables is not None:
            return
        model = self._model
        if not model.built:
            raise ValueError("Invalid `model` for `PublishDeltas`: it is not built yet. Build "
                             "it (call it on data, or give `keras.Input`s) first. "
                             f"Received: model={model!r}")
        tables, covered = [], set()
        # A table's rows are flagged by a kerasps strategy's updates; elsewhere (a model
        # of no kerasps strategy) every weight is dense, written whole.
        kerasps_model = getattr(model.distribute_strategy, "_is_kerasps", False)
        for layer in model._flatten_layers():
            if isinstance(layer, DynamicEmbedding) and layer._table is not None:
                table = _DynamicTable(layer)
                tables.append(table)
                covered |= table.variables
            elif kerasps_model and isinstance(layer, keras.layers.Embedding) and (
                    isinstance(layer.embeddings, variables_lib.ShardedVariable)
                    or layer.embeddings.trainable):
                table = _FixedTable(layer.embeddings)
                tables.append(table)
                covered.add(id(layer.embeddings))
        self._tables = tables
        self._restores = recovery.restores(model)
        logical = variables_lib.logical_variables(model.weights)
        # Where each one is among the model's weights: a consumer's model built from the
        # same config has them in the same order (its paths may differ: name scopes).
        self._index = {id(v): i for i, v in enumerate(logical)}
        for table in tables:
            table.index = self._index.get(id(table.variable if table.kind == "fixed"
                                             else table.table.rows))
        self._dense = [v for v in logical if id(v) not in covered]
        # Functions traced before the tables were tracked set no flags.
        forget_step_functions(model)

    # -- fit ------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._prepare()
        self._steps_before_epoch = 0
        self._steps_at_publish = 0
        self._time_at_publish = time.monotonic()
        if self.version is None or self._full_next:
            self.publish()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_steps = 0

    # The batch hook is `on_train_batch_begin`, whose logs are none: a hook on a batch's
    # end would make `fit` read the metrics' results for it a few times a second
    # (`kerasps.keras.trainer.dispatch.reads_batch_logs`), and a publish reads no logs.
    def on_train_batch_begin(self, batch, logs=None):
        self._epoch_steps = batch  # the steps run (or running) before this batch
        self._publish_if_due(self._steps_before_epoch + batch)

    def on_epoch_end(self, epoch, logs=None):
        self._steps_before_epoch += (self.params or {}).get("steps") or (
            getattr(self, "_epoch_steps", 0) + 1)
        if self.every_steps is None and self.every_seconds is None:
            self.publish()
        else:
            self._publish_if_due(self._steps_before_epoch)

    def _publish_if_due(self, steps):
        due = (self.every_steps is not None
               and steps - self._steps_at_publish >= self.every_steps) or (
            self.every_seconds is not None
            and time.monotonic() - self._time_at_publish >= self.every_seconds)
        if due:
            self.publish()
            self._steps_at_publish = steps

    def on_train_end(self, logs=None):
        if self.every_steps is not None or self.every_seconds is not None:
            self.publish()

    # -- publishing -----------------------------------------------------------------
    def publish(self, full: bool | None = None) -> str:
        """Writes the next version: full if `full`, if it is the first, if
        `full_every` says so or if the changed-row record was lost (a ps task
        restarted); a delta otherwise. Returns the version's folder."""
        if self._model is None:
            raise ValueError("Invalid use of `PublishDeltas.publish()`: no model. Pass "
                             "`model=` to `PublishDeltas`, or use it as a `fit` callback.")
        self._prepare()
        if self.version is None:
            os.makedirs(self.directory, exist_ok=True)
            deltas.remove_temporaries(self.directory)
            found = deltas.versions(self.directory)
            self.version = found[-1] if found else 0
            self._full_next = True
        lost = [t.name for t in self._tables if not t.tracked()]
        if lost:
            _LOG.warning("PublishDeltas: the changed-row record of %s was lost; "
                         "this version is a full one.", ", ".join(lost))
            for table in self._tables:
                table.track()
            forget_step_functions(self._model)
        restored = recovery.restores(self._model) != self._restores
        if restored:
            # The ps state went back to a backup: rows a consumer received since are
            # newer than the trainer's, and no flag says which.
            _LOG.warning("PublishDeltas: the ps tasks' state was restored from a backup; "
                         "this version is a full one.")
        if full is None:
            full = (self._full_next or bool(lost) or restored or (
                self.full_every is not None and self._since_full + 1 >= self.full_every))
        try:
            folder = self._write(bool(full))
        except tf.errors.OpError as error:
            if full:
                raise
            # The flags of a restarted ps task are gone: what changed is not known.
            _LOG.warning("PublishDeltas: reading the changed rows failed (%s: %s); "
                         "this version is a full one.", type(error).__name__,
                         str(error).splitlines()[0] if str(error) else "")
            for table in self._tables:
                table.track(renew=True)
            forget_step_functions(self._model)
            folder = self._write(True)
        self._time_at_publish = time.monotonic()
        return folder

    def _write(self, full: bool) -> str:
        version = self.version + 1
        kind = deltas.FULL if full else deltas.DELTA
        applies_to = None if full else self.version
        started = time.monotonic()
        with deltas.VersionWriter(self.directory, version, applies_to, kind) as writer:
            tables = []
            for index, table in enumerate(self._tables):
                content = table.read(full)
                entry = {**table.describe(), "index": table.index,
                         "count": int(content["count"]), "files": {}}
                for part in ("ids", "keys", "rows", "tombstones"):
                    array = content.get(part)
                    if array is None:
                        continue
                    if part == "rows":
                        array = self._cast(array)
                    name = f"table_{index}.{part}.npy"
                    np.save(writer.path(name), np.ascontiguousarray(array),
                            allow_pickle=False)
                    entry["files"][part] = name
                if content.get("tombstones") is not None:
                    entry["tombstones"] = int(len(content["tombstones"]))
                tables.append(entry)
            dense = []
            arrays = {}
            for index, variable in enumerate(self._dense):
                arrays[f"w{index}"] = self._cast(np.asarray(variable.numpy()))
                dense.append({"path": variable.path, "key": f"w{index}",
                              "index": self._index[id(variable)],
                              "shape": list(variable.shape),
                              "dtype": keras.backend.standardize_dtype(variable.dtype)})
            with open(writer.path("dense.npz"), "wb") as file:
                np.savez(file, **arrays)
            content = {"tables": tables, "dense": {"file": "dense.npz", "weights": dense},
                       "payload_dtype": self.dtype, "created": time.time()}
            if full:
                config = self._model_config()
                if config is not None:
                    with open(writer.path("model.json"), "w") as file:
                        file.write(config)
                    content["model"] = "model.json"
            folder = writer.commit(**content)
        self.version = version
        self.published.append((version, kind))
        self._full_next = False
        if full:
            self._restores = recovery.restores(self._model)
        self._since_full = 0 if full else self._since_full + 1
        _LOG.info("PublishDeltas: version %d (%s) in %.2f s: %s", version, kind,
                  time.monotonic() - started,
                  ", ".join(f"{t['name']} {t['count']} rows" for t in tables) or "no tables")
        return folder

    def _cast(self, array):
        if self.dtype is not None and np.issubdtype(array.dtype, np.floating):
            return array.astype(self.dtype)
        return array

    def _model_config(self):
        try:
            return json.dumps(keras.saving.serialize_keras_object(self._model))
        except Exception as error:  # a model of the user's own may not serialize
            _LOG.warning("PublishDeltas: the model's config could not be serialized (%s); "
                         "a consumer needs the model given to it.", error)
            return None
