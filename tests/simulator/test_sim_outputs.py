"""Outputs: JSON, CSV, Perfetto traces, plots, and ps bytes from kerasps's placement."""

import csv
import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import simulator  # noqa: E402
from kerasps.policy import placement as kerasps_placement  # noqa: E402
from kerasps.policy.partitioners import MinSizePartitioner  # noqa: E402
from simulator import plots  # noqa: E402
from simulator import ps as simulator_ps  # noqa: E402
from simulator.perfetto import trace_events  # noqa: E402

from .builders import make  # noqa: E402

VARIABLES = [{"name": "embedding", "shape": [100_000, 16]},
             {"name": "dense/kernel", "shape": [256, 128]},
             {"name": "dense/bias", "shape": [128]}]


def test_ps_bytes_come_from_kerasps_placement():
    partitioner = {"kind": "min_size", "min_shard_bytes": 1 << 20, "max_shards": 3}
    scenario = make(4, ps={"count": 3}, training={"steps": 100},
                    model={"variables": VARIABLES, "partitioner": partitioner,
                           "placement": "greedy"})
    result = simulator.run(scenario)
    expected = kerasps_placement.plan(
        [(v["name"], v["shape"], "float32") for v in VARIABLES], 3,
        MinSizePartitioner(min_shard_bytes=1 << 20, max_shards=3), "greedy")
    assert [p["bytes"] for p in result.ps] == expected.bytes_per_ps(3)
    assert sum(p["bytes"] for p in result.ps) == (100_000 * 16 + 256 * 128 + 128) * 4


def test_simulator_reuses_not_copies_the_placement_code(monkeypatch):
    assert simulator_ps.placement_lib.plan is kerasps_placement.plan
    calls = []
    real_plan = kerasps_placement.plan
    # Patched in the module the simulator calls it from (kerasps' placement module, by
    # whichever of its names the simulator imports).
    monkeypatch.setattr(simulator_ps.placement_lib, "plan",
                        lambda *a, **k: calls.append(a) or real_plan(*a, **k))
    simulator.run(make(2, training={"steps": 10}, model={"variables": VARIABLES}))
    assert len(calls) == 1


def test_placement_imbalance_makes_the_hot_ps_the_bottleneck():
    # Each worker step holds ps task p for bytes_p / service_rate seconds.
    model = {"variables": [{"name": "big", "shape": [1000, 250]},  # 1 MB
                           {"name": "small", "shape": [250, 250]}]}  # 0.25 MB
    contended = make(50, {"distribution": "constant", "value": 0.01}, model=model,
                     ps={"count": 2, "service_rate": 1e8, "contention": True},
                     training={"steps": 2000})
    result = simulator.run(contended)
    assert result.steps_per_second == pytest.approx(1 / 0.01, rel=0.02)  # 1e6 B / 1e8 B/s
    assert result.ps[0]["utilization"] == pytest.approx(1.0, abs=0.02)
    assert result.ps[1]["utilization"] == pytest.approx(0.25, abs=0.02)
    sharded = simulator.run(contended.with_overrides(
        {"model.partitioner": {"kind": "fixed_shards", "num_shards": 2}}))
    assert sharded.steps_per_second > 1.5 * result.steps_per_second


def test_folded_network_cost_adds_to_every_step():
    model = {"variables": [{"name": "w", "shape": [1000, 250]}]}  # 1e6 bytes
    result = simulator.run(make(1, {"distribution": "constant", "value": 1.0}, model=model,
                                network={"bandwidth": 1e6, "latency": 0.01},
                                training={"steps": 10}))
    assert result.step_time == pytest.approx(1.0 + 2.0 + 4 * 0.01)
    assert result.ps[0]["traffic_bytes"] == 10 * 2 * 1_000_000


@pytest.fixture(scope="module")
def result():
    return simulator.run(make(4, training={"mode": "async", "steps": 400},
                              checkpoint={"every": 100},
                              failures={"events": [{"time": 30.0, "target": "worker",
                                                    "downtime": 5.0}]}),
                         record_events=True)


