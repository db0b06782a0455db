"""The TensorFlow side of a dynamic table: rows, maps and locks on the ps tasks.

A table (`kerasps.tables.TableSpec`) has one shard per ps task that holds
partitions of it (one shard, on this process, without a strategy). A shard
holds, on its ps task:

* its runs of the table's whole variables (Keras variables, the shards of
  `kerasps.ShardedVariable`s, so checkpoints, `get_weights` and ps recovery
  see whole variables that do not depend on the number of ps tasks): `rows`
  (`[capacity, output_dim]`, trainable), `state` (`[capacity, 3]` int64: each
  row's key, last lookup step, count; see `kerasps.tables.STATE_COLUMNS`),
  `stats` (`[num_partitions, 8]` int64, per partition: see
  `kerasps.tables.STAT_COLUMNS`), and, when admission counts, `sketch`
  (`[num_partitions, depth, width]` int32);
* what is derived from `state` and rebuilt whenever it is assigned (a restore,
  `set_weights`): the key -> row map (a `MutableHashTable`), the stacks of free
  rows of each partition, and a `tf.CriticalSection`.

A training lookup runs, on each shard's ps task and inside its critical
section, one "find or insert": look the keys up, touch the rows found, count
and admit the missing ones, free rows if a partition is full, give the
admitted keys rows (initial values, optimizer slots reset), insert them. Two
workers that see a new id at once thus give it one row. TensorFlow has no
atomic insert-if-absent on its tables or variables: without the lock, two
inserts of one key both allocate a row and the map keeps the last (measured:
808 rows allocated for 800 keys in 400 racing steps). Inference lookups read
the map without the lock and change nothing.

The rows then gather on the ps task; their gradient reaches the shard of
`rows` as a row update (`tf.IndexedSlices`), which `kerasps.sparse` applies
to those rows only.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref

import keras
import numpy as np
import tensorflow as tf

from kerasps.backend import _keras, _tf
from kerasps.params import changes as changes_lib
from kerasps.params import variables as variables_lib
from kerasps.policy import tables
from kerasps.policy.tables import (
    ADMITTED,
    CLOCK,
    COUNT,
    EVICTED,
    HITS,
    KEY,
    LAST_SEEN,
    LOOKUPS,
    READ_HITS,
    READS,
    SKETCH_ADDITIONS,
)

# Python ints, made constants where `mix64` runs: a module-level tensor would be one
# constant of the function, made on the worker and sent to each ps task at every step.
_C1, _C2 = tables._C1, tables._C2
_ODD = 0x2545F4914F6CDD1D  # spreads a row's columns over the hash's inputs


def mix64(keys):
    """`kerasps.tables.mix64` of int64 `keys`, as `uint64`s."""
    z = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)
    shift = tf.bitwise.right_shift
    z = tf.bitwise.bitwise_xor(z, shift(z, tf.constant(30, tf.uint64))) * tf.constant(
        _C1, tf.uint64)
    z = tf.bitwise.bitwise_xor(z, shift(z, tf.constant(27, tf.uint64))) * tf.constant(
        _C2, tf.uint64)
    return tf.bitwise.bitwise_xor(z, shift(z, tf.constant(31, tf.uint64)))


def modulo(hashes, n):
    return tf.cast(tf.math.floormod(hashes, tf.constant(n, tf.uint64)), tf.int64)


def rank_within(groups, num_groups):
    """For each element of `groups` (int64), how many elements before it share its group.

    By a stable sort. Running counts per group (a one-hot `[len(groups), num_groups]`
    cumsum, no sort) took longer in one process (199 against 155 us a call at 54 ids and
    30 groups, 779 against 317 at 2,048) and held 6 MiB more RSS in a table of 1e6 rows.
    """
    del num_groups
    count = tf.size(groups, out_type=tf.int64)
    order = tf.argsort(groups, stable=True)
    ordered = tf.gather(groups, order)
    starts = tf.searchsorted(ordered, ordered, side="left", out_type=tf.int64)
    ranks = tf.range(count, dtype=tf.int64) - starts
    return tf.scatter_nd(order[:, None], ranks, [count])


def _scatter_update(variable, indices, updates):
    return tf.raw_ops.ResourceScatterUpdate(resource=variable.handle, indices=indices,
                                            updates=updates)


@contextlib.contextmanager
def _placed(device):
    if device is None:
        yield
        return
    with _tf.no_colocation(), tf.device(device):
        yield


class _Shard:
    """A ps task's part of a table: its partitions' variables, map, free rows and lock."""

    def __init__(self, table, index, ps_task, first_partition, num_partitions):
        self.table = table
        self.spec = table.spec
        self.index_in_table = index
        self.ps_task = ps_task
        self.device = None if ps_task is None else f"/job:ps/replica:0/task:{ps_task}/device:CPU:0"
        self.first_partition = first_partition
        self.num_partitions = num_partitions
        self.size = num_partitions * self.spec.rows_per_partition
        self.variables = {}  # name -> the Keras variable of this shard
        self.slots = []  # (optimizer slot, its initial row): reset when a row is reused
        self.make_resources()

    def make_resources(self):
        """Creates the map, the free-row stacks and the lock (again after a ps restart)."""
        rows = self.spec.rows_per_partition
        # Stack `p` holds partition p's free rows; its top (the last one) is taken first.
        free = np.arange(self.size, dtype=np.int64).reshape(self.num_partitions, rows)[:, ::-1]
        with tf.init_scope():  # also when the layer is first called in a tf.function
            with _placed(self.device):
                self.map = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
                # A mutex of its own. Made eagerly, a `tf.CriticalSection()` gets an empty
                # `shared_name`, and every such mutex of one device is the same resource:
                # all tables' locks on a ps task were one lock, and a step looking up two
                # tables could wait for itself: its two sections are not ordered, and the
                # release of the later one in the program waits for the earlier one's
                # (TensorFlow's automatic control dependencies chain stateful ops such as
                # `ConsumeMutexLock`), so if the later one locked first, neither ended.
                self.lock = tf.CriticalSection(
                    shared_name=f"kerasps_table_lock_{uuid.uuid4().hex}")
            self.free = _tf.variable_on(self.device, np.ascontiguousarray(free))
            self.free_count = _tf.variable_on(
                self.device, np.full([self.num_partitions], rows, np.int64))


    def tf_variable(self, name):
        return _keras.tf_variable(self.variables[name])

    def on_slot(self, slot):
        """Registers an optimizer slot (a Keras variable) of this shard's rows, with its
        initial row."""
        if tf.inside_function() and self.table.traced_in(tf.compat.v1.get_default_graph()):
            raise ValueError(
                f"Invalid optimizer: it creates its slot {slot.path!r} for the rows of a "
                "`DynamicEmbedding` table in a function that has already looked the table "
                "up, so the rows the lookup reuses for new ids cannot start with fresh "
                "slots. Build the optimizer before the first training step: "
                "`optimizer.build(model.trainable_variables)`.")
        initializer = getattr(slot, "_initializer", None)
        if getattr(slot, "_value", None) is None and initializer is not None:
            # Not initialized yet (an optimizer built in a stateless scope).
            row = np.asarray(initializer((1, *slot.shape[1:]), dtype=slot.dtype))
        else:
            with tf.init_scope(), _placed(self.device):
                row = tf.gather(_keras.tf_variable(slot), [0]).numpy()
        self.slots.append((slot, row))

    # -- rebuilding what is derived from `state` ------------------------------------
    def rebuild(self):
        """Makes the map and the free rows those of `state` (after it was assigned)."""
        rows = self.spec.rows_per_partition
        with _placed(self.device):
            state = self.tf_variable("state").read_value()
            occupied = state[:, LAST_SEEN] >= 0
            old_keys, _ = self.map.export()
            with tf.control_dependencies([self.map.remove(old_keys)]):
                used = tf.where(occupied)[:, 0]
                insert = self.map.insert(tf.gather(state[:, KEY], used), used)
            occupied = tf.reshape(occupied, [self.num_partitions, rows])
            column = tf.range(rows, dtype=tf.int64)[None, :]
            # Free rows first, highest first, so that the stack's top is the lowest.
            order = tf.argsort(tf.where(occupied, rows + column, rows - 1 - column),
                               axis=1, stable=True)
            base = tf.range(self.num_partitions, dtype=tf.int64)[:, None] * rows
            with tf.control_dependencies([insert]):
                self.free.assign(tf.cast(order, tf.int64) + base)
                self.free_count.assign(
                    rows - tf.reduce_sum(tf.cast(occupied, tf.int64), axis=1))

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, packed, training, after=()):
        """The vectors (zeros for keys without a row) of the keys of `packed`, on this
        shard's ps task.

        Args:
            packed: int64 `[m, 3]`: distinct keys, their occurrences in the batch, and
                their partitions (local to this shard).
            training: a Python bool; training lookups admit, touch and evict.
            after: tensors the lock waits for (the previous training lookup of the
                table in the same function: `Table._lookup`).
        """
        with _placed(self.device):
            keys, counts, partitions = tf.unstack(packed, axis=1)
            if not training:
                return self.gather(self._read(keys, counts, partitions))
            if tf.inside_function():
                self.table.traced_graphs.add(tf.compat.v1.get_default_graph())
            # The lock is taken once the keys are here, never while they are on the way.
            with tf.control_dependencies([packed, *after]):
                rows = self.lock.execute(
                    lambda: self._find_or_insert(keys, counts, partitions),
                    exclusive_resource_access=False)
            return self.gather(rows)

    def _clock(self):
        return tf.gather(self.tf_variable("stats"), 0)[CLOCK]

    def _read(self, keys, counts, partitions):
        found = tf.reshape(self.map.lookup(keys), [-1])
        if self.spec.steps_to_live is not None:
            last = tf.gather(self.tf_variable("state"), tf.maximum(found, 0))[:, LAST_SEEN]
            found = tf.where(self._clock() - last > self.spec.steps_to_live,
                             tf.constant(-1, found.dtype), found)  # traced: not int32
        n = self.num_partitions
        looked = tf.math.unsorted_segment_sum(
            tf.stack([counts, tf.where(found >= 0, counts, 0)], axis=1), partitions, n)
        cells = tf.stack([tf.broadcast_to(tf.range(n, dtype=tf.int64)[:, None], [n, 2]),
                          tf.broadcast_to(tf.constant([[READS, READ_HITS]], tf.int64), [n, 2])],
                         axis=2)
        count = tf.raw_ops.ResourceScatterNdAdd(  # atomic: no lock on this path
            ref=self.tf_variable("stats").handle, indices=tf.reshape(cells, [-1, 2]),
            updates=tf.reshape(looked, [-1]))
        with tf.control_dependencies([count]):
            return tf.identity(found)

    def _find_or_insert(self, keys, counts, partitions):
        spec, n = self.spec, self.num_partitions
        state, stats = self.tf_variable("state"), self.tf_variable("stats")
        effects = []
        clock = self._clock()
        found = tf.reshape(self.map.lookup(keys), [-1])
        hit = found >= 0
        seen = tf.gather(state, tf.maximum(found, 0))
        freed = tf.zeros([n], tf.int64)
        if spec.steps_to_live is not None:
            expired = hit & (clock - seen[:, LAST_SEEN] > spec.steps_to_live)
            freed, effect = self._release(tf.boolean_mask(found, expired))
            effects.append(effect)
            hit = hit & ~expired
        # Touch the rows found.
        touched = tf.where(hit)[:, 0]
        effects.append(_scatter_update(state, tf.gather(found, touched), tf.stack([
            tf.gather(keys, touched), tf.fill(tf.shape(touched), clock),
            tf.gather(seen[:, COUNT] + counts, touched)], axis=1)))
        # Admission of the others.
        admit = ~hit
        sketch_additions = tf.zeros([n], tf.int64)
        if spec.counts_occurrences:
            admit, sketch_additions, effect = self._count(keys, counts, partitions, admit)
            effects.append(effect)
        if spec.probability < 1.0:
            chance = 1.0 - tf.pow(1.0 - spec.probability, tf.cast(counts, tf.float64))
            admit = admit & (tf.random.uniform(tf.shape(keys), dtype=tf.float64) < chance)
        admitted = tf.where(admit)[:, 0]
        new_partitions = tf.gather(partitions, admitted)
        needed = tf.math.unsorted_segment_sum(tf.ones_like(new_partitions), new_partitions, n)
        rank = rank_within(new_partitions, n)
        # Rows for them: free rows, else rows freed now.
        with tf.control_dependencies(effects):
            free_count = self.free_count.read_value()

        # (Not in a `tf.cond`: a full table evicts at nearly every step, and the ops of an
        # empty eviction cost less than the conditional's function call.)
        evicted, effect = self._evict(new_partitions, rank, free_count, clock)
        with tf.control_dependencies([effect]):
            free_count = self.free_count.read_value()
        placed = tf.where(rank < tf.gather(free_count, new_partitions))[:, 0]
        admitted = tf.gather(admitted, placed)
        new_keys = tf.gather(keys, admitted)
        new_partitions = tf.gather(new_partitions, placed)
        position = tf.gather(free_count, new_partitions) - 1 - tf.gather(rank, placed)
        new_rows = tf.gather_nd(self.free, tf.stack([new_partitions, position], axis=1))
        taken = tf.minimum(needed, free_count)  # rows admitted, per partition
        effects += [
            self.free_count.assign_sub(taken, read_value=False),
            _scatter_update(state, new_rows, tf.stack(
                [new_keys, tf.fill(tf.shape(new_keys), clock), tf.gather(counts, admitted)],
                axis=1)),
            *self._reset(new_rows, new_keys),
            self.map.insert(new_keys, new_rows),
        ]
        # Statistics, per partition (`kerasps.tables.STAT_COLUMNS`).
        looked = tf.math.unsorted_segment_sum(
            tf.stack([counts, tf.where(hit, counts, 0)], axis=1), partitions, n)
        delta = tf.concat([tf.ones([n, 1], tf.int64), looked, tf.stack(
            [taken, evicted + freed, sketch_additions], axis=1), tf.zeros([n, 2], tf.int64)],
            axis=1)
        with tf.control_dependencies(effects):
            effects.append(stats.assign_add(delta, read_value=False))
        if spec.counts_occurrences:
            with tf.control_dependencies(effects):
                effects.append(self._decay_sketch())
        with tf.control_dependencies(effects):
            return tf.tensor_scatter_nd_update(tf.where(hit, found, -1), admitted[:, None],
                                               new_rows)

    def _count(self, keys, counts, partitions, missing):
        """Admission by count: the missing keys seen `min_count` times (this batch
        included) are admitted; the others' occurrences are added to the sketch, by
        conservative update (a key's counters are raised to its new estimate, no
        further: far fewer overestimates than adding to each)."""
        spec = self.spec
        sketch = self.tf_variable("sketch")
        depth, width = spec.sketch_shape
        columns = tf.stack([modulo(mix64(tf.bitcast(tf.bitcast(keys, tf.uint64) + tf.constant(
            seed, tf.uint64), tf.int64)), width) for seed in tables.SKETCH_SEEDS[:depth]], axis=1)
        m = tf.shape(keys)[0]
        rows = tf.broadcast_to(tf.range(depth, dtype=tf.int64)[None, :], [m, depth])
        where = tf.stack([tf.broadcast_to(partitions[:, None], [m, depth]), rows, columns], axis=2)
        estimate = tf.cast(tf.reduce_min(tf.gather_nd(sketch, where), axis=1), tf.int64)
        enough = estimate + counts >= spec.min_count
        add = missing & ~enough
        added = tf.boolean_mask(counts, add)
        effect = tf.raw_ops.ResourceScatterNdMax(
            ref=sketch.handle, indices=tf.reshape(tf.boolean_mask(where, add), [-1, 3]),
            updates=tf.cast(tf.repeat(tf.boolean_mask(estimate, add) + added, depth), tf.int32))
        additions = tf.math.unsorted_segment_sum(
            added, tf.boolean_mask(partitions, add), self.num_partitions)
        return missing & enough, additions, effect

    def _decay_sketch(self):
        """Halves the sketch of each partition that had `sketch_window` additions."""
        sketch, stats = self.tf_variable("sketch"), self.tf_variable("stats")
        over = tf.where(stats.read_value()[:, SKETCH_ADDITIONS] >= self.spec.sketch_window)[:, 0]
        halve = _scatter_update(sketch, over, tf.gather(sketch, over) // 2)
        with tf.control_dependencies([halve]):
            return tf.raw_ops.ResourceScatterNdUpdate(
                ref=stats.handle,
                indices=tf.stack([over, tf.fill(tf.shape(over), tf.constant(
                    SKETCH_ADDITIONS, tf.int64))], axis=1),
                updates=tf.zeros(tf.shape(over), tf.int64))

    def _evict(self, new_partitions, rank, free_count, clock):
        """Frees a row for each new id that its partition has no free row for (fewer if
        fewer may go); returns the rows freed per partition and the effect.

        Args:
            new_partitions: int64 `[a]`, the partition of each id admitted.
            rank: int64 `[a]`, how many ids admitted before it share its partition.
            free_count: int64 `[num_partitions]`, free rows per partition.
            clock: this lookup's step.

        Each row needed is the one the policy ranks first among `EVICTION_SAMPLES` rows of
        its partition drawn at random (two draws that pick the same row free it once); a
        partition of at most that many rows is ranked whole.
        """
        rows, samples = self.spec.rows_per_partition, tables.EVICTION_SAMPLES
        state = self.tf_variable("state")
        # The partition of each row needed: the ids ranked past their partition's free rows.
        owner = tf.gather(new_partitions,
                          tf.where(rank >= tf.gather(free_count, new_partitions))[:, 0])
        if rows <= samples:
            short = tf.math.unsorted_segment_sum(tf.ones_like(owner), owner,
                                                 self.num_partitions)
            full = tf.where(short > 0)[:, 0]
            wanted = tf.gather(short, full)
            candidates = full[:, None] * rows + tf.range(rows, dtype=tf.int64)[None, :]
            score = self._score(tf.gather(state, candidates), clock)  # [q, rows]
            k = tf.cast(tf.minimum(tf.reduce_max(tf.concat([wanted, [0]], 0)), rows), tf.int32)
            negated, columns = tf.math.top_k(-score, k)
            chosen = (tf.range(k, dtype=tf.int64)[None, :] < wanted[:, None]) & (
                negated > -np.inf)
            victims = tf.boolean_mask(tf.gather(candidates, columns, batch_dims=1), chosen)
        else:
            draws = tf.random.uniform(tf.stack([tf.size(owner), samples]), dtype=tf.float32)
            candidates = owner[:, None] * rows + tf.minimum(
                tf.cast(draws * rows, tf.int64), rows - 1)
            score = self._score(tf.gather(state, candidates), clock)  # [needed, samples]
            best = tf.argmin(score, axis=1, output_type=tf.int64)
            victims = tf.gather(candidates, best, batch_dims=1)
            may_go = tf.where(tf.gather(score, best, batch_dims=1) < np.inf)[:, 0]
            victims, _ = tf.unique(tf.gather(victims, may_go))
        return self._release(victims)

    def _score(self, seen, clock):
        """The eviction policy's rank of rows (`seen`: their state): lowest first; `inf` for
        rows that may not go (free, or looked up in the last `protected_steps`)."""
        spec = self.spec
        last = seen[..., LAST_SEEN]
        if spec.eviction == tables.Eviction.LFU.value:
            score = tf.cast(seen[..., COUNT], tf.float64) + tf.cast(last, tf.float64) / tf.cast(
                clock + 1, tf.float64)
        else:
            score = tf.cast(last, tf.float64)
        if spec.steps_to_live is not None:
            score = tf.where(clock - last > spec.steps_to_live, -1.0, score)
        may_go = (last >= 0) & (last < clock - self.table.protected_steps)
        return tf.where(may_go, score, np.inf)

    def _release(self, victims):
        """Frees the rows `victims`: out of the map, marked free, on their free stacks."""
        rows = self.spec.rows_per_partition
        state = self.tf_variable("state")
        keys = tf.gather(state, victims)[:, KEY]
        partitions = victims // rows
        rank = rank_within(partitions, self.num_partitions)
        position = tf.gather(self.free_count.read_value(), partitions) + rank
        released = tf.math.unsorted_segment_sum(tf.ones_like(partitions), partitions,
                                                self.num_partitions)
        effects = [
            self.map.remove(keys),
            _scatter_update(state, victims, tf.stack(
                [keys, tf.fill(tf.shape(keys), tf.constant(-1, tf.int64)),
                 tf.zeros_like(keys)], axis=1)),
            tf.raw_ops.ResourceScatterNdUpdate(
                ref=self.free.handle, indices=tf.stack([partitions, position], axis=1),
                updates=victims),
        ]
        with tf.control_dependencies(effects):
            effect = self.free_count.assign_add(released, read_value=False)
        flagged = changes_lib.mark(self.tf_variable("rows"), victims, after=effects)
        if flagged is not None:  # tracked: the freed rows' keys are gone at the next publish
            effect = tf.group(effect, flagged)
        return released, effect

    def _reset(self, rows, keys):
        """Initial values for the reused `rows` (now `keys`') and their optimizer slots."""
        effects = [_scatter_update(self.tf_variable("rows"), rows, self.table.initial_rows(keys))]
        for slot, initial in self.slots:
            slot = _keras.tf_variable(slot)
            effects.append(_scatter_update(slot, rows, tf.tile(
                tf.constant(initial, slot.dtype), [tf.size(rows), 1])))
        flagged = changes_lib.mark(self.tf_variable("rows"), rows, after=effects[:1])
        if flagged is not None:  # tracked: admitted rows are published
            effects.append(flagged)
        return effects

    def gather(self, rows):
        """The vectors of local `rows` (zeros for -1), gathered on this ps task."""
        with _placed(self.device):
            present = tf.where(rows >= 0)[:, 0]
            vectors = tf.gather(self.tf_variable("rows"), tf.gather(rows, present))
            return tf.scatter_nd(present[:, None], vectors,
                                 tf.stack([tf.size(rows, out_type=tf.int64),
                                           tf.constant(self.spec.output_dim, tf.int64)]))


class _State(variables_lib.ShardedVariable):
    """A table's `state`: whenever it is assigned (a restore, `set_weights`), the maps
    and free rows are rebuilt from it."""

    _kerasps_table = None

    def assign(self, value):
        result = super().assign(value)
        if self._kerasps_table is not None and not _keras.checking_weights_file():
            self._kerasps_table.rebuild()
        return result

    def _direct_assign(self, value):
        super()._direct_assign(value)
        if self._kerasps_table is not None:
            self._kerasps_table.rebuild()


class DynamicTable:
    """A dynamic table's variables, shards and lookups (see the module docstring).

    Created by its layer's `build`, under the strategy's scope if any.

    Args:
        layer: the Keras layer that owns the variables.
        spec: a `kerasps.tables.TableSpec`.
        initializer: a Keras initializer drawing each element independently.
        seed: seed of the initial values of admitted rows (an int).
    """

    def __init__(self, layer, spec, initializer, seed):
        self.name = layer.name
        self.spec = spec
        self.initializer = initializer
        self.seed = int(seed)
        self.seed_bits = int(tables.mix64([seed])[0])
        self.traced_graphs = weakref.WeakSet()  # function graphs with a training lookup
        # The graph of the last training lookup traced, and its shards' results.
        self._last_training_lookup = (None, [])
        self._functions = {}  # training -> the lookup as a tf.function, for eager calls
        strategy = variables_lib.kerasps_strategy()
        self.strategy = strategy
        if strategy is None:
            layout, tasks = [(0, spec.num_partitions)], [None]
        else:
            layout = tables.shards_of(spec.num_partitions, strategy.num_ps)
            tasks = list(range(len(layout)))
        # Rows looked up this many training lookups ago or less are never freed: a
        # gradient in flight never lands on a reused row. A step's gradient is applied
        # when it ends; meanwhile the other workers look up about one step each (sync:
        # one gradient each, and those of the step before may still run); 4 per worker
        # leaves room for workers up to 4x slower than the others.
        self.protected_steps = 0 if strategy is None else 4 * strategy.num_workers
        self.shards = [_Shard(self, i, task, first, count)
                       for i, (task, (first, count)) in enumerate(zip(tasks, layout))]
        boundaries = [first for first, _ in layout]
        self._partition_to_shard = np.searchsorted(
            boundaries, np.arange(spec.num_partitions), side="right") - 1
        self._partition_offset = np.asarray(boundaries)[self._partition_to_shard]
        rows = spec.rows_per_partition
        depth, width = spec.sketch_shape
        self.rows = self._make(layer, "rows", (rows, spec.output_dim), keras.config.floatx(),
                               "zeros", trainable=True)
        self.state = self._make(layer, "state", (rows, len(tables.STATE_COLUMNS)), "int64",
                                _free_state, cls=_State)
        self.state._kerasps_table = self
        self.stats = self._make(layer, "stats", (1, len(tables.STAT_COLUMNS)), "int64", "zeros")
        self.sketch = None
        if spec.counts_occurrences:
            self.sketch = self._make(layer, "sketch", (1, depth, width), "int32", "zeros")
        for shard in self.shards:
            shard.variables["rows"]._kerasps_on_slot = shard.on_slot
        if strategy is not None:
            strategy.extended._tables.add(self)

    def _make(self, layer, name, per_partition, dtype, initializer, trainable=False,
              cls=variables_lib.ShardedVariable):
        """A whole variable of `per_partition` rows per partition, one shard per shard."""
        parts = []
        for shard in self.shards:
            shape = (per_partition[0] * shard.num_partitions, *per_partition[1:])
            with contextlib.ExitStack() as stack:
                if shard.ps_task is not None:
                    stack.enter_context(variables_lib.on_ps_task(shard.ps_task))
                stack.enter_context(variables_lib.no_partitioning())
                stack.enter_context(variables_lib.creating(
                    name=f"{layer.name}/{name}/part_{shard.index_in_table}",
                    shard=shard.index_in_table))
                part = layer.add_weight(shape=shape, dtype=dtype, initializer=initializer,
                                        trainable=trainable, autocast=False,
                                        name=f"{name}_part_{shard.index_in_table}")
            shard.variables[name] = part
            parts.append(part)
        whole = cls.of_shards(parts, name=name, path=f"{parts[0].path.rsplit('/', 1)[0]}/{name}")
        for i, part in enumerate(parts):
            part._path = f"{whole.path}/part_{i}"
        return whole

    @property
    def variables(self):
        """The whole variables, in the layer's weight order."""
        return [v for v in (self.rows, self.state, self.stats, self.sketch) if v is not None]

    def initial_rows(self, keys):
        """The initial vectors `[len(keys), output_dim]` of admitted `keys`: drawn from the
        initializer's distribution by hashing `(seed, key, column)`, so that a key starts
        from the same values whatever the number of ps tasks (and again if re-admitted)."""
        init, dim = self.initializer, self.spec.output_dim
        dtype = self.rows.dtype
        kind = type(init).__name__
        if kind in ("Zeros", "Ones", "Constant"):
            value = {"Zeros": 0.0, "Ones": 1.0}.get(kind, getattr(init, "value", 0.0))
            return tf.fill(tf.stack([tf.size(keys), dim]), tf.constant(value, dtype))
        with np.errstate(over="ignore"):
            offsets = np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(_ODD) + np.uint64(
                self.seed_bits)
        bits = mix64(tf.bitcast(tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)[:, None]
                                + tf.constant(offsets)[None, :], tf.int64))
        uniform = (tf.cast(tf.bitwise.right_shift(bits, tf.constant(11, tf.uint64)), tf.float64)
                   + 0.5) * 2.0 ** -53
        if kind == "RandomUniform":
            values = init.minval + (init.maxval - init.minval) * uniform
        elif kind == "RandomNormal":
            values = init.mean + init.stddev * tf.math.ndtri(uniform)
        else:  # TruncatedNormal: within two standard deviations, by the inverse CDF
            low = 0.5 * tf.math.erfc(tf.constant(2.0 / np.sqrt(2.0), tf.float64))  # Φ(-2)
            values = init.mean + init.stddev * tf.math.ndtri(low + (1 - 2 * low) * uniform)
        return tf.cast(values, dtype)

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, keys, training):
        """Vectors `[n, output_dim]` of the int64 `keys` `[n]`."""
        if self.strategy is not None and tf.executing_eagerly():
            # On the coordinator: eager ops lose the shapes of remote resources.
            if training not in self._functions:
                self._functions[training] = tf.function(
                    lambda keys: self._lookup(keys, training), reduce_retracing=True)
            return self._functions[training](keys)
        return self._lookup(keys, training)

    def _lookup(self, keys, training):
        after = self._after_previous_lookup(training)
        unique, positions, counts = tf.unique_with_counts(keys, out_idx=tf.int64)
        partitions = modulo(mix64(unique), self.spec.num_partitions)
        if len(self.shards) == 1:
            found = [self.shards[0].lookup(tf.stack([unique, counts, partitions], axis=1),
                                           training, after)]
            vectors = found[0]
        else:
            shard_of = tf.gather(tf.constant(self._partition_to_shard, tf.int32), partitions)
            local = partitions - tf.gather(tf.constant(self._partition_offset, tf.int64),
                                           partitions)
            count = len(self.shards)
            where = tf.dynamic_partition(tf.range(tf.size(unique)), shard_of, count)
            # One tensor (key, count, partition) per ps task: one transfer each, not three.
            parts = tf.dynamic_partition(tf.stack([unique, counts, local], axis=1), shard_of,
                                         count)
            found = [shard.lookup(part, training, after)
                     for shard, part in zip(self.shards, parts)]
            vectors = tf.dynamic_stitch(where, found)
        if training and tf.inside_function():
            self._last_training_lookup = (
                weakref.ref(tf.compat.v1.get_default_graph()), found)
        return variables_lib._expand_rows(vectors, positions)

    def _after_previous_lookup(self, training) -> list:
        """What the locks of a training lookup wait for: the results of the table's
        previous training lookup in the same function (a layer called twice), which
        come after its locks were released; nothing for the first.

        Unordered, two lookups of one step could deadlock two workers: TensorFlow's
        automatic control dependencies release a step's locks (`ConsumeMutexLock`) in
        program order, across ps tasks, so a worker holding the lock of its second lookup
        on one ps task waits, to release it, for the release of its first lookup's lock on
        the other ps task, which another worker holds, waiting in turn for the first."""
        if not (training and tf.inside_function()):
            return []
        graph, found = self._last_training_lookup
        if graph is None or graph() is not tf.compat.v1.get_default_graph():
            return []
        return found

    def totals(self):
        """`[lookups, hits, admitted, evicted, rows_used]` (int64) over the shards: lookups
        and hits of every lookup (training or not), admitted and evicted rows so far."""
        parts = []
        for shard in self.shards:
            with _placed(shard.device):
                stats = tf.reduce_sum(shard.tf_variable("stats").read_value(), axis=0)
                parts.append(tf.stack([
                    stats[LOOKUPS] + stats[READS], stats[HITS] + stats[READ_HITS],
                    stats[ADMITTED],
                    stats[EVICTED], shard.size - tf.reduce_sum(shard.free_count.read_value())]))
        return tf.add_n(parts)

    # -- state --------------------------------------------------------------------------
    def rebuild(self):
        for shard in self.shards:
            shard.rebuild()

    def renew(self, ps_tasks):
        """Gives the shards on restarted `ps_tasks` new maps, free rows and locks (their
        variables are renewed, and `state` restored, by the caller)."""
        for shard in self.shards:
            if shard.ps_task in ps_tasks:
                shard.make_resources()
        self._functions.clear()

    def traced_in(self, graph) -> bool:
        """True if a training lookup was traced in `graph`."""
        return graph in self.traced_graphs

    def maps(self):
        return [shard.map for shard in self.shards]

    def stats_per_partition(self) -> np.ndarray:
        return self.stats.numpy()

    def records(self) -> list:
        """A `kerasps.tables.TableRecord` per shard, read now."""
        records = []
        for shard in self.shards:
            stats = shard.variables["stats"].numpy().sum(axis=0)
            records.append(tables.TableRecord(
                name=self.name, ps_task=shard.ps_task, capacity=shard.size,
                rows_used=shard.size - int(shard.free_count.numpy().sum()),
                lookups=int(stats[LOOKUPS]), hits=int(stats[HITS]),
                admitted=int(stats[ADMITTED]), evicted=int(stats[EVICTED])))
        return records


def _free_state(shape, dtype=None):
    """Every row free: key 0, last seen -1, count 0."""
    return tf.tile(tf.constant([[0, -1, 0]], tf.int64), [shape[0], 1])
