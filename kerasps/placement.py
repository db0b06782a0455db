"""`kerasps.placement`: the public names of `kerasps.policy.placement`, where they live."""

from kerasps.policy.placement import (
    CallablePlacement,
    Greedy,
    PlacementReport,
    Placer,
    RoundRobin,
    ShardRecord,
    get_placer,
    plan,
    shard_count,
)

__all__ = ["Placer", "RoundRobin", "Greedy", "CallablePlacement", "ShardRecord", "PlacementReport",
           "get_placer", "plan", "shard_count"]
