"""The dynamic table model: a growing id stream, the table's hit rate and churn, and the
ps load they imply (`[table]` scenarios). Checked against the layer itself in
`tests/test_dynamic_embedding.py`."""

import pathlib
import re

import numpy as np
import pytest

import simulator
from kerasps.policy import tables
from simulator.idstream import ZipfStream
from simulator.table import TableModel, predict_load

SCENARIO = pathlib.Path(simulator.__file__).parent / "scenarios" / "dynamic_embedding.toml"


def test_the_stream_grows_its_vocabulary_and_keeps_popular_ids_popular():
    stream = ZipfStream(examples=200_000, distinct=100_000, window=20_000, chunk=10_000)
    chunks = list(stream.chunks())
    assert len(chunks) == 20 and all(len(c) == 10_000 for c in chunks)
    assert chunks[0].max() < 20_000 and chunks[-1].min() >= 80_000  # the window slid
    ids, labels = stream.arrays()
    assert np.array_equal(ids, np.concatenate(chunks))
    values, counts = np.unique(ids, return_counts=True)
    head = counts[np.argsort(-counts)][:100].sum() / len(ids)
    assert head > 0.2  # Zipf: a few ids take a large share
    scores = stream.scores(values)
    clicked = np.array([labels[ids == v].mean() for v in values[np.argsort(-counts)][:50]])
    top = scores[np.argsort(-counts)][:50]
    assert np.corrcoef(top, clicked)[0, 1] > 0.8  # labels follow the hidden scores


def _chunks_drawn_window_by_window(stream):
    """The stream's chunks as first written: every chunk weighs its whole window again."""
    rng = np.random.default_rng(stream.seed)
    for c in range(stream.num_chunks):
        start = stream.window_start(c)
        live = np.arange(start, start + stream.window, dtype=np.int64)
        weights = stream.popularity(live)
        size = min(stream.chunk, stream.examples - c * stream.chunk)
        yield rng.choice(live, size=size, p=weights / weights.sum())


@pytest.mark.parametrize("examples, distinct, window, chunk", [
    (100_000, 50_000, 5_000, 1_000),   # the window moves 45 ids a chunk: mostly kept
    (30_000, 200_000, 3_000, 1_000),   # it jumps past itself: nothing kept
    (5_000, 5_000, 5_000, 1_000),      # it never moves
    (777, 9_000, 4_000, 100),          # a short last chunk
])
def test_the_stream_keeps_each_ids_weight_as_the_window_slides_and_draws_the_same_ids(
        examples, distinct, window, chunk):
    stream = ZipfStream(examples=examples, distinct=distinct, window=window, chunk=chunk, seed=3)
    drawn = list(stream.chunks())
    expected = list(_chunks_drawn_window_by_window(stream))
    assert len(drawn) == len(expected)
    for got, want in zip(drawn, expected):
        np.testing.assert_array_equal(got, want)


def test_lru_keeps_the_most_recent_ids_and_counts_churn():
    model = TableModel(tables.TableSpec(capacity=4, output_dim=2, num_partitions=1))
    for batch in ([1, 2, 3, 4], [2], [3], [4], [9]):
        model.lookup(batch)
    assert set(model.row_of) == {2, 3, 4, 9}
    assert (model.admitted, model.evicted, model.hits, model.lookups) == (5, 1, 3, 8)


def test_min_count_admits_on_the_nth_occurrence():
    model = TableModel(tables.TableSpec(capacity=64, output_dim=2, num_partitions=1,
                                        min_count=3))
    for batch in ([5], [5, 6], [5, 7, 7, 7]):
        model.lookup(batch)
    assert set(model.row_of) == {5, 7}


def test_predicted_load_splits_over_the_ps_tasks_by_partition_share():
    spec = tables.TableSpec(capacity=6000, output_dim=8, num_partitions=3)
    stream = ZipfStream(examples=60_000, distinct=50_000, window=10_000, chunk=5_000)
    load = predict_load(spec, stream.chunks(), 500, num_ps=2, warmup_steps=20)
    assert load.steps == 100 and load.ids_per_step == 500
    assert 0 < load.hit_rate < 1 and load.rows_used == 6000
    assert load.evicted_per_step > 0
    assert load.bytes_per_step[0] == pytest.approx(2 * load.bytes_per_step[1])  # 2 of 3
    with pytest.raises(ValueError, match="warmup_steps=500"):
        predict_load(spec, stream.chunks(), 500, num_ps=2, warmup_steps=500)


def test_the_table_scenario_reports_hit_rate_churn_and_ps_bytes():
    scenario = simulator.load_scenario(SCENARIO).with_overrides(
        {"training.steps": 200, "table.ids.examples": 400_000, "table.warmup_steps": 100})
    result = simulator.run(scenario)
    table = result.summary()["table"]
    assert 0.5 < table["hit_rate"] < 1 and table["admitted_per_step"] > 0
    assert len(table["bytes_per_step"]) == 4 and all(b > 0 for b in table["bytes_per_step"])
    assert re.search(r"dynamic table +hit rate 0\.\d+", str(result))
    quiet = simulator.run(scenario.with_overrides({"table.ids_per_step": 64}))
    assert quiet.ps[1]["utilization"] < result.ps[1]["utilization"]  # less table traffic


@pytest.mark.parametrize("override, message", [
    ({"table.capacity": 0}, r"`table.capacity`.*capacity=0"),
    ({"table.eviction": "fifo"}, r"`table.eviction`.*'fifo'"),
    ({"table.ids.window": 10**9}, r"`table.ids.window`"),
    ({"table.warmup_steps": 10**6}, r"`table.warmup_steps`"),
    ({"table.bogus": 1}, r"Unknown key `table.bogus`"),
])
def test_bad_table_settings_name_the_key(override, message):
    with pytest.raises(simulator.ScenarioError, match=message):
        simulator.load_scenario(SCENARIO).with_overrides(override)
