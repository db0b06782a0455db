"""TensorFlow's log lines: none reach a user of kerasps by default, all of them with
`KERASPS_TF_LOGS=1` or with a `TF_CPP_MIN_LOG_LEVEL` the user set (`kerasps.backend.tf_logs`).

Each program runs in a process of its own, with the environment a user has: no
`TF_CPP_MIN_LOG_LEVEL` (the test suite sets one for itself).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

DEADLINE = 240  # seconds: generous for 2 loaded cores, never asserted on

# A line of TensorFlow's C++ log (`I0000 00:00:1795748814.692664   11679 file.cc:349] ...`),
# or one of the lines TensorFlow prints around them.
CPP_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]", re.MULTILINE)
TENSORFLOW_TEXT = re.compile(
    r"absl::InitializeLog|cuInit|Could not find cuda drivers|oneDNN custom operations|"
    r"rebuild TensorFlow|Started server with target|SessionOptions|device_count|"
    r"collective_group_leader|default session config|Failed to remove function remotely|"
    r"non-existent function")
MARK = "kerasps imported"  # written to stderr by the programs once `import kerasps` ran

# Two strategies on two in-process clusters: building each starts servers and connects
# (TensorFlow logs the servers and each task's session config); the first model's
# functions, freed after the second connection, cannot be removed from the tasks of the
# first ("Failed to remove function remotely due to Tried to remove non-existent function").
TWO_CLUSTERS = """
    def train(workers):
        strategy = kerasps.ParameterServerStrategy(
            kerasps.cluster.in_process(num_workers=workers, num_ps=1))
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")

        def dataset_fn(context):
            x = tf.random.uniform((64, 4))
            return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(8)

        model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=2, verbose=0)
        return model

    first = train(1)
    train(2)
    del first
    gc.collect()
    print("trained", flush=True)
"""
KERASPS_FIRST = """
    import gc, sys
    import kerasps
    print("kerasps imported", file=sys.stderr, flush=True)
    import keras
    import tensorflow as tf
"""
# The README's order: Keras (and with it TensorFlow) before kerasps; and a user who logs
# at INFO (`logging.basicConfig`), which TensorFlow's Python loggers follow.
TENSORFLOW_FIRST = """
    import gc, logging, sys
    logging.basicConfig(level=logging.INFO)
    import keras
    import tensorflow as tf
    import kerasps
    print("kerasps imported", file=sys.stderr, flush=True)
"""


def run_program(code, env=None):
    """Runs `code` as a user's script, in a user's environment (no TF_CPP_MIN_LOG_LEVEL)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERASPS_TF_LOGS")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=DEADLINE, env={**environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tensorflow_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if CPP_LINE.match(line) or TENSORFLOW_TEXT.search(line)]


def test_a_script_that_imports_kerasps_first_gets_none_of_tensorflows_lines():
    result = run_program(KERASPS_FIRST + TWO_CLUSTERS)
    assert "trained" in result.stdout
    assert tensorflow_lines(result.stderr) == [], result.stderr[-3000:]


def test_after_import_kerasps_no_tensorflow_line_reaches_a_script_that_imported_tensorflow_first():
    """TensorFlow printed its start-up lines when the script imported it, before kerasps
    could do anything; from `import kerasps` on, none: the C++ lines (cuInit, the
    servers, each task's session config, the functions of the earlier connection) and
    absl's `default session config` at INFO."""
    result = run_program(TENSORFLOW_FIRST + TWO_CLUSTERS)
    assert "trained" in result.stdout
    after = result.stderr.split(MARK, 1)[1]
    assert tensorflow_lines(after) == [], after[-3000:]


# -- item 7: building a strategy on an in-process cluster -------------------------------------
IN_PROCESS_STRATEGY = """
    import logging, sys
    logging.basicConfig(level=logging.INFO)
    import keras
    import kerasps

    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.in_process(num_workers=2, num_ps=2))
    print("built", flush=True)
"""


