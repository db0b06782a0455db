"""`kerasps.cluster.parse_tf_config` / `from_tf_config`: TF_CONFIG to a resolver, strictly.

Nothing here starts a server: a resolver only describes the cluster (the tests of
`in_process` and `resolve` get the test session's shared in-process cluster again).
"""

import json
import os
import warnings

import pytest

from kerasps.runtime import cluster

CLUSTER = {
    "chief": ["chief0:2222"],
    "worker": ["worker0:2222", "worker1:2222"],
    "ps": ["ps0:2222", "ps1:2222"],
    "evaluator": ["eval0:2222"],
}


def _tf_config(cluster_dict=None, task_type="chief", index=0):
    config = {"cluster": CLUSTER if cluster_dict is None else cluster_dict}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return json.dumps(config)


@pytest.fixture
def env(monkeypatch):
    """A clean TF_CONFIG / GRPC_FAIL_FAST / TF_GRPC_DEFAULT_OPTIONS environment, restored
    afterwards."""
    for name in ("TF_CONFIG", "GRPC_FAIL_FAST", cluster.GRPC_OPTIONS_ENV,
                 cluster.JOBSET_REPLICAS_ENV, "JOB_COMPLETION_INDEX", *cluster.JOBSET_ENV):
        monkeypatch.setenv(name, "placeholder")  # recorded, so teardown restores the original
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def no_new_servers():
    before = list(cluster._SERVERS)
    yield
    assert cluster._SERVERS == before, "building a resolver must not start servers"


# -- valid configs -------------------------------------------------------------------------
def test_from_tf_config_reads_the_environment_variable(env, no_new_servers):
    env.setenv("TF_CONFIG", _tf_config())
    resolver = cluster.from_tf_config()
    assert resolver.task_type == "chief"
    assert resolver.task_id == 0
    assert resolver.rpc_layer == "grpc"
    # The evaluator runs beside the training cluster, not in it.
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["chief0:2222"],
        "worker": ["worker0:2222", "worker1:2222"],
        "ps": ["ps0:2222", "ps1:2222"],
    }


def test_from_tf_config_makes_grpc_fail_fast(env, no_new_servers):
    env.setenv("TF_CONFIG", _tf_config())
    cluster.from_tf_config()
    assert os.environ["GRPC_FAIL_FAST"] == "use_caller"


def test_from_tf_config_keeps_a_grpc_fail_fast_the_user_set(env, no_new_servers):
    env.setenv("GRPC_FAIL_FAST", "true")
    cluster.from_tf_config(_tf_config())
    assert os.environ["GRPC_FAIL_FAST"] == "true"


def _grpc_options() -> dict:
    text = os.environ.get(cluster.GRPC_OPTIONS_ENV, "")
    return dict(entry.split("=", 1) for entry in text.split(",") if entry)


def test_from_tf_config_gives_the_chief_grpc_keepalive(env, no_new_servers):
    env.setenv("TF_CONFIG", _tf_config())
    cluster.from_tf_config()
    options = _grpc_options()
    assert options["grpc.keepalive_time_ms"] == "1000"
    assert options["grpc.keepalive_timeout_ms"] == "2000"
    # No pings on an idle connection, one between the chief's sends: servers end a
    # connection pinged too often ("too_many_pings").
    assert "grpc.keepalive_permit_without_calls" not in options
    assert options["grpc.http2.max_pings_without_data"] == "1"


def test_from_tf_config_keeps_the_grpc_options_the_user_set(env, no_new_servers):
    env.setenv(cluster.GRPC_OPTIONS_ENV, "grpc.keepalive_time_ms=30000,grpc.max_metadata_size=9")
    cluster.from_tf_config(_tf_config())
    assert os.environ[cluster.GRPC_OPTIONS_ENV] == (
        "grpc.keepalive_time_ms=30000,grpc.max_metadata_size=9,grpc.keepalive_timeout_ms=2000,"
        "grpc.http2.max_pings_without_data=1")
    cluster.from_tf_config(_tf_config())  # twice: nothing added again
    assert os.environ[cluster.GRPC_OPTIONS_ENV].count("keepalive_timeout_ms") == 1


@pytest.mark.parametrize("task_type", ["worker", "ps"])
def test_from_tf_config_gives_no_keepalive_to_a_worker_or_ps(env, no_new_servers, task_type):
    """A worker's keepalive would fail its steps while a ps task's link is cut, where
    waiting for the link loses nothing."""
    cluster.from_tf_config(_tf_config(task_type=task_type))
    assert cluster.GRPC_OPTIONS_ENV not in os.environ


