"""`benchmarks/network.py predict`: the simulator calibrated on one bench run predicts others.

Pure Python (no bench, no root): the records are synthetic, made by the simulator itself.
"""

import os

import pytest

from benchmarks import network

MIB = 1 << 20
VARIABLES = [["dense_1/kernel", MIB, 0], ["dense_1/bias", 2048, 1],
             ["dense_2/kernel", MIB, 0], ["dense_2/bias", 2048, 1]]


def _record(rate, placement, step_time, duplex, sharing, workers=2, efficiencies=None):
    """A bench record of `workers` workers whose throughput is the simulator's own, with
    `duplex` and `sharing` links (losing `efficiencies`, per rate) and no framing."""
    held = {"round_robin": (2 * MIB, 4096), "greedy": (MIB + 2048, MIB + 2048)}[placement]
    record = {"mode": "throughput", "rate": "1gbit", "ps_rate": rate, "ps": 2,
              "placement": placement, "spe": 1, "steps": 10, "variables": VARIABLES,
              "workers": workers,
              "counters": {f"kps-net-ps-{i}": {"tx_bytes": 10 * b} for i, b in
                           enumerate(held)}}
    record["steps_per_s"] = network._simulate(record, step_time, 1.0, duplex, sharing,
                                              efficiencies)
    return record


@pytest.mark.parametrize("duplex, sharing, column", [("full", "queue", 1),
                                                     ("full", "fair", 2)])
def test_a_model_predicts_its_own_records_from_one_calibration(duplex, sharing, column):
    records = [_record(rate, placement, 0.02, duplex, sharing)
               for rate in ("1gbit", "100mbit") for placement in ("greedy", "round_robin")]
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2))
    assert "step time" in table and "full duplex, fair" in table
    lines = table.splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in lines if line.startswith(("| 1gbit", "| 100mbit"))]
    assert len(rows) == 4
    errors = [row[8 + 2 * column] for row in rows]  # the model's error column
    assert set(errors) <= {"+0%", "-0%"}, table
    worst = [cell.strip() for cell in lines[-1].strip("|").split("|")]
    assert worst[0] == "largest error, other rows" and worst[8 + 2 * column] == "0%"
    # The records differ between the models, so the others miss some rows.
    others = {row[8 + 2 * c] for row in rows for c in (0, 1, 2) if c != column}
    assert others - {"+0%", "-0%"}, table


def test_an_unknown_calibration_configuration_is_named():
    records = [_record("1gbit", "greedy", 0.02, "full", "queue")]
    with pytest.raises(SystemExit, match="100mbit"):
        network.predict_table(records, ("100mbit", 2, "greedy", 1, 2))


def test_more_workers_on_a_saturated_ps_link_are_predicted_from_a_two_worker_run():
    """The workers' count is part of a configuration: a 2-worker calibration predicts the
    1- and 4-worker runs of the same model exactly, and a saturated link's throughput no
    longer grows with workers."""
    records = [_record("100mbit", "round_robin", 0.02, "full", "fair", workers=w)
               for w in (1, 2, 4)]
    assert records[2]["steps_per_s"] < 1.2 * records[1]["steps_per_s"]  # the link is full
    assert records[0]["steps_per_s"] < records[1]["steps_per_s"]
    table = network.predict_table(records, ("100mbit", 2, "round_robin", 1, 2))
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| 100mbit")]
    assert [row[2] for row in rows] == ["1", "2", "4"]
    assert {row[8 + 2 * 2] for row in rows} <= {"+0%", "-0%"}, table


RECORDS = os.path.join(os.path.dirname(network.__file__), "records")


def _committed(name, mode):
    return network.read_records([os.path.join(RECORDS, name)], mode)


# The link runs: at 100 Mbit/s (2026-11-26) and at 1 Gbit/s (2026-11-26e).
LINKS = ["network_link_2026-11-26.jsonl", "network_link_2026-11-26e.jsonl"]


@pytest.mark.slow  # minutes of simulation: the published tables, checked in CI
@pytest.mark.parametrize("day, workers", [("2026-11-25", ["1", "2", "3", "4"]),
                                          ("2026-11-26", ["2"]), ("2026-11-26b", ["2"]),
                                          ("2026-11-26c", ["2"]), ("2026-11-26d", ["2"]),
                                          ("2026-11-26e", ["2"])])
