"""Dynamic-vocabulary tables: the arithmetic, without TensorFlow.

A `kerasps.layers.DynamicEmbedding` table of `capacity` rows is cut into
`num_partitions` equal partitions. A key (an int64 id, or a string's 64-bit
fingerprint) belongs to partition `mix64(key) % num_partitions`, and its row,
once admitted, is one of that partition's rows. The ps tasks hold contiguous
runs of partitions (TensorFlow's "div" split of the partitions, as
`kerasps.partitioners.shard_sizes`), each with the key -> row map of its
partitions. So a row's position in the whole table depends on the key only,
never on the number of ps tasks: a checkpoint restores into any number of
them, and only the maps are rebuilt (keys re-hashed to their task).

This module is pure Python (NumPy only): the layer and `simulator/` share the
hashing, the admission counter's sizing, the eviction policies' names and
their decisions, and the memory arithmetic.

Policies:

* Admission: an id gets a row once seen `min_count` times (counted in a
  count-min sketch per partition, `sketch_shape`, with conservative updates,
  halved every `sketch_window` additions so that it counts recent
  occurrences in bounded memory, as TinyLFU does), and/or with probability
  `probability` per occurrence. Until then it reads the default vector
  (zeros) and gets no update.
* Eviction, when a partition has no free row: `"lru"` frees the rows of the
  least recently seen ids (the default: a growing stream's new ids replace
  the ones no longer seen), `"lfu"` those of the least frequently seen ids
  (ties: least recent; for stationary distributions, where recency is noise).
  As Redis' approximated LRU, each row needed is the one the policy ranks
  first among `EVICTION_SAMPLES` (16) rows of the partition drawn at random,
  so a new id costs the same whatever the table's size: the row freed is the
  oldest of 16, older than 96% of the partition's rows half of the time
  (older than a share q of them with probability 1 - q**16); a partition of
  at most 16 rows is ranked whole (exact). With `steps_to_live`, an id unseen
  for that many steps has no row any more: its next lookup misses, and its
  row goes first among those sampled.
* Under a strategy, rows looked up in the last 4 x workers training lookups
  are never freed: a gradient still in flight for an id never lands on a row
  reused for another.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

import numpy as np

from kerasps.policy import partitioners as partitioners_lib
from kerasps.policy._validation import positive_int

__all__ = [
    "Eviction",
    "TableRecord",
    "TableSpec",
    "mix64",
    "partition_of",
    "sketch_hashes",
    "default_num_partitions",
    "shards_of",
    "STATE_COLUMNS",
    "STAT_COLUMNS",
]

_MASK = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Seeds of the sketch's hash functions (one per row of the sketch).
SKETCH_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)

# Rows of a partition the eviction policy ranks per row it frees (see above).
EVICTION_SAMPLES = 16

# Columns of a table's `state` ([capacity, 3] int64): the key of each row, the
# step it was last looked up at (-1: the row is free) and how often.
STATE_COLUMNS = ("key", "last_seen", "count")
KEY, LAST_SEEN, COUNT = range(3)
# Columns of a table's `stats` ([num_partitions, 8] int64), per partition: its
# clock (training lookups so far), ids looked up in training, of which found,
# rows admitted, rows freed, additions to the sketch since it was last halved,
# and ids looked up outside training (evaluation, serving), of which found.
STAT_COLUMNS = ("clock", "lookups", "hits", "admitted", "evicted", "sketch_additions",
                "reads", "read_hits")
CLOCK, LOOKUPS, HITS, ADMITTED, EVICTED, SKETCH_ADDITIONS, READS, READ_HITS = range(8)
# A key of a map (TensorFlow's `MutableHashTable`, a `std::unordered_map`): its
# node as glibc allocates it (next pointer, key, value: 24 bytes in a 32-byte
# chunk), and one bucket pointer per bucket (measured: 43.6 bytes a key, 1e6 keys).
MAP_NODE_BYTES = 32
MAP_BUCKET_BYTES = 8


def mix64(keys) -> np.ndarray:
    """The 64-bit finalizer of SplitMix64 of int64 `keys`, as `uint64`s.

    The TensorFlow side computes the same bits (`kerasps.layers` tests check
    that); partitions and sketch positions are taken modulo from it.
    """
    z = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
        return z ^ (z >> np.uint64(31))


def partition_of(keys, num_partitions: int) -> np.ndarray:
    """The partition (int64) each key belongs to."""
    return (mix64(keys) % np.uint64(num_partitions)).astype(np.int64)


def sketch_hashes(keys, depth: int, width: int) -> np.ndarray:
    """`[depth, len(keys)]`: each key's column in each row of a sketch."""
    keys = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return np.stack([(mix64((keys + np.uint64(seed)).astype(np.int64)) % np.uint64(width))
                         .astype(np.int64) for seed in SKETCH_SEEDS[:depth]])


def default_num_partitions(capacity: int) -> int:
    """The most partitions (at most 60, which 1-6, 10, 12, 15, 20 and 30 ps tasks split
    evenly) that divide `capacity` into partitions of at least 256 rows; 1 if none."""
    for count in range(60, 1, -1):
        if capacity % count == 0 and capacity // count >= 256:
            return count
    return 1


def shards_of(num_partitions: int, num_ps: int) -> list[tuple[int, int]]:
    """`(first partition, partition count)` of each ps task holding a part of a table:
    `min(num_ps, num_partitions)` tasks, from task 0."""
    count = min(num_ps, num_partitions)
    sizes = partitioners_lib.shard_sizes(num_partitions, count)
    offsets = partitioners_lib.shard_offsets(num_partitions, count)
    return list(zip(offsets, sizes))


