"""Calibration from kerasps traces: fitted parameters and predicted throughput."""

import pytest

import simulator
from kerasps.policy.trace import read_trace, write_trace
from simulator.calibrate import mva_throughput, predict_goodput, synthetic_trace
from simulator.cli import main


@pytest.fixture(scope="module")
def dedicated_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "trace.csv"
    write_trace(path, synthetic_trace(4, 1000, shift=0.05, rate=20.0, seed=1))
    return path


def test_fits_a_shifted_exponential_from_a_trace_file(dedicated_trace):
    model = simulator.calibrate(dedicated_trace)
    assert model.num_workers == 4
    assert model.pooled.shift == pytest.approx(0.05, rel=0.01)
    assert model.pooled.rate == pytest.approx(20.0, rel=0.05)
    assert model.pooled.ks < 0.05
    assert len(model.per_worker) == 4
    assert all(f.rate == pytest.approx(20.0, rel=0.15) for f in model.per_worker)


@pytest.mark.parametrize("workers", [2, 8])
def test_predicts_dedicated_workers_at_another_count(dedicated_trace, workers):
    model = simulator.calibrate(read_trace(dedicated_trace))
    truth = workers / (0.05 + 1 / 20.0)
    assert simulator.predict_throughput(model, workers) == pytest.approx(truth, rel=0.03)
    assert simulator.predict_throughput(model, workers, method="mva") == pytest.approx(
        truth, rel=0.03)


def shared_cpu_system(workers, steps=3000):
    """Ground truth for an in-process run: 10 ms off-CPU per step, 20 ms of CPU on 2 cores."""
    return simulator.Scenario.from_dict({
        "workers": {"count": workers, "step_time": {"distribution": "constant", "value": 0.01}},
        "host": {"cpus": 2, "cpu_time": {"distribution": "exponential", "rate": 50.0}},
        "training": {"steps": steps}})


@pytest.fixture(scope="module")
def shared_traces():
    return {w: simulator.run(shared_cpu_system(w), record_events=True).step_events()
            for w in (2, 4)}


def test_mva_matches_the_simulated_shared_cpu(shared_traces):
    for workers in (1, 3, 6):
        simulated = simulator.run(shared_cpu_system(workers)).steps_per_second
        assert mva_throughput(workers, 2, 0.02, 0.01) == pytest.approx(simulated, rel=0.03)


def test_one_trace_of_a_saturated_machine_predicts_more_workers(shared_traces):
    model = simulator.calibrate(shared_traces[4], cpus=2)
    assert model.cpus == 2 and model.latency == pytest.approx(0.0, abs=1e-3)
    truth = simulator.run(shared_cpu_system(8)).steps_per_second
    assert simulator.predict_throughput(model, 8) == pytest.approx(truth, rel=0.15)


def test_two_traces_separate_latency_and_predict_both_directions(shared_traces):
    model = simulator.calibrate([shared_traces[2], shared_traces[4]], cpus=2)
    assert model.cpu_time == pytest.approx(0.02, rel=0.15)
    assert model.latency == pytest.approx(0.01, rel=0.3)
    for workers in (1, 8):
        truth = simulator.run(shared_cpu_system(workers)).steps_per_second
        assert simulator.predict_throughput(model, workers) == pytest.approx(truth, rel=0.15)


def test_calibrated_scenario_round_trips_as_toml(shared_traces, tmp_path):
    model = simulator.calibrate(shared_traces[4], cpus=2)
    path = tmp_path / "calibrated.toml"
    path.write_text(model.scenario(6).to_toml())
    scenario = simulator.load_scenario(path)
    assert scenario.workers.count == 6 and scenario.host.cpus == 2


