"""The metrics' updates of a training loop, sent to the ps tasks once per execution.

A Keras metric adds to its accumulators every step (the loss tracker's `total` and
`count`, a metric's confusion counts). On a ps task each addition is a tensor sent
from the worker every step, a transfer of its own whatever its size. In the
`tf.while_loop` of a training function (`steps_per_execution > 1`), the increments are
summed on the worker instead, as one float64 vector carried by the loop
(`accumulated`), and added to the accumulators after the loop (`apply`): one transfer
per ps task per execution.

What changes for a reader: the metrics on the ps tasks take an execution's steps at
its end, not one by one (the logs of an execution are read after it, and see them
all); an execution that a lost worker never finished adds nothing to them, where its
steps already run used to be counted, and counted again when it ran elsewhere; a
`train_step` that reads a metric's value in the loop reads it as it was when the
execution began. float64 holds the sums exactly for float32 accumulators and for
integer ones up to 2**53.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from kerasps.backend import _keras


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one accumulator's increment sits in the loop's vector."""

    variable: tf.Variable
    offset: int
    size: int


def accumulated(step, carried, layout: list):
    """Runs `step()` with its metric updates deferred, and returns `carried` (the
    float64 vector of the loop's earlier steps; empty before the first) plus this
    step's increments.

    `layout` is filled with the `Slot`s of the vector, grouped by ps task.
    """
    with _keras.metric_updates_deferred() as pending:
        step()
    entries = sorted(pending.values(), key=lambda entry: entry[0].device)
    layout.clear()
    parts, offset = [], 0
    for variable, delta in entries:
        size = variable.shape.num_elements()
        layout.append(Slot(variable, offset, size))
        parts.append(tf.reshape(tf.cast(delta, tf.float64), [size]))
        offset += size
    vector = tf.concat(parts, 0) if parts else tf.zeros([0], tf.float64)
    # `carried` is empty in the first iteration, and as long as `vector` after it.
    return vector + tf.pad(carried, [[0, offset - tf.size(carried)]])


def apply(vector, layout):
    """Adds the loop's increments to the accumulators: one slice of `vector` sent to
    each ps task, split there."""
    by_device = {}
    for slot in layout:
        by_device.setdefault(slot.variable.device, []).append(slot)
    for device, slots in by_device.items():
        start = slots[0].offset
        end = slots[-1].offset + slots[-1].size
        segment = vector[start:end]
        with tf.device(device):
            received = tf.identity(segment)
            for slot in slots:
                delta = received[slot.offset - start:slot.offset - start + slot.size]
                slot.variable.assign_add(
                    tf.cast(tf.reshape(delta, slot.variable.shape), slot.variable.dtype))
