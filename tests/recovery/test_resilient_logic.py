"""The in-step recovery logic of ``ResilientDataParallel``, in process, against an in-memory stand-in of ``FTWorld``.

The stand-in plays this rank's view of a world of 1-rank replicas: it adds the other replicas' contributions to
each reduction, fails a chosen collective (after leaving a half-reduced buffer behind, as a real failed reduction
does) and answers the repair with a chosen failed set. What is under test is everything around it: the snapshot
before each bucket's reduction, the restore, the re-plan of only the orphans, the second reduction, the commit of
exactly M microbatches, spare activation and the fallback below ``min_replicas``. The fault path itself (real
processes, real SIGKILLs) is tested in ``tests/ft``.

Every microbatch adds 1.0 to every gradient element, so a committed gradient must be M everywhere: a missed
restore, a double-counted bucket or a lost orphan shows as another number.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nanotron.optim.named_optimizer import NamedOptimizer

from nanotron_recover.config import config_from_dict
from nanotron_recover.ft import FailureDetected, RepairEvent
from nanotron_recover.ft.hang_policy import MainThreadProgress
from nanotron_recover.recovery.resilient import BelowMinimumReplicas, ResilientDataParallel
from nanotron_recover.training.seam import LocalWork, StepServices
from nanotron_recover.workload.planner import orphans_of, plan_step, replan_orphans
from tests.conftest import make_tiny_config

STEP = 3


class InMemoryWorld:
    """This rank (replica 0, world rank 0) in a world of ``n_replicas`` 1-rank replicas."""

    def __init__(self, n_replicas: int, active: list[int]) -> None:
        self.rank, self.epoch = 0, 0
        self.replica, self.local_rank, self.pooled = 0, 0, False
        self.events: list[RepairEvent] = []
        self.active_replicas = list(active)
        self.live_ranks = list(range(n_replicas))
        self.evicted = self.starting = False
        self.progress = MainThreadProgress()
        self.hang_monitor = None
        self.repair_hook = None
        self.others_per_microbatch = 0.0  # what the other replicas add to every gradient element, this attempt
        self.others_microbatches = 0.0
        self.fail_at: tuple[str, int] | None = None  # (op, n-th call of it) that fails
        self.next_failure: list[int] = []  # failed replicas reported by the repair
        self.after_repair = (0.0, 0.0)  # (others_per_microbatch, others_microbatches) once the failed set left
        self.calls: dict[str, int] = {}
        self.bcasts: list[int] = []
        self.active_sets: list[list[int]] = []

    @property
    def live_replicas(self) -> list[int]:
        return sorted(self.live_ranks)

    def _maybe_fail(self, op: str, buf: np.ndarray | None = None) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.fail_at == (op, self.calls[op]):
            self.fail_at = None
            if buf is not None:
                buf += 1e6  # a half-reduced buffer is garbage
            raise FailureDetected(op, 75, self.epoch, "stand-in failure")

    def allreduce_sum_(self, buf: np.ndarray, comm: str = "coord") -> np.ndarray:
        self._maybe_fail(f"allreduce({comm})", buf)
        if comm == "coord":
            buf += self.others_per_microbatch
        else:
            buf[1] += self.others_microbatches
        return buf

    def agree(self, flag: bool = True, epoch: int | None = None) -> bool:
        self._maybe_fail("agree")
        return flag

    def repair(self, since_epoch: int | None = None) -> RepairEvent:
        failed = self.next_failure
        self.epoch += 1
        self.live_ranks = [r for r in self.live_ranks if r not in failed]
        self.active_replicas = [r for r in self.active_replicas if r not in failed]
        self.others_per_microbatch, self.others_microbatches = self.after_repair
        self.events.append(RepairEvent(self.epoch, failed, failed, [], self.live_ranks, self.active_replicas))
        return self.events[-1]

    def set_active_replicas(self, replicas) -> None:
        self.active_replicas = sorted(replicas)
        self.active_sets.append(self.active_replicas)

    def bcast_(self, buf: np.ndarray, root_replica: int, comm: str = "coord") -> np.ndarray:
        self.bcasts.append(root_replica)
        return buf

    def failure_pending(self) -> bool:
        return False


class Sink:
    enabled = True

    def __init__(self) -> None:
        self.events: list[dict] = []

    def set_logging(self, enabled: bool) -> None:
        self.enabled = enabled

    def start_wandb(self, background: bool = False) -> bool:
        return False

    def log_step(self, record: dict) -> None:
        pass

    def log_event(self, record: dict) -> None:
        self.events.append(record)


class Training:
    """A tiny model, its optimizer, and the compute callable: each microbatch adds 1.0 to every gradient."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        self.named_params = list(self.model.named_parameters())
        self.unwrapped_model = self.model
        self.optimizer = NamedOptimizer(self.named_params, lambda groups: torch.optim.AdamW(groups, lr=1e-3))
        self.computed: list[list[int]] = []

    def compute(self, step: int, indices, loss_divisor: int) -> LocalWork:
        if not indices:
            return LocalWork()
        self.computed.append(list(indices))
        for _, p in self.named_params:
            p.grad.add_(float(len(indices)))
        return LocalWork(loss_sum=0.5 * len(indices) / loss_divisor, microbatches=len(indices))


