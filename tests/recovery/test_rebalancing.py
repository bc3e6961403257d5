"""Rebalancing inside the resilient step, in process, against the in-memory world of the step-logic tests.

The stand-in world adds the other replicas' contributions to the step's world-wide stats (their compute seconds and
microbatches, in their slots' entries) as their local rank 0 would. What is under test: this rank's own entry, the
observation of the committed attempt only, the next step's weighted plan, a spare that takes a slot without the
slot's history, draining, and that with rebalancing off the plan is exactly the equal split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanotron_recover.config import config_from_dict
from nanotron_recover.recovery.errors import StragglerEvicted
from nanotron_recover.recovery.resilient import ResilientDataParallel
from nanotron_recover.recovery.step_sums import StepStats, step_sums_layout
from nanotron_recover.training.seam import LocalWork
from nanotron_recover.workload.planner import plan_step
from nanotron_recover.workload.spares import ReplicaRoster
from tests.conftest import make_tiny_config
from tests.recovery.test_resilient_logic import InMemoryWorld, Sink, Training, committed_gradient, services

SECONDS = 0.01  # this rank's compute time per microbatch


class SpeedWorld(InMemoryWorld):
    """Also adds ``others[slot] = (seconds, microbatches)`` into the speed entries of the world-wide stats."""

    def __init__(self, n_replicas: int, active: list[int]) -> None:
        super().__init__(n_replicas, active)
        self.others: dict[int, tuple[float, int]] = {}
        self.offsets = step_sums_layout(len(active)).offsets  # the step sums' entries, by name

    def allreduce_sum_(self, buf: np.ndarray, comm: str = "coord") -> np.ndarray:
        super().allreduce_sum_(buf, comm)
        if comm == "world":
            seconds_at, counts_at = self.offsets["slot_seconds"], self.offsets["slot_microbatches"]
            for slot, (seconds, n) in self.others.items():
                buf[seconds_at][slot] += seconds
                buf[counts_at][slot] += n
        return buf

    def repair(self, since_epoch: int | None = None):
        self.others = {}  # the failed replicas' entries are gone; a survivor's work is this rank's (1 other here)
        return super().repair(since_epoch)


class TimedTraining(Training):
    def compute(self, step: int, indices, loss_divisor: int) -> LocalWork:
        work = super().compute(step, indices, loss_divisor)
        work.compute_s = SECONDS * len(indices)
        return work


def make(dp: int, spares: int = 0, **ft) -> tuple[ResilientDataParallel, SpeedWorld, TimedTraining]:
    raw = make_tiny_config(dp=dp, accumulation=2, steps=6, fault_tolerance={
        "enabled": True, "reduce_bucket_mb": 0.0002, "spare_replicas": spares, "recycle": False,
        **ft})  # 1-rank replicas leave nobody to recycle; the stand-in does not play the pool
    world = SpeedWorld(dp + spares, active=list(range(dp)))
    strategy = ResilientDataParallel(config_from_dict(raw), 1.0, end_job=lambda reason: None, ft=world,
                                     parallel_context=None)
    training = TimedTraining()
    strategy.attach_model(training.model, training.named_params, torch.device("cpu"))
    return strategy, world, training


def step(strategy, world, training, step: int, others: dict[int, tuple[int, float]]):
    """One committed step; ``others[slot] = (microbatches, seconds per microbatch)`` of the other replicas."""
    world.others = {slot: (n * s, n) for slot, (n, s) in others.items()}
    world.others_per_microbatch = world.others_microbatches = sum(n for n, _ in others.values())
    result = strategy.forward_backward_reduce(step, services(training, Sink()))
    assert result.microbatches == strategy.M
    np.testing.assert_array_equal(committed_gradient(training), strategy.M)
    strategy.zero_grad(training)
    return result


def test_a_slow_replica_gets_fewer_microbatches_from_the_next_step_and_every_step_commits_M() -> None:
    strategy, world, training = make(dp=3, rebalance=True)  # M = 6
    warmup = step(strategy, world, training, 1, {1: (2, 9 * SECONDS), 2: (2, SECONDS)})
    assert warmup.balance == {"compute_s": {"0": 0.02, "1": 0.18, "2": 0.02}, "speeds": {}}  # first: left out
    first = step(strategy, world, training, 2, {1: (2, SECONDS), 2: (2, 4 * SECONDS)})
    assert first.quotas == {0: 2, 1: 2, 2: 2}
    assert first.balance["speeds"] == {"0": 100.0, "1": 100.0, "2": 25.0}  # microbatches per second
    second = step(strategy, world, training, 3, {1: (3, SECONDS)})
    assert second.quotas == {0: 3, 1: 3, 2: 0}  # 4x slower: its exact share 0.67 loses the remainder race
    assert training.computed == [[0, 1], [0, 1], [0, 1, 2]]  # slot 0 keeps the first range, now 3 long


def test_with_rebalancing_off_the_plan_is_the_equal_split_and_speeds_are_still_logged() -> None:
    strategy, world, training = make(dp=3)
    for s in (1, 2, 3):
        result = step(strategy, world, training, s, {1: (2, SECONDS), 2: (2, 4 * SECONDS)})
        assert result.quotas == {0: 2, 1: 2, 2: 2}
    assert strategy._plan(4) == plan_step(4, strategy.M, [0, 1, 2])
    assert result.balance["speeds"]["2"] == 25.0 and "drained" not in result.balance


def test_a_persistent_straggler_is_drained_and_logged() -> None:
    strategy, world, training = make(dp=3, straggler_factor=2.0, straggler_steps=2)
    for s in (1, 2, 3):
        result = step(strategy, world, training, s, {1: (2, SECONDS), 2: (2, 4 * SECONDS)})
    assert result.balance["drained"] == [2]
    assert step(strategy, world, training, 4, {1: (3, SECONDS)}).quotas == {0: 3, 1: 3, 2: 0}


def test_a_persistent_straggler_with_an_idle_spare_is_evicted() -> None:
    strategy, world, training = make(dp=3, spares=1, straggler_factor=2.0, straggler_steps=2,
                                     straggler_action="evict")
    for s in (1, 2, 3):
        result = step(strategy, world, training, s, {1: (2, SECONDS), 2: (2, 4 * SECONDS)})
    assert result.balance["drained"] == [2] and result.balance["evicting"] == [2]
    stats, roster = strategy.step_stats, strategy.roster
    with pytest.raises(StragglerEvicted, match="replica 2 evicted as a persistent straggler before step 4"):
        stats.leave_if_evicted(2, 4, roster)  # what replica 2's ranks do as step 4 begins
    stats.leave_if_evicted(0, 4, roster)  # a healthy replica carries on
    stats.leave_if_evicted(None, 4, roster)  # and so does a pool rank
    assert step(strategy, world, training, 4, {1: (3, SECONDS)}).quotas == {0: 3, 1: 3, 2: 0}


def test_a_straggler_whose_spare_was_used_by_a_failure_meanwhile_stays_drained() -> None:
    """The eviction is chosen as step 3 commits; a replica dies before step 4 begins (in the update, a save, a
    snapshot) and the spare takes its slot: the straggler must not leave too (nobody would take its slot)."""
    strategy, world, training = make(dp=3, spares=1, straggler_factor=2.0, straggler_steps=2,
                                     straggler_action="evict")
    for s in (1, 2, 3):
        result = step(strategy, world, training, s, {1: (2, SECONDS), 2: (2, 4 * SECONDS)})
    assert result.balance["evicting"] == [2]
    strategy.roster.on_failure([1])  # spare 3 takes slot 1
    strategy.step_stats.leave_if_evicted(2, 4, strategy.roster)  # stays: no raise
    assert strategy.step_stats.speeds.evicting == set() and strategy.step_stats.speeds.balancer.drained == {2}


def test_a_drained_straggler_leaves_once_a_spare_appears() -> None:
    """Drained while no spare was idle (the configured one was used up); later a replica formed by recycling waits
    as a spare (every slot held): the next committed step chooses the eviction. The step's world-wide sums are
    filled in as the replicas' local ranks 0 would (one contributor per entry)."""
    config = config_from_dict(make_tiny_config(dp=3, accumulation=2, steps=6, fault_tolerance={
        "enabled": True, "spare_replicas": 1, "straggler_factor": 2.0, "straggler_steps": 2,
        "straggler_action": "evict"}))
    stats, roster = StepStats.of(config), ReplicaRoster(active=[0, 1, 2], spares=[3])
    roster.on_failure([1])  # spare 3 takes slot 1

    def observe(per_slot: dict[int, tuple[int, float]]) -> dict:
        stats.stats[:] = 0.0
        for slot, (n, seconds) in per_slot.items():
            stats["slot_seconds"][slot], stats["slot_microbatches"][slot] = n * seconds, n
        return stats.observe(roster)

    for _ in range(3):
        record = observe({0: (2, SECONDS), 1: (2, SECONDS), 2: (2, 4 * SECONDS)})
    assert record["drained"] == [2] and "evicting" not in record
    stats.leave_if_evicted(2, 4, roster)  # nothing to leave for
    assert roster.add_replica(5) is None  # a formed replica, waiting as a spare
    assert observe({0: (3, SECONDS), 1: (3, SECONDS)})["evicting"] == [2]
    with pytest.raises(StragglerEvicted):
        stats.leave_if_evicted(2, 5, roster)

