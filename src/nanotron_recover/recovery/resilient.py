"""ReCoVer's data-parallel path: every step commits exactly M microbatches, whatever fails.

Per step: the planner (layer 3) splits the M global microbatches over the active replicas' slots (by measured speed
with ``rebalance``: :mod:`nanotron_recover.recovery.rebalancing`); each replica computes its share into flat fp32
buckets (loss / M); each bucket is snapshotted, keyed by (step, world epoch), right before its cross-replica SUM
over ULFM (layer 1); a world-wide ``Agree`` commits the step (a non-finite loss or gradient is never committed).

If anything fails before the commit: repair (layer 1), restore every bucket from its snapshot (a half-reduced
buffer is garbage), re-plan only the failed replicas' orphaned microbatches onto the survivors, compute them on
top, and reduce again in the new epoch. The optimizer then steps once, on the full M-microbatch gradient. Spares
replace failed replicas at the next step boundary, after a state copy from a live replica.
"""

from __future__ import annotations

import datetime
import gc
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import torch.distributed as torch_dist
from mpi4py import MPI

from nanotron_recover.config import RecoverConfig
from nanotron_recover.ft import FailureDetected, HangPolicy, RepairEvent, ReplicaWorld, make_data_plane
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.recovery.errors import BelowMinimumReplicas
from nanotron_recover.recovery.formation import ReplicaFormation, forget_torch_world
from nanotron_recover.recovery.lifecycle import EntryHooks, LifecycleSettings, ProcessLifecycle
from nanotron_recover.recovery.membership import Membership
from nanotron_recover.recovery.state_transfer import activate_new_replicas
from nanotron_recover.recovery.step_sums import StepStats
from nanotron_recover.run.disk_space import is_disk_full
from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.run.phases import Phase
from nanotron_recover.snapshots.local_snapshot import LocalSnapshots
from nanotron_recover.snapshots.schedule import SnapshotSchedule
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.training.buckets import GradBuckets
from nanotron_recover.training.seam import (
    AttachedModel,
    CheckpointWriter,
    CommittedStep,
    DataParallelStrategy,
    LocalWork,
    StepServices,
)
from nanotron_recover.training.torch_world import ReplicaTorchWorld
from nanotron_recover.training.training_state import TrainingState, fp32_accumulator
from nanotron_recover.workload.planner import Plan, merge, orphans_of, plan_step, replan_orphans
from nanotron_recover.workload.spares import ReplicaRoster

REPAIR_WITHOUT_FAILURE = "repair_without_failure"  # a repair round that found no dead rank (see log_repair)


