"""Recycling's formation transaction: the pool of recycled survivors becomes a new replica at a step boundary.

The pure choice of who forms which replica is :class:`nanotron_recover.workload.recycle.RankPool`; the
:class:`ReplicaFormation` object that :class:`~nanotron_recover.recovery.resilient.ResilientDataParallel` holds
carries it out on every rank: the world learns the members, they start a torch world and build their coordinate's
model, all agree, and the new replica takes a free slot (its state comes with the spare activation) or waits as a
spare. A member lost in the middle breaks the new replica like any other; its survivors go back to the pool.

It is an object, not a base class of the strategy: it owns the pool and the formation's timing, and what it shares
with the strategy (the FT world, the roster, the holders, the repair, the replica's build) is handed to it by name,
so that a reader sees which of the strategy's state a formation touches.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

from nanotron_recover.ft import FailureDetected, RepairEvent, ReplicaWorld
from nanotron_recover.ft.hang_policy import KILL_CONFIRM_S, HangPolicy
from nanotron_recover.nanotron_compat.process_groups import forget_process_groups
from nanotron_recover.recovery.errors import BelowMinimumReplicas
from nanotron_recover.run.phases import Phase
from nanotron_recover.training.seam import StepServices
from nanotron_recover.training.torch_world import init_replica_torch_world
from nanotron_recover.training.training_state import TrainingState
from nanotron_recover.workload.recycle import Formation, RankPool
from nanotron_recover.workload.spares import ReplicaRoster

Repair = Callable[[StepServices, int, str, int], Any]  # (services, step, phase, since_epoch): the strategy's repair
LogRepair = Callable[[StepServices, int, str, RepairEvent], None]  # (services, step, phase, event): apply and log it


class ReplicaFormation:
    """Recycling (``recycle``; with it off, nothing here acts): the pool and its formations, and a rank's move into
    the pool when a replica-mate dies in its torch traffic. Owns ``pool`` (the recycled survivors), ``formed_at``
    (``perf_counter()`` when the last new replica was formed: the start of its state transfer's timing, until
    :meth:`activated`) and the pool as it was before the last repairs (for the ``pool_changed`` event).

    Given by the strategy: the FT world and the roster (shared references), the hang policy (how long a pooled rank
    waits for its repair), ``min_replicas`` and the collective ``timeout_s``; and callbacks into its state:
    ``repair`` (repair the world, apply and log it), ``log_repair`` (apply and log a repair this rank did),
    ``apply_repairs`` (apply the repairs not applied yet), ``applied`` (how many of the world's repairs are),
    ``holders`` (the replicas holding the committed state), ``coordinates_changed`` (take this rank's replica
    coordinates from the world), ``build_replica`` (a member's nanotron groups and model over its new torch world)
    and ``drop_if_pooled`` (a rank moved to the pool drops its replica)."""

    def __init__(self, ft: ReplicaWorld, roster: ReplicaRoster, hang_policy: HangPolicy, *, ranks_per_replica: int,
                 recycle: bool, min_replicas: int, timeout_s: float, repair: Repair, log_repair: LogRepair,
                 apply_repairs: Callable[[StepServices], Any], applied: Callable[[], int],
                 holders: Callable[[], set[int]], coordinates_changed: Callable[[], None],
                 build_replica: Callable[[TrainingState, StepServices], None],
                 drop_if_pooled: Callable[[StepServices], None]) -> None:
        self.ft, self.roster, self.hang_policy = ft, roster, hang_policy
        self.recycle, self.min_replicas, self.timeout_s = recycle, min_replicas, timeout_s
        self._repair, self._log_repair, self._apply_repairs, self._applied = repair, log_repair, apply_repairs, applied
        self._holders, self._coordinates_changed = holders, coordinates_changed
        self._build_replica, self._drop_if_pooled = build_replica, drop_if_pooled
        self.pool = RankPool(ranks_per_replica, hosts=getattr(ft, "hosts", None))  # recycled survivors
        self.formed_at: float | None = None
        self._pool_before: list[int] = []

    # --------------------------------------------------------------------------------------------- the pool
    def apply_repairs(self, events: list[RepairEvent]) -> None:
        """The repairs the strategy applies now, in order: their dead ranks leave the pool, the survivors of broken
        replicas join it (the same on every rank)."""
        self._pool_before = self.pool.ranks
        for event in events if self.recycle else []:
            self.pool.remove(event.failed_ranks)
            self.pool.add(event.pooled)

    def pool_news(self, step: int, event: RepairEvent) -> dict | None:
        """The ``pool_changed`` event of a repair that moved ranks into the pool or killed pool ranks, else None."""
        died = set(event.failed_ranks) & set(self._pool_before)
        if not self.recycle or not (event.pooled or died):
            return None
        return {"event": "pool_changed", "step": step, "epoch": event.epoch, "joined": sorted(event.pooled),
                "died": sorted(died), "pool_ranks": self.pool.ranks}

    def activated(self) -> None:
        """The new replicas received the committed state: the next transfer is timed from the next formation."""
        self.formed_at = None

    def update_replica(self, step: int, services: StepServices, update: Callable[[], None]) -> None:
        """The committed step's update; recycling: a replica-mate's death in its collectives pools this rank."""
        try:
            update()
            return
        except Exception as exc:  # noqa: BLE001 - torch traffic inside the replica broke: pooled, or re-raised
            if self.repairs_that_pooled_me(services, step) is None:
                raise
            print(f"[nanotron-recover] rank {self.ft.rank}: the replica broke in the update of step {step} "
                  f"({type(exc).__name__}); this rank waits in the pool", flush=True)
        gc.collect()  # the torch error's traceback held the old replica's process groups: now they close

    def repairs_that_pooled_me(self, services: StepServices, step: int) -> list[RepairEvent] | None:
        """Recycling, after a torch error in compute: if a replica-mate's death moved this rank to the pool, the
        repairs this rank had not applied yet; else None (not a fault: the caller re-raises).

        The death is either not yet repaired (we repair now, once it is noticed), or being repaired by the watcher
        (it holds the operation lock: :meth:`FTWorld.repair_if_pending` waits for it), or repaired already."""
        if not self.recycle or self.ft.starting:
            return None
        first = self._applied()
        deadline = time.monotonic() + self.ft.notice_timeout_s + self.hang_policy.timeout_s + KILL_CONFIRM_S + 2.0
        try:
            while not self.ft.pooled:
                self.ft.progress.waiting("failure notice")  # a stall here is somebody else's (a repair resumes)
                event = self.ft.repair_if_pending()
                if event is not None:
                    self._log_repair(services, step, "in-step", event)
                elif time.monotonic() > deadline:
                    return None
                else:
                    time.sleep(0.01)
        finally:
            self.ft.progress.resume()
        events = self.ft.events[first:]
        self._apply_repairs(services)
        return events

    # --------------------------------------------------------------------------------------------- formation
    def form(self, step: int, state: TrainingState, services: StepServices) -> bool:
        """At a step boundary: while the pool holds a replica's worth of ranks, make a new replica of them (the same
        choice on every rank: :class:`RankPool`). Its members start a torch world of their own and build their new
        coordinate's model; it takes a free slot (its state then comes from a live replica with the spare
        activation) or waits as a spare. Returns whether a replica took a slot (a spare activation is due).

        A formation is a transaction: every rank of the world agrees that every member has its torch world and
        model, or all repair. A member lost in the middle breaks the new replica like any other; its survivors go
        back to the pool, and the pool forms again at once."""
        activation = False
        while self.recycle and (formation := self.pool.form(self.ft.assignment.next_replica_id)) is not None:
            self.ft.progress.busy(Phase.REPLICA_FORMATION, step)
            t0 = time.perf_counter()
            slot = self.roster.add_replica(formation.replica)
            epoch = self.ft.epoch
            try:
                self._build(step, formation, state, services, epoch)
                self.ft.agree(True, epoch)
            except FailureDetected:
                self._repair(services, step, Phase.REPLICA_FORMATION, epoch)
                activation |= self._abandon(step, formation, services)
                continue
            except Exception:  # noqa: BLE001 - a member's rendezvous or model build broke under a co-member's death
                if self.repairs_that_pooled_me(services, step) is None:
                    raise
                gc.collect()  # the error's traceback held the broken replica's process groups
                activation |= self._abandon(step, formation, services)
                continue
            activation |= slot is not None
            self.formed_at = t0
            services.metrics.log_event({
                "event": "replica_formed", "step": step, "epoch": self.ft.epoch, **formation.as_dict(),
                "slot": slot, "donor": min(self.ft.active_replicas) if slot is not None else None,
                "pool_ranks": self.pool.ranks,
            })
        return activation

    def _abandon(self, step: int, formation: Formation, services: StepServices) -> bool:
        """After a repair that interrupted a formation, on every rank alike: the new replica is undone. When the
        repair found it broken (a member died) its survivors are in the pool already; when the failure was
        elsewhere, its members go back to the pool too (some may not have built their model yet), and its slot is
        freed for the next formation. Returns whether a waiting replica took the freed slot."""
        activation = False
        if formation.replica not in self.roster.retired:
            activation = bool(self.roster.on_failure([formation.replica]).replacements)
            alive = [m.rank for m in formation.members if m.rank in self.ft.live_ranks]
            self.pool.add(self.ft.assignment.to_pool(alive))
            self._drop_if_pooled(services)
        if not self._holders():
            # the fault took the last replicas that hold the committed state: nobody can give it to a new one
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step,
                                       reason=f"no live replica holds the committed state of step {step}")
        if self.roster.below_minimum(self.min_replicas):
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step)
        return activation

    def _build(self, step: int, formation: Formation, state: TrainingState, services: StepServices,
               epoch: int) -> None:
        """Every rank: the world learns the new replica's members; a member starts its torch world (rendezvous
        agreed over MPI) and builds its coordinate's model. The caller's Agree then closes the formation."""
        services.fault_point(step, Phase.FORMING)
        replica_comm = self.ft.form_replica(formation.replica, formation.ranks)
        self._coordinates_changed()
        try:
            # the world Split need not fail on every rank alike: all learn that it worked before a member waits on
            # another in the rendezvous (a member whose Split failed is in the repair, not in the rendezvous)
            self.ft.agree(True, epoch)
            if replica_comm is None:  # not a member
                return
            services.fault_point(step, Phase.RENDEZVOUS)
            with self.ft.progress.slow_io(Phase.REPLICA_BUILD):  # like the build at start-up: the I/O allowance
                init_replica_torch_world(replica_comm, self.timeout_s)
        finally:
            if replica_comm is not None:
                replica_comm.Free()
        self._build_replica(state, services)
        services.fault_point(step, Phase.FORMATION)


def forget_torch_world(rank: int) -> None:
    """Drop this rank's references to its (old) replica's torch world, so that gloo closes its connections."""
    try:
        forget_process_groups()
    except Exception as e:  # noqa: BLE001 - a broken world may not tear down cleanly; the references go anyway
        print(f"[nanotron-recover] rank {rank}: torch world of the old replica: {e!r}", flush=True)