def test_the_committed_bench_records_make_the_published_prediction_tables(day, workers):
    """`benchmarks/records` holds the runs behind docs/figures.md: `predict` reads them
    without root, calibrates on the named run and lists every configuration, with the
    link runs' loss as a fourth model."""
    records = _committed(f"network_throughput_{day}.jsonl", "throughput")
    links = [r for name in LINKS for r in _committed(name, "link")]
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2), links=links)
    assert ("100mbit links keep 0.766 of their rate each way when loaded both ways "
            "(0.55-0.93 in 12 `link --both-ways` runs, each transfer drawing one); 1gbit "
            "links keep 0.831 of their rate each way when loaded both ways (0.69-0.99 in 12 "
            "`link --both-ways` runs, each transfer drawing one); other rates none") in table
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith(("| 1gbit", "| 100mbit"))]
    assert sorted({row[2] for row in rows}) == workers
    calibration = [row for row in rows if "(calibration)" in row[3]]
    assert len(calibration) == 1 and calibration[0][8] in {"+0%", "-0%"}, table


@pytest.mark.slow  # minutes of simulation: the published tables, checked in CI
def test_the_latest_runs_are_predicted_as_published():
    """docs/figures.md, 2026-11-26e: runs made after the model was set, predicted by it.
    The largest error over the rows other than the calibration's, per model: 28% with the
    ps links alone (the 1 Gbit/s round_robin rows), 13% with the workers' links."""
    records = _committed("network_throughput_2026-11-26e.jsonl", "throughput")
    links = [r for name in LINKS for r in _committed(name, "link")]
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2), links=links)
    worst = [cell.strip() for cell in table.splitlines()[-1].strip("|").split("|")]
    assert worst[0] == "largest error, other rows"
    assert (worst[8 + 2 * 3], worst[8 + 2 * 4]) == ("28%", "13%"), table


@pytest.mark.slow  # minutes of simulation: the published tables, checked in CI
def test_the_four_sets_pooled_are_predicted_as_published():
    """docs/figures.md, "Seven or eight runs per row": the sets 26b-26e, made with the
    same workload and bench, pooled (the median of each row's 7-8 runs). Largest error
    over the rows other than the calibration's: 23% with the ps links alone, 10% (10.1%:
    100 Mbit/s greedy, spe 1) with the workers' links."""
    records = [r for suffix in "bcde"
               for r in _committed(f"network_throughput_2026-11-26{suffix}.jsonl", "throughput")]
    links = [r for name in LINKS for r in _committed(name, "link")]
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2), links=links)
    worst = [cell.strip() for cell in table.splitlines()[-1].strip("|").split("|")]
    assert (worst[8 + 2 * 3], worst[8 + 2 * 4]) == ("23%", "10%"), table
    greedy = [row for row in table.splitlines()
              if row.startswith("| 100mbit | 2 | 2 | greedy | 1 |")]
    assert len(greedy) == 1 and greedy[0].split("|")[-3].strip() == "+10%", table


@pytest.mark.slow  # minutes of simulation: the published tables, checked in CI
def test_the_runs_after_the_gradients_were_packed_are_predicted_as_published():
    """docs/figures.md, 2026-11-26f: the set made after each ps task's small gradients
    crossed in one tensor (26% at worst with the ps links alone, 7% with the workers'
    links); all five sets since the model was set, pooled: 24% and 10% (9.8%)."""
    links = [r for name in LINKS for r in _committed(name, "link")]

    def worst(suffixes):
        records = [r for suffix in suffixes for r in _committed(
            f"network_throughput_2026-11-26{suffix}.jsonl", "throughput")]
        table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2), links=links)
        cells = [cell.strip() for cell in table.splitlines()[-1].strip("|").split("|")]
        return (cells[8 + 2 * 3], cells[8 + 2 * 4]), table

    latest, table = worst("f")
    assert latest == ("26%", "7%"), table
    pooled, table = worst("bcdef")
    assert pooled == ("24%", "10%"), table


def _link(rate, out, into=None):
    record = {"mode": "link", "ps_rate": rate, "flows": 1, "both_ways": into is not None,
              "out_bits_per_s": out * 1e6}
    if into is not None:
        record["in_bits_per_s"] = into * 1e6
    return record


