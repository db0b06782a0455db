"""A link direction shared fairly (concurrent transfers split its rate), and the two
directions of a full-duplex link, which slow each other while both carry bytes."""

from __future__ import annotations

import math

import numpy as np
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
    The share may be a `Distribution` of them instead: each transfer then keeps
    its own, drawn when it starts. TCP flows through such a link vary from one
    to the next (`benchmarks/network.py link --both-ways` measured 0.55-0.94 of
    the rate at 100 Mbit/s), and a step whose bytes cross two links waits for
    the slower: a constant share misses that.

    Attributes:
        bandwidth: bytes per second of the direction.
        duplex_efficiency: the share of `bandwidth` left while `peer` carries bytes,
            a number or a `Distribution` of numbers in (0, 1].
        peer: the link's other direction, or `None`.
        flows: the transfers in flight, their done event to the bytes they have left.
        shares: each transfer's share of the rate while `peer` carries bytes.
        arrivals: the transfers started since the link last advanced `flows` (they
            join `flows` from that instant, and move nothing before it).
        busy: seconds during which at least one transfer was in flight.
        process: the `link` process.
    """

    def __init__(self, env: simpy.Environment, bandwidth: float,
                 duplex_efficiency=1.0, rng: np.random.Generator | None = None):
        self.env = env
        self.bandwidth = bandwidth
        self.duplex_efficiency = duplex_efficiency
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.peer: Link | None = None
        self.flows: dict[simpy.Event, float] = {}
        self.shares: dict[simpy.Event, float] = {}
        self.arrivals: dict[simpy.Event, float] = {}
        self.busy = 0.0
        self.changed = env.event()
        self.process = env.process(link(env, self))

    @property
    def carrying(self) -> bool:
        """Whether a transfer is in flight or has just started."""
        return bool(self.flows or self.arrivals)

    def rates(self) -> dict[simpy.Event, float]:
        """Bytes per second each transfer in flight moves at now, by its done event."""
        each = self.bandwidth / len(self.flows)
        if self.peer is None or not self.peer.carrying:
            return dict.fromkeys(self.flows, each)
        return {done: each * self.shares[done] for done in self.flows}

    def transfer(self, nbytes: float) -> simpy.Event:
        """Starts moving `nbytes`; returns the event that fires once they are across."""
        done = self.env.event()
        if nbytes <= 0 or math.isinf(self.bandwidth):
            done.succeed()
            return done
        self.arrivals[done] = float(nbytes)
        share = self.duplex_efficiency
        self.shares[done] = (float(share.sample(self.rng, 1)[0])
                             if hasattr(share, "sample") else float(share))
        _wake(self)
        return done


def duplex(env: simpy.Environment, bandwidth: float, duplex_efficiency=1.0,
           rng: np.random.Generator | None = None) -> tuple[Link, Link]:
    """The two directions of one full-duplex link, each the other's `peer` (drawing
    their transfers' shares, if `duplex_efficiency` is a distribution, from `rng`)."""
    one = Link(env, bandwidth, duplex_efficiency, rng)
    other = Link(env, bandwidth, duplex_efficiency, rng)
    one.peer, other.peer = other, one
    return one, other


def _wake(shared: Link) -> None:
    if not shared.changed.triggered:
        shared.changed.succeed()


def link(env: simpy.Environment, shared: Link):
    """The link's process: moves the bytes of every transfer in flight at its rate
    (`Link.rates`), and fires a transfer's event when its last byte is across.

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
        rates = shared.rates()
        first = min(flows, key=lambda done: flows[done] / rates[done])
        next_end = env.timeout(flows[first] / rates[first])
        yield next_end | shared.changed
        elapsed = env.now - start
        shared.busy += elapsed
        for done, left in list(flows.items()):
            moved = elapsed * rates[done]
            if left - moved <= _EPSILON or (next_end.processed and done is first):
                del flows[done]
                del shared.shares[done]
                done.succeed()
                if shared.peer is not None:
                    _wake(shared.peer)
            else:
                flows[done] = left - moved
        if shared.changed.triggered:
            shared.changed = env.event()
