"""A chief's process exits promptly once its program has ended.

Python's finalization ran the cyclic garbage collector over the whole of a chief's heap
(TensorFlow, Keras, traced functions and their graphs) after the `atexit` handlers: about
1 s of CPU in every chief, which took 2-6 s on two loaded cores between the program's last
line and the process's exit. The heap is now frozen at exit
(`kerasps.backend._tf.release_at_exit`). These tests measure the CPU the process spends
after its last `atexit` handler, which the machine's load does not stretch as it stretches
wall time.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.launched import DEADLINE, launch, process_gone, wait_until

# CPU seconds a chief may spend after its program's end: the exit took 0.9-1.5 s of CPU
# before the heap was frozen at exit, 0.03-0.12 s since (both on 2 loaded cores).
EXIT_CPU_S = 0.4

# A model as benchmarks/chaos.py's (an embedding sharded over the ps tasks, Adam), for a
# few steps. `cpu_at_exit` is registered first, so it is the last `atexit` handler to run:
# what the process spends after it is the interpreter's finalization.
TRAINING = """
import atexit, resource, sys, time


def cpu_at_exit():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(f"cpu-at-exit {usage.ru_utime + usage.ru_stime!r} {time.time()!r}", flush=True)


atexit.register(cpu_at_exit)
import keras, tensorflow as tf, kerasps

strategy = kerasps.ParameterServerStrategy(
    CLUSTER, variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
with strategy.scope():
    ids = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(1000, 16)(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(keras.optimizers.Adam(0.001), "mse")


def dataset_fn(context):
    x = tf.random.stateless_uniform((256, 4), [1, context.input_pipeline_id], maxval=1000,
                                    dtype=tf.int32)
    y = tf.cast(tf.reduce_sum(x % 7, axis=1, keepdims=True), tf.float32) / 10.0
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)


model.fit(kerasps.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=20, verbose=0)
print("fit returned", flush=True)
"""

CPU_AT_EXIT = re.compile(r"cpu-at-exit (\S+) (\S+)")


def _script(cluster: str) -> str:
    return textwrap.dedent(TRAINING).replace("CLUSTER", cluster)


@pytest.mark.slow
def test_a_chief_with_an_in_process_cluster_spends_little_cpu_after_its_program(tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(_script("kerasps.cluster.in_process(num_workers=2, num_ps=2)"))
    process = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # the child's whole CPU time, exactly
    assert os.waitstatus_to_exitcode(status) == 0, output
    assert "fit returned" in output, output
    at_exit = float(CPU_AT_EXIT.search(output).group(1))
    exit_cpu = usage.ru_utime + usage.ru_stime - at_exit
    assert exit_cpu < EXIT_CPU_S, f"{exit_cpu:.2f} s of CPU after the last atexit handler"


def _cpu_seconds(pid: int) -> float | None:
    """`pid`'s CPU time so far (its threads', user and system), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_launched_chief_exits_promptly_with_its_status_after_its_program(tmp_path):
    job = launch(tmp_path, _script("kerasps.cluster.from_tf_config()"), "--workers", "2",
                 "--ps", "2")
    readings = []  # the chief's CPU time, read every 10 ms until it is gone
    try:
        pid = job.pid("chief 0")

        def gone():
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                readings.append(cpu)
            return process_gone(pid)

        # The launcher reaps the chief within its 50 ms poll: the last reading misses at
        # most that much of the exit.
        assert wait_until(gone, timeout=DEADLINE, interval=0.01), job.output()
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    assert "[launcher] chief 0 finished with exit code 0" in job.lines, job.output()
    at_exit = float(job.wait_for(r"\[chief 0\] cpu-at-exit (\S+)").group(1))
    exit_cpu = readings[-1] - at_exit
    assert exit_cpu < EXIT_CPU_S, f"{exit_cpu:.2f} s of CPU after the last atexit handler"