def test_grpc_options_merges_without_overriding():
    assert cluster.grpc_options({"a": "1", "b": "2"}) == "a=1,b=2"
    assert cluster.grpc_options({"a": "1", "b": "2"}, "") == "a=1,b=2"
    assert cluster.grpc_options({"a": "1", "b": "2"}, "b=5, c=\"x\"") == "b=5, c=\"x\",a=1"
    assert cluster.grpc_options({"a": "1"}, "a=7,") == "a=7"


@pytest.mark.parametrize("task_type, index", [
    ("chief", 0), ("worker", 0), ("worker", 1), ("ps", 1), ("evaluator", 0)])
def test_resolver_has_the_task_type_and_index_of_tf_config(env, no_new_servers, task_type,
                                                           index):
    env.setenv("TF_CONFIG", _tf_config(task_type=task_type, index=index))
    resolver = cluster.from_tf_config()
    assert (resolver.task_type, resolver.task_id) == (task_type, index)
    assert resolver.cluster_spec().num_tasks("ps") == 2
    assert resolver.cluster_spec().num_tasks("worker") == 2


def test_explicit_tf_config_argument_wins_over_the_environment(env, no_new_servers):
    env.setenv("TF_CONFIG", _tf_config(task_type="worker", index=1))
    resolver = cluster.from_tf_config(_tf_config(task_type="ps", index=0))
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)


def test_evaluator_may_be_outside_the_cluster(env, no_new_servers):
    training_only = {k: v for k, v in CLUSTER.items() if k != "evaluator"}
    resolver = cluster.from_tf_config(_tf_config(training_only, "evaluator", 0))
    assert resolver.task_type == "evaluator"
    assert "evaluator" not in resolver.cluster_spec().as_dict()


def test_parse_tf_config_returns_cluster_task_type_and_index():
    parsed = cluster.parse_tf_config(_tf_config(task_type="worker", index=1))
    assert parsed == {"cluster": CLUSTER, "task_type": "worker", "task_index": 1}


def test_task_without_index_is_index_zero():
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker"}})
    assert cluster.parse_tf_config(text)["task_index"] == 0


def test_config_without_task_has_no_task_type(env, no_new_servers):
    parsed = cluster.parse_tf_config(_tf_config(task_type=None))
    assert (parsed["task_type"], parsed["task_index"]) == (None, None)
    resolver = cluster.from_tf_config(_tf_config(task_type=None))
    assert resolver.task_type is None


def test_cluster_without_chief_is_valid():
    no_chief = {"worker": ["w:1"], "ps": ["p:1"]}
    parsed = cluster.parse_tf_config(_tf_config(no_chief, "worker", 0))
    assert parsed["cluster"] == no_chief


# -- invalid configs -------------------------------------------------------------------------
WORKERS_PS = {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}

BAD_CONFIGS = {
    "malformed_json": ("{'cluster': ", ["`TF_CONFIG`", "not valid JSON",
                                        "Received: TF_CONFIG=\"{'cluster': \""]),
    "not_an_object": ("[1, 2]", ["`TF_CONFIG`", "JSON object", "Received: TF_CONFIG='[1, 2]'"]),
    "missing_cluster": (json.dumps({"task": {"type": "worker", "index": 0}}),
                        ["field `cluster`", "Received: cluster=None"]),
    "empty_cluster": (json.dumps({"cluster": {}}), ["field `cluster`", "Received: cluster={}"]),
    "cluster_not_an_object": (json.dumps({"cluster": ["w:1"]}),
                              ["field `cluster`", "Received: cluster=['w:1']"]),
    "no_ps": (_tf_config({"worker": ["w0:1"]}, "worker", 0),
              ["field `cluster`", "`ps`", "Received: cluster={'worker': ['w0:1']}"]),
    "no_worker": (_tf_config({"ps": ["p0:1"], "chief": ["c:1"]}, "chief", 0),
                  ["field `cluster`", "`worker`", "Received: cluster={'ps': ['p0:1']"]),
    "unknown_task_type_in_cluster": (
        _tf_config({**WORKERS_PS, "master": ["m:1"]}, "worker", 0),
        ["unknown task type 'master' in `cluster`", "Received: cluster="]),
    "unknown_task_type_in_task": (
        _tf_config(WORKERS_PS, "master", 0), ["`task.type`", "Received: task.type='master'"]),
    "index_out_of_range": (_tf_config(WORKERS_PS, "worker", 2),
                           ["`task.index`", "2 task(s)", "Received: task.index=2"]),
    "negative_index": (_tf_config(WORKERS_PS, "ps", -1),
                       ["`task.index`", "Received: task.index=-1"]),
    "chief_task_absent_from_cluster": (_tf_config(WORKERS_PS, "chief", 0),
                                       ["`task.index`", "'chief' with 0 task(s)"]),
    "string_index": (_tf_config(WORKERS_PS, "worker", "0"),
                     ["`task.index`", "Received: task.index='0'"]),
    "bool_index": (_tf_config(WORKERS_PS, "worker", True),
                   ["`task.index`", "Received: task.index=True"]),
    "non_string_address": (_tf_config({"worker": [2222], "ps": ["p0:1"]}, "worker", 0),
                           ["`cluster.worker`", "Received: 2222 in cluster.worker=[2222]"]),
    "address_without_port": (_tf_config({"worker": ["w0:1"], "ps": ["localhost"]}, "ps", 0),
                             ["`cluster.ps`", "Received: 'localhost'"]),
    "addresses_not_a_list": (_tf_config({"worker": "w0:1", "ps": ["p0:1"]}, "worker", 0),
                             ["`cluster.worker`", "Received: cluster.worker='w0:1'"]),
    "empty_address_list": (_tf_config({"worker": [], "ps": ["p0:1"]}, None),
                           ["`cluster.worker`", "Received: cluster.worker=[]"]),
    "two_chiefs": (_tf_config({**WORKERS_PS, "chief": ["c0:1", "c1:1"]}, "chief", 0),
                   ["`cluster.chief`", "only one chief",
                    "Received: cluster.chief=['c0:1', 'c1:1']"]),
    "task_not_an_object": (json.dumps({"cluster": WORKERS_PS, "task": "worker"}),
                           ["field `task`", "Received: task='worker'"]),
    "index_without_type": (json.dumps({"cluster": WORKERS_PS, "task": {"index": 1}}),
                           ["field `task`", "without `type`", "Received: task={'index': 1}"]),
}


