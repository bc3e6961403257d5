"""Recycling's formation transaction: the pool of recycled survivors becomes a new replica at a step boundary.

The pure choice of who forms which replica is :class:`nanotron_recover.workload.recycle.RankPool`; this mixin of
:class:`~nanotron_recover.recovery.resilient.ResilientDataParallel` carries it out on every rank: the world learns
the members, they start a torch world and build their coordinate's model, all agree, and the new replica takes a
free slot (its state comes with the spare activation) or waits as a spare. A member lost in the middle breaks the
new replica like any other; its survivors go back to the pool. A rank moved to the pool drops its replica here.
"""

from __future__ import annotations

import datetime
import gc
import time
from typing import Callable

import torch.distributed as torch_dist

from nanotron_recover.ft import FailureDetected, RepairEvent
from nanotron_recover.ft.hang_policy import KILL_CONFIRM_S
from nanotron_recover.nanotron_compat.process_groups import forget_process_groups
from nanotron_recover.recovery.errors import BelowMinimumReplicas
from nanotron_recover.run.phases import Phase
from nanotron_recover.training.seam import StepServices
from nanotron_recover.training.torch_world import init_replica_torch_world
from nanotron_recover.training.training_state import TrainingState
from nanotron_recover.workload.recycle import Formation


class ReplicaFormation:
    """The formation and pool-membership half of the resilient strategy, as its base class (it reads and writes the
    strategy's roster, pool, holders and replica coordinates, and repairs through the strategy's ``_repair``)."""

    def _form_replicas(self, step: int, state: TrainingState, services: StepServices) -> None:
        """Recycling, at a step boundary: while the pool holds a replica's worth of ranks, make a new replica of
        them (the same choice on every rank: :class:`RankPool`). Its members start a torch world of their own and
        build their new coordinate's model; it takes a free slot (its state then comes from a live replica with
        the spare activation below) or waits as a spare.

        A formation is a transaction: every rank of the world agrees that every member has its torch world and
        model, or all repair. A member lost in the middle breaks the new replica like any other; its survivors go
        back to the pool, and the pool forms again at once."""
        while (formation := self.pool.form(self.ft.assignment.next_replica_id)) is not None:
            self.progress(step, Phase.REPLICA_FORMATION)
            t0 = time.perf_counter()
            slot = self.roster.add_replica(formation.replica)
            epoch = self.ft.epoch
            try:
                self._build_formed_replica(step, formation, state, services, epoch)
                self.ft.agree(True, epoch)
            except FailureDetected:
                self._repair(services, step, Phase.REPLICA_FORMATION, epoch)
                self._abandon_formation(step, formation, services)
                continue
            except Exception:  # noqa: BLE001 - a member's rendezvous or model build broke under a co-member's death
                if self._repairs_that_pooled_me(services, step) is None:
                    raise
                gc.collect()  # the error's traceback held the broken replica's process groups
                self._abandon_formation(step, formation, services)
                continue
            if slot is not None:
                self._pending_activation = True
            self._formed_at = t0
            services.metrics.log_event({
                "event": "replica_formed", "step": step, "epoch": self.ft.epoch, **formation.as_dict(),
                "slot": slot, "donor": min(self.ft.active_replicas) if slot is not None else None,
                "pool_ranks": self.pool.ranks,
            })

    def _abandon_formation(self, step: int, formation: Formation, services: StepServices) -> None:
        """After a repair that interrupted a formation, on every rank alike: the new replica is undone. When the
        repair found it broken (a member died) its survivors are in the pool already; when the failure was
        elsewhere, its members go back to the pool too (some may not have built their model yet), and its slot is
        freed for the next formation."""
        if formation.replica not in self.roster.retired:
            if self.roster.on_failure([formation.replica]).replacements:  # a waiting replica takes the freed slot
                self._pending_activation = True
            alive = [m.rank for m in formation.members if m.rank in self.ft.live_ranks]
            self.pool.add(self.ft.assignment.to_pool(alive))
            self._drop_replica_if_pooled(services)
        if not self.holders:
            # the fault took the last replicas that hold the committed state: nobody can give it to a new one
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step,
                                       reason=f"no live replica holds the committed state of step {step}")
        if self.roster.below_minimum(self.min_replicas):
            raise BelowMinimumReplicas(len(self.ft.active_replicas), self.min_replicas, step)

    def _build_formed_replica(self, step: int, formation: Formation, state: TrainingState, services: StepServices,
                              epoch: int) -> None:
        """Every rank: the world learns the new replica's members; a member starts its torch world (rendezvous
        agreed over MPI) and builds its coordinate's model. The caller's Agree then closes the formation."""
        services.fault_point(step, Phase.FORMING)
        replica_comm = self.ft.form_replica(formation.replica, formation.ranks)
        self.replica, self.local_rank = self.ft.replica, self.ft.local_rank
        try:
            # the world Split need not fail on every rank alike: all learn that it worked before a member waits on
            # another in the rendezvous (a member whose Split failed is in the repair, not in the rendezvous)
            self.ft.agree(True, epoch)
            if replica_comm is None:  # not a member
                return
            services.fault_point(step, Phase.RENDEZVOUS)
            with self.slow_io(Phase.REPLICA_BUILD):  # like the same build at start-up: the I/O allowance, not a step's
                init_replica_torch_world(replica_comm, self._timeout_s)
        finally:
            if replica_comm is not None:
                replica_comm.Free()
        with self.slow_io(Phase.REPLICA_BUILD):
            self.parallel_context = self._replica_parallel_context(datetime.timedelta(seconds=self._timeout_s))
            services.rebuild_replica(self.parallel_context)
        self.zero_grad(state)  # as every rank did after this step's optimizer step
        services.fault_point(step, Phase.FORMATION)

    def update_replica(self, step: int, services: StepServices, update: Callable[[], None]) -> None:
        """The committed step's update; recycling: a replica-mate's death in its collectives pools this rank."""
        try:
            update()
            return
        except Exception as exc:  # noqa: BLE001 - torch traffic inside the replica broke: pooled, or re-raised
            if self._repairs_that_pooled_me(services, step) is None:
                raise
            print(f"[nanotron-recover] rank {self.ft.rank}: the replica broke in the update of step {step} "
                  f"({type(exc).__name__}); this rank waits in the pool", flush=True)
        gc.collect()  # the torch error's traceback held the old replica's process groups: now they close

    def _repairs_that_pooled_me(self, services: StepServices, step: int) -> list[RepairEvent] | None:
        """Recycling, after a torch error in compute: if a replica-mate's death moved this rank to the pool, the
        repairs this rank had not applied yet; else None (not a fault: the caller re-raises).

        The death is either not yet repaired (we repair now, once it is noticed), or being repaired by the watcher
        (it holds the operation lock: :meth:`FTWorld.repair_if_pending` waits for it), or repaired already."""
        if not self.recycle or self.ft.starting:
            return None
        first = self._applied
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

    def _drop_replica_if_pooled(self, services: StepServices) -> None:
        self.replica, self.local_rank = self.ft.replica, self.ft.local_rank
        if self.recycle and self.ft.pooled:
            if self.parallel_context is not None:
                self._leave_replica(services)
            elif torch_dist.is_initialized():  # a formation that broke after its rendezvous, before the model
                self._forget_torch_world()

    def _leave_replica(self, services: StepServices) -> None:
        """Pooled: drop the model and the replica's torch world, so that a replica-mate still waiting on this rank
        in torch traffic gets an error now instead of at its timeout (gloo closes a connection only when the last
        reference to its process group is gone)."""
        services.release_replica()
        self.parallel_context = None
        self.buckets = None
        if self.snapshots is not None:
            self.snapshots.finish()
            self.snapshots = None
        self._forget_torch_world()

    def _forget_torch_world(self) -> None:
        try:
            forget_process_groups()
        except Exception as e:  # noqa: BLE001 - a broken world may not tear down cleanly; the references go anyway
            print(f"[nanotron-recover] rank {self.ft.rank}: torch world of the old replica: {e!r}", flush=True)
