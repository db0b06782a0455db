"""The coordinator: dispatch policies, the model version, checkpoints and recovery.

Mechanism and policy are separate. The `Coordinator` owns the mechanism: the
global step (model version), a dispatch gate that holds workers back during
checkpoints and recoveries, rollback to the last checkpoint. A dispatch
policy (`AsyncPolicy`, `SyncPolicy`, `HybridPolicy`) decides what a worker's
gradient does: applied on arrival, aggregated until a sync step has enough of
them, or both (hybrid: the row update on arrival, the dense gradient in a step).
"""

from __future__ import annotations

import simpy

from kerasps.policy.restarts import Action
from simulator.failures import Abort, Cancel, Restarts
from simulator.metrics import Metrics
from simulator.scenario import CheckpointSpec, Mode, TrainingSpec

__all__ = ["Coordinator", "AsyncPolicy", "SyncPolicy", "HybridPolicy", "make_policy", "coordinator"]


class AsyncPolicy:
    """Asynchronous training: every gradient updates the model when it arrives.

    Staleness of a gradient is the number of updates applied between the
    worker reading the variables and its gradient arriving. With
    `max_staleness`, staler gradients are dropped.
    """

    mode = Mode.ASYNC

    def __init__(self, coordinator: Coordinator, max_staleness: int | None = None):
        self.coordinator = coordinator
        self.max_staleness = max_staleness
        self._staleness = coordinator.metrics.staleness

    def start(self, worker) -> simpy.Event | None:
        """Called before `worker` computes a step; returns an event to wait for first."""
        return None

    def push(self, worker, version: int):
        """A gradient computed from `version` arrived; returns an event to wait on, or `None`."""
        c = self.coordinator
        staleness = c.version - version
        if self.max_staleness is not None and staleness > self.max_staleness:
            c.metrics.dropped += 1
            return None
        self._staleness.append(staleness)
        c.apply(1)
        return None

    def lost(self, worker):
        """`worker`'s in-flight step was interrupted."""

    def on_membership_change(self):
        pass

    def reset(self):
        pass


class SyncPolicy:
    """Synchronous training with `backup_workers` (drop the slowest).

    Every member works on the current step; the step completes as soon as
    `members - backup_workers` gradients have arrived. With `late_workers="cancel"`
    the workers still computing are cancelled (their gradients are dropped) and
    everybody starts the next step together. With `"finish"`, as in kerasps, a late
    worker finishes its step and its gradient is dropped when it arrives; a worker
    that was busy when a step started joins it only if the step would be short of
    gradients without it (kerasps schedules the step's function behind it then),
    otherwise it waits for the next step. A crashed worker stays a member, so a step
    without enough live workers waits for restarts; permanent losses and
    elastic leaves shrink the quorum.

    With `training.apply_time` or `workers.embedding_time`, the step's apply
    function then runs (the apply time, plus in sync mode the kept workers' row
    updates, dequeued from their slots and applied together) before the next
    step starts, as kerasps schedules it.
    """

    mode = Mode.SYNC

    def __init__(self, coordinator: Coordinator, backup_workers: int = 0,
                 apply_time: float = 0.0, late_workers: str = "cancel", machine=None):
        self.coordinator = coordinator
        self.backup_workers = backup_workers
        self.apply_time = apply_time
        self.cancels_late = late_workers == "cancel"
        self.machine = machine  # `None`, or the `Machine` the apply function computes on
        self.received = 0
        self.in_flight = 0
        self.current = 0  # workers computing the current step
        self.applying = False  # between a step's last kept gradient and its update
        self._generation = 0  # bumped by `reset`: an apply in progress is void
        self._row_seconds = 0.0  # the kept workers' row updates (sync mode)
        self.step_done = coordinator.env.event()

    @property
    def quorum(self) -> int:
        return max(1, self.coordinator.members - self.backup_workers)

    def start(self, worker):
        c = self.coordinator
        if self.applying or worker.pushed == c.version:
            return self.step_done  # already contributed to this step
        if worker.missed == c.version and self.received + self.current >= self.quorum:
            return self.step_done  # busy when the step started, and not needed
        self.in_flight += 1
        self.current += 1
        return None

    def push(self, worker, version):
        c = self.coordinator
        self.in_flight -= 1
        if version != c.version or self.applying:  # a late worker (never when cancelled)
            c.metrics.dropped += 1  # its gradient: the step it was for has its quorum
            worker.missed = c.version
            return None
        self.current -= 1
        self.received += 1
        self._row_seconds += worker.embedding_seconds
        worker.pushed = version
        if self.received >= self.quorum:
            self._complete()
            return None
        return self.step_done

    def lost(self, worker):
        """`worker`'s in-flight step was interrupted."""
        self.in_flight -= 1
        if worker.version == self.coordinator.version and not self.applying:
            self.current -= 1

    def on_membership_change(self):
        if self.received and self.received >= self.quorum and not self.applying:
            self._complete()

    def reset(self):
        """Forget the partial step (after a rollback) and wake its waiters."""
        self.coordinator.metrics.lost += self.received
        self.received = 0
        self._row_seconds = 0.0
        self.applying = False
        self._generation += 1
        for worker in self.coordinator.workers:
            worker.pushed = None
        self._next_step()

    def _cancel_late(self):
        if self.in_flight:
            for worker in self.coordinator.workers:
                if worker.in_flight:
                    worker.process.interrupt(Cancel())

    def _complete(self):
        c = self.coordinator
        gradients, self.received = self.received, 0
        rows, self._row_seconds = self._row_seconds, 0.0
        if self.cancels_late:
            self._cancel_late()
        delay = self.apply_time + (rows if self.mode is Mode.SYNC else 0.0)
        if delay > 0:
            self.applying = True
            c.env.process(self._apply_after(delay, gradients, self._generation))
            return
        self._next_step()
        c.apply(gradients)

    def _apply_after(self, delay: float, gradients: int, generation: int):
        env = self.coordinator.env
        yield env.timeout(delay) if self.machine is None else self.machine.compute(delay)
        if generation != self._generation:  # rolled back meanwhile
            return
        self.applying = False
        self._next_step()
        self.coordinator.apply(gradients)

    def _next_step(self):
        self.current = 0
        done, self.step_done = self.step_done, self.coordinator.env.event()
        done.succeed()


