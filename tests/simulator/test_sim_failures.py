"""Failures, checkpoints and elastic membership, with constant step times so that the
expected numbers are exact."""

import pytest

import simulator

from .builders import make

CONSTANT = {"distribution": "constant", "value": 1.0}


def sync(workers, steps, **sections):
    return make(workers, CONSTANT, training={"mode": "sync", "steps": steps}, **sections)


def test_checkpoints_pause_training_for_their_duration():
    result = simulator.run(sync(4, 100, checkpoint={"every": 10, "duration": 0.5}))
    assert [step for _, step in result.checkpoints] == list(range(10, 100, 10))
    assert result.elapsed == pytest.approx(100 + 9 * 0.5)


def test_ps_crash_rolls_back_to_the_last_checkpoint():
    # Steps end at t = 1, 2, ...; checkpoints at steps 10, 20; the ps fails at t = 25.5.
    result = simulator.run(sync(
        4, 40, checkpoint={"every": 10, "restore_time": 2.0},
        failures={"events": [{"time": 25.5, "target": "ps", "downtime": 3.0}]}))
    assert result.rolled_back_steps == 5
    assert result.failures == [(25.5, "ps:0", "crash", 5)]
    assert result.gradients_lost == 4 * 5 + 4  # rolled-back gradients + in-flight steps
    # 25.5 s of work, 5 s of recovery, then steps 21..40 from scratch.
    assert result.elapsed == pytest.approx(25.5 + 5.0 + 20)
    assert result.downtime == pytest.approx(5.0)
    assert result.steps == 40
    assert result.applied_fraction == pytest.approx(160 / (160 + 24))
    assert result.goodput == pytest.approx((20 + 20) / result.elapsed)  # kept steps, 1 s each


def test_coordinator_crash_also_restarts_from_the_checkpoint():
    result = simulator.run(sync(
        2, 30, checkpoint={"every": 10},
        failures={"events": [{"time": 14.5, "target": "coordinator", "downtime": 1.0}]}))
    assert result.failures == [(14.5, "coordinator", "crash", 4)]
    assert result.elapsed == pytest.approx(14.5 + 1.0 + 20)


def test_a_failure_during_a_checkpoint_write_loses_that_checkpoint():
    result = simulator.run(sync(
        2, 30, checkpoint={"every": 10, "duration": 2.0},
        failures={"events": [{"time": 23.0, "target": "ps"}]}))
    # Step 10 ends at t=10 and its checkpoint at 12; step 20 ends at 22, and the
    # failure at 23 interrupts writing its checkpoint: back to step 10.
    assert result.failures[0][3] == 10
    assert [step for _, step in result.checkpoints] == [10, 20]
    assert result.checkpoints[1][0] > 23.0


def test_worker_crash_loses_its_step_and_sync_waits_for_the_restart():
    result = simulator.run(sync(
        3, 10, failures={"events": [{"time": 2.5, "target": "worker", "index": 1,
                                     "downtime": 4.0}]}))
    # Step 3 needs worker 1: it restarts at 6.5 and finishes step 3 at 7.5.
    assert result.gradients_lost == 1
    assert result.elapsed == pytest.approx(7.5 + 7)
    assert result.failures == [(2.5, "worker:1", "crash", 0)]


def test_backup_workers_hide_a_worker_crash():
    result = simulator.run(make(
        4, CONSTANT, training={"mode": "sync", "steps": 10, "backup_workers": 1},
        failures={"events": [{"time": 2.5, "target": "worker", "index": 1,
                              "downtime": 4.0}]}))
    assert result.elapsed == pytest.approx(10.0)


def test_permanent_worker_loss_shrinks_the_sync_quorum():
    result = simulator.run(sync(
        4, 10, failures={"events": [{"time": 2.5, "target": "worker", "index": 0,
                                     "kind": "loss"}]}))
    assert result.finished
    assert result.elapsed == pytest.approx(10.0)
    assert result.gradients_applied == 2 * 4 + 8 * 3


def test_async_worker_crash_costs_only_that_worker():
    result = simulator.run(make(
        2, CONSTANT, training={"steps": 21},
        failures={"events": [{"time": 0.5, "target": "worker", "index": 0,
                              "downtime": 4.5}]}))
    # Worker 1 runs alone for 5 s (5 steps), then both (2 steps/s) for 8 s.
    assert result.elapsed == pytest.approx(13.0)
    assert result.gradients_lost == 1


def test_random_worker_failures_follow_the_mtbf():
    result = simulator.run(make(
        20, CONSTANT, training={"steps": 40_000},
        failures={"worker_mtbf": 100.0, "worker_restart_time": 10.0}))
    # Each worker is up about 100 / 110 of the time, failing once per 100 s up.
    up_time = result.elapsed * 20 * 100 / 110
    assert len(result.failures) == pytest.approx(up_time / 100, rel=0.15)
    assert result.applied_fraction < 1.0  # the crashed workers' steps in flight
    assert result.goodput == pytest.approx(1.0)  # async training never stopped
    assert result.steps_per_second == pytest.approx(20 * 100 / 110, rel=0.05)


def test_random_ps_failures_with_checkpoints_lose_progress():
    result = simulator.run(make(
        8, CONSTANT, training={"steps": 20_000}, ps={"count": 2},
        checkpoint={"every": 200, "duration": 1.0},
        failures={"ps_mtbf": 400.0, "ps_restart_time": 5.0}))
    assert result.finished
    assert len(result.failures) > 5
    assert result.rolled_back_steps > 0
    assert result.goodput < 1.0


def test_elastic_join_adds_throughput():
    result = simulator.run(make(
        2, CONSTANT, training={"steps": 100},
        elastic={"events": [{"time": 10.0, "action": "join", "count": 2}]}))
    # 2 steps/s for 10 s, then 4 steps/s.
    assert result.elapsed == pytest.approx(10 + 80 / 4)


def test_elastic_joins_beyond_max_workers_are_refused():
    result = simulator.run(make(
        2, CONSTANT, training={"steps": 100}, elastic={
            "max_workers": 3, "events": [{"time": 10.0, "action": "join", "count": 5}]}))
    assert result.elapsed == pytest.approx(10 + 80 / 3, abs=1.0)


def test_training_pauses_below_min_workers_until_a_join():
    result = simulator.run(make(
        2, CONSTANT, training={"steps": 40}, elastic={
            "min_workers": 2, "events": [{"time": 4.5, "action": "leave"},
                                         {"time": 10.0, "action": "join"}]}))
    # Steps 1..8 by t=4 (2/s), one in-flight step dropped at 4.5, pause until 10.
    assert result.elapsed == pytest.approx(10 + 32 / 2)


def test_losing_every_worker_stops_the_run_unfinished():
    result = simulator.run(make(
        1, CONSTANT, training={"steps": 100},
        failures={"events": [{"time": 3.5, "target": "worker", "kind": "loss"}]}))
    assert not result.finished
    assert result.steps == 3


def test_max_time_stops_a_run():
    result = simulator.run(make(2, CONSTANT, training={"steps": 1000, "max_time": 10.5}))
    assert not result.finished
    assert result.steps == 20


def test_async_max_staleness_drops_stale_gradients():
    result = simulator.run(make(8, training={"steps": 5000, "max_staleness": 3}))
    assert result.gradients_dropped > 0
    assert result.staleness.max() <= 3
