"""The tutorial notebooks run end to end and print what their text promises."""

import ast
import math
import re

import nbformat
import pytest

from tests.notebooks import TUTORIALS, run_notebook

PS_TUTORIAL = "01_parameter_server_training.ipynb"
COIN_FLIP_LOSS = math.log(2)  # binary cross-entropy of always predicting 0.5


def _stdout_of(nb, tag):
    """The printed output of the one code cell tagged `tag`."""
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return "".join(o.get("text", "") for o in cells[0].outputs
                   if o.output_type == "stream" and o.name == "stdout")


def test_tutorials_are_stored_valid_and_executed_in_order():
    """Stored executed (`python -m tests.notebooks`), top to bottom, with no error output,
    so that a reader on GitHub sees what each cell prints."""
    for path in sorted(TUTORIALS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        counts = [cell.execution_count for cell in code]
        assert counts == list(range(1, len(code) + 1)), (
            f"{path.name}: not stored executed in order (execution counts {counts})")
        for cell in code:
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"{path.name}: stored with an error: {errors[0].get('ename')}"


@pytest.fixture(scope="module")
def ps_tutorial():
    return run_notebook(PS_TUTORIAL, timeout=600)


@pytest.mark.notebook
def test_parameter_server_tutorial_trains_below_coin_flip_loss(ps_tutorial):
    text = _stdout_of(ps_tutorial, "fit-metrics")
    epochs = re.findall(r"^epoch (\d+): loss=([\d.]+) accuracy=([\d.]+)$", text, re.M)
    assert [int(e) for e, _, _ in epochs] == [1, 2, 3, 4]
    final = re.search(r"final epoch: loss=(\S+) accuracy=(\S+)", text)
    loss, accuracy = float(final.group(1)), float(final.group(2))
    assert math.isfinite(loss) and loss < COIN_FLIP_LOSS
    assert 0.55 < accuracy <= 1.0


@pytest.mark.notebook
def test_parameter_server_tutorial_custom_loop_runs_every_scheduled_step(ps_tutorial):
    text = _stdout_of(ps_tutorial, "custom-loop-metrics")
    assert "done after join? True" in text
    assert "optimizer steps: 100" in text
    accuracy = float(re.search(r"training accuracy over 100 steps: (\S+)", text).group(1))
    last_loss = float(re.search(r"loss of the last scheduled step: (\S+)", text).group(1))
    assert 0.5 < accuracy <= 1.0
    assert math.isfinite(last_loss) and last_loss < 1.0


@pytest.mark.notebook
def test_parameter_server_tutorial_evaluates_the_same_from_creator_and_arrays(ps_tutorial):
    text = _stdout_of(ps_tutorial, "evaluate-metrics")
    creator = ast.literal_eval(re.search(r"evaluate\(DatasetCreator\): (\{.*\})", text).group(1))
    arrays = ast.literal_eval(re.search(r"evaluate\(arrays\): +(\{.*\})", text).group(1))
    assert set(creator) == {"loss", "accuracy"}
    # Both visit each of the 2,000 test examples exactly once.
    assert creator == pytest.approx(arrays, abs=1e-3)
    assert math.isfinite(creator["loss"]) and creator["loss"] < COIN_FLIP_LOSS


@pytest.mark.notebook
def test_parameter_server_tutorial_predicts_in_input_order(ps_tutorial):
    text = _stdout_of(ps_tutorial, "predict-order")
    assert "predictions: (2000, 1)" in text
    difference = float(re.search(r"largest difference from a direct call: (\S+)", text).group(1))
    assert difference < 1e-5


FAILURES_TUTORIAL = "03_failures_and_recovery.ipynb"


@pytest.fixture(scope="module")
def failures_tutorial():
    return run_notebook(FAILURES_TUTORIAL, timeout=600)


@pytest.mark.notebook
@pytest.mark.slow
def test_failures_tutorial_recovers_a_killed_worker_and_ps_inside_fit(failures_tutorial):
    assert "chief exit code: 0" in _stdout_of(failures_tutorial, "kill-worker-and-ps")
    text = _stdout_of(failures_tutorial, "recovery-report")
    assert re.search(r"worker 1 exited with signal 9 \(SIGKILL\); restart 1 of 3", text)
    assert re.search(r"ps 0 exited with signal 9 \(SIGKILL\); restart 1 of 3", text)
    assert "lost their variables" in text
    steps = int(re.search(r"optimizer steps (\d+)", text).group(1))
    reexecuted = int(re.search(r"re-executed (\d+)", text).group(1))
    rolled_back = int(re.search(r"rolled back (\d+)", text).group(1))
    # A backup every 10 steps: the kill lands 0 to 10 steps after the last one (0 when
    # it comes right after a backup, as in 1 of 6 runs here).
    assert steps == 180 + reexecuted and 0 <= rolled_back <= 10
    assert math.isfinite(float(re.search(r"final loss (\S+)", text).group(1)))


@pytest.mark.notebook
@pytest.mark.slow
def test_failures_tutorial_restarts_a_killed_coordinator_that_resumes_inside_the_epoch(
        failures_tutorial):
    text = _stdout_of(failures_tutorial, "coordinator-restart")
    assert "chief exit code: 0" in text
    assert re.search(r"chief 0 exited with signal 9 \(SIGKILL\); restart 1 of 3", text)
    resumed = re.search(r"started at optimizer step (\d+) and ran (\d+) steps", text)
    start, ran = int(resumed.group(1)), int(resumed.group(2))
    assert 60 < start < 120  # the backup of a step inside epoch 2, where it was killed
    steps = int(re.search(r"optimizer steps (\d+)", text).group(1))
    assert steps == start + ran >= 180


EMBEDDINGS_TUTORIAL = "02_sharded_embeddings.ipynb"


@pytest.fixture(scope="module")
def embeddings_tutorial():
    return run_notebook(EMBEDDINGS_TUTORIAL, timeout=600)


@pytest.mark.notebook
def test_embeddings_tutorial_greedy_placement_evens_out_what_round_robin_does_not(
        embeddings_tutorial):
    text = _stdout_of(embeddings_tutorial, "placement-imbalance")
    imbalance = {policy: float(value) for policy, value in
                 re.findall(r"^(round_robin|greedy): imbalance ([\d.]+)$", text, re.M)}
    assert imbalance["round_robin"] > 1.2
    assert imbalance["greedy"] < 1.05
    # The greedy report itself: both user shards, on different ps tasks.
    shards = re.findall(r"^user/embeddings/part_\d +\(500000, 32\) .* (\d)$", text, re.M)
    assert sorted(shards) == ["0", "1"]


@pytest.mark.notebook
def test_embeddings_tutorial_lazy_adam_moves_only_the_rows_of_the_batch(embeddings_tutorial):
    text = _stdout_of(embeddings_tutorial, "lazy-vs-dense-rows")
    steps = re.findall(r"^step (\d): (\d+) users in the batch; rows moved: dense Adam (\d+), "
                       r"lazy Adam (\d+); largest difference between the two tables (\S+)$",
                       text, re.M)
    assert [s[0] for s in steps] == ["1", "2"]
    (_, users_1, dense_1, lazy_1, difference_1), (_, users_2, dense_2, lazy_2, difference_2) = [
        (int(a), int(b), int(c), int(d), float(e)) for a, b, c, d, e in steps]
    # First step: zero moments, so both rules move exactly the rows of the batch, alike
    # (to float rounding: dense Adam runs as one fused kernel, lazy Adam as Keras' ops).
    assert dense_1 == lazy_1 == users_1 > 200
    assert difference_1 < 1e-6
    # Second step: dense Adam also moves the first batch's rows, lazy Adam does not.
    assert lazy_2 == users_2
    assert users_2 < dense_2 <= users_1 + users_2
    assert difference_2 > 1e-5


@pytest.mark.notebook
def test_embeddings_tutorial_times_dense_and_lazy_adam_with_fit(embeddings_tutorial):
    text = _stdout_of(embeddings_tutorial, "sparse-timings")
    rates = dict(re.findall(r"^(dense Adam|lazy Adam): ([\d.]+) steps/s$", text, re.M))
    assert set(rates) == {"dense Adam", "lazy Adam"}
    assert all(float(rate) > 0 for rate in rates.values())
    assert re.search(r"^lazy Adam is [\d.]+x faster$", text, re.M)


@pytest.mark.notebook
def test_embeddings_tutorial_restores_two_shards_into_three_exactly(embeddings_tutorial):
    text = _stdout_of(embeddings_tutorial, "reshard")
    assert "user table shards: 2 -> 3" in text
    before, after = re.search(r"optimizer steps: (\d+) -> (\d+)", text).groups()
    assert int(before) == int(after) > 0
    assert float(re.search(r"after restoring: (\S+)", text).group(1)) == 0.0
    # The optimizer's moments came along: one more step keeps both models equal.
    step = _stdout_of(embeddings_tutorial, "reshard-step")
    assert float(re.search(r"after one more step on each: (\S+)", step).group(1)) < 1e-6


@pytest.mark.notebook
def test_embeddings_tutorial_export_serves_without_kerasps(embeddings_tutorial):
    text = _stdout_of(embeddings_tutorial, "export")
    assert "kerasps imported: False" in text
    variables = re.search(r"SavedModel variables: (.*)", text).group(1)
    assert "(1000000, 32)" in variables and "(500000, 32)" not in variables
    for kind in ("SavedModel", ".keras"):
        difference = re.search(rf"^{re.escape(kind)}: largest difference (\S+)$", text, re.M)
        assert float(difference.group(1)) < 1e-5


SYNC_TUTORIAL = "04_sync_async_and_backup_workers.ipynb"


def executed(name: str, timeout: int = 900):
    """A module-scoped fixture: notebook `name`, executed once for its tests."""
    @pytest.fixture(scope="module")
    def notebook():
        return run_notebook(name, timeout=timeout)
    return notebook


sync_tutorial = executed(SYNC_TUTORIAL)


@pytest.mark.notebook
def test_sync_tutorial_compares_the_three_modes_with_a_straggler(sync_tutorial):
    text = _stdout_of(sync_tutorial, "step-times")
    rows = {m.group(1).strip(): m for m in re.finditer(
        r"^(.+?) step +([\d.]+) ms -> +([\d.]+) ms with the straggler \(([\d.]+)x\); "
        r"dropped (\d+); staleness ([\d.]+); final loss ([\d.]+)$", text, re.M)}
    assert set(rows) == {"async", "sync", "sync + 1 backup"}
    # Sync applies no stale gradient; only the backup mode drops gradients.
    assert float(rows["sync"].group(6)) == 0.0 and float(rows["sync + 1 backup"].group(6)) == 0.0
    assert int(rows["sync"].group(5)) == 0 and int(rows["async"].group(5)) == 0
    assert int(rows["sync + 1 backup"].group(5)) > 0
    for row in rows.values():
        assert math.isfinite(float(row.group(7)))


@pytest.mark.notebook
def test_sync_tutorial_prints_the_simulator_prediction_beside_the_measurement(sync_tutorial):
    text = _stdout_of(sync_tutorial, "simulator")
    found = re.findall(r"^sync \+ (\d) backup with the straggler: simulator ([\d.]+) ms, "
                       r"measured ([\d.]+) ms \(ratio ([\d.]+)\)$", text, re.M)
    assert [b for b, *_ in found] == ["0", "1"]
    assert all(float(p) > 0 and float(m) > 0 for _, p, m, _ in found)


INPUT_TUTORIAL = "06_input_and_elastic_workers.ipynb"


input_tutorial = executed(INPUT_TUTORIAL)


@pytest.mark.notebook
def test_input_tutorial_reads_every_id_once_per_epoch_only_with_exactly_once(input_tutorial):
    text = _stdout_of(input_tutorial, "visits")
    rows = {m.group(1).strip(): tuple(map(int, m.group(2, 3, 4))) for m in re.finditer(
        r"^(.+?) +exact +(\d+) +missed +(\d+) +repeated +(\d+)$", text, re.M)}
    assert set(rows) == {"per worker, repeated", "finite dataset, per worker", "exactly once"}
    assert rows["exactly once"] == (1024, 0, 0)
    for exact, missed, repeated in rows.values():
        assert exact + missed + repeated == 1024


@pytest.mark.notebook
def test_input_tutorial_workers_join_and_leave_a_running_fit(input_tutorial):
    text = _stdout_of(input_tutorial, "elastic")
    order = ["worker 1 leaves the pool", "worker 1 left:", "worker 1 joins the pool",
             "worker 1 joined:", "worker 1 leaves the pool"]
    position = 0
    for phrase in order:
        position = text.index(phrase, position) + len(phrase)
    assert re.search(r"missed \d+ repeated 0$", text, re.M)
    assert "exit status 0" in text


DYNAMIC_TUTORIAL = "07_dynamic_embeddings.ipynb"


dynamic_tutorial = executed(DYNAMIC_TUTORIAL)


@pytest.mark.notebook
def test_dynamic_tutorial_beats_the_hashed_table_at_equal_memory(dynamic_tutorial):
    text = _stdout_of(dynamic_tutorial, "auc")
    found = {(table, int(rows.replace(",", ""))): float(value) for table, rows, value in
             re.findall(r"^ *(dynamic|hashed|unbounded) table, +([\d,]+) rows: AUC ([\d.]+)$",
                        text, re.M)}
    sizes = (1_000, 4_000, 16_000)
    assert {(t, r) for t in ("dynamic", "hashed") for r in sizes} <= set(found)
    # The tutorial seeds every model (seed 0), so its AUCs repeat to ~1e-4 (the workers'
    # updates interleave as they come). Across seeds 0-4 the dynamic table led by +0.021
    # to +0.030 at 1,000 rows (~10x fewer than live ids), +0.006 to +0.017 at 4,000 and
    # +0.000 to +0.019 at 16,000; unseeded, one CI run had it 0.009 behind at 16,000.
    # So it must win clearly where rows are scarce, and elsewhere not lose by more than
    # the noise of seed 0's run.
    assert found["dynamic", 1_000] > found["hashed", 1_000] + 0.01, found
    for rows in sizes:
        assert found["dynamic", rows] > found["hashed", rows] - 0.005, found
    # The "within 0.005 AUC of the unbounded table" is a benchmark figure
    # (docs/figures.md); on the tutorial's short asynchronous run the unbounded table's
    # AUC moved by 0.019 between two runs (0.7741 stored, 0.7927 in CI), so the tutorial
    # checks the trend: more rows bring the dynamic table closer to it.
    unbounded = next(v for (t, _), v in found.items() if t == "unbounded")
    gaps = [unbounded - found["dynamic", rows] for rows in sizes]
    assert gaps[-1] < gaps[0], found


@pytest.mark.notebook
def test_dynamic_tutorial_reports_rows_used_admitted_and_evicted_per_epoch(dynamic_tutorial):
    text = _stdout_of(dynamic_tutorial, "epochs")
    epochs = [tuple(map(float, m)) for m in re.findall(
        r"^epoch \d: rows used (\d+), admitted (\d+), evicted (\d+), hit rate ([\d.]+)$",
        text, re.M)]
    assert len(epochs) == 8
    used = [e[0] for e in epochs]
    assert max(used) == used[-1] == 4000  # full, never above capacity
    assert sum(e[1] for e in epochs) - sum(e[2] for e in epochs) == 4000
    assert epochs[-1][2] > 0 and all(0 < e[3] < 1 for e in epochs)
    placement = _stdout_of(dynamic_tutorial, "placement")
    rows = re.findall(r"^items +(\d) +2,000 +2,000 ", placement, re.M)
    assert "dynamic tables:" in placement and sorted(rows) == ["0", "1"]


@pytest.mark.notebook
def test_dynamic_tutorial_restores_into_one_process_and_serves_without_kerasps(
        dynamic_tutorial):
    text = _stdout_of(dynamic_tutorial, "restore")
    assert "table shards: 2 ps tasks -> 1 process" in text
    assert float(re.search(r"largest difference after restoring: (\S+)", text).group(1)) == 0
    served = _stdout_of(dynamic_tutorial, "export")
    assert "kerasps imported: False" in served
    assert float(re.search(r"SavedModel: largest difference (\S+)", served).group(1)) < 1e-5


@pytest.mark.notebook
def test_dynamic_tutorial_simulator_predicts_the_hit_rate(dynamic_tutorial):
    text = _stdout_of(dynamic_tutorial, "simulator")
    predicted, measured = map(float, re.search(
        r"hit rate: simulator ([\d.]+), measured \(mean of epochs 2-8\) ([\d.]+)", text).groups())
    assert abs(predicted - measured) < 0.03


KERAS_RS_TUTORIAL = "08_keras_rs.ipynb"


@pytest.fixture(scope="module")
def keras_rs_tutorial():
    pytest.importorskip("keras_rs")  # in the `test` extra
    return run_notebook(KERAS_RS_TUTORIAL, timeout=600)


@pytest.mark.notebook
def test_keras_rs_tutorial_places_each_table_and_its_optimizers_slots_on_the_ps_tasks(
        keras_rs_tutorial):
    report = _stdout_of(keras_rs_tutorial, "placement")
    for table in ("users", "movies"):
        shards = re.findall(rf"^embedding/{table}/embeddings/part_(\d) .* (\d)$", report, re.M)
        assert sorted(shards) == [("0", "0"), ("1", "1")], report
    assert re.search(r"^adagrad/embedding_users_embeddings_part_1_accumulator .* 1$", report,
                     re.M)
    text = _stdout_of(keras_rs_tutorial, "tables")
    assert "users: Adagrad | shards on ps tasks [0, 1] | its slots on ps tasks [0, 1]" in text
    assert "movies: Adam | shards on ps tasks [0, 1] | its slots on ps tasks [0, 1]" in text
    assert "model optimizer slots of a table: []" in text


@pytest.mark.notebook
def test_keras_rs_tutorial_trains_the_rows_of_the_batch_with_each_tables_optimizer(
        keras_rs_tutorial):
    text = _stdout_of(keras_rs_tutorial, "auc")
    assert float(re.search(r"held-out AUC ([\d.]+)", text).group(1)) > 0.55
    assert "all of them seen in training: True" in text
    steps = re.findall(r"^(users|movies): (Adagrad|Adam) ran (\d+) steps$", text, re.M)
    assert sorted(steps) == [("movies", "Adam", "704"), ("users", "Adagrad", "704")]


@pytest.mark.notebook
def test_keras_rs_tutorial_outruns_keras_rs_alone_as_the_tables_grow(
        keras_rs_tutorial):
    text = _stdout_of(keras_rs_tutorial, "speed")
    rates = {int(rows.replace(",", "")): (float(alone), float(on_ps)) for rows, alone, on_ps in
             re.findall(r"^ *([\d,]+) rows per table: keras-rs alone +([\d.]+) steps/s, "
                        r"kerasps +([\d.]+) steps/s$", text, re.M)}
    assert sorted(rates) == [10_000, 100_000, 400_000]
    # keras-rs' dense Adam moves every row each step (20-40x slower at 40x the rows);
    # kerasps' step touches the rows of the batch only. Machine load moves its rates by
    # up to 2x, so the test checks the order of things, not a ratio of kerasps' own.
    assert rates[400_000][0] < 0.5 * rates[10_000][0], rates
    assert rates[400_000][1] > 2 * rates[400_000][0], rates


HYBRID_TUTORIAL = "09_hybrid_training.ipynb"


@pytest.fixture(scope="module")
def hybrid_tutorial():
    return run_notebook(HYBRID_TUTORIAL, timeout=600)


@pytest.mark.notebook
def test_hybrid_tutorial_keeps_the_late_workers_row_updates(hybrid_tutorial):
    text = _stdout_of(hybrid_tutorial, "two-modes")
    runs = {mode: dict(re.findall(r"(global steps|dense gradients dropped|rows moved): (\d+)",
                                  line))
            for mode, line in (line.split(None, 1) for line in text.strip().splitlines())}
    assert set(runs) == {"sync", "hybrid"}
    for run in runs.values():
        assert run["global steps"] == "30" and int(run["dense gradients dropped"]) > 0
    # The straggler's row updates count in hybrid mode, not in sync mode.
    assert int(runs["hybrid"]["rows moved"]) > int(runs["sync"]["rows moved"])


@pytest.mark.notebook
def test_hybrid_tutorial_shows_the_study_of_every_mode(hybrid_tutorial):
    text = _stdout_of(hybrid_tutorial, "study")
    for mode in ("sync", "hybrid", "sync + 1 backup", "hybrid + 1 backup", "async"):
        assert re.search(rf"^{re.escape(mode)}\s+\d", text, re.MULTILINE), text


ONLINE_TUTORIAL = "10_online_training_and_serving.ipynb"


@pytest.fixture(scope="module")
def online_tutorial():
    return run_notebook(ONLINE_TUTORIAL, timeout=600)


@pytest.mark.notebook
def test_online_tutorial_publishes_a_full_version_then_the_rows_that_changed(online_tutorial):
    text = _stdout_of(online_tutorial, "published")
    versions = re.findall(r"^v\d+: (full|delta)\s+(\d+) rows", text, re.MULTILINE)
    assert [kind for kind, _ in versions] == ["full"] + ["delta"] * 4
    full = int(versions[0][1])
    assert all(0 < int(rows) < full / 5 for _, rows in versions[1:]), text
    exact = _stdout_of(online_tutorial, "exact")
    assert "server rows equal the trainer's: True" in exact
    assert "same predictions: True" in exact


@pytest.mark.notebook
def test_online_tutorial_fresher_servers_score_the_next_clicks_better(online_tutorial):
    text = _stdout_of(online_tutorial, "freshness")
    mean = {name.strip(): float(auc) for name, auc in
            re.findall(r"^(.+?)\s+mean AUC ([\d.]+),", text, re.MULTILINE)}
    assert set(mean) == {"deltas", "full every 10", "frozen"}, text
    assert mean["deltas"] > mean["full every 10"] > mean["frozen"] + 0.02, text
    study = _stdout_of(online_tutorial, "study")
    assert re.search(r"^frozen\s+mean AUC", study, re.MULTILINE), study
