"""What the simulator reports: step-time percentiles, the global step interval, ps lines
and plot panels only where modelled, goodput by time, and the errors of its command line."""

import dataclasses
import importlib

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import simulator  # noqa: E402
from kerasps.policy.trace import write_trace  # noqa: E402
from simulator import plots  # noqa: E402
from simulator.calibrate import synthetic_trace  # noqa: E402
from simulator.cli import main  # noqa: E402

from .builders import make  # noqa: E402

EXPONENTIAL = {"distribution": "exponential", "rate": 10.0}
CONSTANT = {"distribution": "constant", "value": 1.0}
MODEL = {"variables": [{"name": "w", "shape": [1000, 250]}]}


def sync(backups, **sections):
    return make(20, EXPONENTIAL, training={"mode": "sync", "steps": 2000,
                                           "backup_workers": backups}, **sections)


# 12. Step times.


def test_worker_step_times_include_the_steps_backup_workers_made_others_drop():
    """The same workers have the same step-time distribution, with backups or without."""
    without, with_backups = simulator.run(sync(0)), simulator.run(sync(4))
    assert with_backups.gradients_dropped > 4 * 1900
    a = without.summary()["worker_step_time"]
    b = with_backups.summary()["worker_step_time"]
    assert b["dropped"] == with_backups.gradients_dropped and a["dropped"] == 0
    assert b["count"] == with_backups.step_times.size + with_backups.gradients_dropped
    assert b["p99"] == pytest.approx(a["p99"], rel=0.1)
    assert b["p50"] == pytest.approx(a["p50"], rel=0.1)
    assert "dropped by backup workers" in str(with_backups)


def test_dropped_steps_whose_time_is_unknown_are_left_out_and_the_label_says_so():
    # Under ps contention a step's time includes its queueing, unknown for a cancelled step.
    result = simulator.run(make(6, EXPONENTIAL, model=MODEL,
                                ps={"service_rate": 1e9, "contention": True},
                                training={"mode": "sync", "steps": 200, "backup_workers": 2}))
    assert result.gradients_dropped > 0
    assert result.summary()["worker_step_time"]["dropped"] == 0
    assert "completed steps only" in str(result)


