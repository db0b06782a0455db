"""Online deltas (issue 41) under faults, with real processes: a ps task SIGKILLed in the
middle of a publish, under `kerasps launch`, and the backup restored inside the same
`fit` (rows the consumer received after that backup are newer than the trainer's)."""

import os
import re

import numpy as np
import pytest

import kerasps
from kerasps.policy import deltas
from tests.launched import launch

# A chief training a 4096-row table sharded on 2 ps tasks (8 random ids a step: the rows
# the steps lost with the ps task are almost never those the steps after the restore
# touch) and publishing every 2 steps; backed up when `fit` starts and each epoch ends
# (a restore in epoch 1 rolls back every step before it). The 12th read of changed rows
# (publish 6's second shard) waits for the file argv[3]: the test kills that shard's ps
# task meanwhile. At the end, the trainer's rows and weights go to argv[4], what it
# published is printed.
CHIEF = """
    import os, sys, time
    import keras, numpy as np, tensorflow as tf, kerasps
    from kerasps.params import changes

    directory, backup, marker, final = sys.argv[1:5]
    strategy = kerasps.ParameterServerStrategy(
        kerasps.cluster.from_tf_config(),
        variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        ids = keras.Input((1,), dtype="int64")
        x = keras.layers.Flatten()(keras.layers.Embedding(4096, 4, name="fixed")(ids))
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(x))
        model.compile(keras.optimizers.Adagrad(0.1), "mse")

    def dataset_fn(context):  # unseeded: a pipeline started again reads other ids
        ids = tf.data.Dataset.random().map(lambda r: tf.reshape(r % 4096, [1]))
        return ids.map(lambda i: (i, tf.cast(i % 2, tf.float32))).batch(8)

    take, reads = changes.RowChanges.take, [0]

    def held_take(self, *args, **kwargs):
        reads[0] += 1
        if reads[0] == 12:
            print("publishing, reading", self.device, flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
        return take(self, *args, **kwargs)

    changes.RowChanges.take = held_take
    publisher = kerasps.callbacks.PublishDeltas(directory, every_steps=2)
    model.fit(kerasps.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=12, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=100), publisher])
    np.savez(final, fixed=model.get_layer("fixed").embeddings.numpy(),
             kernel=model.get_layer("head").kernel.numpy(),
             bias=model.get_layer("head").bias.numpy())
    print("published", publisher.published, flush=True)
"""


@pytest.mark.slow
def test_a_ps_task_killed_mid_publish_leaves_no_partial_version_and_the_next_is_full(
        tmp_path):
    directory, marker, final = tmp_path / "deltas", tmp_path / "killed", tmp_path / "final.npz"
    job = launch(tmp_path, CHIEF, "--workers", "2", "--ps", "2", "--max-restarts", "1",
                 args=[str(directory), str(tmp_path / "backup"), str(marker), str(final)])
    try:
        task = job.wait_for(r"\[chief 0\] publishing, reading .*/job:ps/replica:0/task:(\d)")
        ps = f"ps {task.group(1)}"
        # Mid-publish: version 6 is half written, in a temporary folder no reader lists.
        assert deltas.versions(directory) == list(range(1, 6))
        assert [n for n in os.listdir(directory) if n.startswith(".tmp-v00000006-")]
        job.kill(ps)
        job.wait_for(rf"\[launcher\] {ps} exited with signal 9 \(SIGKILL\); restart 1 of 1")
        marker.write_text("")
        published = job.wait_for(r"\[chief 0\] published (.*)$").group(1)
        assert job.finish() == 0, job.output()
    finally:
        job.close()
    job.wait_for(r"lost their variables at epoch 1 step \d+;")
    job.wait_for(r"Restored the backup of epoch 1 step 0 ")
    job.wait_for(r"restored from a backup; this version is a full one")
    versions = eval(published)  # [(version, kind), ...]
    # Version 6 was never made visible half written; the first one after the restore
    # (numbered 6: the cut one never was) is a full version, deltas after it.
    assert [v for v, _ in versions] == list(range(1, len(versions) + 1))
    assert [k for v, k in versions if v <= 5] == ["full"] + ["delta"] * 4
    assert versions[5] == (6, "full") and {k for _, k in versions[6:]} == {"delta"}
    assert deltas.versions(directory) == list(range(1, len(versions) + 1))
    assert not [n for n in os.listdir(directory) if n.startswith(deltas.TEMPORARY_PREFIX)]
    # A consumer that applied versions 1-5 (rows newer than the backup restored) and goes
    # on in order ends at the trainer's rows and weights, bit for bit.
    consumer = kerasps.DeltaConsumer(directory)
    for version in range(1, len(versions) + 1):
        assert consumer.apply(directory / deltas.version_name(version))
    trainer = np.load(final)
    np.testing.assert_array_equal(consumer.rows("fixed/embeddings"), trainer["fixed"])
    weights = consumer.weights()
    np.testing.assert_array_equal(weights["head/kernel"], trainer["kernel"])
    np.testing.assert_array_equal(weights["head/bias"], trainer["bias"])
    assert not any(re.search(r"\[launcher\] chief 0 .*restart", line) for line in job.lines)
