"""Scenario files: the shipped ones load, bad ones fail early naming the key and value."""

import pathlib

import pytest

import simulator
from simulator.scenario import parse_value

from .builders import make

SCENARIOS = pathlib.Path(simulator.__file__).parent / "scenarios"


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_scenarios_load(path):
    scenario = simulator.load_scenario(path)
    assert scenario.name == path.stem
    assert scenario.workers.count >= 1


def test_shipped_scenarios_cover_the_issue():
    names = {p.stem for p in SCENARIOS.glob("*.toml")}
    assert {"stragglers_backup", "ps_failures_checkpoint", "placement_imbalance",
            "scale_out_1000"} <= names


def write(tmp_path, text):
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return path


GOOD = """
[workers]
count = 4
step_time = { distribution = "exponential", rate = 1.0 }
"""


@pytest.mark.parametrize("extra, message", [
    ("[training]\nmode = 'sync'\nbackup_workers = 4\n",
     "Invalid value for `training.backup_workers` in scenario.toml: it must be less than "
     "`workers.count` (4)"),
    ("[training]\nmode = 'sideways'\n",
     "Invalid value for `training.mode` in scenario.toml: expected one of ['async', 'sync', "
     "'hybrid']. "
     "Received: training.mode='sideways'"),
    ("[training]\nsteps = 0\n", "Received: training.steps=0"),
    ("[training]\nbackup_workers = 1\n",
     'backup workers need `training.mode = "sync"` or `"hybrid"`'),
    ("[training]\nmode = 'sync'\nmax_staleness = 3\n", "Received: training.max_staleness=3"),
    ("[ps]\nservice_rate = -5.0\n",
     "Invalid value for `ps.service_rate` in scenario.toml: it must be positive. "
     "Received: ps.service_rate=-5.0"),
    ("[ps]\ncount = 'two'\n", "it must be an integer. Received: ps.count='two'"),
    ("[network]\nlatency = -1\n", "Received: network.latency=-1.0"),
    ("[network]\nbandwith = 1e9\n",
     "Unknown key `network.bandwith` in scenario.toml: did you mean `bandwidth`? Expected "
     "one of ['bandwidth', 'duplex', 'duplex_efficiency', 'latency', 'sharing', "
     "'worker_bandwidth']. "
     "Received: network.bandwith=1000000000.0"),
    ("[failures]\nworker_mtbf = -10.0\n", "Received: failures.worker_mtbf=-10.0"),
    ("[failures]\nworker_loss_probability = 1.5\n", "it must be at most 1.0"),
    ("[[failures.events]]\ntime = 1.0\ntarget = 'ps'\nindex = 3\n",
     "Invalid value for `failures.events[0].index` in scenario.toml: there are only 1 ps "
     "actors. Received: failures.events[0].index=3"),
    ("[[failures.events]]\ntime = 1.0\ntarget = 'ps'\nkind = 'loss'\n",
     "only workers can be lost for good"),
    ("[stragglers]\ncount = 9\n", "Received: stragglers.count=9"),
    ("[stragglers]\ntail_probability = 2.0\n", "Received: stragglers.tail_probability=2.0"),
    ("[checkpoint]\nevery = -100\n",
     "Invalid value for `checkpoint.every` in scenario.toml: it must not be negative. "
     "Received: checkpoint.every=-100"),
    ("[elastic]\nmin_workers = 10\n", "Received: elastic.min_workers=10"),
    ("[elastic]\nmax_workers = 2\n", "Received: elastic.max_workers=2"),
    ("[host]\ncpus = 2\n", "`host.cpus` and `host.cpu_time` must be given together"),
    ("[model]\nplacement = 'random'\n", "Received: model.placement='random'"),
    ("[[model.variables]]\nname = 'w'\nshape = [10, -1]\n",
     "Received: model.variables[0].shape=[10, -1]"),
    ("[[model.variables]]\nname = 'w'\nshape = [10]\ndtype = 'float99'\n",
     "Received: model.variables[0].dtype='float99'"),
    ("[model]\npartitioner = { kind = 'min_size', max_shards = 0 }\n",
     "Received: model.partitioner.max_shards=0"),
    ("[model]\npartitioner = { kind = 'fixed_shards' }\n", "model.partitioner.num_shards"),
    ("seeds = 3\n", "Unknown key `seeds`"),
])
def test_bad_scenarios_name_key_and_value(tmp_path, extra, message):
    text = extra + GOOD if not extra.startswith("[") else GOOD + extra
    with pytest.raises(simulator.ScenarioError) as info:
        simulator.load_scenario(write(tmp_path, text))
    assert message in str(info.value)


