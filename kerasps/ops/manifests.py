"""Kubernetes manifests for the job `kerasps launch` runs locally (`--emit k8s`).

Two flavours of the same job:

* a `JobSet` (kubernetes-sigs/jobset, `jobset.x-k8s.io/v1alpha2`, JobSet v0.8 or
  newer; what Kubeflow Trainer v2 and Kueue build on): one replicated job per task
  type (`ps`, `worker`, `chief`, `evaluator`), each task a Job of one pod reached
  through the JobSet's headless Service. Nothing per pod is written out: every pod
  of a replicated job has the same template, and finds its `TF_CONFIG` with
  `kerasps.cluster.tf_config_from_jobset` from what JobSet gives it;
* a Kubeflow `TFJob` (`kubeflow.org/v1`) for clusters that still run the v1
  Training Operator (v1.7 to v1.9), which sets `TF_CONFIG` in every pod itself.

With `engine="ray"` (`kerasps launch --engine ray --emit k8s`), a KubeRay `RayJob`
(`ray.io/v1`, KubeRay v1.1 or newer) instead: a Ray cluster of a head pod, where the
entrypoint `kerasps launch --engine ray --address auto ...` runs the chief (the Ray driver),
and one Ray worker pod per task, where Ray places the worker and ps tasks' actors.

Restarts follow `kerasps launch --max-restarts N` as closely as each flavour
allows; `notes` says how, and heads each emitted file.

With `evaluator=True` in the spec, both get a task `evaluator 0` running the
script (it serves nothing). The chief and the evaluator must share the checkpoint
directory (a volume you add), and the chief calls
`kerasps.evaluator.mark_training_finished` so that the evaluator stops.

With an elastic pool (`--workers MIN:MAX`) both declare MAX workers and give the
chief `$KERASPS_MIN_WORKERS` (its strategy's `min_workers`): worker pods beyond MIN
may be deleted and come back while the job runs (all must answer when the chief
starts), and below MIN the chief holds training.

The image must hold kerasps and the script: the script's path is taken relative
to the image's working directory (`script_in_image`); servers run `kerasps serve`,
the chief and the evaluator `python <script> <args>`, or `python -m <module> <args>`
for a module (`program=("-m", module, *args)`, found on the image's Python path).
Pure Python (PyYAML writes the files).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex

import yaml

from kerasps.ops.launch import MIN_WORKERS_ENV, LaunchSpec, program_module, runs_program
from kerasps.runtime.cluster import JOBSET_ENV, JOBSET_PORT, JOBSET_REPLICAS_ENV

__all__ = ["jobset", "tfjob", "rayjob", "notes", "job_name", "script_in_image", "dump", "PORT",
           "MAX_NAME_LENGTH", "RAY_TASK_POD", "RAY_HEAD_POD"]

PORT = JOBSET_PORT  # every task's port: TFJob's default, and the JobSet resolver's
# A JobSet's pods are named `<name>-<replicated job>-<job index>-<pod index>-<5 characters>`,
# at most 63 characters: 40 leaves room for `-evaluator-0-0-abcde` and 99,999 workers.
MAX_NAME_LENGTH = 40
_ORDER = ("ps", "worker", "chief", "evaluator")  # a replicated job may depend on an earlier one
_TFJOB_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}


def job_name(text: str) -> str:
    """`text` as a DNS-1035 label, what Kubernetes accepts as the name of a job, a Service
    and the names made from them: lower-case letters, digits and `-`, starting with a letter
    (`"01_train"` -> `"kerasps-01-train"`), at most `MAX_NAME_LENGTH` characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")
    if not name:
        raise ValueError("Invalid value for argument `name`: it has no letter or digit to "
                         f"make a Kubernetes name from. Received: name={text!r}")
    if not name[0].isalpha():
        name = f"kerasps-{name}"
    return name[:MAX_NAME_LENGTH].rstrip("-")


