"""Parameter sweeps: one run per combination of overridden scenario keys."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from simulator.metrics import Result, rows_to_csv
from simulator.scenario import Scenario
from simulator.simulation import run

__all__ = ["SweepPoint", "sweep", "sweep_rows", "sweep_csv"]


class SweepPoint(tuple):
    """`(overrides, result)` for one combination of a sweep."""

    @property
    def overrides(self) -> dict:
        return self[0]

    @property
    def result(self) -> Result:
        return self[1]


def sweep(scenario: Scenario, vary: Mapping[str, Sequence], *, repeats: int = 1,
          source: str | None = None) -> list[SweepPoint]:
    """Runs `scenario` for every combination of the values in `vary`.

    Args:
        scenario: the base scenario.
        vary: dotted keys to their values, e.g.
            `{"training.backup_workers": [0, 1, 2], "ps.count": [1, 2]}`.
        repeats: runs per combination, with seeds `seed, seed + 1, ...`.
        source: what errors name as the values' origin (`"--vary"`); by default the
            overrides and the scenario's file.

    Returns:
        One `SweepPoint` per run, in the order of `itertools.product`. Every
        combination is validated before anything runs, so a bad value fails fast.
    """
    keys = list(vary)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*vary.values())]
    plans = []
    for combo in combos:
        for r in range(repeats):
            overrides = {**combo, "seed": scenario.seed + r} if repeats > 1 else combo
            label = None if source is None else " ".join(
                [source] + [f"{k}={v!r}" for k, v in combo.items()])
            plans.append((overrides, scenario.with_overrides(overrides, source=label)))
    return [SweepPoint((overrides, run(s))) for overrides, s in plans]


def sweep_rows(points: Sequence[SweepPoint]) -> list[dict]:
    """One flat dict per run: the overridden keys, then the flat summary."""
    return [{**p.overrides, **p.result.flat_summary()} for p in points]


def sweep_csv(points: Sequence[SweepPoint], path=None) -> str:
    """`sweep_rows` as CSV; written to `path` if given."""
    return rows_to_csv(sweep_rows(points), path)
