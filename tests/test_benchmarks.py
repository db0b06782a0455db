"""Every benchmark in `benchmarks/` still runs: its `--quick` smoke run, started from the
repository's root as a user would start it, exits 0 and prints its result.

A smoke run's figures are not measurements (tiny sizes, a shared machine): only that it ran
through is asserted, and that it wrote no record. Benchmarks with a tf_keras anchor leave
its rows out when tf_keras is not installed (CI installs `.[test]` only).
"""

import re
from pathlib import Path

import pytest

from tests.launched import run_with_deadline

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "records"
# A generous bound for 2 loaded cores, never a timing assertion: a run past it hangs.
DEADLINE = 420
# `python SCRIPT ARGS` as `python -c` (what `run_with_deadline` runs): the script as
# __main__, its own folder first on sys.path, as Python puts it.
PROGRAM = ("import os, runpy, sys; sys.argv = sys.argv[1:]; "
           "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
           "runpy.run_path(sys.argv[0], run_name='__main__')")


def benchmark(script, result, *marks):
    """A case: `python benchmarks/<script>.py --quick`, and a regex its stdout matches."""
    return pytest.param(f"benchmarks/{script}.py", result, marks=marks, id=script)


BENCHMARKS = [
    benchmark("simulator_speed", r"cost per worker-step at 1000 vs 10 workers"),
    benchmark("calibration", r"worst prediction error"),
    benchmark("crossings", r"\d+ tensors cross tasks per step"),
    benchmark("fit_throughput", r"\| kerasps \| 1 \| \d"),
    benchmark("fit_overhead", r"keras3 +spe=1 +cpu"),
    benchmark("embedding_scaling", r"\| 20,000 \| adagrad \|"),
    benchmark("stragglers", r"Targets: sync \+ 1 backup"),
    benchmark("hybrid", r"\| hybrid \+ 1 backup \| \d"),
    benchmark("keras_rs_tables", r"### Quality: AUC"),
    benchmark("dynamic_embedding", r"### Faults: ps 1 SIGKILLed"),
    benchmark("input_throughput", r"\| `DatasetCreator`, `exactly_once=True` \| 4096 \| 0 \| 0 \|"),
    benchmark("faults", r"\| ps_killed \| kerasps \| 1/1 \|"),
    # A worker, a ps task and the chief killed in turn; it exits 1 unless every step was
    # applied within the at-least-once bound.
    benchmark("chaos", r"\| 1 \| yes \| \d+ / 1200 \| 3 \(1, 1, 1\) \|"),
    benchmark("network", r"largest error, other rows"),
    benchmark("on_ray", r"\| ray \| 1/1 \|"),
    benchmark("online", r"steps/s publishing / none: \d"),
    benchmark("freshness", r"\| frozen \| - \| 0\.\d+ \|"),
    benchmark("soak", r"."),
]


@pytest.mark.parametrize("script, result", BENCHMARKS)
def test_a_benchmarks_quick_run_finishes_and_prints_its_result(script, result):
    before = {path.name: path.stat().st_mtime_ns for path in RECORDS.iterdir()}
    done = run_with_deadline(PROGRAM, script, "--quick", deadline=DEADLINE, cwd=ROOT,
                             what=f"`python {script} --quick`")
    output = f"{done.stdout[-6000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.returncode == 0, output
    assert re.search(result, done.stdout), output
    assert {path.name: path.stat().st_mtime_ns for path in RECORDS.iterdir()} == before
