"""`kerasps launch --emit k8s`: the JobSet and the TFJob, validated against the schemas of
the versions docs/guide/launching.md names, and the TF_CONFIG each JobSet pod resolves;
with `--engine ray`, KubeRay's RayJob.

The JobSet, TFJob and RayJob CRDs' OpenAPI schemas are test data (tests/data/README.md says where
from); the core kinds inside them (Job and pod templates) are validated with
`kubernetes-validate`. Validation is strict: a field the schema does not define is an
error, as with `kubectl apply --validate=strict`.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kerasps.ops import launch, manifests
from kerasps.runtime import cluster as cluster_lib

DATA = os.path.join(os.path.dirname(__file__), "data")
JOBSET_VERSIONS = ["v0.8.0", "v0.12.0"]
TFJOB_VERSIONS = ["v1.7.0", "v1.9.0"]
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

SPEC = launch.LaunchSpec(program=("train.py", "--epochs", "3"), workers=3, ps=2, max_restarts=4,
                         gpus_per_worker=1)
EVALUATED = dataclasses.replace(SPEC, evaluator=True)
ELASTIC = launch.LaunchSpec(program=("train.py",), workers=4, min_workers=2)
SPECS = {"fixed": SPEC, "evaluated": EVALUATED, "elastic": ELASTIC}


def _strict(schema):
    """`schema` with `additionalProperties: false` on every object that lists its properties
    and does not preserve unknown fields (the API server's strict field validation)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(name: str):
    with open(os.path.join(DATA, f"{name}.crd-schema.json")) as f:
        crd = json.load(f)
    return crd, jsonschema.Draft4Validator(_strict(crd["openAPIV3Schema"]))


def crd_errors(obj: dict, name: str) -> list[str]:
    crd, validator = crd_validator(name)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(obj)]
    if obj.get("apiVersion") != f"{crd['group']}/{crd['version']}":
        errors.append(f"apiVersion {obj.get('apiVersion')!r} is not the CRD's")
    if obj.get("kind") != crd["kind"]:
        errors.append(f"kind {obj.get('kind')!r} is not the CRD's")
    return errors


def core_errors(obj: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def emitted(make, spec, name="train", image="repo/img:1"):
    """`make(spec, ...)` through YAML, as the file holds it."""
    return yaml.safe_load(manifests.dump(make(spec, name, image)))


# Schemas.


@pytest.mark.parametrize("version", JOBSET_VERSIONS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_jobset_is_valid_against_the_jobset_crd_schema(spec, version):
    assert crd_errors(emitted(manifests.jobset, spec), f"jobset-{version}") == []


@pytest.mark.parametrize("version", TFJOB_VERSIONS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_tfjob_is_valid_against_the_tfjob_crd_schema(spec, version):
    assert crd_errors(emitted(manifests.tfjob, spec), f"tfjob-{version}") == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_jobset_job_templates_are_valid_batch_v1_jobs(spec, version):
    for replicated in emitted(manifests.jobset, spec)["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": f"train-{replicated['name']}-0"},
               "spec": replicated["template"]["spec"]}
        assert core_errors(job, version) == [], replicated["name"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_tfjob_pod_templates_are_valid_core_pod_templates(spec, version):
    for kind, replica in emitted(manifests.tfjob, spec)["spec"]["tfReplicaSpecs"].items():
        template = {"apiVersion": "v1", "kind": "PodTemplate",
                    "metadata": {"name": f"train-{kind.lower()}"},
                    "template": {**replica["template"],
                                 "spec": {**replica["template"]["spec"],
                                          "restartPolicy": replica["restartPolicy"]}}}
        assert core_errors(template, version) == [], kind


def test_the_validation_rejects_what_kubernetes_would():
    jobset = emitted(manifests.jobset, SPEC)
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["imagePullPolicy"] = 3
    jobset["spec"]["failurePolicy"]["maxRestart"] = 1  # a typo
    errors = crd_errors(jobset, "jobset-v0.8.0")
    assert any("maxRestart" in e for e in errors) and any("imagePullPolicy" in e or "3 is not"
                                                          in e for e in errors)
    tfjob = emitted(manifests.tfjob, SPEC)
    tfjob["spec"]["runPolicy"]["backoffLimits"] = 1
    assert any("backoffLimits" in e for e in crd_errors(tfjob, "tfjob-v1.9.0"))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "i",
                                                           "restart": "Never"}]}}}}
    assert core_errors(job, KUBERNETES_VERSIONS[0])


