"""Matplotlib plots of results and sweeps.

Each function draws on `ax` if given (so notebooks can lay out their own
figures), else on a new `matplotlib.figure.Figure`, which needs no display
and can be saved with `fig.savefig(path)`. Matplotlib is imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from simulator.metrics import Result

__all__ = ["plot_step_times", "plot_staleness", "plot_progress", "plot_ps", "plot_result",
           "plot_sweep"]


def _axes(ax):
    if ax is not None:
        return ax
    from matplotlib.figure import Figure

    return Figure(figsize=(6, 4), layout="constrained").add_subplot()


def plot_step_times(result: Result, ax=None):
    """Histogram of worker step durations (`Result.worker_step_times`: with the steps
    backup workers made others drop, where known), with the mean marked."""
    ax = _axes(ax)
    times = result.worker_step_times
    ax.hist(times, bins=60, color="tab:blue", alpha=0.8)
    if times.size:
        ax.axvline(times.mean(), color="k", ls="--", label="mean")
        ax.legend()
    ax.set(xlabel="worker step time (s)", ylabel="worker steps", title="Step times")
    return ax


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
    panels = [plot_progress, plot_step_times]
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

    Runs repeated with several seeds are averaged, with their range as error bars.

    Raises:
        ValueError: if `y` is not a numeric key of the flat summary (naming those that are).
    """
    if points:
        names = [k for k, v in points[0].result.flat_summary().items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if y not in names:
            raise ValueError(f"Invalid value for argument `y`: expected a metric of the flat "
                             f"summary, one of {names}. Received: y={y!r}")
    ax = _axes(ax)
    groups: dict = {}
    for point in points:
        groups.setdefault(point.overrides[x], []).append(point.result.flat_summary()[y])
    xs = sorted(groups)
    means = np.array([np.mean(groups[v]) for v in xs])
    low = means - np.array([np.min(groups[v]) for v in xs])
    high = np.array([np.max(groups[v]) for v in xs]) - means
    ax.errorbar(xs, means, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.set(xlabel=x, ylabel=y)
    return ax