def test_calibrate_command_reports_fit_and_writes_scenario(dedicated_trace, tmp_path, capsys):
    out = tmp_path / "calibrated.toml"
    assert main(["calibrate", str(dedicated_trace), "--predict", "2,8", "--workers", "8",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "shifted exponential" in text and "predicted steps/s with 8 workers" in text
    assert simulator.load_scenario(out).workers.count == 8


@pytest.mark.parametrize("kwargs, message", [
    ({"cpus": 0}, "Received: cpus=0"),
    ({"cpus": "many"}, "Received: cpus='many'"),
    ({"cpus": 2, "latency": -1.0}, "Received: latency=-1.0"),
])
def test_bad_calibration_arguments(dedicated_trace, kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulator.calibrate(dedicated_trace, **kwargs)


def test_trace_without_train_steps_is_rejected(tmp_path):
    path = tmp_path / "empty.csv"
    write_trace(path, [])
    with pytest.raises(ValueError, match="no train steps"):
        simulator.calibrate(path)
    assert main(["calibrate", str(path)]) == 2


def _sync_trace(steps=40, gradient=0.010, step=0.015, workers=4):
    """A sync run's trace: every step, `workers` gradient functions, then an apply."""
    from kerasps.policy.trace import StepEvent

    events = []
    for v in range(steps):
        start = v * step
        for w in range(workers):
            events.append(StepEvent(worker=w, step=len(events), start=start,
                                    end=start + gradient, version=v))
        events.append(StepEvent(worker=0, step=len(events), start=start + gradient,
                                end=start + step, kind="apply", version=v))
    return events


def test_sync_prediction_reproduces_the_traced_step_and_a_straggler():
    from simulator.calibrate import predict_sync_step_time

    trace = _sync_trace()
    assert predict_sync_step_time(trace, num_workers=4) == pytest.approx(0.015, rel=1e-6)
    # Worker 0 held back 45 ms per batch: without a backup every step waits for it; with
    # one, the others make the step at the traced pace.
    slow = predict_sync_step_time(trace, num_workers=4, straggler_delay=0.045)
    assert slow == pytest.approx(0.045, rel=0.05)
    backed = predict_sync_step_time(trace, num_workers=4, backup_workers=1,
                                    straggler_delay=0.045)
    assert backed == pytest.approx(0.015, rel=0.05)


def test_sync_prediction_refuses_an_async_trace():
    from simulator.calibrate import predict_sync_step_time

    with pytest.raises(ValueError, match="trace of a sync"):
        predict_sync_step_time(synthetic_trace(2, 20, 0.01, 100.0), num_workers=2)


def test_elastic_prediction_follows_joins_and_leaves_of_dedicated_workers():
    """Dedicated workers: throughput scales with the pool, and goes back after a leave."""
    from simulator.calibrate import predict_elastic_throughput

    trace = synthetic_trace(num_workers=2, steps_per_worker=400, shift=0.01, rate=100.0)
    phases = predict_elastic_throughput(trace, workers=2, events=[(20.0, 2), (40.0, -2)],
                                        duration=60.0, cpus=None)
    one_worker = 1 / (0.01 + 0.01)  # steps/s of one worker (mean step 0.02 s)
    assert phases[0] == pytest.approx(2 * one_worker, rel=0.1)
    assert phases[1] == pytest.approx(4 * one_worker, rel=0.1)
    assert phases[2] == pytest.approx(phases[0], rel=0.1)


def test_elastic_prediction_on_a_shared_cpu_saturates():
    from simulator.calibrate import predict_elastic_throughput

    trace = synthetic_trace(num_workers=2, steps_per_worker=400, shift=0.01, rate=100.0)
    phases = predict_elastic_throughput(trace, workers=2, events=[(20.0, 2), (40.0, -2)],
                                        duration=60.0, cpus=1, cores_per_step="all")
    assert phases[1] == pytest.approx(phases[0], rel=0.15)  # one core: more workers, no gain


# A fault-free job of 10 s start-up and 1000 steps in 100 s (2 workers, 0.2 s a step each;
# steps end every 0.2 s, 2 at a time), backed up every 25 steps; kills 52.55 s into training.
JOB = dict(training_time=100.0, steps=1000, workers=2, ps=2, checkpoint_every=25)


def predicted_wall(goodput):
    return 110.0 / goodput


def test_goodput_without_kills_is_one():
    assert predict_goodput({}, [], 110.0, **JOB) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["chief", "ps"])
def test_a_chief_or_ps_kill_costs_its_recovery_and_the_steps_since_the_backup(kind):
    goodput = predict_goodput({kind: 5.0}, [(52.55, kind, 1 if kind == "ps" else 0)], 110.0,
                              **JOB)
    # Back 5 s later at the backup of step 500: the 24 steps since run again (2.4 s).
    assert predicted_wall(goodput) == pytest.approx(10 + 52.55 + 5.0 + 50.0)


def test_a_worker_kill_halves_the_rate_while_it_is_away():
    goodput = predict_goodput({"worker": 10.0}, [(52.55, "worker", 1)], 110.0, **JOB)
    # 10 s at half rate (5 s), and the 0.15 s its lost step had run.
    assert predicted_wall(goodput) == pytest.approx(110 + 5.0 + 0.15)


def test_kills_need_a_known_kind_with_a_recovery_time():
    with pytest.raises(ValueError, match=r"argument `kill_schedule`.*Received: kinds \['ps'\]"):
        predict_goodput({"chief": 1.0}, [(1.0, "ps", 0)], 110.0, **JOB)
    with pytest.raises(ValueError, match=r"argument `kill_schedule`.*kinds \['master'\]"):
        predict_goodput({"master": 1.0}, [(1.0, "master", 0)], 110.0, **JOB)
    with pytest.raises(ValueError, match=r"argument `training_time`.*training_time=120"):
        predict_goodput({}, [], 110.0, **{**JOB, "training_time": 120})