def make(dp: int, spares: int = 0, min_replicas: int = 1) -> tuple[ResilientDataParallel, InMemoryWorld, Training]:
    raw = make_tiny_config(dp=dp, accumulation=2, steps=6, fault_tolerance={
        "enabled": True, "reduce_bucket_mb": 0.0002, "spare_replicas": spares, "min_replicas": min_replicas,
        "recycle": False})  # 1-rank replicas leave nobody to recycle; the stand-in does not play the pool
    config = config_from_dict(raw)
    world = InMemoryWorld(dp + spares, active=list(range(dp)))
    strategy = ResilientDataParallel(config, 1.0, end_job=lambda reason: None, ft=world, parallel_context=None)
    training = Training()
    strategy.attach_model(training.model, training.named_params, torch.device("cpu"))
    return strategy, world, training


def services(training: Training, sink: Sink) -> StepServices:
    return StepServices(compute=training.compute, fault_point=lambda step, phase: None, metrics=sink,
                        last_record=lambda: None)


def committed_gradient(training: Training) -> np.ndarray:
    return np.concatenate([p.grad.detach().numpy().ravel() for _, p in training.named_params])


@pytest.mark.parametrize("failing", [("allreduce(coord)", 2), ("allreduce(world)", 1), ("agree", 1)])
def test_a_failure_before_the_commit_restores_recomputes_the_orphans_and_commits_M(failing) -> None:
    """A failure in the second bucket's reduction (one bucket already reduced), in the loss reduction, or at the
    commit agreement (every bucket reduced): the same outcome."""
    strategy, world, training = make(dp=3)
    M = strategy.M
    assert strategy.buckets.num_buckets >= 2
    plan = plan_step(STEP, M, [0, 1, 2])
    extra = replan_orphans(orphans_of(plan, [1]), [0, 2], plan)
    world.others_per_microbatch = len(plan[1]) + len(plan[2])  # before the failure: replicas 1 and 2 computed
    world.fail_at, world.next_failure = failing, [1]
    survivor = len(plan[2]) + len(extra[2])  # replica 2: its share + its orphans
    world.after_repair = (survivor, survivor)
    sink = Sink()
    result = strategy.forward_backward_reduce(STEP, services(training, sink))

    assert training.computed == [plan[0], extra[0]]  # its own share once, then only its orphans
    assert result.quotas == {0: len(plan[0]) + len(extra[0]), 2: survivor}  # logged every step: sums to M
    assert result.microbatches == M and result.recoveries == 1 and result.epoch == 1 and result.live_replicas == 2
    np.testing.assert_array_equal(committed_gradient(training), np.full_like(committed_gradient(training), M))
    assert not strategy.buckets.has_snapshot(STEP)  # released at the commit
    (repair,) = [e for e in sink.events if e["event"] == "repair"]
    assert repair["failed_replicas"] == [1] and repair["phase"] == "in-step"