def test_building_a_strategy_on_an_in_process_cluster_prints_no_session_config():
    """Four `ConfigProto` dumps (each task's `SessionOptions`, logged by its eager service
    at INFO) and the servers' start-up lines reached a user's script, TensorFlow having
    been imported (by Keras) before kerasps; and absl's `default session config: ...` at
    INFO for a script that logs at INFO."""
    result = run_program(IN_PROCESS_STRATEGY)
    assert "built" in result.stdout
    for text in ("device_count", "collective_group_leader", "SessionOptions",
                 "default session config", "Started server with target",
                 "Creating sync eager service context", "cuInit"):
        assert text not in result.stderr, result.stderr[-3000:]


def test_a_program_that_logs_at_info_gets_none_of_tensorflows_python_info_lines():
    """TensorFlow's strategy logs at INFO through its Python logger ("ParameterServerStrategy
    is now connecting to cluster ..."): a program (or a notebook) logging at INFO got them."""
    program = IN_PROCESS_STRATEGY.replace('print("built", flush=True)', (
        'logging.getLogger("mine").info("my own line")\n    print("built", flush=True)'))
    result = run_program(program)
    assert "INFO:mine:my own line" in result.stderr  # the program's own INFO lines stay
    assert "INFO:tensorflow" not in result.stderr, result.stderr[-3000:]
    shown = run_program(program, env={"KERASPS_TF_LOGS": "1"})
    assert "INFO:tensorflow:ParameterServerStrategy is now connecting" in shown.stderr


def test_an_interactive_session_gets_none_of_tensorflows_python_info_lines():
    """In an interactive session (a notebook's kernel, `python -i`) TensorFlow sets its
    logger to INFO, printed on stdout."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERASPS_TF_LOGS")}
    program = textwrap.dedent("""
        import kerasps
        strategy = kerasps.ParameterServerStrategy(
            kerasps.cluster.in_process(num_workers=1, num_ps=1))
        print("built", flush=True)
    """)
    result = subprocess.run([sys.executable, "-i", "-c", program], input="",
                            capture_output=True, text=True, timeout=DEADLINE, env=environ)
    assert "built" in result.stdout, result.stderr[-3000:]
    assert "INFO:tensorflow" not in result.stdout + result.stderr, result.stdout[-3000:]


# -- the switch, and a level the user set ---------------------------------------------------
SERVERS = """
    import os, sys
    import kerasps
    print("level:", os.environ.get("TF_CPP_MIN_LOG_LEVEL"), flush=True)
    import tensorflow as tf
    kerasps.cluster.in_process(num_workers=1, num_ps=1)