def test_the_global_step_interval_is_in_the_text_summary_and_the_sweep_table(tmp_path, capsys):
    result = simulator.run(sync(2))
    interval = result.summary()["global_step_interval"]
    assert f"p50 {interval['p50']:.4f} s, p99 {interval['p99']:.4f} s" in str(result)
    path = tmp_path / "s.toml"
    path.write_text("[workers]\ncount = 4\nstep_time = { distribution = 'exponential', "
                    "rate = 10.0 }\n[training]\nmode = 'sync'\nsteps = 100\n")
    assert main(["sweep", str(path), "--vary", "training.backup_workers=0,1"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert "global_step_interval.p50" in header and "global_step_interval.p99" in header


# 13. Only what the scenario models.


def test_no_ps_lines_when_the_scenario_places_nothing_on_ps_tasks():
    assert "ps0" not in str(simulator.run(sync(0)))
    assert "ps0 " in str(simulator.run(make(2, EXPONENTIAL, model=MODEL,
                                            training={"steps": 50})))


def test_the_summary_figure_has_no_empty_panels():
    bare = plots.plot_result(simulator.run(sync(1)))
    assert [ax.get_title() for ax in bare.axes] == ["Progress", "Step times"]
    full = plots.plot_result(simulator.run(make(4, EXPONENTIAL, model=MODEL,
                                                training={"steps": 200})))
    assert [ax.get_title() for ax in full.axes] == ["Progress", "Step times", "Staleness",
                                                    "ps load"]
    assert all(ax.has_data() for ax in full.axes)


# 14. Goodput.


def test_goodput_is_the_share_of_wall_time_spent_on_steps_that_count():
    # One worker, 1 s steps, a checkpoint every 10 steps; the ps fails at t = 15.5 and is
    # back 4 s later: steps 11..15 roll back; steps 11..20 run again from t = 19.5.
    result = simulator.run(make(1, CONSTANT, training={"steps": 20},
                                checkpoint={"every": 10},
                                failures={"events": [{"time": 15.5, "target": "ps",
                                                      "downtime": 4.0}]}))
    assert result.elapsed == pytest.approx(29.5)
    assert result.goodput == pytest.approx(20 / 29.5)
    assert result.applied_fraction == pytest.approx(20 / (20 + 5 + 1))
    assert result.rolled_back_steps == 5
    text = str(result)
    assert "goodput              0.678" in text and "5 global steps rolled back" in text


def test_checkpoint_pauses_are_not_goodput_and_backups_do_not_lower_it():
    paused = simulator.run(make(1, CONSTANT, training={"steps": 10},
                                checkpoint={"every": 5, "duration": 2.0}))
    assert paused.elapsed == pytest.approx(12.0)
    assert paused.goodput == pytest.approx(10 / 12)
    backups = simulator.run(sync(4))
    assert backups.goodput == pytest.approx(1.0)
    assert backups.applied_fraction < 0.85
    summary = backups.summary()
    assert "steps_lost" not in summary and summary["rolled_back_steps"] == 0


# 15. Errors of the command line and of scenarios.


def test_sweep_validates_its_metric_before_running(tmp_path, capsys, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text("[workers]\ncount = 4\nstep_time = { distribution = 'exponential', "
                    "rate = 10.0 }\n")
    monkeypatch.setattr(importlib.import_module("simulator.sweep"), "run",
                        lambda *a, **k: pytest.fail("it ran"))
    assert main(["sweep", str(path), "--vary", "workers.count=2,4", "--metric",
                 "step_per_second", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for `--metric`" in err and "Received: --metric step_per_second" in err
    assert "steps_per_second" in err and "global_step_interval.p99" in err
    assert not (tmp_path / "p.png").exists()


def test_plot_sweep_names_the_valid_metrics():
    points = simulator.sweep(make(2, training={"steps": 20}), {"workers.count": [1, 2]})
    with pytest.raises(ValueError, match=r"argument `y`.*steps_per_second.*Received: y='x'"):
        plots.plot_sweep(points, x="workers.count", y="x")


@pytest.mark.parametrize("text, message", [
    ("[worker]\ncount = 4\nstep_time = { distribution = 'exponential', rate = 50.0 }\n",
     "Unknown key `worker` in s.toml: did you mean `workers`?"),
    ("[workers]\ncount = 4\nstep_time = { distribution = 'exponential', rat = 50.0 }\n",
     "Unknown key `workers.step_time.rat` in s.toml: did you mean `rate`?"),
    ("[workers]\ncont = 4\ncount = 4\nstep_time = { distribution = 'constant', value = 1.0 }\n",
     "Unknown key `workers.cont` in s.toml: did you mean `count`?"),
])
def test_unknown_keys_are_named_even_where_a_required_key_is_missing(tmp_path, text, message):
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(simulator.ScenarioError) as info:
        simulator.load_scenario(path)
    assert message in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("workers.count=-3", "Invalid value for `workers.count` in --set workers.count=-3: it "
                         "must be positive. Received: workers.count=-3"),
    ("workers.cont=3", "Unknown key `workers.cont` in --set workers.cont=3: did you mean "
                       "`count`?"),
    ("training.backup_workers=9", "Invalid value for `training.backup_workers` in --set "
                                  "training.backup_workers=9"),
])
def test_set_errors_blame_the_override_not_the_file(tmp_path, capsys, override, message):
    path = tmp_path / "s.toml"
    path.write_text("[workers]\ncount = 4\nstep_time = { distribution = 'exponential', "
                    "rate = 10.0 }\n[training]\nmode = 'sync'\n")
    assert main(["run", str(path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "s.toml" not in err


def test_calibrate_warns_on_a_poor_fit(tmp_path):
    good = simulator.calibrate(synthetic_trace(2, 500, shift=0.05, rate=20.0, seed=1))
    assert good.pooled.ks < 0.05 and "warning" not in good.report()
    # Two step times, 0.1 s and 0.3 s: nothing like a shifted exponential.
    events = synthetic_trace(2, 500, shift=0.05, rate=20.0, seed=1)
    for i, e in enumerate(events):
        events[i] = dataclasses.replace(e, end=e.start + (0.1 if i % 2 else 0.3))
    path = tmp_path / "t.csv"
    write_trace(path, events)
    poor = simulator.calibrate(path)
    assert poor.pooled.ks > 0.2
    assert f"warning: poor fit (KS distance {poor.pooled.ks:.3f} > 0.1)" in poor.report()


def test_vary_errors_blame_the_sweep_value(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text("[workers]\ncount = 4\nstep_time = { distribution = 'exponential', "
                    "rate = 10.0 }\n")
    assert main(["sweep", str(path), "--vary", "training.backup_workers=0,5"]) == 2
    err = capsys.readouterr().err
    assert ("Invalid value for `training.backup_workers` in --vary training.backup_workers=5: "
            "backup workers need") in err and "s.toml" not in err
