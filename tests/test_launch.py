"""`kerasps launch` without processes: the restart policy, specs, Kubernetes manifests."""

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from kerasps import cluster as cluster_lib
from kerasps import launch, manifests
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


SPEC = launch.LaunchSpec(program=("train.py", "--epochs", "3"), workers=3, ps=2, max_restarts=4,
                         gpus_per_worker=1)
EVALUATED = dataclasses.replace(SPEC, evaluator=True)


def test_tfjob_manifest_has_the_fields_the_tfjob_schema_requires():
    job = yaml.safe_load(manifests.dump(manifests.tfjob(SPEC, "My Train_Job", "repo/img:1")))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    assert job["metadata"]["name"] == "my-train-job"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 4
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Chief", "Worker", "PS"}  # TFJob's replica type names
    assert {k: r["replicas"] for k, r in replicas.items()} == {"Chief": 1, "Worker": 3, "PS": 2}
    for replica in replicas.values():
        assert replica["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"  # the operator finds the container by name
        assert container["image"] == "repo/img:1"
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
    assert replicas["Worker"]["restartPolicy"] == replicas["PS"]["restartPolicy"] == "OnFailure"
    assert replicas["Chief"]["template"]["spec"]["containers"][0]["command"] == [
        "python", "train.py", "--epochs", "3"]
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["command"] == [
        "kerasps", "serve"]
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": 1}}


def test_tfjob_manifest_has_an_evaluator_replica_running_the_script():
    replicas = yaml.safe_load(manifests.dump(manifests.tfjob(EVALUATED, "job", "img")))[
        "spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Chief", "Worker", "PS", "Evaluator"}
    evaluator = replicas["Evaluator"]
    assert evaluator["replicas"] == 1 and evaluator["restartPolicy"] == "OnFailure"
    (container,) = evaluator["template"]["spec"]["containers"]
    assert container["command"] == ["python", "train.py", "--epochs", "3"]
    assert "resources" not in container  # GPUs go to workers


def test_plain_kubernetes_manifest_runs_the_evaluator_in_a_pod_beside_the_cluster():
    objects = list(yaml.safe_load_all(manifests.dump(manifests.kubernetes(EVALUATED, "job",
                                                                           "img"))))
    (pod,) = [o for o in objects if o["metadata"]["name"] == "job-evaluator-0"]
    assert pod["kind"] == "Pod"
    assert pod["spec"]["restartPolicy"] == "OnFailure"  # stays down once finished
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "train.py", "--epochs", "3"]
    config = manifests.tf_config_of(container)
    assert config["task"] == {"type": "evaluator", "index": 0}
    assert set(config["cluster"]) == {"chief", "worker", "ps"}
    chief = next(o for o in objects if o["kind"] == "Job")
    chief_config = manifests.tf_config_of(chief["spec"]["template"]["spec"]["containers"][0])
    assert config["cluster"] == chief_config["cluster"]
    assert not [o for o in objects if o["kind"] == "Service" and "evaluator" in
                o["metadata"]["name"]]  # it serves nothing


def test_plain_kubernetes_manifest_wires_every_task_with_a_valid_tf_config():
    objects = list(yaml.safe_load_all(manifests.dump(manifests.kubernetes(SPEC, "job", "img"))))
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    workloads = [o for o in objects if o["kind"] in ("Pod", "Job")]
    assert len(services) == len(workloads) == 6
    for workload in workloads:
        pod_spec = workload["spec"] if workload["kind"] == "Pod" else (
            workload["spec"]["template"]["spec"])
        config = manifests.tf_config_of(pod_spec["containers"][0])
        parsed = cluster_lib.parse_tf_config(json.dumps(config))  # kerasps accepts it
        addresses = [a for tasks in parsed["cluster"].values() for a in tasks]
        assert {a.split(":")[0] for a in addresses} == services
        own = f"job-{parsed['task_type']}-{parsed['task_index']}"
        assert workload["metadata"]["name"] == own
        assert pod_spec["restartPolicy"] == ("Never" if workload["kind"] == "Job" else "Always")


def emit(output_dir, *argv):
    """`kerasps launch --emit k8s --image img --output-dir output_dir *argv`, succeeding."""
    result = subprocess.run(
        [sys.executable, "-m", "kerasps.cli", "launch", "--emit", "k8s", "--image", "img",
         "--output-dir", str(output_dir), *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_emit_writes_both_manifests_and_runs_nothing(tmp_path):
    emit(tmp_path, "--workers", "2", "my_train.py", "--lr", "0.1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-train.k8s.yaml",
                                                         "my-train.tfjob.yaml"]
    job = yaml.safe_load((tmp_path / "my-train.tfjob.yaml").read_text())
    assert job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2
    assert "Evaluator" not in job["spec"]["tfReplicaSpecs"]


def test_emit_with_evaluator_adds_it_to_both_manifests(tmp_path):
    emit(tmp_path, "--evaluator", "train.py")
    job = yaml.safe_load((tmp_path / "train.tfjob.yaml").read_text())
    assert job["spec"]["tfReplicaSpecs"]["Evaluator"]["replicas"] == 1
    objects = list(yaml.safe_load_all((tmp_path / "train.k8s.yaml").read_text()))
    assert "train-evaluator-0" in {o["metadata"]["name"] for o in objects}


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


def test_elastic_manifests_declare_max_workers_and_give_the_chief_its_minimum():
    from kerasps import manifests

    spec = launch.LaunchSpec(program=("train.py",), workers=4, min_workers=2)
    job = manifests.tfjob(spec, "train", "image:1")
    replicas = job["spec"]["tfReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 4
    chief_env = replicas["Chief"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": launch.MIN_WORKERS_ENV, "value": "2"} in chief_env
    assert "env" not in replicas["Worker"]["template"]["spec"]["containers"][0]
    pods = {o["metadata"]["name"]: o for o in manifests.kubernetes(spec, "train", "image:1")
            if o["kind"] in ("Pod", "Job")}
    chief = pods["train-chief-0"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": launch.MIN_WORKERS_ENV, "value": "2"} in chief["env"]
    assert len(manifests.tf_config_of(chief)["cluster"]["worker"]) == 4