"""


@pytest.mark.parametrize("env, level", [({"KERASPS_TF_LOGS": "1"}, None),
                                        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, "0")])
def test_kerasps_tf_logs_or_a_users_own_level_shows_tensorflows_lines(env, level):
    result = run_program(SERVERS, env=env)
    assert f"level: {level}" in result.stdout  # kerasps left the environment as it was
    # Printed as TensorFlow loads: which ones depends on the machine (no oneDNN notice on
    # a CPU where TensorFlow leaves oneDNN's custom operations off).
    from kerasps.backend import tf_logs

    assert any(map(tf_logs.is_start_up_noise, result.stderr.splitlines())), result.stderr
    assert "Started server with target" in result.stderr  # INFO, later


def test_only_kerasps_tf_logs_1_switches_the_lines_on():
    from kerasps.backend import tf_logs

    assert tf_logs.wanted({"KERASPS_TF_LOGS": "1"})
    for value in (None, "", "0"):
        assert not tf_logs.wanted({} if value is None else {"KERASPS_TF_LOGS": value})


def test_kerasps_launch_gives_its_tasks_the_same_rule():
    from kerasps.backend import tf_logs

    assert tf_logs.launched_environment({}, tf_logs=False) == {"TF_CPP_MIN_LOG_LEVEL": "3"}
    assert tf_logs.launched_environment({"TF_CPP_MIN_LOG_LEVEL": "1"}, tf_logs=False) == {
        "TF_CPP_MIN_LOG_LEVEL": "1"}  # the user's
    assert tf_logs.launched_environment({"TF_CPP_MIN_LOG_LEVEL": "0"}, tf_logs=True) == {
        "TF_CPP_MIN_LOG_LEVEL": "0", "KERASPS_TF_LOGS": "1"}


# -- clean exits (issue 38) ---------------------------------------------------------------
# (Not `failed call to cuInit`, printed once the first device is made on a machine without
# a GPU: an error of TensorFlow's that this level asks for.)
REMOVAL_ERROR = re.compile(r".*(context\.cc:\d+\]|Failed to remove function remotely|"
                           r"non-existent function).*")


def test_a_script_on_two_clusters_exits_without_tensorflows_errors_even_at_level_2():
    """The functions of a first connection, freed after a second one (or at exit), were
    removed from the tasks of the second, which never had them: an `E0000 ...
    context.cc:911] Failed to remove function remotely due to Tried to remove non-existent
    function` error per function and task, shown to a user who asked for TensorFlow's
    errors (`TF_CPP_MIN_LOG_LEVEL=2`, as this test suite does). Now none is sent."""
    result = run_program(KERASPS_FIRST + TWO_CLUSTERS, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "trained" in result.stdout
    assert REMOVAL_ERROR.findall(result.stderr) == [], result.stderr[-3000:]


def test_a_pytest_session_of_strategies_on_in_process_clusters_ends_without_errors(tmp_path):
    """`python -m pytest docs/guide/sync.md` passed its 3 tests, then printed 90 such
    errors when pytest collected the garbage at its end."""
    tests = "import gc\nimport keras, tensorflow as tf\nimport kerasps\n\n" + textwrap.dedent(
        TWO_CLUSTERS.split("    first = train(1)")[0]) + textwrap.dedent("""
        def test_first():
            train(1)

        def test_second():
            train(2)
        """)
    (tmp_path / "test_two.py").write_text(tests)
    (tmp_path / "conftest.py").write_text(
        "import os\nos.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')\n")
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERASPS_TF_LOGS")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-c", os.devnull, "--rootdir", str(tmp_path), "test_two.py"],
                            capture_output=True, text=True, timeout=DEADLINE, env=environ,
                            cwd=tmp_path)
    assert "2 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert REMOVAL_ERROR.findall(output) == [], output[-3000:]


def test_tensorflows_messages_about_a_failure_go_to_the_file_kerasps_names(tmp_path, monkeypatch):
    """Issue 38: TensorFlow's coordinator logs each failure it handles as an `ERROR:
    tensorflow:` block of nested gRPC messages; they go to `detail_file()`, named by
    kerasps' own line about the failure, and other records of TensorFlow stay."""
    import logging

    from kerasps.backend import tf_logs

    monkeypatch.delenv("KERASPS_TF_LOGS", raising=False)
    monkeypatch.setenv("KERASPS_TF_LOG_FILE", str(tmp_path / "tf.log"))
    logger = logging.getLogger("tensorflow")
    shown = []
    handler = logging.Handler()
    handler.emit = shown.append
    logger.addHandler(handler)
    try:
        tf_logs.keep_fault_detail()
        coordinator = "/x/tensorflow/python/distribute/coordinator/cluster_coordinator.py"
        for pathname, text in [(coordinator, "Remote function on worker 0 failed"),
                               ("/x/tensorflow/python/eager/def_function.py", "other")]:
            logger.handle(logger.makeRecord("tensorflow", logging.ERROR, pathname, 1, text,
                                            (), None))
    finally:
        logger.removeHandler(handler)
        logger.filters = [f for f in logger.filters if not isinstance(f, tf_logs._FaultDetail)]
    assert [record.getMessage() for record in shown] == ["other"]
    assert "ERROR tensorflow: Remote function on worker 0 failed" in (
        tmp_path / "tf.log").read_text()
    assert tf_logs.detail_note() == f" TensorFlow's messages: {tmp_path / 'tf.log'}."
    monkeypatch.setenv("KERASPS_TF_LOGS", "1")
    assert tf_logs.detail_note() == ""
