"""A link direction shared fairly: concurrent transfers split its rate (processor sharing)."""

from __future__ import annotations

import math

import simpy

__all__ = ["Link", "link"]

# Bytes left below which a transfer counts as done (float rounding of rate x time).
_EPSILON = 1e-6


class Link:
    """One direction of a link whose concurrent transfers share its rate equally.

    `n` transfers in flight each move at `bandwidth / n` bytes per second, as
    TCP flows through one bottleneck queue do on average; a transfer that
    starts or ends changes the others' rate at once. Its process is `link`.

    Attributes:
        bandwidth: bytes per second of the direction.
        flows: the transfers in flight, their done event to the bytes they have left.
        arrivals: the transfers started since the link last advanced `flows` (they
            join `flows` from that instant, and move nothing before it).
        busy: seconds during which at least one transfer was in flight.
        process: the `link` process.
    """

    def __init__(self, env: simpy.Environment, bandwidth: float):
        self.env = env
        self.bandwidth = bandwidth
        self.flows: dict[simpy.Event, float] = {}
        self.arrivals: dict[simpy.Event, float] = {}
        self.busy = 0.0
        self.changed = env.event()
        self.process = env.process(link(env, self))

    def transfer(self, nbytes: float) -> simpy.Event:
        """Starts moving `nbytes`; returns the event that fires once they are across."""
        done = self.env.event()
        if nbytes <= 0 or math.isinf(self.bandwidth):
            done.succeed()
            return done
        self.arrivals[done] = float(nbytes)
        if not self.changed.triggered:
            self.changed.succeed()
        return done


def link(env: simpy.Environment, shared: Link):
    """The link's process: moves the bytes of every transfer in flight at its share of
    the rate, and fires a transfer's event when its last byte is across.

    It wakes when the next transfer would end at the current shares, or when a new
    one starts (and the shares change).
    """
    flows = shared.flows
    while True:
        flows.update(shared.arrivals)
        shared.arrivals.clear()
        if not flows:
            yield shared.changed
            shared.changed = env.event()
            continue
        start = env.now
        rate = shared.bandwidth / len(flows)
        first = min(flows.values())
        next_end = env.timeout(first / rate)
        yield next_end | shared.changed
        elapsed = env.now - start
        shared.busy += elapsed
        moved = elapsed * rate
        for done, left in list(flows.items()):
            if left - moved <= _EPSILON or (next_end.processed and left == first):
                del flows[done]
                done.succeed()
            else:
                flows[done] = left - moved
        if shared.changed.triggered:
            shared.changed = env.event()
