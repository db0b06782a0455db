"""Variable partitioners: how many shards a variable is split into.

A partitioner is called with a variable's `shape` and `dtype` and returns the
number of partitions along each axis, as TensorFlow's
`tf.distribute.experimental.partitioners` do. Only axis 0 is ever split, so a
result looks like `[num_shards, 1, 1, ...]`.

This module is pure Python (it imports neither TensorFlow nor Keras) so that
`simulator/` shards variables with exactly the arithmetic kerasps uses.
Shapes may be any sequence of ints (a `tf.TensorShape` works); dtypes may be a
name (`"float32"`), a NumPy dtype, or any object with `name` and `size`
attributes (a `tf.DType` works).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kerasps.policy._validation import positive_int

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "shard_sizes",
    "shard_offsets",
    "element_bytes",
]


def _as_shape(shape) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(
            f"Invalid value for argument `shape`: expected a sequence of "
            f"dimensions. Received: shape={shape!r}"
        ) from None
    out = []
    for d in dims:
        d = getattr(d, "value", d)  # tf.compat.v1.Dimension
        if d is None:
            raise ValueError(
                "Invalid value for argument `shape`: a partitioned variable "
                f"needs a fully defined shape. Received: shape={shape!r}"
            )
        out.append(int(d))
    return tuple(out)


def element_bytes(dtype, bytes_per_string: int = 16) -> int:
    """Returns the size in bytes of one element of `dtype`.

    Strings have no fixed size; they count as `bytes_per_string` bytes, as in
    TensorFlow's partitioners.
    """
    name = getattr(dtype, "name", dtype)
    if name in ("string", "str", object):
        return bytes_per_string
    size = getattr(dtype, "size", None)
    if isinstance(size, int) and not isinstance(dtype, np.dtype):
        return size
    try:
        numpy_dtype = np.dtype(dtype if isinstance(dtype, (np.dtype, type)) else name)
    except TypeError:
        raise ValueError(
            f"Invalid value for argument `dtype`: unknown dtype. Received: "
            f"dtype={dtype!r}"
        ) from None
    if numpy_dtype.kind in "OSUa":  # Python objects and strings: TensorFlow strings
        return bytes_per_string
    return int(numpy_dtype.itemsize)


def shard_sizes(num_rows: int, num_shards: int) -> list[int]:
    """Rows per shard when `num_rows` are split into `num_shards` shards.

    The first `num_rows % num_shards` shards hold one extra row, which is how
    TensorFlow's `ShardedVariable` splits a variable.
    """
    base, extra = divmod(num_rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def shard_offsets(num_rows: int, num_shards: int) -> list[int]:
    """First row of each shard (see `shard_sizes`)."""
    offsets, start = [], 0
    for size in shard_sizes(num_rows, num_shards):
        offsets.append(start)
        start += size
    return offsets


class Partitioner:
    """Base class: decides the number of shards of a variable.

    Subclasses implement `num_shards(shape, dtype)`; calling the partitioner
    returns TensorFlow's format, a list with one partition count per axis.
    """

    def num_shards(self, shape: Sequence[int], dtype) -> int:
        raise NotImplementedError

    def __call__(self, shape, dtype, axis: int = 0) -> list[int]:
        dims = _as_shape(shape)
        if axis != 0:
            raise ValueError(
                "Invalid value for argument `axis`: kerasps only partitions "
                f"along axis 0. Received: axis={axis!r}"
            )
        partitions = [1] * len(dims)
        if dims:
            partitions[0] = self.num_shards(dims, dtype)
        return partitions

    def get_config(self) -> dict:
        return dict(vars(self))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into `num_shards` shards (fewer if it has fewer rows).

    Args:
        num_shards: positive int, the number of shards.
    """

    def __init__(self, num_shards: int):
        self.num_shards_ = positive_int("num_shards", num_shards)

    def num_shards(self, shape, dtype):
        dims = _as_shape(shape)
        return max(1, min(self.num_shards_, dims[0])) if dims else 1

    def get_config(self):
        return {"num_shards": self.num_shards_}


class MinSizePartitioner(Partitioner):
    """Makes shards of at least `min_shard_bytes`, at most `max_shards` of them.

    Args:
        min_shard_bytes: positive int, the smallest shard in bytes.
        max_shards: positive int, the largest number of shards.
        bytes_per_string: positive int, bytes counted per string element.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16):
        self.min_shard_bytes = positive_int("min_shard_bytes", min_shard_bytes)
        self.max_shards = positive_int("max_shards", max_shards)
        self.bytes_per_string = positive_int("bytes_per_string", bytes_per_string)

    def num_shards(self, shape, dtype):
        dims = _as_shape(shape)
        if not dims:
            return 1
        total = math.prod(dims) * element_bytes(dtype, self.bytes_per_string)
        wanted = math.ceil(total / self.min_shard_bytes)
        return max(1, min(dims[0], self.max_shards, wanted))


class MaxSizePartitioner(Partitioner):
    """Makes shards of at most `max_shard_bytes` (whole rows), capped at `max_shards`.

    A single row larger than `max_shard_bytes` still makes a shard of its own.

    Args:
        max_shard_bytes: positive int, the largest shard in bytes.
        max_shards: positive int or `None`, the largest number of shards.
        bytes_per_string: positive int, bytes counted per string element.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16):
        self.max_shard_bytes = positive_int("max_shard_bytes", max_shard_bytes)
        self.max_shards = positive_int("max_shards", max_shards, allow_none=True)
        self.bytes_per_string = positive_int("bytes_per_string", bytes_per_string)

    def num_shards(self, shape, dtype):
        dims = _as_shape(shape)
        if not dims or dims[0] == 0:
            return 1
        row_bytes = math.prod(dims[1:]) * element_bytes(dtype, self.bytes_per_string)
        rows_per_shard = max(1, self.max_shard_bytes // max(row_bytes, 1))
        shards = math.ceil(dims[0] / rows_per_shard)
        if self.max_shards is not None:
            shards = min(shards, self.max_shards)
        return max(1, shards)
