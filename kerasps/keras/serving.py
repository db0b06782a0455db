"""Applying published versions without a cluster: `kerasps.DeltaConsumer`.

A consumer reads the versions `kerasps.callbacks.PublishDeltas` writes, checks each
(its place in the chain, the sha256 of each file) before it changes anything, and
applies it to its copy of the tables and weights, then to its Keras model (built,
outside any strategy, from the model config of the full version, or given). Its
`version` is set last: a consumer stopped by an error while applying applies the
same version again, with the same result (rows are assigned, keys removed or
placed, never added to).
"""

from __future__ import annotations

import io
import json
import os

import keras
import numpy as np
import tensorflow as tf

from kerasps.backend import _keras
from kerasps.keras.layers.dynamic_embedding import DynamicEmbedding
from kerasps.params import variables as variables_lib
from kerasps.policy import deltas
from kerasps.policy import tables as tables_lib
from kerasps.policy.tables import COUNT, KEY, LAST_SEEN

__all__ = ["DeltaConsumer", "DeltaError"]

DeltaError = deltas.DeltaError


def _load(folder, manifest, name):
    return np.load(io.BytesIO(deltas.read_checked(folder, manifest, name)), allow_pickle=False)


class _Fixed:
    def __init__(self, entry):
        self.name = entry["name"]
        self.dtype = np.dtype(entry["dtype"])
        self.rows = np.zeros(entry["shape"], self.dtype)
        self.variable = None

    def apply(self, entry, arrays, full):
        rows = arrays["rows"].astype(self.dtype, copy=False)
        if full:
            self.rows[...] = rows
            return None
        ids = arrays["ids"]
        self.rows[ids] = rows
        return ids

    def push(self, changed):
        if self.variable is None:
            return
        if changed is None:
            self.variable.assign(self.rows)
        elif len(changed):
            _keras.tf_variable(self.variable).scatter_update(
                tf.IndexedSlices(tf.constant(self.rows[changed]), tf.constant(changed)))


