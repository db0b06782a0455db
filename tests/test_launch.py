"""`kerasps launch` without processes: the restart policy, specs, the command line
(the Kubernetes manifests are in test_manifests.py)."""

import json
import subprocess
import sys

import pytest

from kerasps import cluster as cluster_lib
from kerasps import launch
from kerasps.restarts import Action, RestartPolicy, describe_exit


def test_a_server_is_restarted_until_its_budget_is_spent():
    policy = RestartPolicy(max_restarts=2)
    assert policy.decide("worker", 1, -9, restarts=0).action is Action.RESTART
    assert policy.decide("ps", 0, 1, restarts=1).action is Action.RESTART
    spent = policy.decide("worker", 1, -9, restarts=2)
    assert spent.action is Action.END_JOB
    assert spent.reason == ("worker 1 exited with signal 9 (SIGKILL) and its restart budget "
                            "is spent (2 restarts)")


def test_the_chief_finishes_the_job_with_status_0_and_is_restarted_like_a_server_otherwise():
    policy = RestartPolicy(max_restarts=2)
    done = policy.decide("chief", 0, 0, restarts=0)
    assert done.action is Action.FINISH and done.reason == "chief 0 finished with exit code 0"
    # As torchrun and Kubernetes' OnFailure: a kill and a Python error are both restarted.
    assert policy.decide("chief", 0, -9, restarts=0).action is Action.RESTART
    restarted = policy.decide("chief", 0, 1, restarts=1)
    assert restarted.action is Action.RESTART
    assert restarted.reason == "chief 0 exited with exit code 1; restart 2 of 2"
    spent = policy.decide("chief", 0, -9, restarts=2)
    assert spent.action is Action.END_JOB
    assert spent.reason == ("chief 0 exited with signal 9 (SIGKILL) and its restart budget "
                            "is spent (2 restarts)")
    assert RestartPolicy(max_restarts=0).decide("chief", 0, 3, 0).action is Action.END_JOB


def test_the_evaluator_is_restarted_when_it_fails_and_left_down_when_it_is_done():
    policy = RestartPolicy(max_restarts=1)
    done = policy.decide("evaluator", 0, 0, restarts=0)
    assert done.action is Action.DONE and done.reason == "evaluator 0 finished"
    assert policy.decide("evaluator", 0, -9, restarts=0).action is Action.RESTART
    assert policy.decide("evaluator", 0, 1, restarts=1).action is Action.END_JOB


def test_exit_descriptions_name_signals_and_codes():
    assert describe_exit(-15) == "signal 15 (SIGTERM)"
    assert describe_exit(2) == "exit code 2"


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_restarts=-1), "max_restarts"), (dict(workers=0), "workers"),
    (dict(ps=1.5), "ps"), (dict(gpus_per_worker=0), "gpus_per_worker"),
    (dict(program=()), "program"), (dict(evaluator=1), "evaluator"),
    (dict(min_workers=0), "min_workers"), (dict(workers=2, min_workers=3), "min_workers")])
def test_bad_launch_specs_are_refused_naming_the_argument(kwargs, name):
    arguments = {"program": ("train.py",), **kwargs}
    with pytest.raises(ValueError, match=rf"argument `{name}`.*Received: {name}="):
        launch.LaunchSpec(**arguments)


def test_unknown_task_types_are_refused():
    with pytest.raises(ValueError, match=r"argument `task_type`.*Received: task_type='master'"):
        RestartPolicy().decide("master", 0, 1, 0)


def test_the_evaluator_runs_the_program_outside_the_cluster_it_is_told_about():
    spec = launch.LaunchSpec(program=("train.py", "--lr", "1"), workers=2, ps=1, evaluator=True)
    assert launch.Task("evaluator", 0) in spec.tasks
    assert launch.Task("evaluator", 0) not in launch.LaunchSpec(program=("train.py",)).tasks
    cluster = launch.make_cluster(spec, pick_port=iter(range(5000, 5100)).__next__)
    assert set(cluster) == {"chief", "worker", "ps"}  # it serves nothing: no address
    config = json.loads(launch.tf_config(cluster, launch.Task("evaluator", 0)))
    parsed = cluster_lib.parse_tf_config(json.dumps(config))
    assert (parsed["task_type"], parsed["task_index"]) == ("evaluator", 0)
    assert parsed["cluster"] == cluster
    assert launch._command(spec, launch.Task("evaluator", 0))[1:] == ["train.py", "--lr", "1"]


@pytest.mark.parametrize("argv, message", [
    (["launch"], "the chief's script is required"),
    (["launch", "--emit", "k8s", "train.py"], "--image is required"),
    (["launch", "--workers", "4:2", "train.py"], "MIN (4) is greater than MAX (2)"),
    (["launch", "--workers", "0:2", "train.py"], "Received: workers='0:2'"),
    (["launch", "--workers", "two", "train.py"], "Received: workers='two'"),
])
def test_launch_command_line_errors(argv, message):
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", *argv], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_negative_max_restarts_is_refused_by_the_command_line():
    result = subprocess.run([sys.executable, "-m", "kerasps.cli", "launch", "--max-restarts",
                             "-2", "train.py"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected an integer >= 0, received '-2'" in result.stderr


def test_request_workers_outside_an_elastic_launch_says_what_it_needs(monkeypatch):
    monkeypatch.delenv(launch.WORKERS_WANTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"kerasps launch --workers MIN:MAX"):
        launch.request_workers(2)
    with pytest.raises(ValueError, match=r"argument `count`.*Received: count=0"):
        launch.request_workers(0)


def test_an_elastic_launch_tells_the_chief_its_minimum_and_every_task_the_control_file():
    spec = launch.LaunchSpec(program=("train.py",), workers=4, min_workers=2)
    cluster = launch.make_cluster(spec, pick_port=iter(range(5000, 5010)).__next__)
    chief = launch._environment(spec, cluster, launch.Task("chief", 0), {}, "/scratch")
    worker = launch._environment(spec, cluster, launch.Task("worker", 3), {}, "/scratch")
    assert len(cluster["worker"]) == 4  # MAX addresses are declared
    assert chief[launch.MIN_WORKERS_ENV] == "2"
    assert chief[launch.WORKERS_WANTED_ENV] == worker[launch.WORKERS_WANTED_ENV]
    assert launch.MIN_WORKERS_ENV not in worker


