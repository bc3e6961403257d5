"""Who takes part in the job now, the same on every rank: one object the strategy and the formation share.

It holds the replicas' slots and spares (the roster, :class:`~nanotron_recover.workload.spares.ReplicaRoster`),
the pool of recycled ranks (:class:`~nanotron_recover.workload.recycle.RankPool`), the replicas that hold the
committed state (only they are planned work, give their state and write a checkpoint), and whether a spare
activation is due. It is fed the FT world's repairs in order (:meth:`Membership.apply_repairs`: every rank applies
the same list, so every rank's membership is the same) and says where this rank sits now (:meth:`seat`). Pure
bookkeeping: no MPI, no torch (the strategy drops a pooled rank's model; the formation builds a new replica's).
"""

from __future__ import annotations

from typing import Any

from nanotron_recover.ft import RepairEvent, ReplicaWorld
from nanotron_recover.workload.recycle import RankPool
from nanotron_recover.workload.spares import ReplicaRoster, RosterChange


class Membership:
    """``roster``, ``pool``, ``holders`` and ``activation_due`` (a replica took a slot and needs the committed
    state), kept in step with the world's repairs (``applied``: how many of ``ft.events`` are in)."""

    def __init__(self, ft: ReplicaWorld, roster: ReplicaRoster, ranks_per_replica: int, recycle: bool) -> None:
        self.ft, self.roster, self.recycle = ft, roster, recycle
        self.pool = RankPool(ranks_per_replica, hosts=getattr(ft, "hosts", None))  # recycled survivors
        self.holders: set[int] = set(roster.active)
        self.activation_due = False
        self.applied = len(ft.events)
        self.commit_epoch = ft.epoch  # the world epoch the last step committed in (the same on every rank)
        self._pool_before: list[int] = []  # the pool before the last repairs applied (for ``pool_changed``)

    def seat(self) -> tuple[int | None, int | None]:
        """This rank's replica and local rank now (None, None: in the pool, or evicted)."""
        return self.ft.replica, self.ft.local_rank

    def apply_repairs(self) -> list[RosterChange]:
        """Every repair of the world not applied yet (the watcher's too), in order: the failed replicas leave the
        roster (spares take their slots) and the holders; recycling, their dead ranks leave the pool and the
        survivors of broken replicas join it."""
        events = self.ft.events[self.applied:]
        changes = [self.roster.on_failure(event.failed_replicas) for event in events]
        self.holders -= {r for event in events for r in event.failed_replicas}
        self._pool_before = self.pool.ranks
        for event in events if self.recycle else []:
            self.pool.remove(event.failed_ranks)
            self.pool.add(event.pooled)
        self.applied = len(self.ft.events)
        self.activation_due |= any(change.replacements for change in changes)
        return changes

    def committed(self, replicas: Any, epoch: int) -> None:
        """``replicas`` computed and committed the step, in world epoch ``epoch``: they hold its state."""
        self.holders, self.commit_epoch = set(replicas), epoch

    def ahead_of_commit(self) -> bool:
        """Whether this rank applied a repair of a later epoch than the one the last step committed in. A
        replica-mate lost inside the update pools this rank there, after the commit, while the other replicas meet
        that loss only in the next step's collectives: a formation or state transfer at this boundary, which the
        others have passed, would match their next step's collectives (seen: a replica formed one step behind the
        donor's step count and LR, then a deadlock at the next checkpoint). Every rank applied every repair up to
        the commit epoch before committing, so deciding on those alone is the same decision on every rank: the
        rest waits for the next step's boundary. (The events are in epoch order: the newest applied one tells.)"""
        return self.applied > 0 and self.ft.events[self.applied - 1].epoch > self.commit_epoch

    def activated(self) -> None:
        """Every new replica received the committed state (the spare activation's agreement)."""
        self.holders = set(self.roster.active)
        self.activation_due = False

    def pool_news(self, step: int, event: RepairEvent) -> dict | None:
        """The ``pool_changed`` event of a repair that moved ranks into the pool or killed pool ranks, else None."""
        died = set(event.failed_ranks) & set(self._pool_before)
        if not self.recycle or not (event.pooled or died):
            return None
        return {"event": "pool_changed", "step": step, "epoch": event.epoch, "joined": sorted(event.pooled),
                "died": sorted(died), "pool_ranks": self.pool.ranks}
