"""Sync steps, backup workers and bounded staleness as policies (pure Python)."""

import random

import pytest

from kerasps.policy.consistency import Consistency, Mode, StalenessBound, SyncStep


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="bulk"), "mode='bulk'"),
    (dict(mode="sync", backup_workers=-1), "backup_workers=-1"),
    (dict(mode="sync", backup_workers=4), "backup_workers=4"),
    (dict(mode="async", backup_workers=1), "need `mode='sync'`"),
    (dict(mode="async", max_staleness=-1), "max_staleness=-1"),
    (dict(mode="sync", max_staleness=2), "max_staleness=2 with mode='sync'"),
    (dict(mode="sync", backup_workers=1.5), "backup_workers=1.5"),
    (dict(measure_staleness=1), "measure_staleness=1"),
])
def test_bad_arguments_name_the_argument_and_value(kwargs, match):
    args = dict(mode="async", backup_workers=0, max_staleness=None) | kwargs
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Consistency.of(num_workers=4, **args)


def test_valid_arguments():
    assert Consistency.of("sync", 3, None, num_workers=4) == Consistency(Mode.SYNC, 3, None)
    assert Consistency.of("async", 0, 0, num_workers=1).max_staleness == 0
    assert not Consistency().sync


def test_sync_step_keeps_the_first_gradients_and_drops_the_rest():
    step = SyncStep(version=7, needed=2)
    for slot in (0, 1, 2, 3):
        step.started(slot)
    assert step.arrived(2) and not step.complete
    assert step.arrived(0) and step.complete
    assert not step.arrived(3)
    assert step.kept == [2, 0]
    assert step.finish() == 1  # slot 1 still computing
    assert step.dropped == 2


def _simulate(bound, functions=400, workers=4, seed=0):
    """Random start and finish order under the bound; returns the staleness of every
    applied step (updates applied between a function's start and each of its steps)."""
    rng = random.Random(seed)
    applied, running, observed, token = 0, {}, [], 0
    while functions or running:
        steps = rng.choice([1, 2, 3])
        if functions and len(running) < workers and bound.admits(steps):
            bound.scheduled(token, steps)
            running[token] = (applied, steps)
            token, functions = token + 1, functions - 1
            continue
        done = rng.choice(list(running))
        start, steps = running.pop(done)
        for _ in range(steps):
            observed.append(applied - start)
            start += 1  # its own step: the next one reads it
            applied += 1
        bound.finished(done)
    return observed


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_staleness_bound_holds_under_any_finishing_order(k):
    for seed in range(5):
        assert max(_simulate(StalenessBound(k), seed=seed)) <= k


def test_staleness_bound_admits_a_lone_function_and_serializes_at_zero():
    bound = StalenessBound(0)
    assert bound.admits(5)
    bound.scheduled("a", 5)
    assert not bound.admits(1)
    bound.finished("a")
    assert bound.admits(1)


def test_unbounded_runs_are_staler_than_the_bound():
    # The simulation is a real test of the bound: without it staleness exceeds k.
    class Unbounded(StalenessBound):
        def admits(self, steps):
            return True

    assert max(_simulate(Unbounded(0))) > 3
