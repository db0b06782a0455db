"""Matplotlib plots of results and sweeps.

Each function draws on `ax` if given (so notebooks can lay out their own
figures), else on a new `matplotlib.figure.Figure`, which needs no display
and can be saved with `fig.savefig(path)`. Matplotlib is imported lazily.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Sequence

import numpy as np

from simulator.metrics import Result
from simulator.units import metric_label, metric_words, parameter_unit, with_unit

__all__ = ["plot_step_times", "plot_staleness", "plot_progress", "plot_ps", "plot_result",
           "plot_sweep"]


def _axes(ax):
    if ax is not None:
        return ax
    from matplotlib.figure import Figure

    return Figure(figsize=(6, 4), layout="constrained").add_subplot()


def plot_step_times(result: Result, ax=None, *, title: str | None = None):
    """Histogram of worker step durations (`Result.worker_step_times`: with the steps
    backup workers made others drop, where known), on log-scaled axes: the bins are
    spaced evenly in log(time) from the shortest step to the longest, and the counts are
    on a log scale, so that a heavy tail of a few slow steps shows next to the bulk. The
    mean, the p99 and the longest step are marked and given in the legend.

    Args:
        title: the axes' title; by default "Worker step times: <scenario name>"
            (`plot_result` names the scenario in the figure's title instead).
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = _axes(ax)
    ax.set_xscale("log")
    ax.set_yscale("log")
    times = result.worker_step_times
    times = times[np.isfinite(times) & (times > 0)]
    if times.size:
        low, high = times.min(), times.max()
        if high <= low * 1.01:  # (nearly) constant steps: a narrow range around them
            low, high = low / 1.1, high * 1.1
        counts, _, _ = ax.hist(times, bins=np.geomspace(low, high, 61), color="tab:blue",
                               alpha=0.8, label=f"{times.size:,} steps")
        p99 = np.percentile(times, 99)
        ax.axvline(times.mean(), color="k", ls="--", label=f"mean {_seconds(times.mean())}")
        ax.axvline(p99, color="tab:red", ls=":", label=f"p99 {_seconds(p99)}")
        tail = int((times > p99).sum())
        ax.plot([], [], " ", label=f"longest {_seconds(times.max())}; "
                                   f"{tail:,} step{'s' * (tail != 1)} above p99")
        # A bin of one step stands above the bottom; the bars fill the lower 65% of the
        # height, leaving the legend room above them.
        ax.set_ylim(0.5, 0.5 * (2 * counts.max()) ** (1 / 0.65))
        ax.legend(fontsize=8, loc="upper right")
        decades = np.log10(high / low)
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades <= 3 else
                                              (1.0,)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    # 0.1 s and 1,000 steps rather than 10^-1 and 10^3.
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    tallest = ax.get_ylim()[1] if not times.size else 10 * counts.max()
    ax.yaxis.set_major_formatter(FuncFormatter(  # no labels in the legend's room
        lambda value, _: "" if value > tallest else f"{value:,.0f}" if value >= 1
        else f"{value:g}"))
    ax.set(xlabel="worker step time (s, log scale)", ylabel="worker steps (log scale)",
           title=f"Worker step times: {result.name}" if title is None else title)
    return ax


def _seconds(value: float) -> str:
    return f"{value:.3g} s"


def plot_staleness(result: Result, ax=None):
    """Histogram of gradient staleness (async runs)."""
    ax = _axes(ax)
    if result.staleness.size:
        counts = np.bincount(result.staleness)
        ax.bar(np.arange(counts.size), counts, width=1.0, color="tab:orange")
    ax.set(xlabel="staleness (updates)", ylabel="gradients", title="Staleness")
    return ax


def plot_progress(result: Result, ax=None):
    """Global step against simulated time, with failures (red) and checkpoints (grey)."""
    ax = _axes(ax)
    ax.plot(result.step_ends, np.arange(1, result.step_ends.size + 1), color="tab:green")
    for time, *_ in result.checkpoints:
        ax.axvline(time, color="0.8", lw=0.5, zorder=0)
    for time, actor, *_ in result.failures:
        ax.axvline(time, color="tab:red", lw=1, alpha=0.7 if actor.startswith("w") else 1)
    ax.set(xlabel="simulated time (s)", ylabel="global step", title="Progress")
    return ax


def plot_ps(result: Result, ax=None):
    """Utilization of each ps task, labelled with the bytes placed on it."""
    ax = _axes(ax)
    index = [p["index"] for p in result.ps]
    ax.bar(index, [p["utilization"] for p in result.ps], color="tab:purple")
    for p in result.ps:
        ax.annotate(f"{p['bytes'] / 2**20:.1f} MiB", (p["index"], p["utilization"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="ps task", ylabel="utilization", title="ps load", xticks=index)
    return ax


def plot_result(result: Result, fig=None):
    """A summary figure: progress and step times, then staleness (async runs) and ps load
    (scenarios that place something on ps tasks), two panels a row."""
    panels = [plot_progress, functools.partial(plot_step_times, title="Step times")]
    if result.staleness.size:
        panels.append(plot_staleness)
    if result.models_ps:
        panels.append(plot_ps)
    rows = (len(panels) + 1) // 2
    if fig is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 3.5 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False).ravel()
    for panel, ax in zip(panels, axes):
        panel(result, ax)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    fig.suptitle(f"{result.name}: {result.steps_per_second:.3g} steps/s, "
                 f"goodput {result.goodput:.2f}")
    return fig


def plot_sweep(points: Sequence, x: str, y: str = "steps_per_second", ax=None,
               label: str | None = None):
    """Plots metric `y` (a key of `Result.flat_summary()`) against swept key `x`.

    Runs repeated with several seeds are averaged, with their range as error bars. Where
    the sweep varied other keys too (a grid), each combination of their values is a line
    of its own, named in the legend. The axes are labelled in words with units
    ("throughput (steps/s)", "training.backup_workers (workers)"), an integer `x` has
    integer ticks, and the title names the scenario, the metric and the values swept.

    Raises:
        ValueError: if `y` is not a numeric key of the flat summary (naming those that are).
    """
    if points:
        names = [k for k, v in points[0].result.flat_summary().items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if y not in names:
            raise ValueError(f"Invalid value for argument `y`: expected a metric of the flat "
                             f"summary, one of {names}. Received: y={y!r}")
    from matplotlib.ticker import MaxNLocator

    ax = _axes(ax)
    others = [k for k in (points[0].overrides if points else {}) if k not in (x, "seed")]
    lines: dict = {}
    for point in points:
        key = tuple(_plain(point.overrides[k]) for k in others)
        lines.setdefault(key, {}).setdefault(_plain(point.overrides[x]), []).append(
            point.result.flat_summary()[y])
    for key, groups in lines.items():
        xs = sorted(groups)
        means = np.array([np.mean(groups[v]) for v in xs])
        low = means - np.array([np.min(groups[v]) for v in xs])
        high = np.array([np.max(groups[v]) for v in xs]) - means
        name = ", ".join(f"{k}={v}" for k, v in zip(others, key, strict=True))
        if label is not None:
            name = f"{label}, {name}" if name else label
        ax.errorbar(xs, means, yerr=[low, high], marker="o", capsize=3, label=name or None)
    values = sorted({_plain(p.overrides[x]) for p in points}, key=lambda v: (str(type(v)), v))
    if values and all(isinstance(v, int) for v in values):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=with_unit(x, parameter_unit(x)), ylabel=metric_label(y))
    ax.set_title(_sweep_title(points, x, y, values, others), fontsize=10)
    if len(lines) > 1 or label is not None:
        ax.legend(fontsize=8)
    return ax


def _plain(value):
    """A swept value as a point of an axis: numbers and strings as they are, booleans as
    in TOML ("true"), tables and arrays as text (a category each)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return value
    return str(value)


def _sweep_title(points, x: str, y: str, values: list, others: list) -> str:
    """"<scenario>: <metric> against <x>", the values swept, then how repeats and other
    swept keys are drawn; wrapped to the width of a figure."""
    name = points[0].result.name if points else ""
    shown = [str(v) for v in values]
    if len(shown) > 8:
        shown = shown[:3] + ["..."] + shown[-2:]
    unit = parameter_unit(x)
    lines = [f"{name + ': ' if name else ''}{metric_words(y)} against {x}",
             f"{x} = {', '.join(shown)}{' ' + unit if unit else ''}"]
    notes = []
    seeds = {p.overrides.get("seed") for p in points}
    if len(seeds) > 1:
        notes.append(f"mean of {len(seeds)} seeds, bars from min to max")
    if others:
        notes.append(f"a line per {', '.join(others)}")
    if notes:
        lines.append("; ".join(notes))
    return "\n".join(textwrap.fill(line, 72) for line in lines)