# Names.


@pytest.mark.parametrize("text, name", [
    ("01_train", "kerasps-01-train"),
    ("2stage", "kerasps-2stage"),
    ("My Train_Job", "my-train-job"),
    ("-train-", "train"),
    ("x" * 80, "x" * manifests.MAX_NAME_LENGTH),
])
def test_job_names_are_dns_1035_labels(text, name):
    assert manifests.job_name(text) == name
    assert DNS_1035.match(name)


def test_a_name_without_letters_or_digits_is_refused():
    with pytest.raises(ValueError, match=r"argument `name`.*Received: name='__'"):
        manifests.job_name("__")


@pytest.mark.parametrize("script", ["01_train.py", "2stage.py", "a" * 70 + ".py"])
def test_every_name_kubernetes_makes_from_the_manifests_is_a_dns_1035_label(tmp_path, script):
    """The names JobSet's webhook checks (jobs, and pods with their 5-character suffix) and
    the TFJob operator's pod and Service names `<name>-<type>-<index>`."""
    emit(tmp_path, "--evaluator", "--workers", "10000", script)
    jobset_file, tfjob_file = sorted(tmp_path.iterdir())
    jobset = yaml.safe_load(jobset_file.read_text())
    tfjob = yaml.safe_load(tfjob_file.read_text())
    name = jobset["metadata"]["name"]
    assert jobset_file.name == f"{name}.jobset.yaml" and tfjob["metadata"]["name"] == name
    names = [name]
    for replicated in jobset["spec"]["replicatedJobs"]:
        last = replicated["replicas"] - 1
        names += [f"{name}-{replicated['name']}-{last}",  # the Job
                  f"{name}-{replicated['name']}-{last}-0-abcde"]  # its pod
    names += [f"{name}-{kind.lower()}-{replica['replicas'] - 1}"
              for kind, replica in tfjob["spec"]["tfReplicaSpecs"].items()]
    for made in names:
        assert DNS_1035.match(made) and len(made) <= 63, made


# What each JobSet pod resolves.


def pod_environment(jobset: dict, replicated: dict, job_index: int) -> dict:
    """The environment of the pod of Job `job_index` of `replicated`, with the annotations
    the JobSet controller writes on it (`labelAndAnnotateObject`) read through the
    downward API, and the completion index Kubernetes gives an Indexed Job's pod."""
    annotations = {
        "jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
        "jobset.sigs.k8s.io/job-index": str(job_index),
        "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicated["replicas"]),
    }
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    env = {"JOB_COMPLETION_INDEX": "0"}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path).group(1)
            env[variable["name"]] = annotations[key]
    return env


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS)
def test_every_jobset_pod_resolves_its_own_task_in_one_shared_cluster(spec):
    jobset = emitted(manifests.jobset, spec, name="My Job")
    name = jobset["metadata"]["name"]
    clusters, tasks = [], []
    for replicated in jobset["spec"]["replicatedJobs"]:
        for index in range(replicated["replicas"]):
            text = cluster_lib.tf_config_from_jobset(pod_environment(jobset, replicated, index))
            parsed = cluster_lib.parse_tf_config(text)  # kerasps accepts it
            clusters.append(parsed["cluster"])
            tasks.append((parsed["task_type"], parsed["task_index"]))
            if parsed["task_type"] != "evaluator":
                # Its own address is its pod's hostname in the JobSet's headless Service.
                own = parsed["cluster"][parsed["task_type"]][parsed["task_index"]]
                assert own == f"{name}-{replicated['name']}-{index}-0.{name}:{manifests.PORT}"
    assert all(c == clusters[0] for c in clusters)
    assert {k: len(v) for k, v in clusters[0].items()} == {"chief": 1, "worker": spec.workers,
                                                           "ps": spec.ps}
    assert sorted(tasks) == sorted(
        [("chief", 0)] + [("worker", i) for i in range(spec.workers)]
        + [("ps", i) for i in range(spec.ps)] + [("evaluator", 0)] * spec.evaluator)


