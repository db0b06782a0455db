"""`kerasps.membership`: the public names of `kerasps.policy.membership`, where they live."""

from kerasps.policy.membership import (
    Change,
    Membership,
    PoolSpec,
    TooFewWorkersError,
    WorkerState,
    parse_workers,
)

__all__ = ["PoolSpec", "WorkerState", "Change", "Membership", "TooFewWorkersError", "parse_workers"]