@pytest.mark.parametrize("step_time, message", [
    ("{ distribution = 'exponential', rate = -2.0 }",
     "Invalid value for `workers.step_time.rate` in scenario.toml: it must be positive. "
     "Received: workers.step_time.rate=-2.0"),
    ("{ distribution = 'gamma', rate = 1.0 }", "Received: workers.step_time.distribution='gamma'"),
    ("{ distribution = 'exponential' }", "`workers.step_time.rate`"),
    ("{ distribution = 'constant', value = 1.0, mean = 2.0 }",
     "Unknown key `workers.step_time.mean`"),
    ("{ distribution = 'empirical', samples = [] }", "Received: workers.step_time.samples=[]"),
    ("{ distribution = 'empirical', trace = 'missing.csv' }", "Received: workers.step_time.trace"),
])
def test_bad_distributions_name_key_and_value(tmp_path, step_time, message):
    text = f"[workers]\ncount = 2\nstep_time = {step_time}\n"
    with pytest.raises(simulator.ScenarioError) as info:
        simulator.load_scenario(write(tmp_path, text))
    assert message in str(info.value)


def test_negative_worker_count_is_reported_keras_style(tmp_path):
    text = GOOD.replace("count = 4", "count = -3")
    with pytest.raises(simulator.ScenarioError, match=r"Invalid value for `workers.count` in "
                       r"scenario.toml: it must be positive. Received: workers.count=-3"):
        simulator.load_scenario(write(tmp_path, text))


def test_toml_syntax_errors_name_the_file(tmp_path):
    with pytest.raises(simulator.ScenarioError, match="Invalid TOML in scenario.toml"):
        simulator.load_scenario(write(tmp_path, "[workers\n"))


def test_overrides_are_validated_like_files():
    scenario = make(4, training={"mode": "sync"})
    assert scenario.with_overrides({"training.backup_workers": 2}).training.backup_workers == 2
    with pytest.raises(simulator.ScenarioError, match="training.backup_workers=7"):
        scenario.with_overrides({"training.backup_workers": 7})


def test_empirical_step_times_from_a_kerasps_trace(tmp_path):
    from kerasps.policy.trace import StepEvent, write_trace

    write_trace(tmp_path / "t.csv", [StepEvent(0, 0, 0.0, 0.5), StepEvent(1, 1, 0.0, 1.5)])
    path = write(tmp_path, "[workers]\ncount = 2\n"
                           "step_time = { distribution = 'empirical', trace = 't.csv' }\n")
    dist = simulator.load_scenario(path).workers.step_time
    assert sorted(dist.samples) == [0.5, 1.5]


def test_to_toml_round_trips(tmp_path):
    scenario = simulator.load_scenario(SCENARIOS / "placement_imbalance.toml")
    again = simulator.load_scenario(write(tmp_path, scenario.to_toml()))
    assert again == scenario


def test_command_line_values_parse_as_toml():
    assert parse_value("3") == 3
    assert parse_value("0.5") == 0.5
    assert parse_value("true") is True
    assert parse_value("greedy") == "greedy"
    assert parse_value("{kind='min_size'}") == {"kind": "min_size"}


def test_same_seed_same_result_other_seed_other_result():
    scenario = make(8, training={"mode": "async", "steps": 2000})
    a, b = simulator.run(scenario), simulator.run(scenario)
    c = simulator.run(scenario.with_overrides({"seed": 1}))
    assert a.elapsed == b.elapsed and (a.step_times == b.step_times).all()
    assert a.elapsed != c.elapsed
