"""A dynamic embedding table's hit rate, churn and ps load, from a stream of ids.

`TableModel` replays ids through the policies of `kerasps.layers.DynamicEmbedding`
(`kerasps.tables`: the same hashing of keys to partitions and ps tasks, the
same admission, the same sampled eviction), one training lookup per worker
step, without TensorFlow. `predict_load` turns what it measured into the
bytes each ps task moves and applies per worker step, which the simulation
adds to the ps tasks' service and wire time (`[table]` in a scenario).

Where the model is simpler than the layer: lookups are sequential (no
in-flight protection; a step's own rows are never freed in either), and the
rows sampled for eviction are other random draws.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kerasps.policy import tables

__all__ = ["TableModel", "TableLoad", "predict_load"]


@dataclasses.dataclass(frozen=True)
class TableLoad:
    """What a replay measured, per worker step (means), and the ps load it implies.

    Attributes:
        steps: worker steps replayed.
        ids_per_step: ids looked up per step (occurrences).
        unique_per_step: distinct ids per step.
        hit_rate: share of looked-up ids that had a row.
        admitted_per_step: rows given to new ids.
        evicted_per_step: rows freed.
        rows_used: rows holding an id at the end.
        bytes_per_step: per ps task, bytes moved and applied per worker step
            (see `predict_load`).
    """

    steps: int
    ids_per_step: float
    unique_per_step: float
    hit_rate: float
    admitted_per_step: float
    evicted_per_step: float
    rows_used: int
    bytes_per_step: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


class TableModel:
    """The table's rows, keys and counters, replayed in Python.

    Args:
        spec: the table (`kerasps.tables.TableSpec`).
        seed: seed of the eviction's samples and of probabilistic admission.
    """

    def __init__(self, spec: tables.TableSpec, seed: int = 0):
        self.spec = spec
        rows, partitions = spec.rows_per_partition, spec.num_partitions
        self.rng = np.random.default_rng(seed)
        self.row_of: dict[int, tuple[int, int]] = {}  # key -> (partition, row)
        self.key_of = [[0] * rows for _ in range(partitions)]
        self.last = [np.full(rows, -1, np.int64) for _ in range(partitions)]
        self.count = [np.zeros(rows, np.int64) for _ in range(partitions)]
        self.free = [list(range(rows - 1, -1, -1)) for _ in range(partitions)]
        depth, width = spec.sketch_shape
        self.sketch = np.zeros((partitions, depth, width), np.int64)
        self.additions = [0] * partitions
        self.clock = 0
        self.lookups = self.hits = self.admitted = self.evicted = 0

    def lookup(self, ids) -> None:
        """One training lookup of `ids` (a batch), as the layer does it."""
        spec = self.spec
        keys, counts = np.unique(np.asarray(ids, np.int64), return_counts=True)
        partitions = tables.partition_of(keys, spec.num_partitions)
        clock, missing = self.clock, []
        for key, count, p in zip(keys.tolist(), counts.tolist(), partitions.tolist()):
            self.lookups += count
            place = self.row_of.get(key)
            if place is not None and spec.steps_to_live is not None and (
                    clock - self.last[p][place[1]] > spec.steps_to_live):
                self._release(p, place[1])
                place = None
            if place is not None:
                self.hits += count
                self.last[p][place[1]] = clock
                self.count[p][place[1]] += count
            else:
                missing.append((key, count, p))
        admit = [True] * len(missing)
        if spec.counts_occurrences and missing:
            admit = self._count(missing)
        for (key, count, p), admitted in zip(missing, admit):
            if not admitted:
                continue
            if spec.probability < 1.0 and self.rng.random() >= 1 - (
                    1 - spec.probability) ** count:
                continue
            if not self.free[p] and not self._evict(p):
                continue  # every row of the partition is this step's
            row = self.free[p].pop()
            self.row_of[key] = (p, row)
            self.key_of[p][row] = key
            self.last[p][row] = clock
            self.count[p][row] = count
            self.admitted += 1
        self.clock += 1

    def _count(self, missing) -> list[bool]:
        """The layer's count-min sketch: estimates for the whole batch first, then the
        conservative updates of the keys not admitted, then halving."""
        depth, width = self.spec.sketch_shape
        keys = np.array([key for key, _, _ in missing], np.int64)
        counts = np.array([count for _, count, _ in missing], np.int64)
        partitions = np.array([p for _, _, p in missing], np.int64)
        columns = tables.sketch_hashes(keys, depth, width)  # [depth, n]
        cells = self.sketch[partitions[None, :], np.arange(depth)[:, None], columns]
        estimate = cells.min(axis=0)
        admit = estimate + counts >= self.spec.min_count
        for i in np.flatnonzero(~admit):
            p = partitions[i]
            cell = (p, np.arange(depth), columns[:, i])
            self.sketch[cell] = np.maximum(self.sketch[cell], estimate[i] + counts[i])
            self.additions[p] += int(counts[i])
        for p in set(partitions[~admit].tolist()):
            if self.additions[p] >= self.spec.sketch_window:
                self.sketch[p] //= 2
                self.additions[p] = 0
        return admit.tolist()

    def _evict(self, p) -> bool:
        """Frees the row the policy ranks first among `EVICTION_SAMPLES` sampled rows."""
        rows = self.spec.rows_per_partition
        if rows <= tables.EVICTION_SAMPLES:
            candidates = np.arange(rows)
        else:
            candidates = self.rng.integers(0, rows, tables.EVICTION_SAMPLES)
        last = self.last[p][candidates]
        score = last.astype(np.float64)
        if self.spec.eviction == tables.Eviction.LFU.value:
            score = self.count[p][candidates] + last / (self.clock + 1)
        if self.spec.steps_to_live is not None:
            score = np.where(self.clock - last > self.spec.steps_to_live, -1.0, score)
        score = np.where((last >= 0) & (last < self.clock), score, np.inf)
        best = int(np.argmin(score))
        if not np.isfinite(score[best]):
            return False
        self._release(p, int(candidates[best]))
        return True

    def _release(self, p, row):
        del self.row_of[self.key_of[p][row]]
        self.last[p][row] = -1
        self.count[p][row] = 0
        self.free[p].append(row)
        self.evicted += 1

    @property
    def rows_used(self) -> int:
        return len(self.row_of)


def predict_load(spec: tables.TableSpec, chunks, ids_per_step: int, num_ps: int,
                 optimizer_slots: int = 1, float_bytes: int = 4, warmup_steps: int = 0,
                 seed: int = 0) -> TableLoad:
    """Replays a stream through a `TableModel` and derives each ps task's load.

    Args:
        spec: the table.
        chunks: the stream's ids, an iterable of int64 arrays in order
            (`simulator.idstream.ZipfStream.chunks()`).
        ids_per_step: ids one worker step looks up.
        num_ps: ps tasks (the table's partitions are split over
            `min(num_ps, num_partitions)` of them, as the layer does).
        optimizer_slots: the optimizer's slots per row (Adagrad 1, Adam 2).
        float_bytes: bytes per float.
        warmup_steps: steps replayed before the counts start (the table fills).
        seed: seed of the model's random choices.

    Returns:
        A `TableLoad`. Per ps task and worker step, the bytes are its share of
        the table's partitions times: the rows gathered and their gradients
        (2 x rows found or admitted x row bytes), the optimizer's read and write
        of those rows and their slots (2 x (1 + slots) x row bytes each), the
        initial values written for admitted rows ((1 + slots) x row bytes each)
        and 24 bytes of key, count and state per distinct id.
    """
    model = TableModel(spec, seed)
    buffer = np.empty(0, np.int64)
    steps = unique = 0
    start = None
    for chunk in chunks:
        buffer = np.concatenate([buffer, np.asarray(chunk, np.int64)])
        while len(buffer) >= ids_per_step:
            batch, buffer = buffer[:ids_per_step], buffer[ids_per_step:]
            if steps == warmup_steps:
                start = (model.lookups, model.hits, model.admitted, model.evicted)
            model.lookup(batch)
            if steps >= warmup_steps:
                unique += len(np.unique(batch))
            steps += 1
    counted = steps - warmup_steps
    if counted <= 0 or start is None:
        raise ValueError(f"Invalid value for argument `warmup_steps`: the stream has {steps} "
                         f"steps of {ids_per_step} ids. Received: warmup_steps={warmup_steps}")
    lookups, hits, admitted, evicted = (now - then for now, then in zip(
        (model.lookups, model.hits, model.admitted, model.evicted), start))
    per_step = unique / counted
    row = spec.output_dim * float_bytes
    found_share = hits / lookups if lookups else 0.0
    rows_touched = per_step * found_share + admitted / counted
    total = (2 * rows_touched * row + 2 * (1 + optimizer_slots) * rows_touched * row
             + (admitted / counted) * (1 + optimizer_slots) * row + 24 * per_step)
    shares = [count / spec.num_partitions for _, count in tables.shards_of(
        spec.num_partitions, num_ps)]
    shares += [0.0] * (num_ps - len(shares))
    return TableLoad(steps=counted, ids_per_step=lookups / counted, unique_per_step=per_step,
                     hit_rate=found_share, admitted_per_step=admitted / counted,
                     evicted_per_step=evicted / counted, rows_used=model.rows_used,
                     bytes_per_step=tuple(total * share for share in shares))
