"""The command line, and the promise that the simulator never imports TensorFlow."""

import csv
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from simulator.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "simulator" / "scenarios"

SMALL = """
name = "small"
[workers]
count = 4
step_time = { distribution = "exponential", rate = 10.0 }
[training]
mode = "sync"
steps = 200
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    return path


def test_run_writes_json_csv_trace_and_plot(small, tmp_path, capsys):
    out = {k: tmp_path / f"out.{k}" for k in ("json", "csv", "png")}
    trace = tmp_path / "trace.json"
    assert main(["run", str(small), "--json", str(out["json"]), "--csv", str(out["csv"]),
                 "--trace", str(trace), "--plot", str(out["png"]),
                 "--set", "training.backup_workers=1"]) == 0
    assert "small (sync, 4 workers" in capsys.readouterr().out
    data = json.loads(out["json"].read_text())
    assert data["steps"] == 200 and data["gradients_dropped"] >= 199
    assert len(list(csv.DictReader(out["csv"].open()))) == 1
    assert json.loads(trace.read_text())["traceEvents"]
    assert out["png"].stat().st_size > 0


def test_run_seed_makes_runs_reproducible(small, tmp_path):
    outs = []
    for i, seed in enumerate([5, 5, 6]):
        path = tmp_path / f"{i}.json"
        main(["run", str(small), "--seed", str(seed), "--json", str(path)])
        outs.append(json.loads(path.read_text())["elapsed"])
    assert outs[0] == outs[1] != outs[2]


def test_sweep_prints_a_row_per_value_and_writes_csv(small, tmp_path, capsys):
    path = tmp_path / "sweep.csv"
    assert main(["sweep", str(small), "--vary", "training.backup_workers=0,1,2",
                 "--csv", str(path), "--plot", str(tmp_path / "s.png")]) == 0
    rows = list(csv.DictReader(path.open()))
    assert [r["training.backup_workers"] for r in rows] == ["0", "1", "2"]
    lines = capsys.readouterr().out.strip().splitlines()
    table = [line for line in lines if not line.startswith("wrote ")]
    assert len(table) == 2 + 3  # keys, units, a row per value


def _wrote(out: str) -> list[str]:
    return [line.removeprefix("wrote ") for line in out.splitlines()
            if line.startswith("wrote ")]


def test_run_prints_the_path_of_each_file_it_writes(small, tmp_path, capsys):
    paths = [tmp_path / "runs" / name for name in ("step_times.png", "r.json", "r.csv",
                                                   "t.json")]
    paths[0].parent.mkdir()
    assert main(["run", str(small), "--plot", str(paths[0]), "--json", str(paths[1]),
                 "--csv", str(paths[2]), "--trace", str(paths[3])]) == 0
    wrote = _wrote(capsys.readouterr().out)
    assert sorted(wrote) == sorted(str(p) for p in paths)  # one line per file
    assert all(pathlib.Path(p).stat().st_size > 0 for p in wrote)


def test_sweep_prints_the_path_of_each_file_it_writes(small, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", str(small), "--vary", "training.backup_workers=0,1",
                 "--plot", "sweep.svg", "--csv", "sweep.csv", "--json", "sweep.json"]) == 0
    wrote = _wrote(capsys.readouterr().out)
    assert sorted(wrote) == ["sweep.csv", "sweep.json", "sweep.svg"]  # as given
    assert all((tmp_path / p).stat().st_size > 0 for p in wrote)
    assert "<svg" in (tmp_path / "sweep.svg").read_text()


def _table(text: str) -> dict:
    """The sweep table's columns, read by position (right-aligned under their keys):
    key -> (unit, cells)."""
    lines = [line for line in text.splitlines() if line and not line.startswith("wrote ")]
    spans = [m.span() for m in re.finditer(r"\S+", lines[0])]
    columns = {}
    for i, (_, end) in enumerate(spans):
        start = spans[i - 1][1] if i else 0
        field = [line[start:end].strip() for line in lines]
        columns[field[0]] = (field[1], field[2:])
    return columns


def test_sweep_table_has_units_and_one_number_of_decimals_per_column(small, capsys):
    # Sync, 4 workers: applied fraction 1, 0.75, 0.5 (shown as 1.000, 0.750, 0.500).
    assert main(["sweep", str(small), "--vary", "training.backup_workers=0,1,2"]) == 0
    table = _table(capsys.readouterr().out)
    units = {key: unit for key, (unit, _) in table.items()}
    assert units == {"training.backup_workers": "(workers)", "steps_per_second": "(steps/s)",
                     "examples_per_second": "(examples/s)", "goodput": "(fraction)",
                     "applied_fraction": "(fraction)", "global_step_interval.p50": "(s)",
                     "global_step_interval.p99": "(s)"}
    assert table["applied_fraction"][1] == ["1.000", "0.750", "0.500"]
    assert table["training.backup_workers"][1] == ["0", "1", "2"]
    for key, (_, cells) in table.items():
        decimals = {len(cell.partition(".")[2]) for cell in cells}
        assert len(decimals) == 1, (key, cells)


def test_sweep_table_shows_a_swept_float_with_the_decimals_its_values_need(small, capsys):
    assert main(["sweep", str(small), "--vary", "network.latency=0.01,0.0025,0.1"]) == 0
    unit, cells = _table(capsys.readouterr().out)["network.latency"]
    assert unit == "(s)" and cells == ["0.0100", "0.0025", "0.1000"]


def test_bad_scenario_exits_2_naming_key_and_value(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(SMALL.replace("rate = 10.0", "rate = -1.0"))
    assert main(["run", str(path)]) == 2
    assert ("Invalid value for `workers.step_time.rate` in bad.toml: it must be positive. "
            "Received: workers.step_time.rate=-1.0") in capsys.readouterr().err


def test_bad_sweep_value_exits_2(small, capsys):
    assert main(["sweep", str(small), "--vary", "training.backup_workers=1,4"]) == 2
    assert "training.backup_workers=4" in capsys.readouterr().err


def test_bad_set_syntax_exits_2(small, capsys):
    assert main(["run", str(small), "--set", "training.steps"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_python_m_simulator_runs_a_shipped_scenario_without_tensorflow(tmp_path):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['simulator', 'run', {str(SCENARIOS / 'placement_imbalance.toml')!r},"
        f" '--set', 'training.steps=200']\n"
        "try:\n"
        "    runpy.run_module('simulator', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "import simulator.calibrate, simulator.plots, kerasps.placement, kerasps.trace\n"
        "import kerasps.policy.restarts\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
        "print('NO_TF_OK')\n"
    )
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NO_TF_OK" in proc.stdout
    assert "placement_imbalance" in proc.stdout
