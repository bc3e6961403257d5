"""The step's world-wide stats, and the speeds they carry to the rebalancer (stragglers, issue #26).

Every step already SUMs ``[loss, committed microbatches]`` over the whole world (``ResilientDataParallel._reduce``).
The same buffer carries, per data-parallel slot, the compute seconds and the microbatch count of the replica that
holds the slot, written by that replica's local rank 0 alone (every other rank adds zeros): each entry has one
contributor, so its sum is exact and bit-identical on every rank, whatever order MPI adds in. After the commit
every rank feeds the same numbers to the pure :class:`~nanotron_recover.workload.rebalance.Rebalancer`, so the next
step's quotas are the same everywhere with no extra round. Only the committed attempt's numbers are observed: a
reduction that failed may have completed on some ranks only.

One entry counts the ranks whose reduced gradient holds a NaN or an infinity; with the loss sum (NaN or infinite
when any microbatch's loss was) it tells every rank, spares included, in the same step that the step must not be
committed (:meth:`StepStats.nonfinite`). The entry before it counts the ranks that received a stop signal
(:mod:`nanotron_recover.process.stop_request`): the step it is seen in is the job's last
(:meth:`StepStats.stop_at`). Before it: the ranks' start-up of this launch, and how many ranks saw the launcher
say that the standby it started after a loss is ready (:mod:`nanotron_recover.run.in_place`), which regrow waits
for.

Its last four entries feed the snapshot schedule (:mod:`nanotron_recover.snapshots.schedule`): each rank's
cost of its last measured snapshot write and its last step time, in whole microseconds (integers: many
contributors, still an exact sum), with how many ranks contributed each.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nanotron_recover.config import RecoverConfig
from nanotron_recover.process.startup_clock import STARTUP
from nanotron_recover.process.stop_request import STOP, stop_reason
from nanotron_recover.recovery.errors import StragglerEvicted
from nanotron_recover.run.in_place import nodes_back, standby_ready
from nanotron_recover.training.seam import LocalWork, StepStop
from nanotron_recover.workload.rebalance import Rebalancer, RebalanceSettings
from nanotron_recover.workload.spares import ReplicaRoster

LOSS, MICROBATCHES = 0, 1  # the first two entries of the stats buffer
SNAPSHOT_ENTRIES = 4  # the last ones: snapshot write cost, writers, step time, ranks
NONFINITE_GRADS = -(SNAPSHOT_ENTRIES + 1)  # just before them: how many ranks hold a non-finite reduced gradient
STOP_REQUESTS = NONFINITE_GRADS - 1  # and before that: how many ranks were asked to stop (a signal)
STARTUP_US, STARTUP_RANKS = STOP_REQUESTS - 2, STOP_REQUESTS - 1  # the ranks' start-up seconds (µs), how many
STANDBY_READY = STARTUP_US - 1  # how many ranks saw the launcher say that the standby after a loss is ready
NODES_BACK = STANDBY_READY - 1  # how many saw it say that a node this launch left out answers again
TAIL_ENTRIES = -NODES_BACK  # the entries after the slots' speeds


def settings_of(config: RecoverConfig) -> RebalanceSettings:
    """The rebalancer's settings from the ``fault_tolerance`` section."""
    ft = config.fault_tolerance
    weights = ft.replica_weights
    return RebalanceSettings(
        rebalance=ft.rebalance, smoothing=ft.rebalance_smoothing, hysteresis=ft.rebalance_hysteresis,
        straggler_factor=ft.straggler_factor, straggler_steps=ft.straggler_steps,
        fixed=None if weights is None else {r: float(w) for r, w in enumerate(weights)},
    )


