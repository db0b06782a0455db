"""Workers sharing the cores of one machine (`[machine]`: processor sharing), a slow
worker's input held back off the cores (`stragglers.input_delay`), and sync late workers
that finish their step as in kerasps (`training.late_workers = "finish"`)."""

import numpy as np
import pytest
import simpy

import simulator
from simulator.machine import Machine

from .builders import make

WORK = {"distribution": "constant", "value": 0.1}


def rate(count=4, mode="async", steps=400, machine=None, stragglers=None, **training):
    sections = {"training": {"mode": mode, "steps": steps, **training}}
    if machine is not None:
        sections["machine"] = machine
    if stragglers is not None:
        sections["stragglers"] = stragglers
    return simulator.run(make(count, WORK, **sections)).steps_per_second


def worker_step_times(scenario):
    """Each worker's step durations, from the recorded events."""
    result = simulator.run(scenario, record_events=True)
    times = {}
    for worker, start, end, _, _ in result.events:
        times.setdefault(worker, []).append(end - start)
    return {worker: np.array(t) for worker, t in times.items()}


# The machine alone.
def test_computations_share_the_cores_equally_and_speed_up_when_one_ends():
    env = simpy.Environment()
    m = Machine(env, cores=2)
    ends = {}

    def job(name, seconds, at=0.0):
        yield env.timeout(at)
        yield m.compute(seconds)
        ends[name] = env.now

    for name, seconds in [("a", 0.1), ("b", 0.1), ("c", 0.1), ("long", 0.4)]:
        env.process(job(name, seconds))
    env.run()
    # 4 on 2 cores: each at half speed until a, b, c end at 0.2 (0.1 of work done by
    # each); "long" then has 0.3 left, alone, at full speed.
    assert ends["a"] == ends["b"] == ends["c"] == pytest.approx(0.2)
    assert ends["long"] == pytest.approx(0.5)
    assert m.busy == pytest.approx(0.7)


def test_a_cancelled_computation_gives_its_share_back():
    env = simpy.Environment()
    m = Machine(env, cores=1)
    ends = {}
    doomed = m.compute(1.0)

    def job():
        yield m.compute(0.2)
        ends["job"] = env.now

    def cancel():
        yield env.timeout(0.1)  # "job" has done 0.05 of its 0.2
        m.cancel(doomed)

    env.process(job())
    env.process(cancel())
    env.run()
    assert ends["job"] == pytest.approx(0.1 + 0.15)
    assert not doomed.triggered


# Workers on shared cores.
def test_four_compute_bound_workers_on_two_cores_run_async_at_half_the_dedicated_rate():
    dedicated = rate(4)
    assert dedicated == pytest.approx(40.0)
    assert rate(4, machine={"cores": 2}) == pytest.approx(dedicated / 2)
    assert rate(3, machine={"cores": 2}) == pytest.approx(2 / 0.1)  # saturated: cores / work


def test_as_many_workers_as_cores_are_not_slowed():
    assert rate(1, machine={"cores": 2}) == pytest.approx(10.0)
    assert rate(2, machine={"cores": 2}) == pytest.approx(20.0)
    assert rate(4, machine={"cores": 4}) == pytest.approx(40.0)


def test_the_cores_other_jobs_keep_busy_are_not_the_workers():
    # Other jobs use 1.5 of 2 cores: a step alone gets half a core, 4 share it.
    assert rate(1, machine={"cores": 2, "background": 1.5}) == pytest.approx(5.0)
    assert rate(4, machine={"cores": 2, "background": 1.5}) == pytest.approx(5.0)
    # 1 core left: one step is not slowed, two share it.
    assert rate(1, machine={"cores": 2, "background": 1}) == pytest.approx(10.0)
    assert rate(2, machine={"cores": 2, "background": 1}) == pytest.approx(10.0)
    assert rate(3, machine={"cores": 4, "background": 0.5}) == pytest.approx(30.0)


def test_without_machine_results_are_unchanged_by_the_default_keys():
    plain = make(4, training={"mode": "sync", "steps": 200, "backup_workers": 1})
    explicit = plain.with_overrides({"training.late_workers": "cancel",
                                     "stragglers.input_delay": 0.0})
    assert str(simulator.run(plain).summary()) == str(simulator.run(explicit).summary())


