"""`kerasps.partitioners`: the public names of `kerasps.policy.partitioners`, where they live."""

from kerasps.policy.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    element_bytes,
    shard_offsets,
    shard_sizes,
)

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner",
           "shard_sizes", "shard_offsets", "element_bytes"]