def test_json_output_has_the_headline_metrics(result, tmp_path):
    result.to_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["steps"] == 400
    assert data["steps_per_second"] == pytest.approx(result.steps_per_second)
    for key in ("examples_per_second", "goodput", "applied_fraction", "gradients_dropped",
                "rolled_back_steps", "global_step_interval",
                "worker_step_time", "staleness", "ps", "failures", "checkpoints"):
        assert key in data
    assert data["staleness"]["mean"] == pytest.approx(result.mean_staleness)


def test_csv_output_is_one_flat_row(result, tmp_path):
    result.to_csv(tmp_path / "r.csv")
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert len(rows) == 1
    assert float(rows[0]["goodput"]) == pytest.approx(result.goodput)
    assert "staleness.mean" in rows[0] and "ps.0.utilization" in rows[0]


def test_perfetto_trace_has_a_slice_per_worker_step(result, tmp_path):
    simulator.to_perfetto(result, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(result.events)
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert any(e["name"] == "step (lost)" for e in slices)
    assert any(e["ph"] == "i" and e["cat"] == "failure" for e in events)
    assert all(math.isfinite(e["ts"]) and e["dur"] >= 0 for e in slices)


def test_perfetto_needs_recorded_events():
    with pytest.raises(ValueError, match="record_events=True"):
        trace_events(simulator.run(make(2, training={"steps": 10})))


def test_plots_draw_without_a_display(result, tmp_path):
    fig = plots.plot_result(result)
    fig.savefig(tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 10_000
    points = simulator.sweep(make(4, training={"mode": "sync", "steps": 50}),
                             {"training.backup_workers": [0, 1]})
    ax = plots.plot_sweep(points, x="training.backup_workers", y="step_time")
    assert len(ax.lines) >= 1


def test_result_prints_a_summary(result):
    text = str(result)
    assert "steps/s" in text and "goodput" in text and "staleness" in text


def test_sweep_runs_every_combination_and_repeats_with_new_seeds():
    points = simulator.sweep(make(6, training={"mode": "sync", "steps": 200}),
                             {"training.backup_workers": [0, 2], "workers.batch_size": [1, 8]},
                             repeats=2)
    assert len(points) == 8
    assert {p.overrides["seed"] for p in points} == {0, 1}
    by_backups = {}
    for p in points:
        by_backups.setdefault(p.overrides["training.backup_workers"], []).append(
            p.result.step_time)
    assert max(by_backups[2]) < min(by_backups[0])


def test_sweep_validates_every_value_before_running():
    with pytest.raises(simulator.ScenarioError, match="training.backup_workers=9"):
        simulator.sweep(make(4, training={"mode": "sync"}),
                        {"training.backup_workers": [0, 9]})


def test_full_duplex_links_carry_reads_and_gradients_at_once():
    # One ps task with 1e6 bytes, links of 1e6 B/s, 2 workers with negligible compute. A
    # half-duplex link holds each step's read and gradient in turn (2 s a step: 0.5 steps/s);
    # a full-duplex one (as a switched Ethernet link, and the network bench's) carries one
    # worker's read while the other's gradient arrives: 1 s of each direction a step.
    model = {"variables": [{"name": "w", "shape": [1000, 250]}]}
    half = make(2, {"distribution": "constant", "value": 1e-6}, model=model,
                ps={"contention": True}, network={"bandwidth": 1e6}, training={"steps": 200})
    assert half.network.duplex == "half"
    assert simulator.run(half).steps_per_second == pytest.approx(0.5, rel=0.02)
    full = half.with_overrides({"network.duplex": "full"})
    result = simulator.run(full)
    assert result.steps_per_second == pytest.approx(1.0, rel=0.02)
    assert result.ps[0]["utilization"] == pytest.approx(1.0, abs=0.02)
    # Without contention the folded cost of a step is the same either way: read, then send.
    folded = make(1, {"distribution": "constant", "value": 1.0}, model=model,
                  network={"bandwidth": 1e6, "duplex": "full"}, training={"steps": 10})
    assert simulator.run(folded).step_time == pytest.approx(3.0)
    with pytest.raises(simulator.ScenarioError, match="duplex"):
        half.with_overrides({"network.duplex": "simplex"})