class HybridPolicy(SyncPolicy):
    """Hybrid training (kerasps' `mode="hybrid"`): the dense gradients make global steps
    as in `SyncPolicy` with `late_workers="finish"`, and each worker's row update is
    applied when its step ends.

    As in kerasps, a late worker is not cancelled: it finishes its step, its row update
    is applied (`Metrics.row_updates`, with its staleness in global steps) and its dense
    gradient is dropped.
    """

    mode = Mode.HYBRID

    def __init__(self, coordinator: Coordinator, backup_workers: int = 0,
                 apply_time: float = 0.0, machine=None):
        super().__init__(coordinator, backup_workers, apply_time, "finish", machine)

    def push(self, worker, version):
        c = self.coordinator
        c.metrics.row_updates += 1  # applied on arrival, whatever becomes of the dense part
        c.metrics.staleness.append(c.version - version)
        return super().push(worker, version)


def make_policy(coordinator: Coordinator, training: TrainingSpec, machine=None):
    """The dispatch policy for `training.mode` (`machine`: where apply functions compute,
    or `None`)."""
    if training.mode is Mode.SYNC:
        return SyncPolicy(coordinator, training.backup_workers, training.apply_time,
                          training.late_workers, machine)
    if training.mode is Mode.HYBRID:
        return HybridPolicy(coordinator, training.backup_workers, training.apply_time,
                            machine)
    return AsyncPolicy(coordinator, training.max_staleness)


