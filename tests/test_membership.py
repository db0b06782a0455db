"""The elastic pool's policy (pure Python): membership changes, bounds, giving up."""

import pytest

from kerasps.policy.membership import (
    Membership,
    PoolSpec,
    TooFewWorkersError,
    WorkerState,
    parse_workers,
)


def test_observe_reports_who_joined_and_who_left():
    pool = Membership(PoolSpec(max_workers=4, min_workers=2))
    assert pool.observe({0, 1, 2, 3}, now=1.0) == []  # all declared workers start
    left = pool.observe({0, 1}, now=2.0)
    assert [(c.worker, c.state) for c in left] == [(2, WorkerState.ABSENT),
                                                   (3, WorkerState.ABSENT)]
    assert str(left[0]) == "worker 2 left: 2 of 4 workers running"
    joined = pool.observe({0, 1, 3}, now=3.0)
    assert str(joined[0]) == "worker 3 joined: 3 of 4 workers running"
    assert len(pool.changes) == 3


def test_below_min_workers_holds_then_fails_after_the_timeout():
    pool = Membership(PoolSpec(max_workers=3, min_workers=2, timeout=10.0))
    pool.observe({0}, now=100.0)
    assert not pool.has_quorum
    pool.check(now=109.0)  # still waiting
    with pytest.raises(TooFewWorkersError, match=r"Only 1 of 3 workers.*fewer than "
                                                 r"min_workers=2.*not answering: \[1, 2\]"):
        pool.check(now=111.0)


def test_the_timeout_starts_again_after_the_pool_recovers():
    pool = Membership(PoolSpec(max_workers=2, min_workers=2, timeout=10.0))
    pool.observe({0}, now=0.0)
    pool.observe({0, 1}, now=5.0)
    pool.observe({0}, now=20.0)
    pool.check(now=29.0)  # below for 9s only


def test_workers_outside_the_declared_range_are_ignored():
    pool = Membership(PoolSpec(max_workers=2))
    pool.observe({0, 1, 7}, now=0.0)
    assert pool.running == {0, 1}


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), ("2:4", (2, 4)), (" 1:1 ", (1, 1))])
def test_worker_counts_and_ranges_parse(text, expected):
    assert parse_workers(text) == expected


@pytest.mark.parametrize("text, match", [
    ("4:2", r"MIN \(4\) is greater than MAX \(2\)"), ("0:2", "Received: workers='0:2'"),
    ("1:2:3", "Received: workers='1:2:3'"), ("a:b", "Received: workers='a:b'"),
    ("", "Received: workers=''")])
def test_bad_worker_ranges_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_workers(text)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_workers=2, min_workers=3), r"`min_workers`.*at most the number of declared "
                                         r"workers \(2\).*Received: min_workers=3"),
    (dict(max_workers=2, min_workers=0), r"`min_workers`.*Received: min_workers=0"),
    (dict(max_workers=2, timeout=0), r"`min_workers_timeout`.*Received: timeout=0"),
])
def test_bad_pool_bounds_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolSpec(**kwargs)
