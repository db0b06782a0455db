"""A ps task's link: fair sharing (`[network] sharing = "fair"`) and the loss of a duplex
link loaded both ways (`duplex_efficiency`): closed forms."""

import math

import pytest
import simpy

import simulator
from simulator import link as link_lib
from simulator.link import Link

from .builders import make

ONE_MB = {"variables": [{"name": "w", "shape": [1000, 250]}]}  # 1e6 bytes on one ps task


def _ends(transfers, bandwidth=1e6):
    """When each `(start, nbytes)` transfer over one `Link` of `bandwidth` ends."""
    env = simpy.Environment()
    shared = Link(env, bandwidth)
    ends = [None] * len(transfers)

    def sender(i, start, nbytes):
        yield env.timeout(start)
        yield shared.transfer(nbytes)
        ends[i] = env.now

    for i, (start, nbytes) in enumerate(transfers):
        env.process(sender(i, start, nbytes))
    env.run(until=1000)
    return ends, shared


def test_one_transfer_takes_its_bytes_over_the_rate():
    ends, shared = _ends([(0.0, 2e6)])
    assert ends == [pytest.approx(2.0)]
    assert shared.busy == pytest.approx(2.0)


def test_two_equal_transfers_share_the_rate_and_end_together_at_twice_the_time():
    ends, shared = _ends([(0.0, 1e6), (0.0, 1e6)])
    assert ends == [pytest.approx(2.0), pytest.approx(2.0)]
    assert shared.busy == pytest.approx(2.0)


def test_a_transfer_joining_later_slows_the_first_then_runs_alone():
    # 0-1 s: A alone (1e6 of its 2e6 bytes); 1-3 s: both at half the rate (A's last 1e6
    # bytes, B's first 1e6); A ends at 3 s; B's last 0.5e6 bytes alone: 3.5 s.
    ends, shared = _ends([(0.0, 2e6), (1.0, 1.5e6)])
    assert ends == [pytest.approx(3.0), pytest.approx(3.5)]
    assert shared.busy == pytest.approx(3.5)


def test_three_unequal_transfers_end_in_order_of_size():
    # Shares of 1/3 until the smallest (1e6) ends at 3 s, then 1/2 until the middle one's
    # last 1e6 bytes are across at 5 s, then the largest's last 1e6 alone: 6 s.
    ends, _ = _ends([(0.0, 3e6), (0.0, 1e6), (0.0, 2e6)])
    assert ends == [pytest.approx(6.0), pytest.approx(3.0), pytest.approx(5.0)]


def test_an_idle_link_is_not_busy_and_empty_transfers_end_at_once():
    ends, shared = _ends([(0.0, 1e6), (5.0, 1e6), (7.0, 0)])
    assert ends == [pytest.approx(1.0), pytest.approx(6.0), pytest.approx(7.0)]
    assert shared.busy == pytest.approx(2.0)


def _steps_per_second(workers, duplex, sharing, step_time=1e-6, count=1):
    scenario = make(workers, {"distribution": "constant", "value": step_time}, model=ONE_MB,
                    ps={"contention": True, "count": count},
                    network={"bandwidth": 1e6, "duplex": duplex, "sharing": sharing},
                    training={"steps": 200})
    return simulator.run(scenario)


def test_one_worker_alone_reads_then_sends_at_the_full_rate():
    # Nothing shares the link: 1 s of read and 1 s of gradient a step, whatever the model.
    for duplex in ("half", "full"):
        for sharing in ("queue", "fair"):
            result = _steps_per_second(1, duplex, sharing)
            assert result.steps_per_second == pytest.approx(0.5, rel=0.01), (duplex, sharing)