@pytest.mark.parametrize("text, fragments", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_bad_tf_config_raises_value_error_naming_field_and_value(text, fragments):
    with pytest.raises(ValueError) as excinfo:
        cluster.parse_tf_config(text)
    message = str(excinfo.value)
    assert message.startswith("Invalid value for `TF_CONFIG`")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("case", ["malformed_json", "no_ps", "index_out_of_range"])
def test_from_tf_config_rejects_bad_environment_before_touching_anything(env, no_new_servers,
                                                                         case):
    env.setenv("TF_CONFIG", BAD_CONFIGS[case][0])
    with pytest.raises(ValueError, match=r"Invalid value for `TF_CONFIG`"):
        cluster.from_tf_config()
    assert "GRPC_FAIL_FAST" not in os.environ
    assert cluster.GRPC_OPTIONS_ENV not in os.environ


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_missing_tf_config_environment_variable_raises_value_error(env, value):
    if value is not None:
        env.setenv("TF_CONFIG", value)
    with pytest.raises(ValueError) as excinfo:
        cluster.from_tf_config()
    message = str(excinfo.value)
    assert "environment variable is not set or empty" in message
    assert "this is no JobSet pod" in message
    assert f"Received: TF_CONFIG={value!r}" in message


# -- a JobSet's pod: no TF_CONFIG, what JobSet gives the pod -------------------------------
JOBSET_POD = {
    "KERASPS_JOBSET_NAME": "train",
    "KERASPS_REPLICATED_JOB": "worker",
    "KERASPS_JOB_INDEX": "1",
    "KERASPS_REPLICATED_JOB_REPLICAS": "2",
    "KERASPS_JOBSET_REPLICAS": '{"ps": 1, "worker": 2, "chief": 1, "evaluator": 1}',
    "JOB_COMPLETION_INDEX": "0",
}


def test_a_jobset_pod_resolves_its_task_from_the_jobset_names(env, no_new_servers):
    for name, value in JOBSET_POD.items():
        env.setenv(name, value)
    assert cluster.task_type() == "worker"
    resolver = cluster.from_tf_config()
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["train-chief-0-0.train:2222"],
        "worker": ["train-worker-0-0.train:2222", "train-worker-1-0.train:2222"],
        "ps": ["train-ps-0-0.train:2222"],
    }


def test_tf_config_wins_over_the_jobset_names(env, no_new_servers):
    for name, value in JOBSET_POD.items():
        env.setenv(name, value)
    env.setenv("TF_CONFIG", _tf_config(task_type="ps", index=1))
    resolver = cluster.from_tf_config()
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)


def test_outside_a_jobset_there_is_no_jobset_tf_config():
    assert cluster.tf_config_from_jobset({}) is None
    assert cluster.tf_config_from_jobset({"TF_CONFIG": _tf_config()}) is None


