"""What the figures say: a step-time histogram that shows a heavy tail, sweep plots with
titles, units and integer ticks, and the words and units of metrics and scenario keys."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import simulator  # noqa: E402
from simulator import plots  # noqa: E402
from simulator.metrics import metric_names  # noqa: E402
from simulator.sweep import sweep_rows  # noqa: E402

from .builders import make  # noqa: E402

# Sync SGD with a 1% tail of 10x (or worse) steps, as stragglers_backup.toml.
TAIL = {"tail_probability": 0.01, "tail_slowdown": 10.0, "tail_alpha": 2.5}


@pytest.fixture(scope="module")
def heavy_tail():
    return simulator.run(make(20, {"distribution": "shifted_exponential", "shift": 0.08,
                                   "rate": 50.0},
                              name="heavy_tail", stragglers=TAIL,
                              training={"mode": "sync", "steps": 300, "backup_workers": 2}))


def test_step_time_histogram_has_log_axes_that_show_the_tail(heavy_tail):
    ax = plots.plot_step_times(heavy_tail)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "worker step time (s, log scale)"
    assert "heavy_tail" in ax.get_title()
    bars = [p for p in ax.patches if p.get_height() > 0]
    edges = np.array([p.get_x() for p in ax.patches] + [ax.patches[-1].get_x()
                                                        + ax.patches[-1].get_width()])
    assert np.allclose(np.diff(np.log(edges)), np.log(edges[1] / edges[0]))  # log bins
    # The tail, a decade above the median, has bars of its own; one step is a visible bar.
    median = np.median(heavy_tail.worker_step_times)
    assert any(p.get_x() > 10 * median for p in bars)
    assert ax.get_ylim()[0] < 1 <= min(p.get_height() for p in bars)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("p99 ") and t.endswith(" s") for t in legend)
    assert any(t.startswith("longest ") for t in legend)


def test_summary_figure_names_the_scenario_and_keeps_the_log_histogram(heavy_tail, tmp_path):
    fig = plots.plot_result(heavy_tail)
    assert fig.get_suptitle().startswith("heavy_tail: ")
    histogram = fig.axes[1]
    assert histogram.get_title() == "Step times"  # the figure's title names the scenario
    assert histogram.get_xscale() == "log"
    fig.savefig(tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 10_000


def test_step_time_histogram_of_constant_steps_has_a_range():
    result = simulator.run(make(2, {"distribution": "constant", "value": 0.5}, name="flat",
                                training={"steps": 20}))
    ax = plots.plot_step_times(result)
    low, high = ax.get_xlim()
    assert low < 0.5 < high and ax.get_xscale() == "log"


@pytest.fixture(scope="module")
def backups():
    return simulator.sweep(make(4, name="tiny", training={"mode": "sync", "steps": 50}),
                           {"training.backup_workers": [0, 1, 3]})


def test_sweep_plot_has_a_title_labels_in_words_with_units_and_integer_ticks(backups):
    ax = plots.plot_sweep(backups, x="training.backup_workers", y="steps_per_second")
    title = ax.get_title()
    assert title.startswith("tiny: throughput against training.backup_workers")
    assert "training.backup_workers = 0, 1, 3 workers" in title
    assert ax.get_ylabel() == "throughput (steps/s)"
    assert ax.get_xlabel() == "training.backup_workers (workers)"
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    ax = plots.plot_sweep(backups, x="training.backup_workers",
                          y="global_step_interval.p99")
    assert ax.get_ylabel() == "global step interval p99 (s)"


def test_sweep_plot_says_how_repeats_and_a_second_key_are_drawn():
    points = simulator.sweep(make(4, name="grid", training={"mode": "sync", "steps": 30}),
                             {"training.backup_workers": [0, 1], "workers.batch_size": [1, 8]},
                             repeats=2)
    ax = plots.plot_sweep(points, x="training.backup_workers", y="examples_per_second")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "workers.batch_size=1", "workers.batch_size=8"]
    title = " ".join(ax.get_title().split())  # wrapped to the figure's width
    assert "mean of 2 seeds" in title and "a line per workers.batch_size" in title
    assert ax.get_ylabel() == "throughput (examples/s)"


def test_sweep_table_formats_each_column_alike(backups):
    from simulator.sweep import sweep_table

    text = sweep_table(sweep_rows(backups), ["training.backup_workers"],
                       ["steps_per_second", "applied_fraction"])
    keys, units, *rows = [line.split() for line in text.splitlines()]
    assert keys == ["training.backup_workers", "steps_per_second", "applied_fraction"]
    assert units == ["(workers)", "(steps/s)", "(fraction)"]
    assert [row[0] for row in rows] == ["0", "1", "3"]
    assert [row[2] for row in rows] == ["1.000", "0.750", "0.250"]
    assert len({len(row[1].partition(".")[2]) for row in rows}) == 1


def test_every_metric_and_the_usual_scenario_keys_have_words_and_units():
    from simulator.units import metric_label, metric_unit, parameter_unit

    for key in metric_names(2):
        assert metric_label(key) != key, key
    assert metric_unit("steps_per_second") == "steps/s"
    assert metric_unit("ps.1.traffic_bytes") == "bytes"
    assert metric_label("staleness.mean") == "staleness mean (updates)"
    assert metric_label("rolled_back_steps") == "global steps rolled back"  # no "(steps)"
    assert metric_label("no.such.key") == "no.such.key"
    assert parameter_unit("network.latency") == "s"
    assert parameter_unit("checkpoint.every") == "steps"
    assert parameter_unit("workers.step_time.rate") == "1/s"
    assert parameter_unit("model.placement") is None