class ResilientDataParallel(DataParallelStrategy):
    """The step logic. It holds two objects, each given only the state it needs: ``lifecycle``
    (:class:`ProcessLifecycle`: building the worlds, start-up completion, hang events, eviction, the end; the entry
    point's hooks) and ``formation`` (:class:`ReplicaFormation`: recycling's pool and new replicas). ``end_job(reason)``
    ends the job with the restart outcome (:func:`nanotron_recover.process.watchdog.end_job`) when a rank dies during
    start-up and when a hang cannot be ended by killing a rank. ``ft`` and ``parallel_context`` are built (the ULFM
    world over ``MPI.COMM_WORLD``, then the replica's torch world) unless given: tests of the step logic pass an
    in-memory world (the interface: :class:`~nanotron_recover.ft.protocol.ReplicaWorld`).
    """

    def __init__(
        self, config: RecoverConfig, timeout_s: float, end_job: Callable[[str], None], *,
        launch: LaunchContract | None = None, entry: EntryHooks | None = None, ft: ReplicaWorld | None = None,
        parallel_context: ReplicaParallelContext | None = None,
    ) -> None:
        par, ft_args = config.parallelism, config.fault_tolerance
        self.config = config
        self.M = config.microbatches_per_step
        self.min_replicas = ft_args.min_replicas
        self.keep_global_batch = ft_args.keep_global_batch
        self.recycle = ft_args.recycle
        self._timeout_s = timeout_s
        self.launch = launch if launch is not None else LaunchContract()  # what the launcher told this rank
        self.torch_world = ReplicaTorchWorld(timeout_s, self.launch.host)  # how a replica's torch world starts
        world = MPI.COMM_WORLD if ft is None else None
        if world is not None and world.Get_size() != config.world_size:
            raise SystemExit(f"nanotron-recover: launched with {world.Get_size()} ranks, the config needs "
                             f"{config.world_size} ((dp={par.dp} + spare_replicas={ft_args.spare_replicas}) x "
                             f"{config.ranks_per_replica} ranks per replica)")
        rpr = config.ranks_per_replica
        self.replica, self.local_rank = divmod(world.Get_rank() if world is not None else ft.rank, rpr)
        self.loss_divisor = self.M  # every microbatch's loss / M: the reduced gradient is the step's mean
        self.snapshots: LocalSnapshots | None = None  # node-local state snapshots (set up at resume, needs run_dir)
        self.hang_policy = HangPolicy.of(ft_args)  # every bound under collective_timeout_s
        self.lifecycle = ProcessLifecycle(LifecycleSettings.of(ft_args), end_job, self.hang_policy,
                                          entry if entry is not None else EntryHooks(),
                                          coordinates=lambda: (self.replica, self.local_rank),
                                          snapshots=lambda: self.snapshots)

        active = list(range(par.dp))
        roster = ReplicaRoster(active=active, spares=list(range(par.dp, par.dp + ft_args.spare_replicas)))
        if ft is None:  # the FT world first: from here on a death anywhere is noticed (in start-up, ends the job)
            ft, parallel_context = self.lifecycle.start_worlds(
                world, self.replica, active, self.torch_world, ranks_per_replica=rpr, recycle=self.recycle,
                mpi_wait=ft_args.mpi_wait, replica_context=self._replica_parallel_context)
        self.ft = self.lifecycle.ft = ft
        self.parallel_context = parallel_context
        # who takes part: the roster, the pool, and the replicas holding the committed state of the last committed
        # step (those that committed it; a spare or formed replica once its state transfer completed everywhere: one
        # whose donor died mid-transfer holds initial weights). Only holders are planned work and write a checkpoint.
        self.membership = Membership(ft, roster, rpr, self.recycle)
        self.formation = ReplicaFormation(  # recycling (recycle: true): the pool of survivors, new replicas
            ft, self.membership, self, self.hang_policy, recycle=self.recycle, min_replicas=self.min_replicas,
            torch_world=self.torch_world)
        self.step_stats = StepStats.of(config)  # the step's world-wide sums: loss, microbatches, each slot's speed
        self._step_started = 0.0
        # which committed steps are snapshotted: the same decision on every rank, spares and pool ranks included
        self.snapshot_schedule = SnapshotSchedule.of_settings(SnapshotSettings.of(config))
        self._last_step_s: float | None = None

    def _replica_parallel_context(self, timeout: datetime.timedelta) -> ReplicaParallelContext:
        """A 3D replica: nanotron's TP x PP groups over the replica's torch world (dp = 1 inside it)."""
        par = self.config.parallelism
        return ReplicaParallelContext(
            tensor_parallel_size=par.tp, pipeline_parallel_size=par.pp, data_parallel_size=1, timeout=timeout
        )

    def _reports_loss(self) -> bool:
        """Whether this rank's loss sum counts in the step's loss: one rank per microbatch (last stage, TP rank 0)."""
        pp_rank, tp_rank = divmod(self.local_rank, self.config.parallelism.tp)
        return pp_rank == self.config.parallelism.pp - 1 and tp_rank == 0

    # ------------------------------------------------------------------------------------------------- model
    def attach_model(self, model, named_params, device) -> AttachedModel:
        self.buckets = GradBuckets(named_params, self.config.fault_tolerance.reduce_bucket_mb, device=device)
        self.data_plane = make_data_plane(self.config.fault_tolerance.data_plane, self.ft, device, self._timeout_s)
        return AttachedModel(model=model, unwrapped=model, named_params=named_params)

    def computes(self) -> bool:
        return self.replica is not None and self.replica in self.ft.active_replicas

    def pool_ranks(self) -> list[int] | None:
        return self.ft.pool_ranks if self.recycle else None

    def progress(self, step: int, phase: str) -> None:
        self.ft.progress.busy(phase, step)

    def slow_io(self, what: str) -> AbstractContextManager[None]:
        return self.ft.progress.slow_io(what)

    # ------------------------------------------------------------------------------------------------- step
    def forward_backward_reduce(self, step: int, services: StepServices) -> CommittedStep:
        self._step_started = time.monotonic()
        self.step_stats.leave_if_evicted(self.replica, step, self.roster)  # straggler_action: evict
        plan = self._plan(step)
        todo = plan.get(self.replica, [])
        work = LocalWork()
        recoveries = 0
        while True:
            epoch = self.ft.epoch  # a repair of the watcher's after this is one the peers already matched
            try:
                work += services.compute(step, todo, self.loss_divisor)
                todo = []
                self._reduce(services, step, work)
                self.ft.agree(True)  # the commit point: once per attempt, on every live rank; raises on failure
                break
            except FailureDetected:
                recoveries += 1
                plan, todo = self._recover(services, step, plan, since_epoch=epoch)
                continue
            except Exception:  # noqa: BLE001 - torch traffic inside the replica broke: pooled, or re-raised
                repaired = self.formation.repairs_that_pooled_me(services, step)
                if repaired is None:
                    raise
            gc.collect()  # the torch error's traceback held the old replica's process groups: now they close
            recoveries += 1
            work = LocalWork()  # what this rank computed belonged to its broken replica
            plan, todo = self._recover(services, step, plan, repaired)
        if self.buckets is not None:
            self.buckets.release(step)  # committed: the snapshots are no longer needed
        self.membership.committed(plan, epoch)  # who computed and committed this step, still alive; in which epoch
        balance = self.step_stats.observe(self.roster)  # the committed attempt's speeds
        stop = self.step_stats.stop_at(step)  # the job's last step: a rank got a stop signal (the launcher's too)
        self.snapshot_schedule.commit(step, self.step_stats.snapshot_sums(), last=stop is not None)
        loss, committed = self.step_stats.loss_and_microbatches()
        if committed != self.M:
            if self.keep_global_batch:
                raise RuntimeError(f"step {step} committed {committed} microbatches, expected {self.M}")
            # shrinking-batch baseline: the average over what was committed
            self.buckets.flat.mul_(self.M / committed)
            loss *= self.M / committed
        return CommittedStep(loss=loss, microbatches=committed, epoch=self.ft.epoch, live_replicas=len(plan),
                             recoveries=recoveries, quotas={r: len(v) for r, v in plan.items()}, balance=balance,
                             nonfinite=self.step_stats.nonfinite(), stop=stop, cadence=self.step_stats.cadence_inputs())

    def _plan(self, step: int) -> Plan:
        """Slots keep the failure-free ranges: a spare computes exactly what the replica it replaced did. A replica
        that took a slot but does not hold the committed state yet (its activation is still pending, e.g. after a
        death inside a checkpoint save) computes nothing: its slot's microbatches go to the holders, so the step
        still commits M. Shrinking-batch baseline: the failure-free plan minus the slots that were lost."""
        slots = self.roster.active_slots()
        by_slot = plan_step(step, self.M, slots if self.keep_global_batch else range(self.config.parallelism.dp),
                            self.step_stats.slot_weights(self.roster, slots))  # None unless rebalancing
        plan = {self.roster.replica_in_slot(slot): by_slot[slot] for slot in slots}
        waiting = [r for r in plan if r not in self.holders or r not in self.ft.active_replicas]
        if not waiting:
            return plan
        computing = [r for r in plan if r not in waiting]
        orphans = orphans_of(plan, waiting) if self.keep_global_batch else []
        return merge(plan, replan_orphans(orphans, computing, plan, self.step_stats.weights(computing)), waiting)

    def _reduce(self, services: StepServices, step: int, work: LocalWork) -> None:
        """SUM every bucket across the computing replicas, then the step's loss, count and speeds world-wide."""
        computing = self.computes()
        if computing:
            for i in range(self.buckets.num_buckets):
                self.buckets.snapshot_bucket(i, step, self.ft.epoch)
                self.data_plane.allreduce_sum_(self.buckets, i)
                if i == 0:
                    services.fault_point(step, Phase.REDUCE)
            self._log_plane_build(services, step)
        stats = self.step_stats.fill(work.loss_sum if (computing and self._reports_loss()) else 0.0, work,
                                     computing and self.local_rank == 0, self.roster.slot_of(self.replica),
                                     self.snapshots.cost_s if self.snapshots is not None else None,
                                     self._last_step_s, grads_finite=not computing or self.buckets.all_finite(),
                                     save_stall_s=services.save_stall())
        self.ft.allreduce_sum_(stats, "world")

    def _log_plane_build(self, services: StepServices, step: int) -> None:
        """A torch data plane built its coordinate's group in this attempt: how long that took (the logging rank's
        coordinate), the cost a repair adds on that plane."""
        built, self.data_plane.last_build = self.data_plane.last_build, None
        if built is not None:
            services.metrics.log_event({"event": "data_plane_group", "step": step, "backend": self.data_plane.backend,
                                        **built})

    @property
    def roster(self) -> ReplicaRoster:
        return self.membership.roster

    @property
    def holders(self) -> set[int]:
        return self.membership.holders

    @holders.setter
    def holders(self, replicas: set[int]) -> None:
        self.membership.holders = set(replicas)

    def repair(self, services: StepServices, step: int, phase: str, since_epoch: int | None = None) -> RepairEvent:
        """Repair the world (``ReplicaEvicted`` on a rank of a failed replica, unless recycling keeps it in the
        pool), update the roster, log the event. ``since_epoch``: see :meth:`FTWorld.repair`."""
        self.ft.repair_hook = lambda point, attempt: (
            services.fault_point(step, Phase.REPAIR) if point == "after_shrink" else None
        )
        event = self.ft.repair(since_epoch)
        self.log_repair(services, step, phase, event)
        return event

    def log_repair(self, services: StepServices, step: int, phase: str, event: RepairEvent) -> None:
        """Apply the repair to the roster (and the pool) and log it. The new lowest live rank takes over logging,
        re-logging the last committed step in case the old logger died before writing it."""
        changes = self.apply_repairs(services)
        metrics = services.metrics
        logging = self.is_logging_rank()
        if logging and not metrics.enabled:
            metrics.set_logging(True)
            metrics.start_wandb(background=True)  # its start (~1 s) would be the failure step's: in a thread
            last = services.last_record()
            if last is not None:
                metrics.log_step(last)
        elif metrics.enabled and not logging:  # recycling: the logging rank's replica broke, it is in the pool now
            metrics.set_logging(False)
        record = {"event": "repair", "step": step, "phase": phase, **event.as_dict(),
                  "activated_spares": [s for change in changes for s in change.activated]}
        if not event.failed_ranks:
            # Seen (rarely, under load): the commit Agree came back without the healthy bit and nobody repairing. All
            # repair alike, Shrink finds nobody dead, the step is reduced again from its snapshots (trajectory kept).
            record["event"] = REPAIR_WITHOUT_FAILURE
        metrics.log_event(record)
        news = self.membership.pool_news(step, event)
        if news is not None:
            metrics.log_event(news)

    def apply_repairs(self, services: StepServices) -> list:
        """Every repair this rank has not applied yet (the watcher's too) goes into the membership, in order; the
        same on every rank. A rank moved to the pool drops its replica's model and torch world."""
        changes = self.membership.apply_repairs()
        self.drop_replica_if_pooled(services)
        return changes

    def _recover(self, services: StepServices, step: int, plan: Plan, repaired: list[RepairEvent] | None = None,
                 since_epoch: int | None = None) -> tuple[Plan, list[int]]:
        """Repair (unless ``repaired`` says it was done), restore the local sums, and hand the failed replicas'
        microbatches (logged: a crash that comes back at this step is named by them) to the survivors."""
        if repaired is not None:
            events = repaired
        else:
            event = self.repair(services, step, "in-step", since_epoch)
            # the watcher may have repaired more than once since the failure was raised: all of them count
            events = [e for e in self.ft.events if e.epoch > since_epoch] if since_epoch is not None else [event]
        failed = sorted({r for event in events for r in event.failed_replicas})
        survivors = [r for r in plan if r not in failed]
        orphans = orphans_of(plan, failed) if self.keep_global_batch else []
        if orphans:
            services.metrics.log_event({"event": "orphaned", "step": step, "microbatches": orphans})
        if not survivors or self.roster.below_minimum(self.min_replicas):
            raise BelowMinimumReplicas(len(survivors), self.min_replicas, last_committed_step=step - 1)
        if self.buckets is not None and self.buckets.has_snapshot(step):
            self.buckets.restore(step)
        extra = replan_orphans(orphans, survivors, plan, self.step_stats.weights(survivors))
        return merge(plan, extra, failed), (extra.get(self.replica, []) if self.replica is not None else [])

    # ------------------------------------------------------------------------------------------------- commit
    def update_replica(self, step: int, services: StepServices, update: Callable[[], None]) -> None:
        self.settle_snapshot()  # the last snapshot's write reads the state that this update changes
        self.formation.update_replica(step, services, update)  # recycling: a mate's death in it pools this rank

    def zero_grad(self, state: TrainingState) -> None:
        if self.buckets is None:  # in the pool: no model
            return
        self.buckets.zero_()
        accumulator = fp32_accumulator(state)
        if accumulator is not None:
            accumulator.bind_master_grads()

    def after_commit(self, step: int, state: TrainingState, services: StepServices) -> None:
        """Recycling forms new replicas; spares and new replicas that took a slot get the committed state. Both
        wait while this rank holds a repair newer than the step's commit (:meth:`Membership.ahead_of_commit`)."""
        ahead = self.membership.ahead_of_commit()  # decided before forming: a repair inside a formation is this step's
        if not ahead:
            self.membership.activation_due |= self.formation.form(step, state, services)
        self.progress(step, Phase.SPARE_ACTIVATION)
        if self.membership.activation_due and not ahead:
            activate_new_replicas(self.ft, self.roster, step, state, services, formed_at=self.formation.formed_at,
                                  min_replicas=self.min_replicas, computes=self.computes,
                                  repair=lambda epoch: self.repair(services, step, Phase.SPARE_ACTIVATION, epoch))
            self.membership.activated()  # every new replica received the committed state
            self.formation.activated()
        news = self.snapshot_schedule.news(step)
        if news is not None:
            services.metrics.log_event(news)
        if self.snapshots is not None and self.computes():  # an idle spare's state is not the committed one
            self.progress(step, Phase.SNAPSHOT)
            try:
                self.snapshots.after_commit(step, state, epoch=self.ft.epoch, log_event=services.metrics.log_event,
                                            due=self.snapshot_schedule.due_now)
            except OSError as e:  # e.g. /dev/shm full: training goes on, relaunches use the disk checkpoint
                print(f"[nanotron-recover] local snapshots turned off: {e}", flush=True)
                self.snapshots = None
        self._last_step_s = time.monotonic() - self._step_started
        self.hang_policy.record_step(self._last_step_s)

    def settle_snapshot(self) -> None:
        if self.snapshots is not None:
            self.snapshots.settle()  # it said so itself if its write failed

    def checkpoint_at_stop(self) -> bool:
        return self.config.checkpoints is not None and (
            self.config.fault_tolerance.checkpoint_on_stop or not self.snapshot_schedule.enabled)

    def resume_from_local_snapshot(self, state: TrainingState, newer_than: int | None,
                                   rolled_back: bool = False) -> int | None:
        self.snapshots = LocalSnapshots.for_config(self.config, self.lifecycle.run_dir or Path("."), self.ft,
                                                   self.replica, self.local_rank, launch=self.launch)
        self.progress(0, Phase.LOCAL_SNAPSHOT_RESUME)
        return self.snapshots.resume(state, newer_than, rolled_back)

    def finish(self, step: int, services: StepServices) -> None:
        self.lifecycle.finish(repair=lambda: self.repair(services, step, "end"))

    # ------------------------------------------------------------------------------------------------- start-up
    def startup_complete(self, fault_point: Callable[[], None] = lambda: None) -> None:
        self.lifecycle.startup_complete(fault_point)

    def startup_share(self) -> tuple[int, int]:
        live = list(self.ft.live_ranks)
        return live.index(self.ft.rank), len(live)

    def gather_at_startup(self, obj: Any) -> list:
        return self.ft.allgather_object(obj)

    # ------------------------------------------------------------------------------------------------- recycling
    def take_coordinates(self) -> None:
        self.replica, self.local_rank = self.membership.seat()

    def build_formed_replica(self, state: TrainingState, services: StepServices) -> None:
        """A member of a new replica, its torch world started: nanotron's groups and its coordinate's model."""
        with self.slow_io(Phase.REPLICA_BUILD):  # like the same build at start-up: the I/O allowance, not a step's
            self.parallel_context = self._replica_parallel_context(datetime.timedelta(seconds=self._timeout_s))
            services.rebuild_replica(self.parallel_context)
        self.zero_grad(state)  # as every rank did after this step's optimizer step

    def drop_replica_if_pooled(self, services: StepServices) -> None:
        """Pooled: drop the model, buckets, snapshots and torch world, so that a mate waiting on this rank in torch
        traffic gets an error now, not at its timeout (gloo closes a connection with its group's last reference)."""
        self.take_coordinates()
        if not (self.recycle and self.ft.pooled):
            return
        held = self.parallel_context is not None
        if held:
            services.release_replica()
            self.parallel_context = self.buckets = None
            if self.snapshots is not None:
                self.snapshots.drop_replica()  # the broken replica's files on this node: no live replica needs them
                self.snapshots = None
        if held or torch_dist.is_initialized():  # else a formation that broke after its rendezvous, before the model
            forget_torch_world(self.ft.rank)

    # ------------------------------------------------------------------------------------------------- misc
    def is_logging_rank(self) -> bool:
        """The lowest live rank (recycling: of a computing replica: a pool rank holds no LR schedule)."""
        if self.ft.evicted:
            return False
        if not self.recycle:
            return self.ft.rank == min(self.ft.live_ranks)
        active = set(self.ft.active_replicas)
        computing = [r for r in self.ft.live_ranks if self.ft.assignment.replica_of(r) in active]
        return self.ft.rank == min(computing, default=min(self.ft.live_ranks))

    def can_checkpoint(self) -> bool:
        """Whether a live replica holds the committed state (else no checkpoint may be written: it would publish
        another state under the step's name; a relaunch resumes from what was committed before)."""
        return bool(self.holders)

    def save_checkpoint(self, step: int, write: CheckpointWriter, services: StepServices,
                        extra_state: dict | None = None) -> None:
        """The lowest replica holding the committed state writes; all agree it is done; if the writer dies, the next
        holder saves. A spare replacing a replica lost in the save is activated at the next step's end."""
        while True:
            if not self.holders:
                raise BelowMinimumReplicas(0, self.min_replicas, step,
                                           reason=f"no live replica holds the committed state of step {step}")
            epoch = self.ft.epoch  # a repair of the watcher's during the write is the one this save's peers matched
            writer_replica = min(self.holders)
            try:  # a writer's mate dying mid-write is a torch error: recycling pools this rank (it writes no more)
                state = {"epoch": self.ft.epoch, "live_replicas": self.ft.live_replicas, **(extra_state or {})}
                write(self.replica == writer_replica, lambda: torch_dist.barrier(group=self.parallel_context.world_pg),
                      self.replica == writer_replica and self.local_rank == 0, state, self.config.ranks_per_replica)
            except Exception as e:  # noqa: BLE001 - not pooled: join the survivors' repair (evicts this rank), or a bug
                if is_disk_full(e):  # this rank's own write, no repair to wait for (up to the hang timeout): exit 2 now
                    raise
                if self.formation.repairs_that_pooled_me(services, step) is None:
                    self.lifecycle.join_repair_after_error()
                    raise
            try:
                self.ft.agree(True, epoch)
                return
            except FailureDetected:
                self.repair(services, step, Phase.CHECKPOINT, epoch)
                if self.roster.below_minimum(self.min_replicas):
                    raise BelowMinimumReplicas(len(self.roster.active), self.min_replicas, step) from None
