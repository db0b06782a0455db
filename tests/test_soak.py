"""The soak benchmark's chief program (`benchmarks/soak.py`) measures a job without
changing it: its watcher thread reads the ps tasks' variables beside `fit`."""

import importlib.util
import itertools
import json
import re
import time
from pathlib import Path

import pytest

from tests.launched import run_with_deadline

ROOT = Path(__file__).resolve().parents[1]


def soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_soaks_watcher_reads_the_ps_variables_beside_fit_without_breaking_it(tmp_path):
    # A 70-minute soak's chief died 3 times of `SystemError: Objects/tupleobject.c:927`
    # raised in the coordinator's threads: its watcher scanned `gc.get_objects()`, which
    # hands out tuples another thread is still building (CPython 3.11). Here the watcher
    # reads every 10 ms for 50 s of fits with validation passes; the scan failed such a
    # run within 5-46 s.
    chief = soak_module().CHIEF
    deadline = time.time() + 50
    done = run_with_deadline(chief, "0.01", str(deadline), "1000", "50", "10", str(tmp_path),
                             deadline=300, cwd=ROOT, what="the soak's chief, watched")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    statuses = [json.loads(m.group(2)) for m in
                re.finditer(r"^(soak|done) (\{.*\})$", done.stdout, re.MULTILINE)]
    assert len(statuses) > 100
    assert re.search(r"^done \{", done.stdout, re.MULTILINE)  # (the watcher may print after)
    # Each sample's live variables are the placement report's, task by task (both grow
    # while the model and its optimizer are built), and nothing grows after the first
    # epoch, across its backups, checkpoints and validation passes.
    samples = [(tuple(s["live_variables"]), tuple(s["report_variables"])) for s in statuses]
    assert all(live == report for live, report in samples), [
        key for key, _ in itertools.groupby(samples)]
    final = samples[-1][0]
    assert min(final) > 0
    assert all(live == final for live, _ in samples[len(samples) // 5:]), [
        key for key, _ in itertools.groupby(samples)]