BAD_JOBSET_PODS = {
    "no_replicated_job": ({"KERASPS_REPLICATED_JOB": None},
                          ["`KERASPS_REPLICATED_JOB`", "Received: KERASPS_REPLICATED_JOB=None"]),
    "index_not_a_number": ({"KERASPS_JOB_INDEX": "one"},
                           ["`KERASPS_JOB_INDEX`", "expected an integer", "='one'"]),
    "no_replicas": ({"KERASPS_JOBSET_REPLICAS": None}, ["`KERASPS_JOBSET_REPLICAS`"]),
    "replicas_not_json": ({"KERASPS_JOBSET_REPLICAS": "worker=2"},
                          ["`KERASPS_JOBSET_REPLICAS`", "JSON object", "='worker=2'"]),
    "negative_replicas": ({"KERASPS_JOBSET_REPLICAS": '{"worker": -1}'},
                          ["`KERASPS_JOBSET_REPLICAS`"]),
    "unknown_replicated_job": ({"KERASPS_REPLICATED_JOB": "data"},
                               ["not among", "Received: KERASPS_REPLICATED_JOB='data'"]),
    "replicas_edited_on_one_side": ({"KERASPS_REPLICATED_JOB_REPLICAS": "3"},
                                    ["runs 3 `worker` job(s) but it declares 2",
                                     "change both together"]),
    "several_pods_per_job": ({"JOB_COMPLETION_INDEX": "1"},
                             ["`JOB_COMPLETION_INDEX`", "one pod", "Received"]),
    "index_out_of_range": ({"KERASPS_JOB_INDEX": "2"},
                           ["`TF_CONFIG` field `task.index`", "out of range"]),
}


@pytest.mark.parametrize("change, fragments", list(BAD_JOBSET_PODS.values()),
                         ids=list(BAD_JOBSET_PODS))
def test_a_bad_jobset_pod_environment_raises_naming_the_variable(env, change, fragments):
    environ = {k: v for k, v in {**JOBSET_POD, **change}.items() if v is not None}
    with pytest.raises(ValueError) as excinfo:
        cluster.parse_tf_config(cluster.tf_config_from_jobset(environ))
    message = str(excinfo.value)
    assert message.startswith("Invalid value for `")
    for fragment in fragments:
        assert fragment in message


# -- in_process() where TF_CONFIG names a cluster; resolve() -----------------------------------
@pytest.fixture
def shared_cluster(request):
    """The test session's in-process cluster (2 workers, 2 ps): `in_process(2, 2)` returns
    it again, starting no server."""
    return request.getfixturevalue("cluster")


def test_in_process_in_the_chief_of_a_launched_job_raises_unless_told_it_is_meant(
        env, shared_cluster):
    """A script that keeps the README's `in_process()` under `kerasps launch` trained on a
    cluster of its own while the job's servers sat idle: it raises (tests/test_cluster.py
    reads the message); `under_launch="allow"` starts it, without a warning."""
    env.setenv("TF_CONFIG", _tf_config())
    env.setenv("KERASPS_TASK", "chief 0")
    with pytest.raises(RuntimeError, match=r"^kerasps\.cluster\.in_process\(\) was called in "
                                           r"chief 0 of a `kerasps launch` job \(TF_CONFIG: "
                                           r"2 workers, 2 ps tasks\)"):
        cluster.in_process(num_workers=2, num_ps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = cluster.in_process(num_workers=2, num_ps=2, under_launch="allow")
    assert resolver.cluster_spec().as_dict() == shared_cluster.cluster_spec().as_dict()


def test_in_process_warns_where_tf_config_names_a_cluster_outside_kerasps_launch(
        env, shared_cluster):
    env.setenv("TF_CONFIG", _tf_config())
    env.delenv("KERASPS_TASK", raising=False)
    with pytest.warns(UserWarning, match=r"in_process\(\) was called in a process whose "
                                         r"TF_CONFIG names a cluster \(task chief 0; 2 workers, "
                                         r"2 ps tasks\)"):
        cluster.in_process(num_workers=2, num_ps=2)


def test_resolve_reads_tf_config_when_it_is_set(env, no_new_servers):
    env.setenv("TF_CONFIG", _tf_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = cluster.resolve(num_workers=1, num_ps=1)  # the job's counts decide
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)
    assert resolver.cluster_spec().as_dict() == {k: v for k, v in CLUSTER.items()
                                                 if k != "evaluator"}


def test_resolve_starts_an_in_process_cluster_without_tf_config(env, shared_cluster):
    env.delenv("KERASPS_TASK", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = cluster.resolve(num_workers=2, num_ps=2)
    assert resolver.cluster_spec().as_dict() == shared_cluster.cluster_spec().as_dict()
    with pytest.raises(ValueError, match=r"argument `num_ps`.*Received: num_ps=0"):
        cluster.resolve(num_workers=2, num_ps=0)