class StepStats:
    """``stats``: ``[loss sum, microbatches, seconds of slot 0 .. dp-1, microbatches of slot 0 .. dp-1]``, reused
    every attempt; ``balancer``: the speed estimates and the weights the planner uses; ``evicting``: drained
    stragglers that leave for a spare (``straggler_action: evict``), the same set on every rank."""

    def __init__(self, slots: int, microbatches_per_step: int, settings: RebalanceSettings, evicts: bool) -> None:
        self.slots = slots
        self.stats = np.zeros(2 + 2 * self.slots + TAIL_ENTRIES, dtype=np.float64)
        self.balancer = Rebalancer(microbatches_per_step, settings)
        self.evicts = evicts
        self.evicting: set[int] = set()

    @classmethod
    def of(cls, config: RecoverConfig) -> StepStats:
        """The sums of a job: ``dp`` slots, M microbatches, the rebalancer's and the stragglers' settings."""
        evicts = config.fault_tolerance.straggler_action == "evict"
        return cls(config.parallelism.dp, config.microbatches_per_step, settings_of(config), evicts)

    def fill(self, loss: float, work: LocalWork, counts: bool, slot: int | None,
             snapshot_cost_s: float | None = None, step_s: float | None = None,
             grads_finite: bool = True, stop: bool | None = None) -> np.ndarray:
        """This rank's contribution: ``counts`` for local rank 0 of a computing replica (the count and the speeds
        are counted once per replica), ``slot`` the slot its replica holds; ``snapshot_cost_s`` and ``step_s``
        its last measured snapshot write and step (None: none measured yet); ``grads_finite``: whether its reduced
        gradient is free of NaN and infinity; ``stop``: whether it received a stop signal (None: this process's
        :data:`~nanotron_recover.process.stop_request.STOP`)."""
        self.stats[:] = 0.0
        self.stats[LOSS] = loss
        self.stats[NONFINITE_GRADS] = 0.0 if grads_finite else 1.0
        self.stats[STOP_REQUESTS] = 1.0 if (STOP.requested if stop is None else stop) else 0.0
        if STARTUP.seconds is not None:
            self.stats[STARTUP_US], self.stats[STARTUP_RANKS] = round(STARTUP.seconds * 1e6), 1.0
        self.stats[STANDBY_READY] = 1.0 if standby_ready() else 0.0
        self.stats[NODES_BACK] = 1.0 if nodes_back() else 0.0
        self.stats[MICROBATCHES] = work.microbatches if counts else 0.0
        if counts and slot is not None:
            self.stats[2 + slot] = work.compute_s
            self.stats[2 + self.slots + slot] = work.microbatches
        tail = self.stats[-SNAPSHOT_ENTRIES:]
        if snapshot_cost_s is not None:
            tail[0], tail[1] = round(snapshot_cost_s * 1e6), 1.0
        if step_s is not None:
            tail[2], tail[3] = round(step_s * 1e6), 1.0
        return self.stats

    def nonfinite(self) -> str | None:
        """What was not finite in the committed attempt (the same answer on every rank), or None."""
        loss, ranks = float(self.stats[LOSS]), int(self.stats[NONFINITE_GRADS])
        if not math.isfinite(loss):
            return f"the step's loss is {loss}" + (f" and {ranks} rank(s) hold a non-finite gradient" if ranks else "")
        if ranks:
            return f"{ranks} rank(s) hold a non-finite gradient (the loss is finite: {loss:.6g})"
        return None

    def startup_s(self) -> float | None:
        """The ranks' mean start-up of this launch (agreed), once measured."""
        ranks = float(self.stats[STARTUP_RANKS])
        return float(self.stats[STARTUP_US]) / ranks / 1e6 if ranks else None

    def standby_ready(self) -> bool:
        """A rank saw the standby after a loss ready (the same answer on every rank)."""
        return bool(self.stats[STANDBY_READY])

    def nodes_back(self) -> bool:
        """A rank saw a node this launch left out answer again (the same answer on every rank)."""
        return bool(self.stats[NODES_BACK])

    def stop_at(self, step: int) -> StepStop | None:
        """Why the committed ``step`` is the job's last, when a rank was asked to stop (the same on every rank)."""
        ranks = int(self.stats[STOP_REQUESTS])
        return StepStop("stop_signal", stop_reason(ranks, step)) if ranks else None

    def snapshot_sums(self) -> tuple[float, float, float, float]:
        """The committed step's (write cost µs, writers, step µs, ranks) sums, for the snapshot schedule."""
        cost_us, writers, step_us, ranks = (float(v) for v in self.stats[-SNAPSHOT_ENTRIES:])
        return cost_us, writers, step_us, ranks

    def observe(self, roster: ReplicaRoster) -> dict[str, Any]:
        """Feed the committed step's speeds to the rebalancer; what the step record carries of them."""
        by_slot = {slot: roster.replica_in_slot(slot) for slot in roster.active_slots()}
        seconds = {r: float(self.stats[2 + s]) for s, r in by_slot.items()}
        counts = {r: int(round(self.stats[2 + self.slots + s])) for s, r in by_slot.items()}
        self.balancer.observe(seconds, counts, computing=sorted(by_slot.values()))
        evicted = self._evict(roster)
        record: dict[str, Any] = {
            "compute_s": {str(r): round(s, 6) for r, s in sorted(seconds.items()) if counts[r] > 0},
            "speeds": {str(r): round(v, 3) for r, v in self.balancer.speeds(list(by_slot.values())).items()},
        }
        if self.balancer.drained:
            record["drained"] = sorted(self.balancer.drained)
        if evicted:
            record["evicting"] = evicted
        return record

    def leave_if_evicted(self, replica: int | None, step: int, roster: ReplicaRoster) -> None:
        """Called by every rank as a step begins (after the commit, checkpoint and snapshot of the step that chose
        the eviction, which the straggler took part in): the evictions still backed by an idle spare stand (a
        failure since may have used the spare: the straggler then stays, drained); on the ranks of an evicted
        replica, raise :class:`StragglerEvicted`. Every rank has applied the same repairs by now: the same roster."""
        if not self.evicting:
            return
        self._keep_backed(roster)
        if replica is not None and replica in self.evicting:
            raise StragglerEvicted(replica, step)

    def _keep_backed(self, roster: ReplicaRoster) -> None:
        """Keep the evictions of replicas still active that an idle spare backs, lowest ids first."""
        self.evicting = set(sorted(r for r in self.evicting if r in roster.active)[:len(roster.spares)])

    def _evict(self, roster: ReplicaRoster) -> list[int]:
        """``straggler_action: evict``: drained replicas (new or earlier ones) that leave as failed, in id order,
        while an idle spare is left for each (the ones already leaving have one promised); the others stay drained
        and may leave when a spare appears (e.g. a replica formed by recycling). Evicting with no spare would lose
        the same capacity as draining and free nothing."""
        if not self.evicts:
            return []
        self._keep_backed(roster)
        candidates = sorted(r for r in self.balancer.drained if r in roster.active and r not in self.evicting)
        chosen = candidates[:len(roster.spares) - len(self.evicting)]
        self.evicting.update(chosen)
        return chosen

    def slot_weights(self, roster: ReplicaRoster, slots: list[int]) -> dict[int, float] | None:
        """The planner's weights by slot (None: rebalancing, fixed weights and draining are all off)."""
        if not self.balancer.settings.changes_the_plan:
            return None
        weights = self.balancer.weights([roster.replica_in_slot(s) for s in slots])
        return None if weights is None else {s: weights[roster.replica_in_slot(s)] for s in slots}

    def weights(self, replicas: list[int]) -> dict[int, float] | None:
        """The planner's weights by replica (for the orphans of a failure)."""
        if not self.balancer.settings.changes_the_plan:
            return None
        return self.balancer.weights(replicas)