def script_in_image(path: str, cwd: str | None = None) -> tuple[str, str | None]:
    """The script's path as the manifests run it, relative to the image's working directory.

    A relative path is kept (normalised). An absolute path that exists on this machine is a
    host path the image does not have: it becomes its path relative to `cwd` (the current
    directory, which the image is assumed to copy to its working directory), or its file
    name when it lies outside `cwd`, with a warning. An absolute path that does not exist
    here is taken to be the script's path in the image and kept.

    Returns:
        `(path, warning)`, `warning` being `None` or a sentence to show the user.
    """
    cwd = os.getcwd() if cwd is None else cwd
    if not os.path.isabs(path):
        relative = posixpath.normpath(path.replace(os.sep, "/"))
        if relative.startswith("../"):
            return relative, (f"the script {path!r} lies outside the working directory; the "
                              f"manifests run {relative!r} from the image's working directory")
        return relative, None
    if not os.path.exists(path):
        return path, None
    relative = os.path.relpath(path, cwd)
    if relative.startswith(os.pardir):
        relative = os.path.basename(path)
    relative = relative.replace(os.sep, "/")
    return relative, (f"the script {path!r} is a path on this machine; the manifests run "
                      f"{relative!r} from the image's working directory (put it there, or "
                      "give the script's path in the image)")


def _counts(spec: LaunchSpec) -> dict:
    return {"ps": spec.ps, "worker": spec.workers, "chief": 1, "evaluator": int(spec.evaluator)}


def _program_command(spec: LaunchSpec, script: str | None) -> list:
    """What the chief and the evaluator run: `python -m module args` for a module (not a
    path: nothing to rewrite), else `python script args`, `script` defaulting to
    `spec.program[0]`."""
    if program_module(spec.program) is not None:
        return ["python", *spec.program]
    return ["python", spec.program[0] if script is None else script, *spec.program[1:]]


def _container(spec: LaunchSpec, task_type: str, image: str, script: str | None,
               env=()) -> dict:
    command = (_program_command(spec, script) if runs_program(task_type)
               else ["kerasps", "serve"])
    env = [*env, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if task_type == "chief" and spec.min_workers is not None:
        env.append({"name": MIN_WORKERS_ENV, "value": str(spec.min_workers)})
    container = {"name": "tensorflow", "image": image, "command": command, "env": env,
                 "ports": [{"name": "tfjob-port", "containerPort": PORT}]}
    if task_type == "worker" and spec.gpus_per_worker:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.gpus_per_worker}}
    return container


def jobset(spec: LaunchSpec, name: str, image: str, script: str | None = None) -> dict:
    """A `JobSet` for `spec`.

    Args:
        spec: the job.
        name: the JobSet's name (made a DNS-1035 label by `job_name`).
        image: the container image holding kerasps and the script.
        script: the script's path in the image; defaults to `spec.program[0]`. Unused
            for a module (`program=("-m", module, *args)`), run as `python -m module args`.
    """
    name = job_name(name)
    counts = _counts(spec)
    shared_env = [{"name": variable, "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{annotation}']"}}}
        for variable, annotation in JOBSET_ENV.items()]
    shared_env.append({"name": JOBSET_REPLICAS_ENV, "value": json.dumps(
        {kind: n for kind, n in counts.items() if n})})
    replicated_jobs = []
    for kind in _ORDER:
        if not counts[kind]:
            continue
        container = _container(spec, kind, image, script, shared_env)
        if not runs_program(kind):
            # Ready once it serves: the next replicated job starts only then.
            container["readinessProbe"] = {"tcpSocket": {"port": PORT}, "periodSeconds": 2}
        replicated = {
            "name": kind,
            "replicas": counts[kind],
            "template": {"spec": {
                # An Indexed Job's pod is named, and found in DNS, by its job and index.
                "completionMode": "Indexed", "parallelism": 1, "completions": 1,
                "backoffLimit": spec.max_restarts,
                "template": {"spec": {"restartPolicy": "OnFailure",
                                      "containers": [container]}}}},
        }
        # TensorFlow's coordinator connects to every worker and ps task once, when the
        # chief's strategy starts: the workers wait for the ps tasks, the chief for both.
        if kind in ("worker", "chief"):
            previous = "ps" if kind == "worker" else "worker"
            replicated["dependsOn"] = [{"name": previous, "status": "Ready"}]
        replicated_jobs.append(replicated)
    targets = ["chief", "evaluator"] if spec.evaluator else ["chief"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": targets},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": replicated_jobs,
        },
    }


