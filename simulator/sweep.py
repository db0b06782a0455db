"""Parameter sweeps: one run per combination of overridden scenario keys."""

from __future__ import annotations

import decimal
import itertools
import math
from collections.abc import Mapping, Sequence

from simulator.metrics import Result, rows_to_csv
from simulator.scenario import Scenario
from simulator.simulation import run
from simulator.units import metric_unit, parameter_unit

__all__ = ["SweepPoint", "sweep", "sweep_rows", "sweep_csv", "sweep_table"]


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


def sweep_table(rows: Sequence[dict], parameters: Sequence[str], metrics: Sequence[str]) -> str:
    """`sweep_rows` as a text table: the swept `parameters`, then the `metrics`.

    Two header lines, the keys (as in the CSV and for `--metric`) and their units in
    parentheses (blank where a key has none), then one line per row, right-aligned. Each
    column has one number of decimals: a parameter's as many as its most precise value
    needs (`0.0010` next to `0.0100`), a metric's four significant digits of its largest
    value (`1.000`, `0.950`); integers have none. Missing values are `-`.
    """
    columns = list(parameters) + list(metrics)
    units = [parameter_unit(c) for c in parameters] + [metric_unit(c) for c in metrics]
    cells = []
    for i, column in enumerate(columns):
        values = [row.get(column) for row in rows]
        decimals = (_exact_decimals if i < len(parameters) else _significant_decimals)(values)
        cells.append([_cell(v, decimals) for v in values])
    header = [f"({u})" if u else "" for u in units]
    widths = [max([len(c), len(h), 10] + [len(x) for x in col])
              for c, h, col in zip(columns, header, cells, strict=True)]
    lines = [columns, header] + [list(line) for line in zip(*cells, strict=True)]
    return "\n".join("  ".join(f"{x:>{w}}" for x, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def _numbers(values) -> list:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)]


def _exact_decimals(values) -> int | None:
    """Decimals that show every value of the column exactly (None: not a number column)."""
    numbers = _numbers(values)
    if not numbers:
        return None
    if all(isinstance(v, int) for v in numbers):
        return 0
    exponents = [decimal.Decimal(repr(float(v))).as_tuple().exponent for v in numbers]
    return min(max([0] + [-e for e in exponents]), 12)


def _significant_decimals(values) -> int | None:
    """Decimals that give the column's largest value four significant digits."""
    numbers = _numbers(values)
    if not numbers:
        return None
    if all(isinstance(v, int) for v in numbers):
        return 0
    largest = max(abs(v) for v in numbers)
    if largest == 0:
        return 3
    return min(max(3 - math.floor(math.log10(largest)), 0), 6)


def _cell(value, decimals: int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value) or decimals is None:
        return str(value)
    return f"{value:.{decimals}f}"
