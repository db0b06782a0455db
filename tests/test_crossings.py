"""What one training step sends between tasks, from TensorFlow's partitioned graphs.

Each tensor that crosses tasks is a gRPC transfer of its own (a request, a response,
their framing, executor work at both ends), whatever its size. The embedding workload
of `benchmarks/crossings.py` (a table in 2 shards on 2 ps tasks, two Dense layers)
needs 12 per worker-step: the ids to each shard and its rows back, each shard's
gradient, the 4 dense variables read and their gradients, sent to each ps task in
one tensor (14 when each gradient crossed on its own).
"""

import collections

import pytest

from benchmarks import crossings


@pytest.fixture(scope="module")
def adam_step():
    return crossings.measure("adam")


def test_optimizer_scalars_cross_to_the_other_ps_task_as_one_tensor(adam_step):
    # Adam reads the learning rate and `iterations` next to every variable it
    # updates. Both live on one ps task and cross to the other in one tensor
    # (two before: `iterations` int64 and the learning rate float from the other task).
    between_ps = collections.Counter(
        (c["sender"], c["receiver"]) for c in adam_step
        if c["sender"].startswith("ps") and c["receiver"].startswith("ps"))
    assert list(between_ps.values()) == [1], crossings.table(adam_step)


def test_no_int64_crosses_tasks(adam_step):
    # Before: the ids sent to the shards (int32 now: the shards have fewer than
    # 2**31 rows), the staleness counter's read of `iterations` sent to the worker
    # and back, the constant 1 that `iterations.assign_add(1)` made on the worker,
    # and `iterations` itself, sent to the other ps task.
    assert [c for c in adam_step if c["dtype"] == "int64"] == []


def test_the_small_gradients_of_a_ps_task_cross_to_it_as_one_tensor(adam_step):
    # Each ps task holds two of the dense variables: their gradients cross in one
    # tensor, and in two when each gradient is sent on its own (as before).
    apart = crossings.measure("adam", gradients_apart=True)

    def to_ps(step):
        return collections.Counter(c["receiver"] for c in step
                                   if c["sender"].startswith("worker"))

    assert to_ps(apart) - to_ps(adam_step) == {"ps:0": 1, "ps:1": 1}, (
        crossings.table(adam_step))
    assert len(apart) - len(adam_step) == 2


def test_a_step_sends_20_tensors_of_which_12_are_the_models(adam_step):
    # The model's 12: the ids to each shard and its rows back, each shard's gradient,
    # the 4 dense variables read and their gradients, in one tensor per ps task.
    # The other 8: the loss tracker's total and count, the optimizer's scalars,
    # the loop condition to each ps task and 3 control edges. 30 before, then 23, 22.
    assert len(adam_step) == 20, crossings.table(adam_step)


def test_a_step_of_the_function_that_returns_logs_sends_no_more(adam_step):
    # That function (every execution's, when a callback reads batch logs, as the
    # progress bar does) computed the logs in every iteration of its loop: the loss
    # tracker's and the staleness counter's reads crossed every step (33 before).
    assert len(crossings.measure("adam", logs=True)) == len(adam_step)