def test_fair_full_duplex_two_workers_in_step_share_each_direction():
    # Two workers starting together read together (2e6 bytes at 1e6 B/s: 2 s), then send
    # together (2 s): 2 steps each 4 s, 0.5 steps/s; the queue model instead pipelines one
    # worker's read with the other's gradient (1 step/s).
    fair = _steps_per_second(2, "full", "fair")
    assert fair.steps_per_second == pytest.approx(0.5, rel=0.01)
    # Each direction carries bytes half the time (reads, then gradients).
    assert fair.ps[0]["utilization"] == pytest.approx(0.5, abs=0.01)
    assert _steps_per_second(2, "full", "queue").steps_per_second == pytest.approx(
        1.0, rel=0.02)


def _staggered(half_duplex):
    """Two steps of 1e6 bytes read then 1e6 bytes of gradient, the second 1 s after the
    first, over the links of one ps task: one `Link` each way, or one for both."""
    env = simpy.Environment()
    inlink = Link(env, 1e6)
    outlink = inlink if half_duplex else Link(env, 1e6)
    ends = []

    def step(delay):
        yield env.timeout(delay)
        yield outlink.transfer(1e6)
        yield inlink.transfer(1e6)
        ends.append(env.now)

    env.process(step(0.0))
    env.process(step(1.0))
    env.run(until=10)
    return ends


def test_fair_full_duplex_opposite_directions_do_not_slow_each_other():
    # A: read 0-1 s, gradient 1-2 s while B reads 1-2 s out of the ps, each direction
    # carrying one transfer at the full rate; B's gradient 2-3 s.
    assert _staggered(half_duplex=False) == [pytest.approx(2.0), pytest.approx(3.0)]


def test_fair_half_duplex_reads_and_gradients_share_one_link():
    # A: read 0-1 s; A's gradient and B's read share the link 1-3 s; B's gradient 3-4 s.
    assert _staggered(half_duplex=True) == [pytest.approx(3.0), pytest.approx(4.0)]


def test_the_cluster_gives_each_ps_task_one_link_each_way_or_one_for_both():
    def links(duplex):
        cluster = simulator.simulation.Cluster(make(
            2, model=ONE_MB, ps={"contention": True, "count": 2},
            network={"bandwidth": 1e6, "duplex": duplex, "sharing": "fair"}))
        return [(s.inlink, s.outlink) for s in cluster.servers]

    full, half = links("full"), links("half")
    assert all(isinstance(x, Link) and x is not y for x, y in full)
    assert all(isinstance(x, Link) and x is y for x, y in half)
    assert len({id(x) for pair in full for x in pair}) == 4
    queue = simulator.simulation.Cluster(make(2, model=ONE_MB, ps={"contention": True}))
    assert queue.servers[0].inlink is None


def test_fair_sharing_adds_the_ps_service_time_after_the_gradient():
    scenario = make(1, {"distribution": "constant", "value": 1e-6}, model=ONE_MB,
                    ps={"contention": True, "service_rate": 2e6},
                    network={"bandwidth": 1e6, "duplex": "full", "sharing": "fair"},
                    training={"steps": 50})
    # 1 s read, 1 s gradient, 0.5 s apply: 2.5 s a step.
    assert simulator.run(scenario).steps_per_second == pytest.approx(0.4, rel=0.01)


def test_sharing_defaults_to_queue_and_is_validated():
    assert make(1).network.sharing == "queue"
    assert make(1, network={"sharing": "fair"}).network.sharing == "fair"
    with pytest.raises(simulator.ScenarioError) as error:
        make(1, network={"sharing": "round_robin"})
    assert str(error.value) == (
        "Invalid value for `network.sharing` in test.toml: expected one of ['fair', "
        "'queue']. Received: network.sharing='round_robin'")
    with pytest.raises(simulator.ScenarioError, match="network.sharing=3"):
        make(1, network={"sharing": 3})


