"""`kerasps.ray`: the public names of `kerasps.runtime.ray_cluster`, where they live."""

from kerasps.runtime.ray_cluster import (
    DEFAULT_RESOURCES,
    MIN_RAY_VERSION,
    PLACEMENTS,
    RayClusterResolver,
    RayTask,
    cluster,
    from_environment,
)

__all__ = ["cluster", "from_environment", "RayClusterResolver", "RayTask", "PLACEMENTS",
           "MIN_RAY_VERSION", "DEFAULT_RESOURCES"]