class Coordinator:
    """Shared training state.

    Attributes:
        version: global step, the number of model updates kept so far.
        gate: `None` while workers may start steps, else an event that fires
            when they may again (see `hold` and `release`).
        members: workers in the job (crashed ones included, lost ones not).
        workers: every worker ever created.
        last_checkpoint: global step of the newest checkpoint.
        done: fires when `training.steps` is reached.
        ended: fires when a task's spent restart budget ends the job.
        restarts: the worker and ps tasks' restarts (`failures.Restarts`).
        up: `False` while the coordinator is down.
    """

    def __init__(self, env: simpy.Environment, training: TrainingSpec,
                 checkpoint: CheckpointSpec, metrics: Metrics, max_restarts: int | None = None,
                 machine=None):
        self.env = env
        self.training = training
        self.checkpoint = checkpoint
        self.metrics = metrics
        self.version = 0
        self.gate = None
        self._holds = 0
        self.members = 0
        self.min_members = 1
        self._below_min = False
        self.workers = []
        self.last_checkpoint = 0
        self._applied_at_checkpoint = 0  # `metrics.applied` when the last checkpoint was taken
        self._applied_at_request = 0
        self._since = 0.0  # when the time of the next global step starts counting
        self.done = env.event()
        self.ended = env.event()
        self.restarts = Restarts(max_restarts)
        self.up = True
        self.process: simpy.Process | None = None
        self.checkpoint_due = env.event()
        self.writing = False
        self.policy = make_policy(self, training, machine)
        self._every = checkpoint.every
        self._steps = training.steps

    # Dispatch gate.
    def hold(self):
        """Stops workers from starting new steps until a matching `release`."""
        if self._holds == 0:
            self.gate = self.env.event()
        self._holds += 1

    def release(self):
        self._holds -= 1
        if self._holds == 0:
            gate, self.gate = self.gate, None
            gate.succeed()
            self._since = self.env.now  # a pause is no step's time

    # Progress.
    def apply(self, gradients: int):
        """Applies one model update made of `gradients` worker gradients."""
        now = self.env.now
        self.version += 1
        self.metrics.applied += gradients
        self.metrics.step_ends.append(now)
        self.metrics.step_work.append(now - self._since)
        self._since = now
        if self.version >= self._steps:
            if not self.done.triggered:
                self.done.succeed()
        elif self._every and self.version % self._every == 0:
            if self.checkpoint.duration == 0:
                self._applied_at_request = self.metrics.applied
                self._saved(self.version)
            elif not self.writing:
                self._applied_at_request = self.metrics.applied
                self.hold()
                self.writing = True
                self.checkpoint_due.succeed()

    def _saved(self, step: int):
        self.last_checkpoint = step
        self._applied_at_checkpoint = self._applied_at_request
        self.metrics.checkpoints.append((self.env.now, step))

    # Membership.
    def join(self, worker):
        self.members += 1
        self._check_min_members()
        self.policy.on_membership_change()

    def leave(self, worker):
        self.members -= 1
        self._check_min_members()
        self.policy.on_membership_change()

    def _check_min_members(self):
        below = self.members < self.min_members
        if below and not self._below_min:
            self._below_min = True
            self.hold()
        elif not below and self._below_min:
            self._below_min = False
            self.release()

    # Failures.
    def restart(self, task_type: str, index: int) -> bool:
        """Whether the crashed task `task_type:index` comes back, as `kerasps launch` decides.

        If its restart budget is spent, the job ends instead (`ended` fires and
        `metrics.ended_by` says which task, after how many restarts, and why).
        """
        decision = self.restarts.decide(task_type, index)
        if decision.action is Action.RESTART:
            return True
        task = f"{task_type}:{index}"
        self.metrics.ended_by = {"time": self.env.now, "task": task,
                                 "restarts": self.restarts.counts.get(task, 0),
                                 "reason": decision.reason}
        if not self.ended.triggered:
            self.ended.succeed()
        return False

    def job_failure(self, actor: str, crash):
        """Recovery from a ps or coordinator failure (a generator; run it with `yield from`).

        Workers stop, in-flight steps are lost, the model rolls back to the
        last checkpoint, and training resumes once the failed actor is back
        (`crash.downtime`) and the checkpoint is restored.
        """
        env = self.env
        self.hold()
        if self.writing and actor != "coordinator":
            self.process.interrupt(Abort(actor))  # the checkpoint being written is lost
        for worker in self.workers:
            if worker.in_flight:
                worker.process.interrupt(Abort(actor))
        lost_steps = self.version - self.last_checkpoint
        self.metrics.failures.append((env.now, actor, "crash", lost_steps))
        self.metrics.rolled_back_steps += lost_steps
        rolled_back = self.metrics.applied - self._applied_at_checkpoint
        self.metrics.lost += rolled_back
        self.metrics.applied -= rolled_back
        self.version = self.last_checkpoint
        del self.metrics.step_ends[self.version:]
        del self.metrics.step_work[self.version:]
        self.policy.reset()
        start = env.now
        yield env.timeout(crash.downtime + self.checkpoint.restore_time)
        self.metrics.downtime += env.now - start
        self.release()


def coordinator(env: simpy.Environment, c: Coordinator):
    """The coordinator's process: writes checkpoints; a failure interrupts it.

    A crash is the chief's (`"chief:0"` to the restart policy): within its budget it
    comes back and training rolls back to the last checkpoint; beyond, the job ends.
    """
    while True:
        try:
            yield c.checkpoint_due
            c.checkpoint_due = env.event()
            step = c.version
            yield env.timeout(c.checkpoint.duration)
            c._saved(step)
            c.writing = False
            c.release()
        except simpy.Interrupt as interrupt:
            if c.writing:
                c.writing = False
                c.checkpoint_due = env.event()
                c.release()
            if isinstance(interrupt.cause, Abort):
                continue  # a ps failed while the checkpoint was written
            c.up = False
            if not c.restart("chief", 0):  # the launcher restarts the chief like any task
                c.metrics.failures.append((env.now, "coordinator", "crash", 0))
                return
            yield from c.job_failure("coordinator", interrupt.cause)
            c.up = True
