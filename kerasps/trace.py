"""`kerasps.trace`: the public names of `kerasps.policy.trace`, where they live."""

from kerasps.policy.trace import (
    StepEvent,
    read_trace,
    with_staleness,
    write_trace,
)

__all__ = ["StepEvent", "write_trace", "read_trace", "with_staleness"]