def test_without_a_failure_one_reduction_and_no_snapshot_left() -> None:
    strategy, world, training = make(dp=2)
    plan = plan_step(STEP, strategy.M, [0, 1])
    world.others_per_microbatch = world.others_microbatches = len(plan[1])
    result = strategy.forward_backward_reduce(STEP, services(training, Sink()))
    assert training.computed == [plan[0]] and result.recoveries == 0 and result.microbatches == strategy.M
    assert world.calls["allreduce(coord)"] == strategy.buckets.num_buckets and world.calls["agree"] == 1
    np.testing.assert_array_equal(committed_gradient(training), strategy.M)


def test_a_spare_replaces_the_failed_replica_at_the_step_boundary() -> None:
    """In-step the survivor takes the orphans; after the commit the spare enters the reduction and receives the
    parameters and Adam state from the replica that committed the step."""
    strategy, world, training = make(dp=2, spares=1)
    plan = plan_step(STEP, strategy.M, [0, 1])
    extra = replan_orphans(orphans_of(plan, [1]), [0], plan)
    world.others_per_microbatch = len(plan[1])
    world.fail_at, world.next_failure = ("allreduce(coord)", 1), [1]  # the spare computes nothing this step
    sink = Sink()
    result = strategy.forward_backward_reduce(STEP, services(training, sink))
    assert training.computed == [plan[0], extra[0]] and result.microbatches == strategy.M
    strategy.after_commit(STEP, training, services(training, sink))
    assert world.active_sets == [[0, 2]]  # the spare took the failed replica's slot
    n_state = len(training.named_params) * 4  # each parameter, then AdamW's step, exp_avg, exp_avg_sq
    assert world.bcasts == [0] * n_state
    assert [e["replicas"] for e in sink.events if e["event"] == "spare_activated"] == [[2]]
    assert strategy.computes()
    # the next step's plan gives the spare exactly the failed replica's range (slot 1)
    assert strategy._plan(STEP + 1) == {0: plan_step(STEP + 1, strategy.M, [0, 1])[0],
                                        2: plan_step(STEP + 1, strategy.M, [0, 1])[1]}


def test_below_min_replicas_stops_with_the_last_committed_step() -> None:
    strategy, world, training = make(dp=2, min_replicas=2)
    world.fail_at, world.next_failure = ("agree", 1), [1]
    with pytest.raises(BelowMinimumReplicas) as stopped:
        strategy.forward_backward_reduce(STEP, services(training, Sink()))
    assert stopped.value.last_committed_step == STEP - 1


def test_a_repair_that_finds_no_dead_rank_reduces_again_and_is_logged_as_such() -> None:
    """The commit agreement can come back without the healthy bit while nobody failed (seen under load): every rank
    repairs alike, nobody is dead, the step is reduced again from its snapshots and committed once."""
    strategy, world, training = make(dp=2)
    plan = plan_step(STEP, strategy.M, [0, 1])
    world.others_per_microbatch = world.others_microbatches = len(plan[1])
    world.after_repair = (len(plan[1]), len(plan[1]))  # replica 1 is still there and contributes again
    world.fail_at, world.next_failure = ("agree", 1), []
    sink = Sink()
    result = strategy.forward_backward_reduce(STEP, services(training, sink))
    assert training.computed == [plan[0]]  # nothing to recompute
    assert result.microbatches == strategy.M and result.recoveries == 1 and result.live_replicas == 2
    np.testing.assert_array_equal(committed_gradient(training), strategy.M)
    assert [e["event"] for e in sink.events] == ["repair_without_failure"]