def test_two_stragglers_and_one_spare_evict_the_lower_id_and_drain_the_other() -> None:
    strategy, world, training = make(dp=5, spares=1, straggler_factor=2.0, straggler_steps=2,
                                     straggler_action="evict")
    slow, fast = (2, 4 * SECONDS), (2, SECONDS)
    for s in (1, 2, 3):  # replicas 0 (this rank), 1 and 4 are fast, 2 and 3 are 4x slower
        result = step(strategy, world, training, s, {1: fast, 2: slow, 3: slow, 4: fast})
    assert result.balance["drained"] == [2, 3] and result.balance["evicting"] == [2]


def test_a_spare_that_takes_a_slot_does_not_inherit_the_slots_slowness() -> None:
    """Replica 1 is slow, then dies mid-reduction: its orphans go to replica 0; the spare that takes slot 1 after
    its state transfer is estimated from the replicas measured so far (replica 0), not from replica 1."""
    strategy, world, training = make(dp=2, spares=1, rebalance=True)  # M = 4
    step(strategy, world, training, 1, {1: (2, 4 * SECONDS)})  # each replica's first measurement is left out
    step(strategy, world, training, 2, {1: (2, 4 * SECONDS)})
    assert strategy._plan(3) == {0: [0, 1, 2], 1: [3]}
    world.others, world.others_per_microbatch = {1: (4 * SECONDS, 1)}, 1
    world.fail_at = ("allreduce(coord)", world.calls["allreduce(coord)"] + 1)  # this step's first bucket
    world.next_failure, world.after_repair = [1], (0.0, 0.0)
    result = strategy.forward_backward_reduce(3, services(training, Sink()))
    assert result.microbatches == strategy.M and result.quotas == {0: 4} and training.computed[-1] == [3]
    strategy.zero_grad(training)
    strategy.after_commit(3, training, services(training, Sink()))
    assert world.active_sets == [[0, 2]]
    assert strategy._plan(4) == {0: [0, 1], 2: [2, 3]}  # the spare in slot 1: as fast as replica 0
