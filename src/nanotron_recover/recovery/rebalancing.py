"""The rebalancer's tenant of the step's sums: each slot's speed, measured, agreed, fed to the planner (issue #26).

Per data-parallel slot, the step's world-wide sums (:mod:`nanotron_recover.recovery.step_sums`) carry the compute
seconds and the microbatch count of the replica that holds the slot, written by that replica's local rank 0 alone
(every other rank adds zeros): each entry has one contributor, so its sum is exact and bit-identical on every rank,
whatever order MPI adds in. After the commit every rank feeds the same numbers to the pure
:class:`~nanotron_recover.workload.rebalance.Rebalancer`, so the next step's quotas are the same everywhere with no
extra round. Drained stragglers may leave for a spare (``straggler_action: evict``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nanotron_recover.config import RecoverConfig
from nanotron_recover.recovery.errors import StragglerEvicted
from nanotron_recover.workload.rebalance import Rebalancer, RebalanceSettings
from nanotron_recover.workload.spares import ReplicaRoster


def speed_entries(slots: int) -> tuple[tuple[str, int], ...]:
    """The step sums' entries of this tenant: per slot, compute seconds and microbatches."""
    return (("slot_seconds", slots), ("slot_microbatches", slots))


def settings_of(config: RecoverConfig) -> RebalanceSettings:
    """The rebalancer's settings from the ``fault_tolerance`` section."""
    ft = config.fault_tolerance
    weights = ft.replica_weights
    return RebalanceSettings(
        rebalance=ft.rebalance, smoothing=ft.rebalance_smoothing, hysteresis=ft.rebalance_hysteresis,
        straggler_factor=ft.straggler_factor, straggler_steps=ft.straggler_steps,
        fixed=None if weights is None else {r: float(w) for r, w in enumerate(weights)},
    )


class SlotSpeeds:
    """``balancer``: the speed estimates and the weights the planner uses; ``evicting``: drained stragglers that
    leave for a spare (``straggler_action: evict``), the same set on every rank."""

    def __init__(self, microbatches_per_step: int, settings: RebalanceSettings, evicts: bool) -> None:
        self.balancer = Rebalancer(microbatches_per_step, settings)
        self.evicts = evicts
        self.evicting: set[int] = set()

    def observe(self, roster: ReplicaRoster, slot_seconds: np.ndarray, slot_microbatches: np.ndarray
                ) -> dict[str, Any]:
        """Feed the committed step's speeds (its sums' entries) to the rebalancer; what the step record carries of
        them."""
        by_slot = {slot: roster.replica_in_slot(slot) for slot in roster.active_slots()}
        seconds = {r: float(slot_seconds[s]) for s, r in by_slot.items()}
        counts = {r: int(round(slot_microbatches[s])) for s, r in by_slot.items()}
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