def tfjob(spec: LaunchSpec, name: str, image: str, script: str | None = None) -> dict:
    """A Kubeflow `TFJob` (`kubeflow.org/v1`) for `spec`; arguments as for `jobset`."""
    name = job_name(name)
    replicas = {}
    for kind in ("chief", "worker", "ps", "evaluator"):
        count = _counts(spec)[kind]
        if count:
            replicas[_TFJOB_TYPES[kind]] = {
                "replicas": count,
                "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [_container(spec, kind, image, script)]}},
            }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name},
        "spec": {"runPolicy": {"backoffLimit": spec.max_restarts * _restartable(spec),
                               "cleanPodPolicy": "Running"},
                 "tfReplicaSpecs": replicas},
    }


# A RayJob's pods' containers, unless told otherwise: one CPU for each task's actor (what a
# task asks Ray for by default, `kerasps.ray.DEFAULT_RESOURCES`), the head's for the chief.
RAY_TASK_POD = {"cpu": "1", "memory": "2Gi"}
RAY_HEAD_POD = {"cpu": "1", "memory": "4Gi"}
_RAY_HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))


def _ray_entrypoint(spec: LaunchSpec, script: str | None) -> str:
    """The RayJob's entrypoint: the same job under `kerasps launch --engine ray`, on the
    RayJob's own Ray cluster (`--address auto`)."""
    command = ["kerasps", "launch", "--engine", "ray", "--address", "auto",
               "--workers", str(spec.workers), "--ps", str(spec.ps),
               "--max-restarts", str(spec.max_restarts)]
    if spec.gpus_per_worker:
        command += ["--gpus-per-worker", str(spec.gpus_per_worker)]
    program = _program_command(spec, script)[1:]  # without `python`
    return shlex.join(command + program)


def _ray_group(name: str, replicas: int, image: str, gpus: int | None) -> dict:
    resources = dict(RAY_TASK_POD)
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    return {
        "groupName": name, "replicas": replicas, "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": {"num-cpus": RAY_TASK_POD["cpu"]},
        "template": {"spec": {"containers": [{
            "name": "ray-worker", "image": image,
            "resources": {"requests": resources, "limits": resources}}]}},
    }


def rayjob(spec: LaunchSpec, name: str, image: str, script: str | None = None) -> dict:
    """A KubeRay `RayJob` (`ray.io/v1`) for `spec` (`engine="ray"`); arguments as for
    `jobset`.

    Its Ray cluster: a head pod that offers Ray no CPU (no task's actor goes there) and runs
    the entrypoint, `kerasps launch --engine ray --address auto ...`, whose chief is the
    Ray driver; and one Ray worker pod per task (`RAY_TASK_POD`'s CPU and memory), in one
    group, or with `gpus_per_worker` a group of GPU pods for the workers and one for the
    ps tasks. KubeRay deletes the cluster when the job has finished.
    """
    name = job_name(name)
    if spec.gpus_per_worker:
        groups = [_ray_group("workers", spec.workers, image, spec.gpus_per_worker),
                  _ray_group("ps", spec.ps, image, None)]
    else:
        groups = [_ray_group("tasks", spec.workers + spec.ps, image, None)]
    head = {"name": "ray-head", "image": image,
            "ports": [{"name": port_name, "containerPort": port}
                      for port_name, port in _RAY_HEAD_PORTS],
            "resources": {"requests": dict(RAY_HEAD_POD), "limits": dict(RAY_HEAD_POD)}}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name},
        "spec": {
            "entrypoint": _ray_entrypoint(spec, script),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 300,
            "rayClusterSpec": {
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [head]}},
                },
                "workerGroupSpecs": groups,
            },
        },
    }


