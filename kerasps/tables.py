"""`kerasps.tables`: the public names of `kerasps.policy.tables`, where they live."""

from kerasps.policy.tables import (
    STAT_COLUMNS,
    STATE_COLUMNS,
    Eviction,
    TableRecord,
    TableSpec,
    default_num_partitions,
    mix64,
    partition_of,
    shards_of,
    sketch_hashes,
)

__all__ = ["Eviction", "TableRecord", "TableSpec", "mix64", "partition_of", "sketch_hashes",
           "default_num_partitions", "shards_of", "STATE_COLUMNS", "STAT_COLUMNS"]
