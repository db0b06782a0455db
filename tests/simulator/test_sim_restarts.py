"""Restarts in the simulator follow `kerasps launch`: the same `RestartPolicy`, a budget
per task, and a spent budget ends the job. Constant step times make the numbers exact."""

import json

import pytest

import simulator
from kerasps.policy.restarts import Action, Decision, RestartPolicy
from simulator.perfetto import trace_events

from .builders import make

CONSTANT = {"distribution": "constant", "value": 1.0}


def crashes(*events, **failures):
    """Scripted worker crashes `(time, index)`, each down for 1 s."""
    scripted = [{"time": t, "target": "worker", "index": i, "downtime": 1.0} for t, i in events]
    return {"events": scripted, **failures}


def sync(workers, steps, failures, **sections):
    return make(workers, CONSTANT, training={"mode": "sync", "steps": steps},
                failures=failures, **sections)


# Worker 1 crashes twice, mid-step: each crash costs the half step it loses plus 1 s down.
TWICE = crashes((2.5, 1), (6.0, 1))


def test_a_spent_budget_ends_the_job_naming_the_task_and_its_restarts():
    result = simulator.run(sync(3, 10, {**TWICE, "max_restarts": 1}))
    assert not result.finished
    assert result.elapsed == pytest.approx(6.0)
    assert result.steps == 4  # steps end at 1, 2, 4.5 and 5.5
    assert result.restarts == {"worker:1": 1}
    assert result.ended_by == {
        "time": 6.0, "task": "worker:1", "restarts": 1,
        "reason": RestartPolicy(max_restarts=1).decide("worker", 1, -9, 1).reason}
    assert "restart budget is spent (1 restart)" in result.ended_by["reason"]


def test_a_budget_that_lasts_brings_the_task_back_after_its_restart_delay():
    result = simulator.run(sync(3, 10, {**TWICE, "max_restarts": 2}))
    assert result.finished
    assert result.ended_by is None
    assert result.restarts == {"worker:1": 2}
    assert result.elapsed == pytest.approx(10 + 2 * 1.5)


def test_without_max_restarts_restarts_are_unlimited():
    events = [(2.5 + 3 * k, 0) for k in range(5)]
    result = simulator.run(sync(2, 20, crashes(*events)))
    assert result.finished
    assert result.restarts == {"worker:0": 5}


def test_the_budget_is_per_task():
    result = simulator.run(sync(3, 10, crashes((2.5, 0), (6.0, 1), max_restarts=1)))
    assert result.finished
    assert result.restarts == {"worker:0": 1, "worker:1": 1}


def test_a_ps_task_beyond_its_budget_ends_the_job():
    result = simulator.run(sync(2, 10, {"max_restarts": 0, "events": [
        {"time": 3.5, "target": "ps", "downtime": 1.0}]}))
    assert not result.finished
    assert result.steps == 3
    assert result.ended_by["task"] == "ps:0"
    assert result.ended_by["restarts"] == 0
    assert result.failures == [(3.5, "ps:0", "crash", 0)]


def test_a_ps_task_within_its_budget_restarts_and_the_job_rolls_back():
    result = simulator.run(sync(2, 20, {"max_restarts": 1, "events": [
        {"time": 13.5, "target": "ps", "downtime": 1.0}]}, checkpoint={"every": 10}))
    assert result.finished
    assert result.restarts == {"ps:0": 1}
    assert result.rolled_back_steps == 3
    assert result.elapsed == pytest.approx(13.5 + 1.0 + 10)


def test_workers_gone_for_good_keep_the_job_running_and_spend_no_budget():
    result = simulator.run(sync(3, 10, {"max_restarts": 0, "events": [
        {"time": 2.5, "target": "worker", "index": 1, "kind": "loss"}]}))
    assert result.finished
    assert result.ended_by is None
    assert result.restarts == {}


def test_random_failures_beyond_the_budget_end_the_job():
    scenario = make(4, CONSTANT, training={"steps": 10_000},
                    failures={"worker_mtbf": 50.0, "worker_restart_time": 5.0,
                              "max_restarts": 2})
    ended = simulator.run(scenario)
    assert not ended.finished
    assert ended.restarts[ended.ended_by["task"]] == 2
    assert max(ended.restarts.values()) <= 2
    unlimited = simulator.run(scenario.with_overrides({"failures.max_restarts": 1000}))
    assert unlimited.finished


def test_restart_decisions_are_kerasps_restart_policy(monkeypatch):
    asked = []

    def decide(self, task_type, index, exit_code, restarts):
        asked.append((task_type, index, restarts))
        return Decision(Action.END_JOB, "the policy said so")

    monkeypatch.setattr(RestartPolicy, "decide", decide)
    result = simulator.run(sync(3, 10, TWICE))
    assert asked == [("worker", 1, 0)]
    assert result.ended_by["reason"] == "the policy said so"


def test_the_end_of_the_job_is_in_the_json_text_and_trace():
    result = simulator.run(sync(3, 10, {**TWICE, "max_restarts": 1}), record_events=True)
    data = json.loads(result.to_json())
    assert data["ended_by"]["task"] == "worker:1"
    assert data["restarts"] == {"worker:1": 1}
    assert "job ended" in str(result)
    assert any(e["name"] == "job ended" for e in trace_events(result))


def test_max_restarts_must_not_be_negative():
    with pytest.raises(simulator.ScenarioError, match=r"Invalid value for `failures."
                       r"max_restarts` in test.toml: it must not be negative. "
                       r"Received: failures.max_restarts=-1"):
        make(2, failures={"max_restarts": -1})


def test_the_coordinator_is_restarted_like_kerasps_launch_restarts_the_chief():
    crash = {"time": 13.5, "target": "coordinator", "downtime": 1.0}
    within = simulator.run(sync(2, 20, {"max_restarts": 1, "events": [crash]},
                                checkpoint={"every": 10}))
    assert within.finished
    assert within.restarts == {"chief:0": 1}
    assert within.elapsed == pytest.approx(13.5 + 1.0 + 10)
    spent = simulator.run(sync(2, 20, {"max_restarts": 0, "events": [crash]},
                               checkpoint={"every": 10}))
    assert not spent.finished
    assert spent.steps == 13
    assert spent.ended_by == {
        "time": 13.5, "task": "chief:0", "restarts": 0,
        "reason": RestartPolicy(max_restarts=0).decide("chief", 0, -9, 0).reason}
