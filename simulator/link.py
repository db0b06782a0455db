"""A link direction shared fairly (concurrent transfers split its rate), and the two
directions of a full-duplex link, which slow each other while both carry bytes."""

from __future__ import annotations

import math

import simpy

__all__ = ["Link", "duplex", "link"]

# Bytes left below which a transfer counts as done (float rounding of rate x time).
_EPSILON = 1e-6


class Link:
    """One direction of a link whose concurrent transfers share its rate equally.

    `n` transfers in flight each move at `bandwidth / n` bytes per second, as
    TCP flows through one bottleneck queue do on average; a transfer that
    starts or ends changes the others' rate at once. Its process is `link`.

    The two directions of a full-duplex link are a pair of `Link`s made by
    `duplex`: each is the other's `peer`. While both carry bytes, each moves at
    `duplex_efficiency` of its rate (on the network bench's rate-limited links
    each direction's queue holds the other direction's acknowledgements behind
    its data, so a link loaded both ways carries less than its rate each way).

    Attributes:
        bandwidth: bytes per second of the direction.
        duplex_efficiency: the share of `bandwidth` left while `peer` carries bytes.
        peer: the link's other direction, or `None`.
        flows: the transfers in flight, their done event to the bytes they have left.
        arrivals: the transfers started since the link last advanced `flows` (they
            join `flows` from that instant, and move nothing before it).
        busy: seconds during which at least one transfer was in flight.
        process: the `link` process.
    """

    def __init__(self, env: simpy.Environment, bandwidth: float,
                 duplex_efficiency: float = 1.0):
        self.env = env
        self.bandwidth = bandwidth
        self.duplex_efficiency = duplex_efficiency
        self.peer: Link | None = None
        self.flows: dict[simpy.Event, float] = {}
        self.arrivals: dict[simpy.Event, float] = {}
        self.busy = 0.0
        self.changed = env.event()
        self.process = env.process(link(env, self))

    @property
    def carrying(self) -> bool:
        """Whether a transfer is in flight or has just started."""
        return bool(self.flows or self.arrivals)

    def rate(self) -> float:
        """Bytes per second each transfer in flight moves at now."""
        both_ways = self.peer is not None and self.peer.carrying
        return (self.bandwidth * (self.duplex_efficiency if both_ways else 1.0)
                / len(self.flows))

    def transfer(self, nbytes: float) -> simpy.Event:
        """Starts moving `nbytes`; returns the event that fires once they are across."""
        done = self.env.event()
        if nbytes <= 0 or math.isinf(self.bandwidth):
            done.succeed()
            return done
        self.arrivals[done] = float(nbytes)
        _wake(self)
        return done


def duplex(env: simpy.Environment, bandwidth: float,
           duplex_efficiency: float = 1.0) -> tuple[Link, Link]:
    """The two directions of one full-duplex link, each the other's `peer`."""
    one = Link(env, bandwidth, duplex_efficiency)
    other = Link(env, bandwidth, duplex_efficiency)
    one.peer, other.peer = other, one
    return one, other


def _wake(shared: Link) -> None:
    if not shared.changed.triggered:
        shared.changed.succeed()


def link(env: simpy.Environment, shared: Link):
    """The link's process: moves the bytes of every transfer in flight at its share of
    the rate, and fires a transfer's event when its last byte is across.

    It wakes when the next transfer would end at the current shares, or when the
    shares change: a transfer starts here, or the peer starts or ends one.
    """
    flows = shared.flows
    while True:
        if shared.arrivals:
            flows.update(shared.arrivals)
            shared.arrivals.clear()
            if shared.peer is not None:
                _wake(shared.peer)
        if not flows:
            yield shared.changed
            shared.changed = env.event()
            continue
        start = env.now
        rate = shared.rate()
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
                if shared.peer is not None:
                    _wake(shared.peer)
            else:
                flows[done] = left - moved
        if shared.changed.triggered:
            shared.changed = env.event()