def test_jobset_pod_templates_hold_nothing_per_pod():
    """One template per replicated job, with no address, index or TF_CONFIG in it."""
    text = manifests.dump(manifests.jobset(SPEC, "train", "img"))
    assert "TF_CONFIG" not in text and "train-worker-1" not in text
    assert "&id" not in text  # each template written out whole, no YAML anchors


# Restarts and the end of the job.


def test_jobset_restarts_each_server_in_place_within_its_own_budget():
    jobset = emitted(manifests.jobset, EVALUATED)
    jobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    assert [r["name"] for r in jobset["spec"]["replicatedJobs"]] == ["ps", "worker", "chief",
                                                                     "evaluator"]
    assert {k: r["replicas"] for k, r in jobs.items()} == {"ps": 2, "worker": 3, "chief": 1,
                                                          "evaluator": 1}
    for replicated in jobs.values():
        job = replicated["template"]["spec"]
        assert job["parallelism"] == job["completions"] == 1  # a task is a Job of one pod
        assert job["completionMode"] == "Indexed"  # hostname <job>-0 in the JobSet's subdomain
        restart = job["template"]["spec"]["restartPolicy"]
        # Restarted in place, same pod and address, `--max-restarts` times: the chief
        # too, as `kerasps launch` restarts it.
        assert (job["backoffLimit"], restart) == (SPEC.max_restarts, "OnFailure")
    # A task whose budget is spent fails the JobSet, which deletes every pod.
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert jobset["spec"]["successPolicy"] == {"operator": "All",
                                               "targetReplicatedJobs": ["chief", "evaluator"]}
    assert emitted(manifests.jobset, SPEC)["spec"]["successPolicy"]["targetReplicatedJobs"] == [
        "chief"]
    assert jobs["worker"]["dependsOn"] == [{"name": "ps", "status": "Ready"}]
    assert jobs["chief"]["dependsOn"] == [{"name": "worker", "status": "Ready"}]
    ps_container = jobs["ps"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert ps_container["readinessProbe"]["tcpSocket"] == {"port": manifests.PORT}
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True


def test_tfjob_budget_is_the_local_total_and_its_file_says_how_it_differs(tmp_path):
    spec = launch.LaunchSpec(program=("train.py",), workers=4, ps=2, max_restarts=3)
    job = emitted(manifests.tfjob, spec)
    assert job["spec"]["runPolicy"] == {"backoffLimit": 21, "cleanPodPolicy": "Running"}
    notes = manifests.notes(spec, "TFJob")
    assert "allows 3 per task" in notes and "3 x 7 restartable tasks = 21" in notes
    emit(tmp_path, "--workers", "4", "--ps", "2", "--max-restarts", "3", "train.py")
    text = (tmp_path / "train.tfjob.yaml").read_text()
    assert text.startswith(notes)
    assert "backoffLimit = 3" in (tmp_path / "train.jobset.yaml").read_text()


def test_tfjob_replicas_run_the_script_or_serve():
    replicas = emitted(manifests.tfjob, EVALUATED)["spec"]["tfReplicaSpecs"]
    assert {k: r["replicas"] for k, r in replicas.items()} == {
        "Chief": 1, "Worker": 3, "PS": 2, "Evaluator": 1}
    assert {k: r["restartPolicy"] for k, r in replicas.items()} == {
        "Chief": "OnFailure", "Worker": "OnFailure", "PS": "OnFailure", "Evaluator": "OnFailure"}
    containers = {k: r["template"]["spec"]["containers"][0] for k, r in replicas.items()}
    for container in containers.values():
        assert container["name"] == "tensorflow"  # the operator finds the container by name
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
    assert containers["Chief"]["command"] == containers["Evaluator"]["command"] == [
        "python", "train.py", "--epochs", "3"]
    assert containers["Worker"]["command"] == containers["PS"]["command"] == ["kerasps", "serve"]
    assert containers["Worker"]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert "resources" not in containers["Evaluator"]  # GPUs go to workers


def test_elastic_manifests_declare_max_workers_and_give_the_chief_its_minimum():
    minimum = {"name": launch.MIN_WORKERS_ENV, "value": "2"}
    replicas = emitted(manifests.tfjob, ELASTIC)["spec"]["tfReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 4
    assert minimum in replicas["Chief"]["template"]["spec"]["containers"][0]["env"]
    assert minimum not in replicas["Worker"]["template"]["spec"]["containers"][0]["env"]
    jobs = {r["name"]: r for r in emitted(manifests.jobset, ELASTIC)["spec"]["replicatedJobs"]}
    assert jobs["worker"]["replicas"] == 4
    chief = jobs["chief"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert minimum in chief["env"]


# The script's path.


def test_a_relative_script_path_is_kept_relative_to_the_image_working_directory():
    assert manifests.script_in_image("src/./train.py") == ("src/train.py", None)
    path, warning = manifests.script_in_image("../train.py")
    assert path == "../train.py" and "outside the working directory" in warning


def test_a_host_absolute_script_path_becomes_relative_with_a_warning(tmp_path):
    script = tmp_path / "src" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    path, warning = manifests.script_in_image(str(script), cwd=str(tmp_path))
    assert path == "src/train.py"
    assert str(script) in warning and "path on this machine" in warning
    path, warning = manifests.script_in_image(str(script), cwd="/somewhere/else")
    assert path == "train.py" and warning


def test_an_absolute_path_absent_here_is_the_image_path():
    assert manifests.script_in_image("/app/no/such/train.py") == ("/app/no/such/train.py", None)


def test_emit_warns_on_a_host_absolute_script_and_runs_it_from_the_working_directory(
        tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    result = emit(tmp_path / "out", str(script), "--lr", "0.1", cwd=tmp_path)
    assert "warning:" in result.stderr and str(script) in result.stderr
    for path in (tmp_path / "out").iterdir():
        assert str(tmp_path) not in path.read_text()
    jobs = {r["name"]: r for r in yaml.safe_load(
        (tmp_path / "out" / "train.jobset.yaml").read_text())["spec"]["replicatedJobs"]}
    chief = jobs["chief"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert chief["command"] == ["python", "train.py", "--lr", "0.1"]


# The command line.


def emit(output_dir, *argv, cwd=None):
    """`kerasps launch --emit k8s --image img --output-dir output_dir *argv`, succeeding."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(manifests.__file__))),
         os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "kerasps.cli", "launch", "--emit", "k8s", "--image", "img",
         "--output-dir", str(output_dir), *argv], capture_output=True, text=True, timeout=120,
        cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    return result


def test_emit_writes_a_jobset_and_a_tfjob_and_runs_nothing(tmp_path):
    result = emit(tmp_path, "--workers", "2", "my_train.py", "--lr", "0.1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-train.jobset.yaml",
                                                         "my-train.tfjob.yaml"]
    assert result.stdout.split() == [str(tmp_path / "my-train.jobset.yaml"),
                                     str(tmp_path / "my-train.tfjob.yaml")]
    jobset = yaml.safe_load((tmp_path / "my-train.jobset.yaml").read_text())
    assert crd_errors(jobset, "jobset-v0.8.0") == []
    assert {r["name"]: r["replicas"] for r in jobset["spec"]["replicatedJobs"]} == {
        "ps": 1, "worker": 2, "chief": 1}
    job = yaml.safe_load((tmp_path / "my-train.tfjob.yaml").read_text())
    assert job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2
    assert "Evaluator" not in job["spec"]["tfReplicaSpecs"]


def test_emit_runs_a_module_as_python_m_and_names_the_job_after_its_last_component(tmp_path):
    result = emit(tmp_path / "out", "--evaluator", "-m", "trainer.main", "--lr", "0.1",
                  cwd=tmp_path)
    assert "warning" not in result.stderr  # no script path to rewrite
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["main.jobset.yaml",
                                                                   "main.tfjob.yaml"]
    command = ["python", "-m", "trainer.main", "--lr", "0.1"]
    jobset = yaml.safe_load((tmp_path / "out" / "main.jobset.yaml").read_text())
    assert crd_errors(jobset, "jobset-v0.8.0") == []
    containers = {r["name"]: r["template"]["spec"]["template"]["spec"]["containers"][0]
                  for r in jobset["spec"]["replicatedJobs"]}
    assert containers["chief"]["command"] == containers["evaluator"]["command"] == command
    assert containers["worker"]["command"] == ["kerasps", "serve"]
    tfjob = yaml.safe_load((tmp_path / "out" / "main.tfjob.yaml").read_text())
    assert crd_errors(tfjob, "tfjob-v1.9.0") == []
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert [replicas[k]["template"]["spec"]["containers"][0]["command"]
            for k in ("Chief", "Evaluator")] == [command, command]


# KubeRay's RayJob (`--engine ray`).
RAYJOB_VERSIONS = ["v1.1.0", "v1.7.0"]
RAY_SPECS = {"cpu": launch.LaunchSpec(program=("train.py", "--epochs", "3"), workers=3, ps=2,
                                      max_restarts=4, engine="ray"),
             "gpu": dataclasses.replace(SPEC, engine="ray"),
             "module": launch.LaunchSpec(program=("-m", "trainer.main", "--lr", "0.1"),
                                         engine="ray")}


def _ray_pod_templates(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"], **{
        group["groupName"]: group["template"] for group in cluster["workerGroupSpecs"]}}


@pytest.mark.parametrize("version", RAYJOB_VERSIONS)
@pytest.mark.parametrize("spec", RAY_SPECS.values(), ids=RAY_SPECS)
def test_rayjob_is_valid_against_the_rayjob_crd_schema(spec, version):
    assert crd_errors(emitted(manifests.rayjob, spec), f"rayjob-{version}") == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("spec", RAY_SPECS.values(), ids=RAY_SPECS)
def test_rayjob_pod_templates_are_valid_core_pod_templates(spec, version):
    for group, template in _ray_pod_templates(emitted(manifests.rayjob, spec)).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"train-{group}"}, "template": template}
        assert core_errors(pod_template, version) == [], group


def test_the_rayjob_schema_rejects_what_kuberay_would():
    rayjob = emitted(manifests.rayjob, RAY_SPECS["cpu"])
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 2  # a typo
    del rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    errors = crd_errors(rayjob, "rayjob-v1.7.0")
    assert any("'replica' was unexpected" in e for e in errors), errors
    assert any("'template' is a required property" in e for e in errors), errors


@pytest.mark.parametrize("spec", RAY_SPECS.values(), ids=RAY_SPECS)
def test_the_rayjob_entrypoint_is_the_same_job_under_the_ray_engine(spec):
    import shlex

    from kerasps.ops import cli

    rayjob = emitted(manifests.rayjob, spec)
    command = shlex.split(rayjob["spec"]["entrypoint"])
    assert command[:2] == ["kerasps", "launch"]
    args = cli.parser().parse_args(command[1:])
    assert (args.engine, args.address, args.workers, args.ps, args.max_restarts,
            args.gpus_per_worker) == ("ray", "auto", (spec.workers, spec.workers), spec.ps,
                                      spec.max_restarts, spec.gpus_per_worker)
    assert cli._program(args, cli.parser()) == spec.program
    # One Ray worker pod per task, each with the CPU a task asks for; none on the head.
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = cluster["workerGroupSpecs"]
    assert sum(g["replicas"] for g in groups) == spec.workers + spec.ps
    assert all(g["replicas"] == g["minReplicas"] == g["maxReplicas"] for g in groups)
    gpus = {g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"].get(
        "nvidia.com/gpu") for g in groups}
    if spec.gpus_per_worker:
        assert gpus == {"workers": str(spec.gpus_per_worker), "ps": None}
    else:
        assert gpus == {"tasks": None}


def test_emit_with_the_ray_engine_writes_a_rayjob_only(tmp_path):
    result = emit(tmp_path, "--engine", "ray", "--workers", "2", "my_train.py", "--lr", "0.1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-train.rayjob.yaml"]
    assert result.stdout.split() == [str(tmp_path / "my-train.rayjob.yaml")]
    text = (tmp_path / "my-train.rayjob.yaml").read_text()
    assert text.startswith("# A KubeRay RayJob (KubeRay v1.1 or newer, ray.io/v1)")
    rayjob = yaml.safe_load(text)
    assert crd_errors(rayjob, "rayjob-v1.1.0") == []
    assert rayjob["spec"]["entrypoint"] == (
        "kerasps launch --engine ray --address auto --workers 2 --ps 1 --max-restarts 3 "
        "my_train.py --lr 0.1")
