"""Active / spare replica bookkeeping: pure state, identical on every rank given the same agreed failures.

Spares are activated before quotas grow: each failed active replica is replaced by the lowest-id remaining spare
(failed replicas taken in id order), so the active width stays the same while spares last. A replacement spare
inherits the failed replica's *slot* (the original active id it stands in for). Planning by slot
(:meth:`ReplicaRoster.active_slots`, then mapping back with :meth:`ReplicaRoster.replica_in_slot`) gives the spare
exactly the microbatch range the failed replica had, keeping per-replica work identical to the failure-free run;
planning by replica id is also correct, only the assignment of ranges to replicas differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RosterChange:
    """What one :meth:`ReplicaRoster.on_failure` did.

    Attributes:
        failed_active: active replicas that were lost (sorted). Lost idle spares just disappear.
        replacements: ``(spare, failed_replica)`` pairs, in activation order: ``spare`` now does the work of
            ``failed_replica`` and needs its model/optimizer state copied from a replica that computed the step.
    """

    failed_active: tuple[int, ...]
    replacements: tuple[tuple[int, int], ...]

    @property
    def activated(self) -> tuple[int, ...]:
        """Spares that became active, in activation order."""
        return tuple(s for s, _ in self.replacements)


@dataclass
class ReplicaRoster:
    """Which replicas compute (active), which wait (spares), which are gone.

    Args:
        active: initially active replica ids.
        spares: initially idle spare ids (disjoint from ``active``).
    """

    active: list[int]
    spares: list[int] = field(default_factory=list)
    retired: list[int] = field(default_factory=list, init=False)
    _slot: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.active = sorted(int(r) for r in self.active)
        self.spares = sorted(int(r) for r in self.spares)
        everyone = self.active + self.spares
        if len(set(everyone)) != len(everyone):
            raise ValueError(f"active {self.active} and spares {self.spares} must be distinct ids")
        if any(r < 0 for r in everyone):
            raise ValueError("replica ids must be >= 0")
        if not self.active:
            raise ValueError("need at least one active replica")
        self._slot = {r: r for r in self.active}
        self._slots = tuple(self.active)  # the failure-free run's slots (its data-parallel width)

    @property
    def known(self) -> frozenset[int]:
        return frozenset(self.active) | frozenset(self.spares) | frozenset(self.retired)

    def on_failure(self, failed_replicas: Iterable[int]) -> RosterChange:
        """Remove ``failed_replicas``, activate spares to keep the width, report what changed.

        Ids already retired are ignored (a repair may re-report them). Unknown ids raise ``ValueError``.
        """
        failed = {int(r) for r in failed_replicas}
        unknown = sorted(failed - self.known)
        if unknown:
            raise ValueError(f"unknown replica ids {unknown}")
        failed -= set(self.retired)
        failed_active = sorted(failed.intersection(self.active))
        failed_spares = sorted(failed.intersection(self.spares))
        survivors = [r for r in self.active if r not in failed]
        spares = [s for s in self.spares if s not in failed]
        replacements = []
        for dead in failed_active:
            if not spares:
                break
            spare = spares.pop(0)
            replacements.append((spare, dead))
            self._slot[spare] = self._slot[dead]
        for dead in failed_active:
            self._slot.pop(dead, None)
        self.active = sorted(survivors + [s for s, _ in replacements])
        self.spares = spares
        self.retired = sorted(self.retired + failed_active + failed_spares)
        return RosterChange(failed_active=tuple(failed_active), replacements=tuple(replacements))

    def add_replica(self, replica: int) -> int | None:
        """A replica formed from recycled ranks (:mod:`nanotron_recover.workload.recycle`) enters like a spare: it
        takes the lowest free slot and computes from the next step (returns the slot), or, when every slot of the
        failure-free width is held, waits as a spare (returns None)."""
        replica = int(replica)
        if replica < 0 or replica in self.known:
            raise ValueError(f"replica id {replica} is negative or already used")
        free = sorted(set(self._slots) - {self._slot[r] for r in self.active})
        if not free:
            self.spares = sorted(self.spares + [replica])
            return None
        self._slot[replica] = free[0]
        self.active = sorted(self.active + [replica])
        return free[0]

    def below_minimum(self, min_replicas: int) -> bool:
        """Whether fewer than ``min_replicas`` replicas are active (the run should fall back to a checkpoint)."""
        return len(self.active) < min_replicas

    def active_slots(self) -> list[int]:
        """Slots of the active replicas, sorted; pass these to the planner to keep failure-free ranges."""
        return sorted(self._slot[r] for r in self.active)

    def slot_of(self, replica: int | None) -> int | None:
        """The slot an active replica holds (None: not active, e.g. an idle spare)."""
        return self._slot.get(replica) if replica in self.active else None

    def replica_in_slot(self, slot: int) -> int:
        """The active replica currently holding ``slot``."""
        for r in self.active:
            if self._slot[r] == slot:
                return r
        raise KeyError(f"no active replica holds slot {slot}")
