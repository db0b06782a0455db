"""`benchmarks/fit_throughput.py` prints each target for what users run by default with
its measured value, and by how much a missed one misses."""

from benchmarks import fit_throughput


def result(config, spe, steps_per_s, cpu_ms_per_step):
    return {"config": config, "spe": spe, "steps_per_s": steps_per_s,
            "loop_steps_per_s": steps_per_s, "cpu_ms_per_step": cpu_ms_per_step}


def test_default_targets_are_ratios_of_medians_with_a_verdict():
    results = [
        result("tf_keras+auto", 10, 50.0, 20.0),
        result("kerasps", 10, 100.0, 12.0), result("kerasps", 10, 120.0, 13.0),
        result("kerasps", 10, 140.0, 14.0),
        result("kerasps+progbar", 10, 117.0, 13.0),
        result("kerasps+callback", 10, 100.0, 13.0),
        result("keras3", 10, 200.0, 8.0),
        result("keras3+progbar", 10, 190.0, 10.0),
    ]
    targets = {t["target"]: t for t in fit_throughput.default_targets(results, [10])}
    assert targets["default fit, kerasps bar / tf_keras default"]["ratio"] == 117.0 / 50.0
    bar = targets["bar cost, kerasps bar / verbose=0"]
    assert bar["ratio"] == 117.0 / 120.0 and bar["met"]  # the median of kerasps' three
    callback = targets["batch callback cost, callback / verbose=0"]
    assert callback["ratio"] == 100.0 / 120.0 and not callback["met"]
    cpu = targets["CPU per step, kerasps / keras3 (verbose=0)"]
    assert cpu["ratio"] == 13.0 / 8.0 and not cpu["met"]
    assert targets["CPU per step, kerasps bar / keras3 bar"]["met"]  # 1.3, at most 1.3

    lines = fit_throughput.default_targets_lines(targets.values())
    assert "- CPU per step, kerasps / keras3 (verbose=0), spe 10: 1.62 (target <= 1.3: " \
           "MISSES by 25%)" in lines
    assert "- bar cost, kerasps bar / verbose=0, spe 10: 0.97 (target >= 0.9: meets)" in lines


def test_a_target_whose_configurations_did_not_run_is_left_out():
    results = [result("kerasps", 1, 100.0, 12.0)]
    targets = fit_throughput.default_targets(results, [1])
    assert [t["ratio"] for t in targets] == [None, None, None]  # spe 1 only: 3 targets
    assert fit_throughput.default_targets_lines(targets) == []