def test_the_loss_of_a_link_loaded_both_ways_is_its_slower_direction_over_one_way():
    links = [_link("100mbit", 96), _link("100mbit", 94),  # one way: median 95
             _link("100mbit", 90, 76), _link("100mbit", 60, 90), _link("100mbit", 95, 95),
             _link("1gbit", 900)]  # no run both ways: no figure
    # Each run's slower direction over 95, sorted: the shares transfers draw from.
    assert network.duplex_efficiencies(links) == {
        "100mbit": [pytest.approx(60 / 95), pytest.approx(0.8), 1.0]}
    assert network.duplex_efficiencies([_link("1gbit", 900), _link("1gbit", 950, 990)]) == {
        "1gbit": [1.0]}  # never above the one-way rate


def test_with_link_records_the_loaded_link_model_predicts_its_own_records():
    """`predict --links`: a fourth model, full duplex whose directions lose what the link
    runs measured, only at the rate they measured; it predicts records made with that loss
    exactly, where the full-duplex model without it misses the rows that load both ways."""
    loss = {"100mbit": 0.8}
    records = [_record(rate, placement, 0.02, "full", "queue", workers=w, efficiencies=loss)
               for rate in ("1gbit", "100mbit") for placement in ("greedy", "round_robin")
               for w in (1, 2)]
    links = [_link("100mbit", 95), _link("100mbit", 76, 90)]
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2), links=links)
    assert "100mbit links keep 0.800 of their rate each way" in table
    assert "(0.80-0.80 in 1 `link --both-ways` runs" in table
    lines = table.splitlines()
    assert "simulator, full duplex, loaded both ways" in lines[2]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in lines if line.startswith(("| 1gbit", "| 100mbit"))]
    assert len(rows) == 8
    assert {row[8 + 2 * 3] for row in rows} <= {"+0%", "-0%"}, table
    # Without the loss the 2-worker 100 Mbit/s rows come out too fast; one worker never
    # loads both directions at once, so its rows agree.
    missed = {(row[0], row[2]) for row in rows if row[8 + 2 * 1] not in {"+0%", "-0%"}}
    assert ("100mbit", "2") in missed and ("100mbit", "1") not in missed, table


def test_each_row_lists_how_busy_its_runs_kept_the_machines_cores():
    """`throughput` records each task's CPU seconds over the timed `fit` (`cpu_s`); `predict`
    lists the share of the cores that kept busy, the median of a configuration's runs (no
    model has the CPU: a row near 100% is paced by it), and nothing for older records."""
    records = [_record(rate, "greedy", 0.02, "full", "queue") for rate in ("1gbit", "100mbit")]
    records.append(dict(records[0]))
    for record, cpu_s in zip(records, ({"ps": 1.5, "worker": 0.5}, None, {"ps": 1.0})):
        if cpu_s:
            record.update(cpu_s=cpu_s, seconds=1.0, cpus=2)  # 100% and 50% of 2 cores
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 2))
    assert "cores busy |" in table.splitlines()[2]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith(("| 1gbit", "| 100mbit"))}
    assert rows["1gbit"][-1] == "75%" and rows["100mbit"][-1] == "", table


def test_one_worker_runs_as_fast_with_either_placement_and_its_link_says_why():
    """On the bench at 1 Gbit/s one worker ran round_robin (both kernels, 2 MiB, on one ps
    task) as fast as greedy (1 MiB on each): every byte of its step also crosses the
    worker's own link, as fast as a ps link. The model that carries each step over the
    worker's link too predicts that; the same model with ps links alone makes round_robin
    a third slower."""
    records = _committed("network_throughput_2026-11-26c_1worker.jsonl", "throughput")
    links = _committed("network_link_2026-11-26.jsonl", "link")
    table = network.predict_table(records, ("1gbit", 2, "greedy", 1, 1), links=links)
    assert "simulator, loaded both ways, worker links" in table.splitlines()[2]
    rows = {(row[3], row[4]): row for row in (
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines() if line.startswith("| 1gbit"))}
    round_robin = rows["round_robin", "1"]
    assert round_robin[6].startswith("28.14")  # measured, as greedy's 28.15
    assert round_robin[8 + 2 * 4] in {"+0%", "-0%"}, table  # with the worker's link
    assert round_robin[8 + 2 * 3] == "-32%", table  # the same, ps links alone
