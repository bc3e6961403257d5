"""Recycling's formation transaction: the pool of recycled survivors becomes a new replica at a step boundary.

The pure choice of who forms which replica is :class:`nanotron_recover.workload.recycle.RankPool`; the
:class:`ReplicaFormation` object that :class:`~nanotron_recover.recovery.resilient.ResilientDataParallel` holds
carries it out on every rank: the world learns the members, they start a torch world and build their coordinate's
model, all agree, and the new replica takes a free slot (its state comes with the spare activation) or waits as a
spare. A member lost in the middle breaks the new replica like any other; its survivors go back to the pool.

It is an object, not a base class of the strategy: it owns the formation's timing; who is in the job (the roster,
the pool, the holders) is the :class:`~nanotron_recover.recovery.membership.Membership` it shares with the strategy,
and what it asks of the strategy (the repair, a replica's build) is a named interface, :class:`FormationHost`.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Callable, Protocol

from nanotron_recover.ft import FailureDetected, RepairEvent, ReplicaWorld
from nanotron_recover.ft.hang_policy import KILL_CONFIRM_S, HangPolicy
from nanotron_recover.nanotron_compat.process_groups import forget_process_groups
from nanotron_recover.recovery.errors import BelowMinimumReplicas
from nanotron_recover.run.phases import Phase
from nanotron_recover.training.seam import StepServices
from nanotron_recover.training.torch_world import ReplicaTorchWorld
from nanotron_recover.training.training_state import TrainingState
from nanotron_recover.workload.recycle import Formation

if TYPE_CHECKING:
    from nanotron_recover.recovery.membership import Membership

class FormationHost(Protocol):
    """What a formation asks of the strategy that holds it: the repair (MPI, then applied and logged), applying
    the repairs not applied yet (then a rank moved to the pool drops its replica), taking this rank's new
    coordinates, a pooled rank dropping its replica, and building a new replica member's nanotron groups and model
    over its new torch world."""

    def repair(self, services: StepServices, step: int, phase: str, since_epoch: int | None = None) -> RepairEvent:
        ...

    def log_repair(self, services: StepServices, step: int, phase: str, event: RepairEvent) -> None: ...

    def apply_repairs(self, services: StepServices) -> list: ...

    def take_coordinates(self) -> None: ...

    def drop_replica_if_pooled(self, services: StepServices) -> None: ...

    def build_formed_replica(self, state: TrainingState, services: StepServices) -> None: ...


class ReplicaFormation:
    """Recycling (``recycle``; with it off, nothing here acts): the pool's formations, and a rank's move into the
    pool when a replica-mate dies in its torch traffic. Owns ``formed_at`` (``perf_counter()`` when the last new
    replica was formed: the start of its state transfer's timing, until :meth:`activated`).

    Given: the FT world and the :class:`~nanotron_recover.recovery.membership.Membership` (shared with the
    strategy: the roster, the pool, the holders), the strategy as a :class:`FormationHost`, the hang policy (how
    long a pooled rank waits for its repair), ``min_replicas`` and how a new replica's torch world starts."""

    def __init__(self, ft: ReplicaWorld, membership: Membership, host: FormationHost, hang_policy: HangPolicy, *,
                 recycle: bool, min_replicas: int, torch_world: ReplicaTorchWorld) -> None:
        self.ft, self.membership, self.host, self.hang_policy = ft, membership, host, hang_policy
        self.recycle, self.min_replicas, self.torch_world = recycle, min_replicas, torch_world
        self.formed_at: float | None = None

    # --------------------------------------------------------------------------------------------- the pool
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
        first = self.membership.applied
        deadline = time.monotonic() + self.ft.notice_timeout_s + self.hang_policy.timeout_s + KILL_CONFIRM_S + 2.0
        try:
            while not self.ft.pooled:
                self.ft.progress.waiting("failure notice")  # a stall here is somebody else's (a repair resumes)
                event = self.ft.repair_if_pending()
                if event is not None:
                    self.host.log_repair(services, step, "in-step", event)
                elif time.monotonic() > deadline:
                    return None
                else:
                    time.sleep(0.01)
        finally:
            self.ft.progress.resume()
        events = self.ft.events[first:]
        self.host.apply_repairs(services)
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
        pool, roster = self.membership.pool, self.membership.roster
        while self.recycle and (formation := pool.form(self.ft.assignment.next_replica_id)) is not None:
            self.ft.progress.busy(Phase.REPLICA_FORMATION, step)
            t0 = time.perf_counter()
            slot = roster.add_replica(formation.replica)
            epoch = self.ft.epoch
            try:
                self._build(step, formation, state, services, epoch)
                self.ft.agree(True, epoch)
            except FailureDetected:
                self.host.repair(services, step, Phase.REPLICA_FORMATION, epoch)
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
                "pool_ranks": pool.ranks,
            })
        return activation

    def _abandon(self, step: int, formation: Formation, services: StepServices) -> bool:
        """After a repair that interrupted a formation, on every rank alike: the new replica is undone. When the
        repair found it broken (a member died) its survivors are in the pool already; when the failure was
        elsewhere, its members go back to the pool too (some may not have built their model yet), and its slot is
        freed for the next formation. Returns whether a waiting replica took the freed slot."""
        activation, roster = False, self.membership.roster
        if formation.replica not in roster.retired:
            activation = bool(roster.on_failure([formation.replica]).replacements)
            alive = [m.rank for m in formation.members if m.rank in self.ft.live_ranks]
            self.membership.pool.add(self.ft.assignment.to_pool(alive))
            self.host.drop_replica_if_pooled(services)
        if not self.membership.holders:
            # the fault took the last replicas that hold the committed state: nobody can give it to a new one
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step,
                                       reason=f"no live replica holds the committed state of step {step}")
        if roster.below_minimum(self.min_replicas):
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step)
        return activation

    def _build(self, step: int, formation: Formation, state: TrainingState, services: StepServices,
               epoch: int) -> None:
        """Every rank: the world learns the new replica's members; a member starts its torch world (rendezvous
        agreed over MPI) and builds its coordinate's model. The caller's Agree then closes the formation."""
        services.fault_point(step, Phase.FORMING)
        replica_comm = self.ft.form_replica(formation.replica, formation.ranks)
        self.host.take_coordinates()
        try:
            # the world Split need not fail on every rank alike: all learn that it worked before a member waits on
            # another in the rendezvous (a member whose Split failed is in the repair, not in the rendezvous)
            self.ft.agree(True, epoch)
            if replica_comm is None:  # not a member
                return
            services.fault_point(step, Phase.RENDEZVOUS)
            with self.ft.progress.slow_io(Phase.REPLICA_BUILD):  # like the build at start-up: the I/O allowance
                self.torch_world.start(replica_comm)
        finally:
            if replica_comm is not None:
                replica_comm.Free()
        self.host.build_formed_replica(state, services)
        services.fault_point(step, Phase.FORMATION)


def forget_torch_world(rank: int) -> None:
    """Drop this rank's references to its (old) replica's torch world, so that gloo closes its connections."""
    try:
        forget_process_groups()
    except Exception as e:  # noqa: BLE001 - a broken world may not tear down cleanly; the references go anyway
        print(f"[nanotron-recover] rank {rank}: torch world of the old replica: {e!r}", flush=True)