def _restartable(spec: LaunchSpec) -> int:
    return 1 + spec.workers + spec.ps + int(spec.evaluator)  # the chief too


def notes(spec: LaunchSpec, kind: str) -> str:
    """What a `"JobSet"`, `"TFJob"` or `"RayJob"` for `spec` does where `kerasps launch`
    would do otherwise, as the comment lines that head its file."""
    n = spec.max_restarts
    if kind == "JobSet":
        lines = [
            "A JobSet (kubernetes-sigs/jobset v0.8 or newer) made by `kerasps launch --emit k8s`.",
            "Every task is a Job of one pod. Each pod finds its TF_CONFIG from the JobSet's",
            "annotations (kerasps.cluster.tf_config_from_jobset); change a replicated job's",
            f"`replicas` and {JOBSET_REPLICAS_ENV} together.",
            f"Restarts, as `kerasps launch --max-restarts {n}`: each chief, worker, ps and",
            f"evaluator pod restarts in place (same pod, same address) up to backoffLimit = {n}",
            "times; a restarted chief resumes from its BackupAndRestore backup, which must be",
            "on a volume (an emptyDir outlives the container's restarts). One more failure",
            "fails its Job, and with failurePolicy.maxRestarts 0 the JobSet, which deletes",
            "every pod (raise it to recreate every pod instead, the backup then on a shared",
            "volume). Unlike `kerasps launch`, Kubernetes waits between restarts (10 s,",
            "doubling, at most 6 min).",
            "The JobSet succeeds when the chief" + (" and the evaluator have" if spec.evaluator
                                                    else " has") + " exited with status 0;",
            "its worker and ps pods are deleted then.",
        ]
    elif kind == "TFJob":
        total = n * _restartable(spec)
        lines = [
            "A Kubeflow TFJob (Training Operator v1.7 to v1.9, kubeflow.org/v1) made by",
            "`kerasps launch --emit k8s`; the operator sets TF_CONFIG in every pod.",
            f"Restarts differ from `kerasps launch --max-restarts {n}`, which allows {n} per task:",
            "TFJob counts restarts over all its pods, so runPolicy.backoffLimit is",
            f"{n} x {_restartable(spec)} restartable tasks = {total}, and one task may use more "
            f"than {n} of them.",
            "A restarted chief resumes from its BackupAndRestore backup, which must be on a",
            "volume. When the job ends, its running pods are deleted (cleanPodPolicy: Running).",
        ]
    elif kind == "RayJob":
        lines = [
            "A KubeRay RayJob (KubeRay v1.1 or newer, ray.io/v1) made by",
            "`kerasps launch --engine ray --emit k8s`. Its entrypoint runs on the head pod:",
            "the chief is the Ray driver, and each worker and ps task a Ray actor on a Ray",
            "worker pod (the head offers Ray no CPU). The image must hold kerasps[ray] and",
            "the script, at the Ray version of the RayJob's cluster.",
            f"Restarts, as `kerasps launch --engine ray --max-restarts {n}`: Ray restarts a",
            f"task's actor whose process died up to {n} times, on its pod (same address);",
            "one more death ends the job with an error naming the task. The launcher in the",
            f"entrypoint restarts a failed chief up to {n} times: a new driver starts new",
            "actors and resumes from its BackupAndRestore backup, which must be on a volume.",
            "A lost worker pod is not recovered yet (Ray would place its actor on another",
            "pod, at another address). The cluster is deleted when the job has finished.",
        ]
    else:
        raise ValueError(f"Invalid value for argument `kind`: expected 'JobSet', 'TFJob' or "
                         f"'RayJob'. Received: kind={kind!r}")
    return "".join(f"# {line}\n" for line in lines)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True  # write shared parts out each time, no `&id001` anchors


def dump(objects, header: str = "") -> str:
    """YAML text of one object or a list of them (`---` between documents), after
    `header` (comment lines)."""
    if isinstance(objects, dict):
        objects = [objects]
    return header + yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120)