def _both_ways(out_transfers, in_transfers, duplex_efficiency):
    """When each `(start, nbytes)` transfer ends on the two directions of one link of 1e6
    B/s whose directions keep `duplex_efficiency` of it while both carry bytes."""
    env = simpy.Environment()
    out, into = link_lib.duplex(env, 1e6, duplex_efficiency)
    ends = {}

    def sender(key, direction, start, nbytes):
        yield env.timeout(start)
        yield direction.transfer(nbytes)
        ends[key] = env.now

    for name, direction, transfers in (("out", out, out_transfers), ("in", into, in_transfers)):
        for i, (start, nbytes) in enumerate(transfers):
            env.process(sender((name, i), direction, start, nbytes))
    env.run(until=1000)
    return ends, out, into


def test_the_directions_of_a_duplex_link_slow_each_other_only_while_both_carry_bytes():
    # Out: 2e6 bytes from 0 s; in: 0.5e6 from 0.5 s; each keeps half its rate while both
    # carry bytes. 0-0.5 s: out alone (0.5e6); 0.5-1.5 s: both at 0.5e6 B/s (the inbound
    # transfer ends, out has moved 1e6); 1.5-2.5 s: out alone again for its last 1e6.
    ends, out, into = _both_ways([(0.0, 2e6)], [(0.5, 0.5e6)], duplex_efficiency=0.5)
    assert ends == {("out", 0): pytest.approx(2.5), ("in", 0): pytest.approx(1.5)}
    assert (out.busy, into.busy) == (pytest.approx(2.5), pytest.approx(1.0))
    # With no loss the directions are independent (the model before `duplex_efficiency`).
    ends, _, _ = _both_ways([(0.0, 2e6)], [(0.5, 0.5e6)], duplex_efficiency=1.0)
    assert ends == {("out", 0): pytest.approx(2.0), ("in", 0): pytest.approx(1.0)}


def test_the_loss_applies_to_the_direction_as_a_whole_not_to_each_transfer():
    # Two transfers out (1e6 bytes each) share the direction's 0.5e6 B/s while one of 1e6
    # comes in, all from 0 s: the inbound one ends at 2 s; by then the two outbound ones
    # have moved 0.5e6 each, and their last 1e6 together take 1 s at the full rate: 3 s.
    ends, _, _ = _both_ways([(0.0, 1e6), (0.0, 1e6)], [(0.0, 1e6)], duplex_efficiency=0.5)
    assert ends == {("out", 0): pytest.approx(3.0), ("out", 1): pytest.approx(3.0),
                    ("in", 0): pytest.approx(2.0)}


def test_two_workers_pipelined_on_a_duplex_link_pay_its_loss_one_worker_does_not():
    def run(workers, sharing, duplex_efficiency):
        return simulator.run(make(
            workers, {"distribution": "constant", "value": 1e-6}, model=ONE_MB,
            ps={"contention": True},
            network={"bandwidth": 1e6, "duplex": "full", "sharing": sharing,
                     "duplex_efficiency": duplex_efficiency},
            training={"steps": 200})).steps_per_second

    # Queue: one worker's read overlaps the other's gradient, each at half the rate: 2 s
    # each, 4 s a step per worker, 0.5 steps/s (1.0 with no loss, as above).
    assert run(2, "queue", 0.5) == pytest.approx(0.5, rel=0.02)
    assert run(2, "queue", 0.8) == pytest.approx(0.8, rel=0.02)
    # One worker reads, then sends: one direction at a time, nothing lost (0.5 steps/s).
    assert run(1, "queue", 0.5) == pytest.approx(0.5, rel=0.01)
    # Fair sharing keeps two workers that start together in phase: both read, then both
    # send, never both directions at once, so the loss does not apply.
    assert run(2, "fair", 0.5) == pytest.approx(0.5, rel=0.01)


