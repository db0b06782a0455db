"""`kerasps.partitioners`: the same shard counts as TensorFlow's partitioners, strict arguments."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from kerasps.policy import partitioners

TF_PARTITIONERS = tf.distribute.experimental.partitioners

SHAPES = [
    (1,),
    (3,),
    (10,),
    (7, 3),
    (2, 1000),  # few rows, wide rows: more shards wanted than rows exist
    (1000, 64),
    (3, 5, 7),
    (1, 1_000_000),
    (1 << 20, 16),  # 64 MiB of float32
    (1 << 30, 128),  # 512 GiB of float32: arithmetic only, nothing is allocated
]
DTYPES = [tf.float32, tf.float16, tf.bfloat16, tf.float64, tf.int8, tf.int64, tf.bool,
          tf.complex128, tf.string]

# (class name, constructor arguments), built identically from kerasps and from TensorFlow.
CONFIGS = [
    ("FixedShardsPartitioner", {"num_shards": 1}),
    ("FixedShardsPartitioner", {"num_shards": 4}),
    ("FixedShardsPartitioner", {"num_shards": 1000}),
    ("MinSizePartitioner", {}),
    ("MinSizePartitioner", {"min_shard_bytes": 1, "max_shards": 3}),
    ("MinSizePartitioner", {"min_shard_bytes": 64, "max_shards": 100}),
    ("MinSizePartitioner", {"min_shard_bytes": 1 << 10, "max_shards": 8, "bytes_per_string": 4}),
    ("MinSizePartitioner", {"min_shard_bytes": 256 << 10, "max_shards": 1 << 20}),
    ("MaxSizePartitioner", {"max_shard_bytes": 1}),
    ("MaxSizePartitioner", {"max_shard_bytes": 100}),
    ("MaxSizePartitioner", {"max_shard_bytes": 100, "max_shards": 3}),
    ("MaxSizePartitioner", {"max_shard_bytes": (64 << 20) - 1, "bytes_per_string": 3}),
]


def _config_id(config):
    name, kwargs = config
    return name + "(" + ",".join(f"{k}={v}" for k, v in kwargs.items()) + ")"


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_partitioner_gives_the_same_partitions_as_tensorflow(config):
    name, kwargs = config
    ours = getattr(partitioners, name)(**kwargs)
    theirs = getattr(TF_PARTITIONERS, name)(**kwargs)
    mismatches = []
    for shape, dtype in itertools.product(SHAPES, DTYPES):
        expected = list(theirs(tf.TensorShape(shape), dtype))
        got_tf_types = ours(tf.TensorShape(shape), dtype)
        got_plain_types = ours(shape, dtype.name)  # what `simulator` passes: no TensorFlow
        if got_tf_types != expected or got_plain_types != expected:
            mismatches.append((shape, dtype.name, expected, got_tf_types, got_plain_types))
    assert not mismatches, mismatches


def test_partitions_are_a_list_of_ints_splitting_only_axis_0():
    result = partitioners.FixedShardsPartitioner(3)(tf.TensorShape([9, 4, 2]), tf.float32)
    assert result == [3, 1, 1]
    assert all(type(p) is int for p in result)


def test_min_size_partitioner_leaves_variables_smaller_than_min_shard_bytes_whole():
    partitioner = partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=4)
    assert partitioner((100, 16), "float32") == [1, 1]  # 6.4 kB
    assert partitioner((4096, 16), "float32") == [1, 1]  # exactly 256 KiB: one shard suffices
    assert partitioner((4097, 16), "float32") == [2, 1]
    assert partitioner((100_000, 64), "float32") == [4, 1]  # capped by max_shards


def test_string_elements_count_bytes_per_string():
    small = partitioners.MinSizePartitioner(min_shard_bytes=100, max_shards=50,
                                            bytes_per_string=10)
    large = partitioners.MinSizePartitioner(min_shard_bytes=100, max_shards=50,
                                            bytes_per_string=20)
    assert small((50,), tf.string) == [5]
    assert large((50,), tf.string) == [10]
    assert small((50,), "string") == [5]


def test_element_bytes_of_strings_defaults_to_16_for_every_spelling():
    assert partitioners.element_bytes(tf.string) == 16
    assert partitioners.element_bytes("string") == 16
    assert partitioners.element_bytes(tf.string, bytes_per_string=3) == 3


@pytest.mark.parametrize("dtype", [np.str_, np.bytes_, np.dtype(object)],
                         ids=["str_", "bytes_", "object"])
def test_element_bytes_of_numpy_string_dtypes_is_bytes_per_string(dtype):
    assert tf.as_dtype(dtype) == tf.string  # TensorFlow treats them as strings
    assert partitioners.element_bytes(dtype) == 16


@pytest.mark.parametrize("dtype, size", [
    (tf.float32, 4), ("float32", 4), (np.float32, 4), (np.dtype("float64"), 8),
    (tf.bfloat16, 2), ("bfloat16", 2), (tf.bool, 1), (tf.complex128, 16), ("int64", 8),
])
def test_element_bytes_accepts_tf_numpy_and_name_dtypes(dtype, size):
    assert partitioners.element_bytes(dtype) == size


def test_more_shards_than_rows_gives_one_shard_per_row():
    assert partitioners.FixedShardsPartitioner(8)((3, 4), tf.float32) == [3, 1]
    assert partitioners.MinSizePartitioner(min_shard_bytes=1, max_shards=100)(
        (2, 1000), tf.float32) == [2, 1]
    assert partitioners.MaxSizePartitioner(max_shard_bytes=1)((5, 3), tf.float32) == [5, 1]


@pytest.mark.parametrize("shape", [(1000, 64), (999, 7), (10, 1000), (1 << 20, 3)])
@pytest.mark.parametrize("max_shard_bytes", [100, 4096, 1 << 20])
def test_max_size_shards_fit_in_max_shard_bytes_unless_a_row_alone_is_larger(
        shape, max_shard_bytes):
    num_shards = partitioners.MaxSizePartitioner(max_shard_bytes)(shape, "float32")[0]
    row_bytes = math.prod(shape[1:]) * 4
    largest = max(partitioners.shard_sizes(shape[0], num_shards)) * row_bytes
    if row_bytes <= max_shard_bytes:
        assert largest <= max_shard_bytes
        # ... and not needlessly many shards: one fewer would overflow.
        if num_shards > 1:
            assert max(partitioners.shard_sizes(shape[0], num_shards - 1)) * row_bytes > (
                max_shard_bytes)
    else:
        assert num_shards == shape[0]


def test_max_size_partitioner_max_shards_takes_precedence_over_max_shard_bytes():
    assert partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=3)(
        (100, 1), "float32") == [3, 1]


def test_scalar_variable_is_never_partitioned():
    # TensorFlow's partitioners raise on scalars; a scalar has nothing to split.
    for partitioner in (partitioners.FixedShardsPartitioner(4),
                        partitioners.MinSizePartitioner(1, 4),
                        partitioners.MaxSizePartitioner(1)):
        assert partitioner((), tf.float32) == []


def test_variable_with_no_rows_gets_one_shard():
    # TensorFlow returns 0 partitions (Fixed) or divides by zero (MaxSize) here.
    for partitioner in (partitioners.FixedShardsPartitioner(4),
                        partitioners.MinSizePartitioner(1, 4),
                        partitioners.MaxSizePartitioner(1)):
        assert partitioner((0, 4), tf.float32) == [1, 1]


def test_shape_may_hold_tf_dimensions():
    shape = (tf.compat.v1.Dimension(10), tf.compat.v1.Dimension(4))
    assert partitioners.FixedShardsPartitioner(3)(shape, tf.float32) == [3, 1]


# -- shard_sizes / shard_offsets --------------------------------------------------------
@pytest.mark.parametrize("rows, shards, sizes", [
    (10, 3, [4, 3, 3]),
    (9, 3, [3, 3, 3]),
    (11, 3, [4, 4, 3]),
    (7, 1, [7]),
    (5, 5, [1, 1, 1, 1, 1]),
    (1_000_003, 4, [250_001, 250_001, 250_001, 250_000]),
])
def test_shard_sizes_give_the_first_remainder_shards_one_extra_row(rows, shards, sizes):
    assert partitioners.shard_sizes(rows, shards) == sizes
    assert partitioners.shard_offsets(rows, shards) == [0] + list(np.cumsum(sizes)[:-1])


@pytest.mark.parametrize("rows, shards", [(1, 1), (10, 3), (11, 4), (12, 4), (17, 5), (64, 7)])
def test_shard_sizes_agree_with_tensorflow_div_embedding_lookup(rows, shards):
    # `tf.nn.embedding_lookup` over a list of shards assumes TF's "div" split; a
    # table split by `shard_sizes` must look up every row correctly.
    table = np.arange(rows * 3, dtype="float32").reshape(rows, 3)
    offsets = partitioners.shard_offsets(rows, shards)
    sizes = partitioners.shard_sizes(rows, shards)
    parts = [tf.constant(table[o:o + s]) for o, s in zip(offsets, sizes, strict=True)]
    looked_up = tf.nn.embedding_lookup(parts, tf.range(rows)).numpy()
    np.testing.assert_array_equal(looked_up, table)


def test_shard_offsets_cover_every_row_exactly_once():
    for rows, shards in itertools.product([1, 2, 9, 10, 101], [1, 2, 3, 7]):
        if shards > rows:
            continue
        offsets = partitioners.shard_offsets(rows, shards)
        sizes = partitioners.shard_sizes(rows, shards)
        covered = [r for o, s in zip(offsets, sizes, strict=True) for r in range(o, o + s)]
        assert covered == list(range(rows))


# -- arguments ---------------------------------------------------------------------------
BAD_POSITIVE_INTS = [0, -1, True, False, 2.0, 2.5, "4", None]

BAD_ARGUMENTS = [
    (cls, arg, value)
    for cls, arg in [
        (partitioners.FixedShardsPartitioner, "num_shards"),
        (partitioners.MinSizePartitioner, "min_shard_bytes"),
        (partitioners.MinSizePartitioner, "max_shards"),
        (partitioners.MinSizePartitioner, "bytes_per_string"),
        (partitioners.MaxSizePartitioner, "max_shard_bytes"),
        (partitioners.MaxSizePartitioner, "max_shards"),
        (partitioners.MaxSizePartitioner, "bytes_per_string"),
    ]
    for value in BAD_POSITIVE_INTS
    # MaxSizePartitioner(max_shards=None) means "no limit".
    if not (cls is partitioners.MaxSizePartitioner and arg == "max_shards" and value is None)
]


@pytest.mark.parametrize(
    "cls, arg, value", BAD_ARGUMENTS,
    ids=[f"{c.__name__}-{a}={v!r}" for c, a, v in BAD_ARGUMENTS])
def test_bad_constructor_argument_raises_value_error_naming_it(cls, arg, value):
    kwargs = {"max_shard_bytes": 10} if cls is partitioners.MaxSizePartitioner else {}
    kwargs[arg] = value
    with pytest.raises(ValueError) as excinfo:
        cls(**kwargs)
    message = str(excinfo.value)
    assert f"Invalid value for argument `{arg}`" in message
    assert f"Received: {arg}={value!r}" in message


def test_max_size_partitioner_without_max_shards_has_no_limit():
    partitioner = partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=None)
    assert partitioner((10_000, 1), "float32") == [10_000, 1]


def test_numpy_integers_are_accepted_as_arguments():
    partitioner = partitioners.MinSizePartitioner(min_shard_bytes=np.int64(4),
                                                  max_shards=np.int32(3))
    assert partitioner.get_config() == {"min_shard_bytes": 4, "max_shards": 3,
                                        "bytes_per_string": 16}
    assert partitioner((10,), "float32") == [3]


@pytest.mark.parametrize("shape", [None, 5, tf.TensorShape([None, 4]), (10, None)])
def test_shape_that_is_not_fully_defined_raises_value_error_naming_shape(shape):
    with pytest.raises(ValueError, match=r"argument `shape`.*Received: shape="):
        partitioners.FixedShardsPartitioner(2)(shape, tf.float32)


def test_shape_of_unknown_rank_raises_value_error():
    # TensorFlow's own message ("Cannot iterate over a shape with unknown rank").
    with pytest.raises(ValueError, match="unknown rank"):
        partitioners.FixedShardsPartitioner(2)(tf.TensorShape(None), tf.float32)


def test_unknown_dtype_raises_value_error_naming_dtype():
    with pytest.raises(ValueError, match=r"argument `dtype`.*Received: dtype='float33'"):
        partitioners.MinSizePartitioner(1, 2)((10, 4), "float33")


def test_partitioning_another_axis_raises_value_error_naming_axis():
    with pytest.raises(ValueError, match=r"argument `axis`.*Received: axis=1"):
        partitioners.FixedShardsPartitioner(2)((10, 4), tf.float32, axis=1)


@pytest.mark.parametrize("partitioner", [
    partitioners.FixedShardsPartitioner(3),
    partitioners.MinSizePartitioner(min_shard_bytes=1 << 10, max_shards=4, bytes_per_string=8),
    partitioners.MaxSizePartitioner(max_shard_bytes=1 << 20, max_shards=None),
], ids=lambda p: type(p).__name__)
def test_get_config_rebuilds_an_equivalent_partitioner(partitioner):
    config = partitioner.get_config()
    clone = type(partitioner)(**config)
    assert clone.get_config() == config
    assert clone((1 << 16, 32), "float32") == partitioner((1 << 16, 32), "float32")
    assert repr(clone) == repr(partitioner)
    assert repr(partitioner).startswith(type(partitioner).__name__ + "(")