class Eviction(enum.Enum):
    """Which rows a full partition frees for new ids."""

    LRU = "lru"
    LFU = "lfu"

    @classmethod
    def of(cls, value) -> Eviction:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                "Invalid value for argument `eviction`: expected one of "
                f"{', '.join(repr(e.value) for e in cls)}. Received: eviction={value!r}"
            ) from None


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A dynamic table's shape and policies (validated on construction).

    Attributes:
        capacity: rows in the whole table.
        output_dim: floats per row.
        num_partitions: partitions (`capacity` divides into them).
        min_count: occurrences before an id is admitted (1: at once).
        probability: chance that an occurrence admits an id (1.0: always).
        eviction: `"lru"` or `"lfu"`.
        steps_to_live: steps after which an unseen id loses its row (`None`: never).
    """

    capacity: int
    output_dim: int
    num_partitions: int | None = None
    min_count: int = 1
    probability: float = 1.0
    eviction: str = "lru"
    steps_to_live: int | None = None

    def __post_init__(self):
        capacity = positive_int("capacity", self.capacity)
        object.__setattr__(self, "capacity", capacity)
        object.__setattr__(self, "output_dim", positive_int("output_dim", self.output_dim))
        partitions = self.num_partitions
        if partitions is None:
            partitions = default_num_partitions(capacity)
        partitions = positive_int("num_partitions", partitions)
        if capacity % partitions:
            raise ValueError(
                "Invalid value for argument `num_partitions`: it must divide `capacity` "
                f"({capacity}) into equal partitions. Received: num_partitions={partitions!r}")
        object.__setattr__(self, "num_partitions", partitions)
        object.__setattr__(self, "min_count", positive_int("min_count", self.min_count))
        p = self.probability
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError("Invalid value for argument `probability`: it must be in (0, 1]. "
                             f"Received: probability={p!r}")
        object.__setattr__(self, "probability", float(p))
        object.__setattr__(self, "eviction", Eviction.of(self.eviction).value)
        object.__setattr__(self, "steps_to_live", positive_int(
            "steps_to_live", self.steps_to_live, allow_none=True))

    # -- layout -------------------------------------------------------------------
    @property
    def rows_per_partition(self) -> int:
        return self.capacity // self.num_partitions

    def partition_of(self, keys) -> np.ndarray:
        return partition_of(keys, self.num_partitions)

    def ps_task_of(self, keys, num_ps: int) -> np.ndarray:
        """The ps task whose map holds each key."""
        starts = [first for first, _ in shards_of(self.num_partitions, num_ps)]
        return np.searchsorted(starts, self.partition_of(keys), side="right") - 1

    # -- admission ------------------------------------------------------------------
    @property
    def counts_occurrences(self) -> bool:
        """True if admission counts occurrences (a sketch is kept)."""
        return self.min_count > 1

    @property
    def sketch_shape(self) -> tuple[int, int]:
        """`(depth, width)` of each partition's count-min sketch: 4 hash rows as wide as
        the partition has rows (16 bytes per row of the table)."""
        return 4, max(64, self.rows_per_partition)

    @property
    def sketch_window(self) -> int:
        """Additions to a partition's sketch after which its counts are halved: as many
        as the sketch is wide, so that an id must come back within about that many
        occurrences of not-yet-admitted ids to be admitted."""
        return self.sketch_shape[1]

    # -- memory ---------------------------------------------------------------------
    def memory_bytes(self, slots_per_row: int = 0, float_bytes: int = 4) -> dict:
        """The table's memory over all ps tasks, by part (bytes).

        Args:
            slots_per_row: optimizer slots per row (Adagrad 1, Adam 2, Ftrl 2).
            float_bytes: bytes per float of the rows.

        The maps are TensorFlow's `MutableHashTable`, a `std::unordered_map` of
        int64 -> int64: a node per key (24 bytes, 32 as glibc allocates it) and a
        bucket pointer per bucket, at most one key per bucket and growing by
        doubling (8 to 16 bytes a key): counted at their largest.
        """
        rows = self.capacity * self.output_dim * float_bytes
        depth, width = self.sketch_shape
        parts = {
            "rows": rows,
            "slots": rows * slots_per_row,
            "state": self.capacity * len(STATE_COLUMNS) * 8,
            "maps": self.capacity * (MAP_NODE_BYTES + 2 * MAP_BUCKET_BYTES),
            "free_rows": self.capacity * 8,
            "sketch": self.num_partitions * depth * width * 4 if self.counts_occurrences else 0,
            "stats": self.num_partitions * len(STAT_COLUMNS) * 8,
        }
        parts["total"] = sum(parts.values())
        return parts


@dataclasses.dataclass(frozen=True)
class TableRecord:
    """A dynamic table's part on one ps task, with its totals so far.

    Attributes:
        name: the table (its layer's name).
        ps_task: the ps task (`None` without a strategy).
        capacity: rows on that task.
        rows_used: rows holding an id.
        lookups: ids looked up by training steps (each occurrence).
        hits: of which found a row.
        admitted: rows given to new ids.
        evicted: rows freed (eviction, `steps_to_live`).
    """

    name: str
    ps_task: int | None
    capacity: int
    rows_used: int
    lookups: int
    hits: int
    admitted: int
    evicted: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def table_lines(records) -> list[str]:
    """`TableRecord`s as the lines of a table (for `PlacementReport`)."""
    header = ("table", "ps_task", "capacity", "rows_used", "admitted", "evicted", "hit_rate")
    rows = [header] + [(r.name, str(r.ps_task), f"{r.capacity:,}", f"{r.rows_used:,}",
                        f"{r.admitted:,}", f"{r.evicted:,}", f"{r.hit_rate:.3f}")
                       for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