def test_a_spare_that_replaced_a_replica_lost_in_a_checkpoint_save_computes_only_after_its_activation() -> None:
    """A death inside a save puts the spare into the roster, but its state comes only with the next activation:
    until then the replicas that hold the committed state compute its slot, so the step still commits M."""
    strategy, world, training = make(dp=2, spares=1)
    world.fail_at, world.next_failure = ("agree", 1), [1]
    writers: list[bool] = []
    strategy.save_checkpoint(STEP, lambda writer, barrier, publisher, extra, count: writers.append(writer),
                             services(training, Sink()))
    assert writers == [True, True]  # replica 0 wrote, and wrote again after the repair
    assert strategy.roster.active == [0, 2] and strategy.holders == {0}
    assert strategy._plan(STEP + 1) == {0: list(range(strategy.M))}  # step-local indices: all M
    result = strategy.forward_backward_reduce(STEP + 1, services(training, Sink()))  # commits in the new epoch
    assert result.microbatches == strategy.M and result.quotas == {0: strategy.M}
    strategy.after_commit(STEP + 1, training, services(training, Sink()))
    assert strategy.holders == {0, 2} and world.active_sets == [[0, 2]]
    by_slot = plan_step(STEP + 2, strategy.M, [0, 1])
    assert strategy._plan(STEP + 2) == {0: by_slot[0], 2: by_slot[1]}


def test_a_repair_after_the_commit_waits_for_the_next_commit_to_activate_its_spare() -> None:
    """A replica lost after step STEP committed (inside its update): this rank applied the repair before its step
    boundary, the other ranks meet the loss in step STEP + 1. No state transfer at STEP's boundary (the others have
    passed it: its collectives would match their next step's); the spare gets the state at STEP + 1's."""
    strategy, world, training = make(dp=2, spares=1)
    world.others_per_microbatch = world.others_microbatches = len(plan_step(STEP, strategy.M, [0, 1])[1])
    strategy.forward_backward_reduce(STEP, services(training, Sink()))  # committed in epoch 0
    world.others_per_microbatch = world.others_microbatches = 0  # replica 0 alone computes the next step
    world.next_failure = [1]
    strategy.repair(services(training, Sink()), STEP, "in-step")  # epoch 1: the spare takes slot 1
    assert strategy.roster.active == [0, 2] and strategy.membership.ahead_of_commit()
    strategy.after_commit(STEP, training, services(training, Sink()))
    assert world.active_sets == [] and world.bcasts == [] and strategy.holders == {0}
    strategy.forward_backward_reduce(STEP + 1, services(training, Sink()))  # replica 0 computes all M, epoch 1
    assert not strategy.membership.ahead_of_commit()
    strategy.after_commit(STEP + 1, training, services(training, Sink()))
    assert world.active_sets == [[0, 2]] and world.bcasts and strategy.holders == {0, 2}


def test_no_checkpoint_is_written_when_no_replica_holds_the_committed_state() -> None:
    strategy, world, training = make(dp=2, spares=1)
    strategy.holders = set()  # e.g. the donors of a transfer were lost: only the spare is left
    with pytest.raises(BelowMinimumReplicas, match="no live replica holds the committed state of step 3"):
        strategy.save_checkpoint(3, lambda *args: pytest.fail("wrote a checkpoint"), services(training, Sink()))
    assert not strategy.can_checkpoint()


@pytest.mark.parametrize("ft, checkpoints, expected", [
    ({}, True, False),  # the step's node-local snapshot holds it
    ({"local_snapshot_interval": 0}, True, True),  # snapshots off: only a checkpoint holds it
    ({"checkpoint_on_stop": True}, True, True),  # asked for
    ({"local_snapshot_interval": 0}, False, False),  # never without a checkpoints section
])
def test_a_graceful_stop_writes_a_checkpoint_when_asked_or_when_no_snapshot_holds_the_step(ft, checkpoints,
                                                                                           expected) -> None:
    raw = make_tiny_config(dp=2, fault_tolerance={"enabled": True, "recycle": False, **ft})
    if not checkpoints:
        raw["checkpoints"] = None
    strategy = ResilientDataParallel(config_from_dict(raw), 1.0, end_job=lambda reason: None,
                                     ft=InMemoryWorld(2, active=[0, 1]), parallel_context=None)
    assert strategy.checkpoint_at_stop() is expected