# A slow worker's input, held back off the cores.
def test_input_delay_makes_a_workers_cycle_the_longer_of_delay_and_step():
    # Async, dedicated cores: the slow worker steps every 0.5 s, the others every 0.1 s.
    assert rate(4, stragglers={"count": 1, "input_delay": 0.5}, steps=1600) == pytest.approx(
        3 / 0.1 + 1 / 0.5, rel=1e-3)
    # Sync without backups waits for it: a step every 0.5 s after the first (its first
    # batch is ready at the start), whatever the work.
    assert rate(4, "sync", steps=100, stragglers={"count": 1, "input_delay": 0.5}) == (
        pytest.approx(100 / (0.1 + 99 * 0.5)))
    # A delay shorter than the step is hidden behind the computation.
    assert rate(4, "sync", steps=100, stragglers={"count": 1, "input_delay": 0.05}) == (
        pytest.approx(10.0))


def test_a_straggler_waiting_for_its_input_leaves_the_cores_to_the_others():
    # Sync, 4 workers on 2 cores, 0.1 s of work each. A straggler whose batch is held
    # back 0.5 s idles meanwhile: the 3 others compute at 2/3 speed (0.15 s), and it
    # computes alone afterwards (0.1 s, at full speed). A straggler as slow by compute
    # (5x the work) takes a share all along: the others take 0.2 s.
    def scenario(stragglers):
        return make(4, WORK, training={"mode": "sync", "steps": 50}, machine={"cores": 2},
                    stragglers={"count": 1, **stragglers})

    waiting = worker_step_times(scenario({"input_delay": 0.5}))
    computing = worker_step_times(scenario({"slowdown": 5.0}))
    for worker in range(3):  # the first step: all 4 at once, the first batch ready
        assert waiting[worker][0] == pytest.approx(0.2)
        assert waiting[worker][1:] == pytest.approx(0.15)
        assert computing[worker] == pytest.approx(0.2)
    # It takes a batch every 0.5 s: the second 0.5 s after the first, taken at 0.
    assert waiting[3][1] == pytest.approx(0.5 - 0.2 + 0.1)
    assert waiting[3][2:] == pytest.approx(0.5)
    assert simulator.run(scenario({"input_delay": 0.5})).steps_per_second == pytest.approx(
        50 / (49 * 0.5 + 0.1))  # the 50th step ends 0.1 s after its batch is taken


# Sync late workers: cancelled, or finishing as in kerasps.
def test_sync_late_workers_finishing_step_as_hybrid_without_row_updates():
    exponential = {"distribution": "exponential", "rate": 10.0}

    def result(mode, backups, **training):
        return simulator.run(make(8, exponential, training={
            "mode": mode, "steps": 2000, "backup_workers": backups, **training}))

    for backups in (1, 2):
        finish = result("sync", backups, late_workers="finish")
        hybrid = result("hybrid", backups)
        assert finish.steps_per_second == pytest.approx(hybrid.steps_per_second, rel=1e-12)
        assert finish.gradients_dropped == hybrid.gradients_dropped > 0
        # Cancelled late workers start the next step at once: faster steps.
        assert result("sync", backups).steps_per_second > 1.1 * finish.steps_per_second


def test_a_late_worker_that_finishes_takes_its_share_of_the_cores_then_sits_a_step_out():
    # 2 workers on 1 core, sync with 1 backup; 0.1 s of work, the straggler's 0.25 s.
    # Cancelled: both compute every step at half speed, the fast one done at 0.2 s.
    # Finishing: the straggler's one step spans 3 global steps (0.2 + 0.2 s at half
    # speed, done 0.1 s into the third), then waits for the next step, so the fast
    # worker computes the rest of the third alone: 3 steps in 0.55 s.
    def steps_per_second(late_workers):
        return rate(2, "sync", steps=300, backup_workers=1, late_workers=late_workers,
                    machine={"cores": 1}, stragglers={"count": 1, "slowdown": 2.5})

    assert steps_per_second("cancel") == pytest.approx(5.0)
    assert steps_per_second("finish") == pytest.approx(3 / 0.55)