def test_duplex_efficiency_defaults_to_no_loss_and_is_validated():
    assert make(1).network.duplex_efficiency == 1.0
    full = {"duplex": "full"}
    assert make(1, network={**full, "duplex_efficiency": 0.7}).network.duplex_efficiency == 0.7
    with pytest.raises(simulator.ScenarioError, match=r"at most 1.0\. Received: "
                       r"network.duplex_efficiency=1.5"):
        make(1, network={**full, "duplex_efficiency": 1.5})
    with pytest.raises(simulator.ScenarioError, match=r"positive\. Received: "
                       r"network.duplex_efficiency=0"):
        make(1, network={**full, "duplex_efficiency": 0})
    with pytest.raises(simulator.ScenarioError) as error:
        make(1, network={"duplex_efficiency": 0.7})
    assert str(error.value) == (
        "Invalid value for `network.duplex_efficiency` in test.toml: a half-duplex link "
        'never carries both directions at once; set `network.duplex = "full"`. Received: '
        "network.duplex_efficiency=0.7")


class _Drawn:
    """A stand-in for `numpy.random.Generator` whose `choice` gives `values` in order."""

    def __init__(self, *values):
        self.values = list(values)

    def choice(self, samples, size):
        assert size == 1 and self.values[0] in samples
        return [self.values.pop(0)]


def test_each_transfer_keeps_the_share_it_drew_while_the_link_carries_both_ways():
    # Shares drawn from {0.5, 1}: the two outbound transfers (1e6 bytes each, from 0 s)
    # draw 0.5 and 1, the inbound one (1e7 bytes) 1. While both directions carry bytes,
    # out A moves at 1e6 x 0.5 / 2, out B at 1e6 x 1 / 2: B ends at 2 s, when A has moved
    # 0.5e6; alone, A moves at 0.5e6 B/s: 3 s. In: 3e6 by 3 s, then alone at 1e6 B/s.
    env = simpy.Environment()
    shares = simulator.distributions.Empirical((0.5, 1.0))
    out, into = link_lib.duplex(env, 1e6, shares, _Drawn(0.5, 1.0, 1.0))
    ends = {}

    def sender(key, direction, nbytes):
        yield direction.transfer(nbytes)
        ends[key] = env.now

    for key, direction, nbytes in (("A", out, 1e6), ("B", out, 1e6), ("in", into, 1e7)):
        env.process(sender(key, direction, nbytes))
    env.run(until=1000)
    assert ends == {"A": pytest.approx(3.0), "B": pytest.approx(2.0),
                    "in": pytest.approx(10.0)}
    assert out.shares == into.shares == {}


def _pipelined(num_ps, duplex_efficiency):
    """Steps/s of 2 workers on 2e6 bytes held by `num_ps` ps tasks, full-duplex links."""
    model = {"variables": [{"name": f"w{i}", "shape": [1000, 250]} for i in range(2)],
             "placement": "round_robin"}
    return simulator.run(make(
        2, {"distribution": "constant", "value": 1e-6}, model=model,
        ps={"contention": True, "count": num_ps},
        network={"bandwidth": 1e6, "duplex": "full", "duplex_efficiency": duplex_efficiency},
        training={"steps": 400})).steps_per_second


def test_a_step_across_two_links_waits_for_the_slower_share():
    # The same bytes on two ps tasks instead of one: twice the steps with a constant
    # share; with shares that vary per transfer, a step waits for the slower of its two
    # links, and the second ps task gains less. This is why the network bench's greedy
    # runs at 100 Mbit/s reached only 1.65-1.70x round_robin's, not 2x.
    constant = _pipelined(2, 0.75) / _pipelined(1, 0.75)
    shares = {"distribution": "empirical", "samples": [0.5, 1.0]}
    varying = _pipelined(2, shares) / _pipelined(1, shares)
    assert constant == pytest.approx(2.0, rel=0.02)
    assert varying < 0.95 * constant


