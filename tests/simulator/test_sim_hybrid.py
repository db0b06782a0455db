"""Hybrid training (`training.mode = "hybrid"`): dense gradients in global steps, row
updates on arrival; the dense and embedding costs of a step (`workers.embedding_time`,
`training.apply_time`) and where each mode spends them."""

import pytest

import simulator

from .builders import make as _make

CONSTANT = {"distribution": "constant", "value": 0.1}


def make(count=4, step_time=None, workers=None, **sections):
    """`builders.make`, with extra `[workers]` keys (`embedding_time`)."""
    data = {"workers": {"count": count, "step_time": step_time or {
        "distribution": "exponential", "rate": 1.0}, **(workers or {})}, **sections}
    return simulator.Scenario.from_dict(data, source="test.toml")


def straggler(mode, backups=0, embedding=0.0, apply=0.0, steps=300, workers=4):
    """`workers` workers, 0.1 s of dense compute a step, the last one 2.5x slower (its
    steps end inside a global step, never on a boundary)."""
    training = {"mode": mode, "steps": steps, "backup_workers": backups}
    if apply:
        training["apply_time"] = apply
    return make(workers, CONSTANT, {"embedding_time": embedding},
                stragglers={"count": 1, "slowdown": 2.5}, training=training)


@pytest.mark.parametrize("backups", [0, 1, 2])
def test_without_embedding_cost_hybrid_steps_as_sync_with_the_same_backups(backups):
    sync = simulator.run(straggler("sync", backups))
    hybrid = simulator.run(straggler("hybrid", backups))
    assert hybrid.steps_per_second == pytest.approx(sync.steps_per_second, rel=1e-9)
    assert hybrid.gradients_applied == sync.gradients_applied


def test_random_late_workers_finish_and_miss_the_next_step_as_in_kerasps():
    # Exponential step times: the simulator's sync policy cancels a late worker, which
    # starts the next step at once; hybrid, as kerasps (in both modes), lets it finish,
    # and the next step does without it unless it would be short: that step waits for
    # all the others. Between sync with and without the backup, then.
    exponential = {"distribution": "exponential", "rate": 10.0}

    def rate(mode, backups):
        return simulator.run(_make(8, exponential, training={
            "mode": mode, "steps": 3000, "backup_workers": backups})).steps_per_second

    assert rate("sync", 0) < rate("hybrid", 1) < 0.9 * rate("sync", 1)


def test_a_dropped_workers_row_updates_are_still_applied():
    result = simulator.run(straggler("hybrid", backups=1, steps=300))
    # The 2.5x slower worker finishes a step inside every third global step: its dense
    # gradient is dropped, its row update applied, 2 global steps late; it waits for the
    # next step to start.
    assert result.gradients_dropped == pytest.approx(100, abs=2)
    assert result.row_updates == result.gradients_applied + result.gradients_dropped
    assert result.row_updates > result.gradients_applied
    late = result.staleness[result.staleness > 0]
    assert late.size == pytest.approx(100, abs=2) and set(late) == {2}
    sync = simulator.run(straggler("sync", backups=1, steps=300))
    assert sync.row_updates == sync.gradients_applied  # sync drops the late rows too


def test_hybrid_without_backups_applies_fresh_row_updates_only():
    result = simulator.run(straggler("hybrid", steps=100))
    assert result.gradients_dropped == 0
    assert result.row_updates == result.gradients_applied == 400
    assert set(result.staleness) == {0}


def test_embedding_cost_is_in_the_apply_in_sync_mode_and_in_the_worker_step_in_hybrid():
    # Dense 0.1 s, rows 0.02 s a worker, apply 0.01 s; 3 of 4 workers kept.
    sync = simulator.run(straggler("sync", 1, embedding=0.02, apply=0.01))
    hybrid = simulator.run(straggler("hybrid", 1, embedding=0.02, apply=0.01))
    assert sync.step_time == pytest.approx(0.1 + 0.01 + 3 * 0.02)
    assert hybrid.step_time == pytest.approx(0.1 + 0.02 + 0.01)
    # Async: every worker step pays its own rows; no apply function.
    asynchronous = simulator.run(make(4, CONSTANT, {"embedding_time": 0.02},
                                      training={"mode": "async", "steps": 400}))
    assert asynchronous.steps_per_second == pytest.approx(4 / 0.12)


def test_embedding_time_takes_a_distribution():
    scenario = straggler("hybrid", 1, embedding={"distribution": "exponential",
                                                 "rate": 50.0})
    result = simulator.run(scenario)
    assert result.finished and 0.1 + 0.02 < result.step_time < 0.3
    again = simulator.Scenario.from_dict(scenario.raw)
    assert again == scenario
    assert simulator.Scenario.from_dict(
        {**scenario.raw, "name": "x"}).workers.embedding_time == scenario.workers.embedding_time


def test_hybrid_summary_and_report_count_row_updates():
    result = simulator.run(straggler("hybrid", 1, steps=30))
    assert result.summary()["row_updates"] == result.row_updates
    assert "row updates" in str(result)
    assert "row_updates" in simulator.metrics.metric_names()


def test_hybrid_with_failures_and_checkpoints_finishes():
    scenario = straggler("hybrid", 1, embedding=0.01, apply=0.01, steps=400).with_overrides({
        "checkpoint.every": 50, "checkpoint.duration": 0.1,
        "failures.events": [{"time": 5.0, "target": "ps", "downtime": 1.0},
                            {"time": 9.0, "target": "worker", "index": 1, "downtime": 0.5}]})
    result = simulator.run(scenario)
    assert result.finished and result.steps == 400
    assert result.rolled_back_steps > 0


@pytest.mark.parametrize("training, workers, message", [
    ({"mode": "hybrid", "max_staleness": 2}, {},
     "Invalid value for `training.max_staleness` in test.toml: in hybrid mode a row update "
     "is at most the global steps its worker took behind"),
    ({"mode": "async", "apply_time": 0.01}, {},
     "Invalid value for `training.apply_time` in test.toml: an async step applies its own "
     "gradient"),
    ({"mode": "hybrid", "apply_time": -1.0}, {},
     "Invalid value for `training.apply_time` in test.toml: it must not be negative"),
    ({"mode": "hybrid", "backup_workers": 4}, {},
     "Invalid value for `training.backup_workers` in test.toml: it must be less than"),
    ({"mode": "hybrid"}, {"embedding_time": -0.5},
     "Invalid value for `workers.embedding_time` in test.toml: it must not be negative. "
     "Received: workers.embedding_time=-0.5"),
    ({"mode": "hybrid"}, {"embedding_time": {"distribution": "exponential"}},
     "`workers.embedding_time.rate`"),
    ({"mode": "hybrid"}, {"embedding_time": "fast"},
     "Received: workers.embedding_time='fast'"),
])
def test_bad_hybrid_scenarios_name_key_and_value(training, workers, message):
    with pytest.raises(simulator.ScenarioError) as info:
        make(4, workers=workers, training=training)
    assert message in str(info.value)