def test_apply_functions_on_the_machine_share_the_cores_with_late_workers():
    # Hybrid, 2 workers on 1 core, 1 backup: the straggler computes (almost) all the
    # time, so the fast worker's 0.1 s step takes 0.2 s; a 0.1 s apply too if the ps
    # task shares the machine (0.4 s a step), else it is 0.1 s (0.3 s a step).
    def steps_per_second(ps):
        return rate(2, "hybrid", steps=200, backup_workers=1, apply_time=0.1,
                    machine={"cores": 1, "ps": ps},
                    stragglers={"count": 1, "slowdown": 1000.0})

    assert steps_per_second(True) == pytest.approx(1 / 0.4, rel=1e-3)
    assert steps_per_second(False) == pytest.approx(1 / 0.3, rel=1e-3)


def test_machine_scenarios_with_failures_and_backups_finish():
    scenario = make(6, {"distribution": "exponential", "rate": 10.0},
                    training={"mode": "sync", "steps": 300, "backup_workers": 2,
                              "late_workers": "finish", "apply_time": 0.01},
                    machine={"cores": 2, "background": 0.5, "ps": True},
                    stragglers={"count": 1, "input_delay": 0.3},
                    checkpoint={"every": 50, "duration": 0.1},
                    failures={"events": [{"time": 3.0, "target": "ps", "downtime": 1.0},
                                         {"time": 5.0, "target": "worker", "index": 1,
                                          "downtime": 0.5}]})
    result = simulator.run(scenario)
    assert result.finished and result.steps == 300 and result.rolled_back_steps > 0
    again = simulator.Scenario.from_dict(scenario.raw)
    assert again == scenario and str(simulator.run(again).summary()) == str(result.summary())


@pytest.mark.parametrize("sections, message", [
    ({"machine": {"cores": 0}},
     "Invalid value for `machine.cores` in test.toml: it must be positive. "
     "Received: machine.cores=0"),
    ({"machine": {"cores": 2.5}}, "Received: machine.cores=2.5"),
    ({"machine": {"cores": 2, "background": -1.0}},
     "Invalid value for `machine.background` in test.toml: it must not be negative. "
     "Received: machine.background=-1.0"),
    ({"machine": {"cores": 2, "background": 2}},
     "Invalid value for `machine.background` in test.toml: other jobs must leave some of "
     "the 2 cores (`machine.cores`) to the workers. Received: machine.background=2"),
    ({"machine": {"ps": True}},
     "Invalid value for `machine.ps` in test.toml: it describes the shared cores of "
     "`machine.cores`, which is not set. Received: machine.ps=True"),
    ({"machine": {"cores": 2, "ps": "yes"}},
     "Invalid value for `machine.ps` in test.toml: it must be true or false"),
    ({"machine": {"cores": 2},
      "host": {"cpus": 2, "cpu_time": {"distribution": "constant", "value": 0.1}}},
     "Invalid value for `machine.cores` in test.toml: `[host]` already shares a CPU"),
    ({"machine": {"core": 2}}, "Unknown key `machine.core` in test.toml: did you mean `cores`?"),
    ({"stragglers": {"input_delay": 0.5}},
     "Invalid value for `stragglers.input_delay` in test.toml: it delays the input of the "
     "`stragglers.count` slow workers, and there are none"),
    ({"stragglers": {"count": 1, "input_delay": -0.5}},
     "Invalid value for `stragglers.input_delay` in test.toml: it must not be negative"),
    ({"training": {"mode": "hybrid", "late_workers": "cancel"}},
     "Invalid value for `training.late_workers` in test.toml: in hybrid mode a late "
     "worker's row update is applied"),
    ({"training": {"mode": "async", "late_workers": "finish"}},
     "Invalid value for `training.late_workers` in test.toml: no worker is late in async "
     "mode"),
    ({"training": {"mode": "sync", "late_workers": "wait"}},
     "Invalid value for `training.late_workers` in test.toml: expected one of ['cancel', "
     "'finish']. Received: training.late_workers='wait'"),
])
def test_bad_machine_and_late_worker_keys_name_key_and_value(sections, message):
    with pytest.raises(simulator.ScenarioError) as info:
        make(4, **sections)
    assert message in str(info.value)


def test_late_workers_default_by_mode():
    assert make(4, training={"mode": "sync"}).training.late_workers == "cancel"
    assert make(4, training={"mode": "hybrid"}).training.late_workers == "finish"
    assert make(4).training.late_workers is None