def test_duplex_efficiency_may_be_a_distribution_of_shares():
    full = {"duplex": "full"}
    shares = {"distribution": "empirical", "samples": [0.6, 0.9]}
    scenario = make(1, network={**full, "duplex_efficiency": shares})
    assert scenario.network.duplex_efficiency == simulator.distributions.Empirical((0.6, 0.9))
    assert 'duplex_efficiency = { distribution = "empirical"' in scenario.to_toml()
    constant = {"distribution": "constant", "value": 0.7}
    assert make(1, network={**full, "duplex_efficiency": constant}).network.duplex_efficiency \
        == simulator.distributions.Constant(0.7)
    for bad in ({"distribution": "empirical", "samples": [0.6, 1.5]},
                {"distribution": "constant", "value": 0},
                {"distribution": "exponential", "rate": 2.0}):
        with pytest.raises(simulator.ScenarioError) as error:
            make(1, network={**full, "duplex_efficiency": bad})
        assert str(error.value).startswith(
            "Invalid value for `network.duplex_efficiency` in test.toml: expected a number "
            "in (0, 1], or a constant or empirical distribution of such numbers. Received: "
            "network.duplex_efficiency={"), str(error.value)
    with pytest.raises(simulator.ScenarioError, match="half-duplex"):
        make(1, network={"duplex_efficiency": shares})


# -- a worker's own link (`[network] worker_bandwidth`) --------------------------------------
# 1e6 bytes on each ps task, greedy; round_robin puts both kernels on ps task 0, as the
# network bench's unbalanced model does.
TWO_PS = {"variables": [{"name": f"{layer}/{part}", "shape": shape}
                        for layer in ("a", "b")
                        for part, shape in (("kernel", [1000, 250]), ("bias", [1]))]}


def _with_worker_links(workers, sharing, worker_bandwidth, placement="greedy"):
    scenario = make(workers, {"distribution": "constant", "value": 1e-6},
                    model={**TWO_PS, "placement": placement},
                    ps={"contention": True, "count": 2},
                    network={"bandwidth": 1e6, "duplex": "full", "sharing": sharing,
                             "worker_bandwidth": worker_bandwidth},
                    training={"steps": 200})
    return simulator.run(scenario).steps_per_second


@pytest.mark.parametrize("sharing", ["queue", "fair"])
def test_a_workers_own_link_carries_the_bytes_of_every_ps_task(sharing):
    """Reads from 2 ps tasks (1e6 bytes each) at once: on ps links of 1e6 B/s a step takes
    1 s each way; through a worker link of 1e6 B/s that the two share, 2 s each way."""
    assert _with_worker_links(1, sharing, float("inf")) == pytest.approx(0.5, rel=0.01)
    assert _with_worker_links(1, sharing, 1e6) == pytest.approx(0.25, rel=0.01)
    assert _with_worker_links(1, sharing, 1e9) == pytest.approx(0.5, rel=0.01)


def test_with_one_worker_on_its_own_link_placement_no_longer_matters():
    """The network bench at 1 Gbit/s, one worker: round_robin (both variables on one ps
    task) ran as fast as greedy (28.14 and 28.15 steps/s): the worker's link, which every
    byte crosses whatever the placement, set the pace. Without it the model made
    round_robin twice as slow."""
    by_placement = {p: _with_worker_links(1, "queue", 1e6, placement=p)
                    for p in ("greedy", "round_robin")}
    assert by_placement["round_robin"] == pytest.approx(by_placement["greedy"], rel=0.01)
    assert _with_worker_links(1, "queue", float("inf"), placement="round_robin") == (
        pytest.approx(0.5 * _with_worker_links(1, "queue", float("inf")), rel=0.01))


def test_worker_bandwidth_needs_full_duplex_ps_links_under_contention():
    assert math.isinf(make(1).network.worker_bandwidth)
    with pytest.raises(simulator.ScenarioError) as error:
        make(1, ps={"contention": True}, network={"worker_bandwidth": 1e6})
    assert str(error.value) == (
        "Invalid value for `network.worker_bandwidth` in test.toml: the workers' links are "
        "modelled with full-duplex ps links under contention; set `network.duplex = "
        '"full"` and `ps.contention = true`. Received: network.worker_bandwidth=1000000.0')
    with pytest.raises(simulator.ScenarioError, match="positive"):
        make(1, network={"duplex": "full", "worker_bandwidth": -1})
