"""`kerasps.placement`: round robin, greedy and callable policies, `plan` and its report."""

import subprocess
import sys

import numpy as np
import pytest

from kerasps.policy import partitioners, placement

F32 = "float32"


def _place_all(placer, sizes):
    return [placer.place(f"v{i}", (n // 4,), F32, n) for i, n in enumerate(sizes)]


# -- round robin -------------------------------------------------------------------------
def test_round_robin_puts_the_nth_variable_on_ps_n_mod_num_ps_whatever_its_size():
    placer = placement.get_placer("round_robin", 3)
    assert isinstance(placer, placement.RoundRobin)
    assert _place_all(placer, [4000, 4, 4, 4, 4000, 4, 4]) == [0, 1, 2, 0, 1, 2, 0]
    assert placer.loads == [4008, 4004, 8]


def test_each_get_placer_call_starts_a_fresh_policy():
    first = placement.get_placer("round_robin", 2)
    _place_all(first, [4, 4, 4])
    second = placement.get_placer("round_robin", 2)
    assert second.place("w", (1,), F32, 4) == 0
    assert second.loads == [4, 0]


# -- greedy ------------------------------------------------------------------------------
def test_greedy_puts_next_shard_on_least_loaded_ps():
    placer = placement.get_placer("greedy", 3)
    assert isinstance(placer, placement.Greedy)
    assert placer.place("a", (100,), F32, 400) == 0
    assert placer.place("b", (10,), F32, 40) == 1
    assert placer.place("c", (20,), F32, 80) == 2
    assert placer.place("d", (5,), F32, 20) == 1  # ps1 holds 40 bytes, the fewest
    assert placer.place("e", (5,), F32, 20) == 1  # still the fewest (60 < 80 < 400)
    assert placer.loads == [400, 80, 80]


def test_greedy_breaks_ties_towards_the_lowest_ps_index():
    placer = placement.get_placer("greedy", 3)
    assert _place_all(placer, [8] * 6) == [0, 1, 2, 0, 1, 2]
    placer = placement.get_placer("greedy", 3)
    placer.record(0, 100)
    assert placer.place("x", (1,), F32, 4) == 1  # ps1 and ps2 tie at 0 bytes


def test_greedy_counts_bytes_it_did_not_place_itself():
    # Optimizer slots are colocated with their variable and reported with `record`.
    placer = placement.get_placer("greedy", 2)
    assert placer.place("kernel", (10,), F32, 40) == 0
    placer.record(0, 40)  # the kernel's slot, next to it on ps0
    assert placer.place("bias", (1,), F32, 4) == 1
    assert placer.place("other", (20,), F32, 80) == 1
    assert placer.loads == [80, 84]


def test_greedy_balances_bytes_better_than_round_robin_when_sizes_differ():
    variables = [("embedding", (1000, 1), F32), ("w1", (100, 1), F32), ("w2", (100, 1), F32),
                 ("w3", (100, 1), F32)]
    round_robin = placement.plan(variables, num_ps=2, placement="round_robin")
    greedy = placement.plan(variables, num_ps=2, placement="greedy")
    assert [r.ps_task for r in round_robin] == [0, 1, 0, 1]
    assert [r.ps_task for r in greedy] == [0, 1, 1, 1]
    assert round_robin.bytes_per_ps() == [4400, 800]
    assert greedy.bytes_per_ps() == [4000, 1200]
    assert max(greedy.bytes_per_ps()) < max(round_robin.bytes_per_ps())


# -- callables ---------------------------------------------------------------------------
def test_callable_placement_receives_name_shape_dtype_and_num_ps():
    calls = []

    def by_name(name, shape, dtype, num_ps):
        calls.append((name, shape, dtype, num_ps))
        return 1 if name.startswith("user") else 0

    report = placement.plan([("user_emb", (8, 2), F32), ("item_emb", (8, 2), F32),
                             ("user_bias", (8,), F32)], num_ps=2, placement=by_name)
    assert [r.ps_task for r in report] == [1, 0, 1]
    assert calls[0] == ("user_emb", (8, 2), F32, 2)
    assert all(isinstance(shape, tuple) for _, shape, _, _ in calls)


def test_callable_placement_sees_each_shard_by_name():
    seen = []
    placement.plan([("emb", (10, 2), F32)], num_ps=3,
                   partitioner=partitioners.FixedShardsPartitioner(3),
                   placement=lambda name, shape, dtype, num_ps: seen.append(name) or 2)
    assert seen == ["emb/part_0", "emb/part_1", "emb/part_2"]


def test_callable_may_return_numpy_integers():
    placer = placement.get_placer(lambda *args: np.int64(1), 2)
    task = placer.place("v", (1,), F32, 4)
    assert task == 1 and type(task) is int


@pytest.mark.parametrize("returned", [2, -1, 7], ids=lambda v: f"returns={v}")
def test_callable_returning_out_of_range_ps_raises_value_error_naming_it(returned):
    placer = placement.get_placer(lambda name, shape, dtype, num_ps: returned, 2)
    with pytest.raises(ValueError) as excinfo:
        placer.place("user_embedding/embeddings", (10,), F32, 40)
    message = str(excinfo.value)
    assert "`placement` callable" in message
    assert "'user_embedding/embeddings'" in message
    assert "[0, 2)" in message
    assert f"Received: {returned!r}" in message


@pytest.mark.parametrize("returned", [1.0, "1", None, True, [0]], ids=repr)
def test_callable_returning_a_non_integer_raises_value_error_naming_it(returned):
    placer = placement.get_placer(lambda name, shape, dtype, num_ps: returned, 2)
    with pytest.raises(ValueError, match=r"`placement` callable for variable 'v'") as excinfo:
        placer.place("v", (10,), F32, 40)
    assert f"Received: {returned!r}" in str(excinfo.value)


def test_failed_callable_placement_does_not_count_bytes():
    placer = placement.get_placer(lambda *args: 5, 2)
    with pytest.raises(ValueError):
        placer.place("v", (10,), F32, 40)
    assert placer.loads == [0, 0]


# -- placement and num_ps arguments --------------------------------------------------------
@pytest.mark.parametrize("value", ["random", "Greedy", "", 3, None, ["greedy"], 1.5], ids=repr)
def test_bad_placement_raises_value_error_listing_the_choices(value):
    with pytest.raises(ValueError) as excinfo:
        placement.get_placer(value, 2)
    message = str(excinfo.value)
    assert "Invalid value for argument `placement`" in message
    assert "['greedy', 'round_robin']" in message
    assert f"Received: placement={value!r}" in message


def test_placer_subclass_is_accepted_as_placement():
    class LastPs(placement.Placer):
        def choose(self, name, shape, dtype, nbytes):
            return self.num_ps - 1

    report = placement.plan([("a", (1,), F32), ("b", (1,), F32)], num_ps=3, placement=LastPs)
    assert [r.ps_task for r in report] == [2, 2]


@pytest.mark.parametrize("num_ps", [0, -2, True, 1.5, "2", None], ids=repr)
@pytest.mark.parametrize("policy", ["round_robin", "greedy", lambda *a: 0],
                         ids=["round_robin", "greedy", "callable"])
def test_bad_num_ps_raises_value_error_naming_it(policy, num_ps):
    with pytest.raises(ValueError) as excinfo:
        placement.get_placer(policy, num_ps)
    message = str(excinfo.value)
    assert "Invalid value for argument `num_ps`" in message
    assert f"Received: num_ps={num_ps!r}" in message


# -- plan ---------------------------------------------------------------------------------
def test_plan_names_shards_var_part_i_with_div_shapes_and_bytes():
    report = placement.plan([("emb", (10, 4), F32), ("bias", (4,), F32)], num_ps=2,
                            partitioner=partitioners.FixedShardsPartitioner(3))
    emb = [r for r in report if r.variable == "emb"]
    assert [r.name for r in emb] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    assert [r.shard for r in emb] == [0, 1, 2]
    assert [r.shape for r in emb] == [(4, 4), (3, 4), (3, 4)]
    assert [r.bytes for r in emb] == [64, 48, 48]
    assert all(r.dtype == F32 for r in emb)
    # `bias` has 4 rows, so FixedShardsPartitioner(3) splits it too.
    assert [r.name for r in report if r.variable == "bias"] == [
        "bias/part_0", "bias/part_1", "bias/part_2"]
    assert [r.ps_task for r in report] == [0, 1, 0, 1, 0, 1]


def test_plan_keeps_unpartitioned_variables_whole_under_their_own_name():
    report = placement.plan([("dense/kernel", (64, 32), F32), ("step", (), "int64")], num_ps=2)
    assert report[0] == placement.ShardRecord(name="dense/kernel", variable="dense/kernel",
                                              shard=0, shape=(64, 32), dtype=F32,
                                              bytes=64 * 32 * 4, ps_task=0)
    assert report[1] == placement.ShardRecord(name="step", variable="step", shard=0, shape=(),
                                              dtype="int64", bytes=8, ps_task=1)


def test_plan_with_min_size_partitioner_shards_only_the_large_variable():
    report = placement.plan(
        [("user_embedding", (100_000, 16), F32), ("dense/kernel", (32, 16), F32)], num_ps=2,
        partitioner=partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2))
    assert [r.name for r in report] == ["user_embedding/part_0", "user_embedding/part_1",
                                        "dense/kernel"]
    assert sum(r.bytes for r in report if r.variable == "user_embedding") == 100_000 * 16 * 4


def test_plan_accepts_tensorflow_style_shapes_and_dtypes():
    tf = pytest.importorskip("tensorflow")
    report = placement.plan([("emb", tf.TensorShape([6, 2]), tf.float16)], num_ps=2,
                            partitioner=partitioners.FixedShardsPartitioner(2))
    assert [(r.shape, r.dtype, r.bytes) for r in report] == [((3, 2), "float16", 12)] * 2


def test_plan_counts_string_elements_as_16_bytes():
    report = placement.plan([("vocab", (100,), "string")], num_ps=1)
    assert report[0].bytes == 1600


def test_plan_caps_a_custom_partitioners_shards_at_the_number_of_rows():
    report = placement.plan([("v", (2, 3), F32)], num_ps=2,
                            partitioner=lambda shape, dtype: [4, 1])
    assert [r.shape for r in report] == [(1, 3), (1, 3)]


# -- PlacementReport -----------------------------------------------------------------------
def _small_report():
    return placement.plan([("user_embedding", (3000, 16), F32), ("dense/bias", (8,), F32)],
                          num_ps=2, partitioner=partitioners.FixedShardsPartitioner(2))


def test_report_prints_a_table_with_one_row_per_shard_and_bytes_per_ps():
    lines = str(_small_report()).splitlines()
    assert lines[0].split() == ["name", "shape", "dtype", "bytes", "ps_task"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["user_embedding/part_0", "(1500,", "16)", F32, "96,000", "0"]
    assert lines[3].split() == ["user_embedding/part_1", "(1500,", "16)", F32, "96,000", "1"]
    assert lines[4].split()[0] == "dense/bias/part_0"
    assert lines[6] == "bytes per ps task: ps0=96,016, ps1=96,016; imbalance (max/mean): 1.00"
    assert len(lines) == 7


def test_report_columns_are_aligned():
    lines = str(_small_report()).splitlines()[:-1]
    # bytes and ps_task are right-aligned: every row's ps_task ends in the same column.
    assert len({len(line) for line in lines}) == 1


def test_bytes_per_ps_sums_shard_bytes_per_task():
    report = _small_report()
    assert report.bytes_per_ps() == [96_016, 96_016]
    assert sum(report.bytes_per_ps()) == 3000 * 16 * 4 + 8 * 4


def test_bytes_per_ps_reports_idle_ps_tasks():
    report = placement.plan([("a", (4,), F32)], num_ps=3)
    assert report.bytes_per_ps() == [16, 0, 0]  # the plan knows there are 3 ps tasks
    assert placement.PlacementReport(tuple(report)).bytes_per_ps() == [16]
    assert placement.PlacementReport(tuple(report)).bytes_per_ps(num_ps=3) == [16, 0, 0]


def test_imbalance_is_the_busiest_ps_tasks_bytes_over_the_mean():
    report = placement.plan([("a", (300,), F32), ("b", (100,), F32)], num_ps=2)
    assert report.bytes_per_ps() == [1200, 400]
    assert report.imbalance == pytest.approx(1.5)
    assert str(report).splitlines()[-1].endswith("; imbalance (max/mean): 1.50")
    # An idle ps task counts: everything on one of 4 ps tasks is the worst case, 4.
    assert placement.plan([("a", (4,), F32)], num_ps=4).imbalance == pytest.approx(4.0)


def test_greedy_placement_is_less_imbalanced_than_round_robin_for_mixed_sizes():
    variables = [("embedding", (1000, 8), F32), ("w1", (100, 8), F32), ("w2", (900, 8), F32),
                 ("w3", (100, 8), F32), ("w4", (50, 8), F32), ("w5", (400, 8), F32)]
    round_robin = placement.plan(variables, num_ps=3, placement="round_robin")
    greedy = placement.plan(variables, num_ps=3, placement="greedy")
    assert greedy.imbalance < round_robin.imbalance


def test_empty_report_has_no_load():
    report = placement.PlacementReport(())
    assert report.imbalance == 1.0
    assert report.bytes_per_ps() == []
    assert report.bytes_per_ps(num_ps=2) == [0, 0]
    assert str(report).splitlines()[0].split() == ["name", "shape", "dtype", "bytes", "ps_task"]


def test_report_is_a_tuple_of_records_convertible_to_dicts():
    report = _small_report()
    assert isinstance(report, tuple) and len(report) == 4
    assert repr(report) == "PlacementReport(4 shards)"
    first = report.to_dicts()[0]
    assert first == {"name": "user_embedding/part_0", "variable": "user_embedding", "shard": 0,
                     "shape": (1500, 16), "dtype": F32, "bytes": 96_000, "ps_task": 0}


def test_shard_records_are_immutable():
    record = _small_report()[0]
    with pytest.raises(AttributeError):
        record.ps_task = 1


# -- the strategy's report ------------------------------------------------------------------
def test_strategy_report_shows_greedy_placement_less_imbalanced_than_round_robin(
        make_strategy):
    keras = pytest.importorskip("keras")
    sizes = [(1000, 4), (100, 4), (100, 4), (100, 4)]
    reports = {}
    for policy in ("round_robin", "greedy"):
        strategy = make_strategy(placement=policy)
        with strategy.scope():
            for i, shape in enumerate(sizes):
                keras.Variable(initializer="zeros", shape=shape, name=f"v{i}")
        reports[policy] = strategy.placement_report()
    assert reports["round_robin"].bytes_per_ps() == [17_600, 3_200]
    assert reports["greedy"].bytes_per_ps() == [16_000, 4_800]
    assert reports["greedy"].imbalance < reports["round_robin"].imbalance
    assert str(reports["greedy"]).splitlines()[-1] == (
        f"bytes per ps task: ps0=16,000, ps1=4,800; imbalance (max/mean): {16_000 / 10_400:.2f}")


# -- bad partitioner output ----------------------------------------------------------------
@pytest.mark.parametrize("returned", [[2], [2, 1, 1], [1, 2], [2, 2], [0, 1], [-1, 1],
                                      [2.0, 1], [2.5, 1], ["2", 1], [True, 1], None, 2,
                                      (np.float64(2), 1)], ids=repr)
def test_plan_rejects_a_partitioner_answer_that_is_not_k_1_naming_the_variable(returned):
    with pytest.raises(ValueError) as excinfo:
        placement.plan([("user/embeddings", (10, 4), F32)], num_ps=2,
                       partitioner=lambda shape, dtype: returned)
    message = str(excinfo.value)
    assert "`variable_partitioner`" in message
    assert "'user/embeddings'" in message and "(10, 4)" in message
    assert message.endswith(f"Received: {returned!r}")


def test_partitioner_answers_may_be_numpy_integers_or_tuples():
    report = placement.plan([("v", (10, 4), F32)], num_ps=2,
                            partitioner=lambda shape, dtype: (np.int64(2), 1))
    assert [r.shape for r in report] == [(5, 4), (5, 4)]


@pytest.mark.parametrize("returned", [[2, 2], [0, 1], [2], [1.5, 1]], ids=repr)
def test_strategy_rejects_a_bad_partitioner_answer_naming_the_variable(make_strategy,
                                                                         returned):
    keras = pytest.importorskip("keras")
    strategy = make_strategy(variable_partitioner=lambda shape, dtype: returned)
    with strategy.scope(), pytest.raises(ValueError) as excinfo:
        keras.layers.Embedding(10, 4, name="items").build((None,))
    message = str(excinfo.value)
    assert "Invalid value returned by `variable_partitioner`" in message
    assert "'items/embeddings'" in message and "(10, 4)" in message
    assert f"Received: {returned!r}" in message


# -- no TensorFlow ---------------------------------------------------------------------------
def test_pure_modules_import_without_tensorflow():
    code = ("import sys, kerasps.placement, kerasps.partitioners, kerasps.trace\n"
            "import kerasps\n"
            "kerasps.placement.plan([('v', (4, 2), 'float32')], num_ps=2,\n"
            "    partitioner=kerasps.partitioners.MinSizePartitioner(1, 2))\n"
            "heavy = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
