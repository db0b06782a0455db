"""The recovery decisions of `fit` after a failure: pure Python, shared with the simulator."""

import os

import pytest

from kerasps.policy.failures import Progress, PsTaskFailedError, Recovery, decide, steps_rolled_back


def test_only_lost_ps_state_is_recovered_and_only_from_a_backup():
    assert decide([], has_backup=True) is None  # not a ps loss: the error is raised as is
    assert decide([1], has_backup=True) is Recovery.RESTORE
    assert decide([0, 1], has_backup=False) is Recovery.RAISE


def test_steps_after_the_backup_run_again():
    assert steps_rolled_back(Progress(epoch=2, step=40), epoch=2, finished=47) == 7
    assert steps_rolled_back(Progress(epoch=2, step=0), epoch=2, finished=0) == 0


def test_a_backup_holding_steps_applied_ahead_of_the_delivered_ones_rolls_none_back():
    """A backup records the steps its weights hold, those applied on the ps tasks before
    their results reached the coordinator included: none of them runs again."""
    assert steps_rolled_back(Progress(epoch=2, step=50), epoch=2, finished=47,
                             scheduled=52) == 0
    with pytest.raises(RuntimeError, match=r"step 53, but .* step 47 \(52 scheduled\)"):
        steps_rolled_back(Progress(epoch=2, step=53), epoch=2, finished=47, scheduled=52)


@pytest.mark.parametrize("backup", [Progress(1, 40), Progress(2, 50)])
def test_a_backup_from_another_epoch_or_ahead_cannot_be_gone_on_from(backup):
    with pytest.raises(RuntimeError, match=r"written at epoch \d step \d+, but training was at "
                                           r"epoch 3 step 47"):
        steps_rolled_back(backup, epoch=2, finished=47)


def test_the_error_names_the_task_and_how_to_recover():
    assert "ps task 1 (/job:ps/replica:0/task:1)" in str(PsTaskFailedError(1, "fit"))
    assert "BackupAndRestore(backup_dir, save_freq=N)" in str(PsTaskFailedError(1, "fit"))
    assert "restore the model from a checkpoint" in str(PsTaskFailedError(0, "evaluate"))


def test_an_unreachable_ps_that_kept_its_state_is_retried_not_restored():
    assert decide([], has_backup=True, ps_unreachable=True) is Recovery.RETRY
    assert decide([], has_backup=False, ps_unreachable=True) is Recovery.RETRY
    assert decide([0], has_backup=True, ps_unreachable=True) is Recovery.RESTORE


def test_unreachable_ps_retries_back_off_past_grpc_reconnects_then_give_up():
    from kerasps.policy.failures import UNREACHABLE_RETRIES, retry_delay

    delays = [retry_delay(k) for k in range(UNREACHABLE_RETRIES)]
    assert delays == sorted(delays) and delays[0] == 0.5 and max(delays) <= 8.0
    assert sum(delays) > 20  # longer than gRPC's reconnect backoff after a ps restart
    assert retry_delay(UNREACHABLE_RETRIES) is None


def test_an_unreadable_progress_record_raises_naming_the_backup(tmp_path):
    import h5py
    import keras

    from kerasps.keras.trainer.recovery import Backup

    backup = Backup(keras.callbacks.BackupAndRestore(str(tmp_path)))
    os.makedirs(os.path.dirname(backup.latest), exist_ok=True)
    with h5py.File(backup.latest, "w") as f:
        f.attrs["kerasps_progress"] = ""  # as a record cut short would read
    with pytest.raises(RuntimeError, match=r"unreadable kerasps progress record \(''\)"):
        backup.progress()


def test_a_backup_that_failed_half_way_does_not_stop_the_next_one(tmp_path):
    """A ps task lost while a backup reads its weights fails the save half-way; `fit`
    retries the steps and backs up again. Keras left the half-written file open (its
    frames live on in the error's traceback), and every later backup of the `fit` failed
    with `OSError: ... unable to truncate a file which is already open`: a keras-rs job
    then lost its chief instead of recovering inside `fit`."""
    import keras
    import tensorflow as tf

    from kerasps.keras.trainer.recovery import Backup, Progress

    lost = [False]

    class OnALostPsTask(keras.layers.Dense):
        def save_own_variables(self, store):
            super().save_own_variables(store)
            if lost[0]:
                raise tf.errors.UnavailableError(None, None, "ps task 0: connection reset")

    model = keras.Sequential([keras.Input((2,)), OnALostPsTask(1)])
    callback = keras.callbacks.BackupAndRestore(str(tmp_path))
    callback.set_model(model)
    backup, progress = Backup(callback), [Progress(0, 1)]
    with backup.recording(lambda: progress[0]):
        backup.save()
        lost[0], progress[0] = True, Progress(0, 2)
        with pytest.raises(tf.errors.UnavailableError) as failed:  # kept, as `fit` keeps it
            backup.save()
        assert backup.progress() == Progress(0, 1)  # the latest backup is untouched
        lost[0], progress[0] = False, Progress(0, 3)
        backup.save()
    assert backup.progress() == Progress(0, 3)
    assert failed.value is not None
