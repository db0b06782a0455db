"""`kerasps.ray`: the public names of `kerasps.runtime.ray_cluster`, where they live."""

from kerasps.runtime.ray_cluster import (
    DEFAULT_RESOURCES,
    MIN_RAY_VERSION,
    PLACEMENTS,
    RayClusterResolver,
    RayTask,
    cluster,
)

__all__ = ["cluster", "RayClusterResolver", "RayTask", "PLACEMENTS", "MIN_RAY_VERSION",
           "DEFAULT_RESOURCES"]