class _Dynamic:
    """A dynamic table's keys and rows, laid out as an unsharded `DynamicEmbedding`'s:
    partition `p` holds rows `p * rows_per_partition` on."""

    def __init__(self, entry):
        self.name = entry["name"]
        self.layer_name = entry.get("layer")
        self.dim = entry["output_dim"]
        self.capacity = entry["capacity"]
        self.num_partitions = entry["num_partitions"]
        self.per_partition = self.capacity // self.num_partitions
        self.dtype = np.dtype(entry["dtype"])
        self.layer = None
        self._reset()

    def _reset(self):
        self.rows = np.zeros([self.capacity, self.dim], self.dtype)
        self.state = np.tile(np.array([[0, -1, 0]], np.int64), [self.capacity, 1])
        self.slot_of = {}
        # Free rows of each partition, the lowest on top.
        self.free = [list(range((p + 1) * self.per_partition - 1, p * self.per_partition - 1,
                                -1)) for p in range(self.num_partitions)]

    def apply(self, entry, arrays, full):
        keys = arrays["keys"].astype(np.int64, copy=False)
        vectors = arrays["rows"].astype(self.dtype, copy=False)
        if full:
            self._reset()
        for key in arrays.get("tombstones", np.zeros([0], np.int64)).tolist():
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self.state[slot] = (0, -1, 0)
                self.rows[slot] = 0
                self.free[slot // self.per_partition].append(slot)
        partitions = tables_lib.partition_of(keys, self.num_partitions)
        slots = np.empty(len(keys), np.int64)
        for i, (key, partition) in enumerate(zip(keys.tolist(), partitions.tolist())):
            slot = self.slot_of.get(key)
            if slot is None:
                if not self.free[partition]:
                    raise DeltaError(
                        f"Invalid version for table {self.name!r}: partition {partition} "
                        f"has no free row for key {key} (capacity {self.capacity}); the "
                        "versions applied are not one chain of one table.")
                slot = self.free[partition].pop()
                self.slot_of[key] = slot
            slots[i] = slot
        self.rows[slots] = vectors
        self.state[slots, KEY] = keys
        self.state[slots, LAST_SEEN] = 0
        self.state[slots, COUNT] = 1
        return slots

    def push(self, changed):
        if self.layer is None:
            return
        self.layer.rows.assign(self.rows)
        self.layer.state.assign(self.state)  # rebuilds the layer's map

    def items(self):
        """`(keys, rows)`, sorted by key."""
        keys = np.fromiter(self.slot_of.keys(), np.int64, len(self.slot_of))
        slots = np.fromiter(self.slot_of.values(), np.int64, len(self.slot_of))
        order = np.argsort(keys, kind="stable")
        return keys[order], self.rows[slots[order]]


class DeltaConsumer:
    """Loads the versions `kerasps.callbacks.PublishDeltas` writes, in order, without a
    cluster: a plain Python and TensorFlow process, e.g. a server.

    ```python
    consumer = kerasps.DeltaConsumer("deltas/")
    consumer.update()                  # the latest full version, then the deltas after it
    predictions = consumer.model.predict(batch)
    ...
    consumer.update()                  # the versions published since, in order
    ```

    Each version is checked before it changes anything: a delta must apply to the
    consumer's version (a gap raises a `kerasps.DeltaConsumer.Error`, a `ValueError`,
    naming the version expected and the one found), and each file must have the
    sha256 its manifest says (else the same error, naming both). A version already
    applied is done (`apply` returns `False`). A consumer stopped while applying a
    version (an error, or a process killed: a new one loads the versions again)
    applies it again with the same result.

    Args:
        directory: the publisher's directory.
        model: a Keras model to keep at the published weights (built like the
            trainer's, outside any strategy). `None`: built from the model config of
            the first full version applied (`custom_objects` for its own classes);
            without one, the consumer keeps arrays only.
        custom_objects: for building the model from its config.
    """

    Error = DeltaError

    def __init__(self, directory, model=None, custom_objects=None):
        self.directory = os.fspath(directory)
        self.version = None
        self.model = model
        self.custom_objects = custom_objects
        self._tables = None  # name -> _Fixed / _Dynamic
        self._dense = None  # list of arrays, in the manifest's order
        self._dense_entries = None
        self._dense_variables = None

    # -- reading --------------------------------------------------------------------
    def available(self) -> list[int]:
        """The versions in the directory now."""
        return deltas.versions(self.directory)

    def update(self) -> list[int]:
        """Applies the versions published since this consumer's, in order; a consumer
        with none starts from the latest full version. Returns those applied."""
        found = [v for v in self.available() if self.version is None or v > self.version]
        if not found:
            return []
        if self.version is None:
            fulls = [v for v in found if self._manifest(v)["kind"] == deltas.FULL]
            if not fulls:
                raise DeltaError(
                    f"No full version in {self.directory!r} to start from: expected one, "
                    f"the first of the chain. Received: versions {found[0]} to {found[-1]}, "
                    "all deltas.")
            found = [v for v in found if v >= fulls[-1]]
        applied = []
        for version in found:
            if self.apply(os.path.join(self.directory, deltas.version_name(version))):
                applied.append(version)
        return applied

    def _manifest(self, version):
        return deltas.read_manifest(os.path.join(self.directory, deltas.version_name(version)))

    def apply(self, folder) -> bool:
        """Applies the version in `folder` (a folder of the publisher's directory).
        Returns `False` for a version already applied."""
        folder = os.fspath(folder)
        manifest = deltas.read_manifest(folder)
        if not deltas.check_next(self.version, manifest):
            return False
        full = manifest["kind"] == deltas.FULL
        # Everything is read and checked before anything changes.
        tables = []
        for entry in manifest["tables"]:
            arrays = {part: _load(folder, manifest, name)
                      for part, name in entry["files"].items()}
            tables.append((entry, arrays))
        with np.load(io.BytesIO(deltas.read_checked(folder, manifest,
                                                    manifest["dense"]["file"])),
                     allow_pickle=False) as archive:
            dense = [archive[w["key"]] for w in manifest["dense"]["weights"]]
        config = None
        if full and self.model is None and manifest.get("model"):
            config = deltas.read_checked(folder, manifest, manifest["model"])
        if not full:
            self._check_layout(manifest)
        # Then the copy of the tables and weights ...
        if full:
            self._tables = {entry["name"]: (_Dynamic(entry) if entry["kind"] == "dynamic"
                                            else _Fixed(entry)) for entry, _ in tables}
            self._dense_entries = manifest["dense"]["weights"]
            self._table_entries = [entry for entry, _ in tables]
        changed = {}
        for entry, arrays in tables:
            changed[entry["name"]] = self._tables[entry["name"]].apply(entry, arrays, full)
        self._dense = [np.asarray(value).astype(w["dtype"], copy=False)
                       for value, w in zip(dense, self._dense_entries)]
        # ... then the model ...
        if config is not None:
            self.model = keras.saving.deserialize_keras_object(
                json.loads(config), custom_objects=self.custom_objects)
        if self.model is not None:
            if full or self._dense_variables is None:
                self._bind(self.model)
                changed = dict.fromkeys(changed)  # every row
            for name, table in self._tables.items():
                table.push(changed[name])
            for variable, value in zip(self._dense_variables, self._dense):
                variable.assign(value)
        # ... and the version last.
        self.version = manifest["version"]
        return True

    def _check_layout(self, manifest):
        if self._tables is None:
            raise DeltaError("No full version applied yet: expected one first. "
                             f"Received: version {manifest['version']}, a delta.")
        names = [entry["name"] for entry in manifest["tables"]]
        if sorted(names) != sorted(self._tables) or len(manifest["dense"]["weights"]) != len(
                self._dense_entries):
            raise DeltaError(
                f"Version {manifest['version']} holds other tables or weights than the full "
                f"version applied: expected tables {sorted(self._tables)}. "
                f"Received: {sorted(names)}")

    def _bind(self, model):
        """Finds the model's variables for the tables and the dense weights: at the
        same place among its weights as in the trainer's model (built from the same
        config), else by path; with the same shape."""
        logical = variables_lib.logical_variables(model.weights)
        by_path = {v.path: v for v in logical}

        def find(entry, shape, what):
            index, path = entry.get("index"), entry.get("path") or entry.get("name")
            at_index = logical[index] if index is not None and index < len(logical) else None
            for variable in (at_index, by_path.get(path)):
                if variable is not None and tuple(variable.shape) == tuple(shape):
                    return variable
            raise DeltaError(
                f"Invalid `model`: expected {what} {path!r} "
                f"of shape {tuple(shape)} (weight {index} of the trainer's model). "
                f"Received: a model whose weights are "
                f"{[(v.path, tuple(v.shape)) for v in logical]}")

        for entry in self._table_entries:
            table = self._tables[entry["name"]]
            if isinstance(table, _Dynamic):
                rows = find(entry, (table.capacity, table.dim), "the rows of a dynamic table")
                layer = next((layer for layer in model._flatten_layers()
                              if isinstance(layer, DynamicEmbedding)
                              and layer._table is not None and layer.rows is rows), None)
                if layer is None:
                    raise DeltaError(
                        f"Invalid `model`: expected a `DynamicEmbedding` layer for table "
                        f"{table.name!r}. Received: weight {rows.path!r} of another layer")
                table.layer = layer
            else:
                table.variable = find(entry, table.rows.shape, "a table")
        self._dense_variables = [find(entry, entry["shape"], "a weight")
                                 for entry in self._dense_entries]

    # -- what the consumer holds ----------------------------------------------------
    @property
    def tables(self) -> list[str]:
        return [] if self._tables is None else list(self._tables)

    def rows(self, name) -> np.ndarray:
        """A fixed table's rows (`[rows, dim]`), as of `version`."""
        table = self._table(name)
        if isinstance(table, _Dynamic):
            raise ValueError(f"Invalid value for argument `name`: {name!r} is a dynamic "
                             "table; read it with `items(name)`. Received: name={name!r}")
        return table.rows

    def items(self, name) -> tuple[np.ndarray, np.ndarray]:
        """A dynamic table's `(keys, rows)`, sorted by key, as of `version`."""
        table = self._table(name)
        if not isinstance(table, _Dynamic):
            raise ValueError(f"Invalid value for argument `name`: {name!r} is a fixed table; "
                             "read it with `rows(name)`. Received: name={name!r}")
        return table.items()

    def weights(self) -> dict:
        """The dense weights, by path."""
        return {w["path"]: value for w, value in zip(self._dense_entries or [],
                                                     self._dense or [])}

    def _table(self, name):
        if not self._tables or name not in self._tables:
            raise ValueError(f"Invalid value for argument `name`: expected one of "
                             f"{self.tables}. Received: name={name!r}")
        return self._tables[name]
