"""ReCoVer's data-parallel path: every step commits exactly M microbatches, whatever fails.

Per step: the planner (layer 3) splits the M global microbatches over the active replicas' slots; each replica
computes its share into flat fp32 buckets (loss / M); each bucket is snapshotted, keyed by (step, world epoch),
right before its cross-replica SUM over ULFM (layer 1); a world-wide ``Agree`` commits the step.

If anything fails before the commit: repair (layer 1), restore every bucket from its snapshot (a half-reduced
buffer is garbage), re-plan only the failed replicas' orphaned microbatches onto the survivors, compute them on
top, and reduce again in the new epoch. The optimizer then steps once, on the full M-microbatch gradient.
Spares replace failed replicas at the next step boundary, after a state copy from a live replica.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as torch_dist
from mpi4py import MPI

from nanotron_recover import run_folder
from nanotron_recover.config import RecoverConfig
from nanotron_recover.devices import needs_host_staging
from nanotron_recover.exit_codes import EXIT_RESTART
from nanotron_recover.ft import FailureDetected, FTWorld, HangPolicy, RepairEvent
from nanotron_recover.ft.hang_policy import KILL_CONFIRM_S
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.nanotron_compat.process_groups import forget_process_groups
from nanotron_recover.recovery.buckets import GradBuckets
from nanotron_recover.training_state import local_tensor
from nanotron_recover.recovery.local_snapshot import LocalSnapshots
from nanotron_recover.training_state import ensure_adam_state, state_tensors
from nanotron_recover.strategy import AttachedModel, CheckpointWriter, CommittedStep, DataParallelStrategy, LocalWork, StepServices
from nanotron_recover.training_state import TrainingState, fp32_accumulator
from nanotron_recover.workload.planner import Plan, merge, orphans_of, plan_step, replan_orphans
from nanotron_recover.workload.recycle import Formation, RankPool
from nanotron_recover.workload.spares import ReplicaRoster
from nanotron_recover.watchdog import arm_exit_deadline
from nanotron_recover.world import init_replica_torch_world
from nanotron_recover.phases import Phase

EXIT_BELOW_MIN_REPLICAS = EXIT_RESTART
REPAIR_WITHOUT_FAILURE = "repair_without_failure"  # a repair round that found no dead rank (see _repair)


class BelowMinimumReplicas(RuntimeError):
    """The job cannot go on: fewer than ``fault_tolerance.min_replicas`` replicas are left, or none that holds the
    committed state. Checkpoint (from a holder, if one is left) and stop with the restart outcome."""

    def __init__(self, live: int, minimum: int, last_committed_step: int, reason: str | None = None) -> None:
        super().__init__(reason or f"{live} live replica(s) < fault_tolerance.min_replicas={minimum}")
        self.last_committed_step = last_committed_step


class ResilientDataParallel(DataParallelStrategy):
    """``end_job(reason)`` ends the whole job with the restart outcome (:func:`nanotron_recover.watchdog.end_job`);
    it is called when a rank dies during start-up and when a hang cannot be ended by killing a rank.

    ``ft`` and ``parallel_context`` are built here (the ULFM world over ``MPI.COMM_WORLD``, then the replica's
    torch world) unless given: tests of the step logic pass an in-memory stand-in of :class:`FTWorld`.
    """

    def __init__(
        self,
        config: RecoverConfig,
        timeout_s: float,
        end_job: Callable[[str], None],
        *,
        ft: FTWorld | None = None,
        parallel_context: ReplicaParallelContext | None = None,
    ) -> None:
        par, ft_args = config.parallelism, config.fault_tolerance
        self.config = config
        self.M = config.microbatches_per_step
        self.min_replicas = ft_args.min_replicas
        self.keep_global_batch = ft_args.keep_global_batch
        self.recycle = ft_args.recycle
        self._timeout_s = timeout_s
        world = MPI.COMM_WORLD if ft is None else None
        if world is not None and world.Get_size() != config.world_size:
            raise SystemExit(
                f"nanotron-recover: launched with {world.Get_size()} ranks, the config needs {config.world_size} "
                f"((dp={par.dp} + spare_replicas={ft_args.spare_replicas}) x {config.ranks_per_replica} ranks per replica)"
            )
        rpr = config.ranks_per_replica
        self.replica, self.local_rank = divmod(world.Get_rank() if world is not None else ft.rank, rpr)
        self.loss_divisor = self.M  # every microbatch's loss / M: the reduced gradient is the step's mean
        self.on_exit: Callable[[int, str], None] = lambda code, reason: None
        self.on_started: Callable[[], None] = lambda: None  # called once every rank is ready to train
        self.run_dir: Path | None = None  # where hang_detected events are appended (set by the entry point)
        self._end_job = end_job

        # The FT world first: from here on a death anywhere is noticed (and, during start-up, ends the job).
        active = list(range(par.dp))
        self.roster = ReplicaRoster(active=active, spares=list(range(par.dp, par.dp + ft_args.spare_replicas)))
        self.hang_policy = HangPolicy(fixed_timeout_s=ft_args.hang_timeout_s, io_allowance_s=ft_args.startup_timeout_s)
        if ft is None:
            ft = FTWorld(world, rpr, active_replicas=active, on_evict=self._on_evict,
                         on_startup_failure=self._on_startup_failure, recycle=self.recycle)
            replica_comm = ft.world_comm.Split(color=self.replica, key=world.Get_rank())  # rendezvous only
            init_replica_torch_world(replica_comm, timeout_s)
            replica_comm.Free()
            parallel_context = self._replica_parallel_context(datetime.timedelta(seconds=timeout_s))
        self.ft = ft
        self.parallel_context = parallel_context
        self.pool = RankPool(rpr, hosts=getattr(ft, "hosts", None))  # recycled survivors (recycle: true)
        self._applied = len(ft.events)  # repair events already applied to the roster and the pool
        self._pool_before: list[int] = []
        self._formed_at: float | None = None  # perf_counter() when the last new replica was formed
        self._stats = np.zeros(2, dtype=np.float64)  # [loss sum, committed microbatches], reused every attempt
        self._pending_activation = False
        # Replicas that hold the committed state of the last committed step: the ones that committed it, and a
        # spare or formed replica only once its state transfer completed everywhere. Only they are planned work
        # and only they write a checkpoint (a spare whose donor died mid-transfer holds initial weights).
        self.holders: set[int] = set(active)
        self._step_started = 0.0
        self.snapshots: LocalSnapshots | None = None  # node-local state snapshots (set up at resume, needs run_dir)

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
        return AttachedModel(model=model, unwrapped=model, named_params=named_params)

    def computes(self) -> bool:
        return self.replica is not None and self.replica in self.ft.active_replicas

    def pool_ranks(self) -> list[int] | None:
        return self.ft.pool_ranks if self.recycle else None

    # ------------------------------------------------------------------------------------------------- start-up
    def startup_complete(self) -> None:
        """Every rank agrees it is ready (a death during start-up fails the agreement everywhere: the job ends with
        the restart outcome); then the start-up watchdog is disarmed and the hang monitor takes over."""
        try:
            self.ft.complete_startup()
        except FailureDetected as e:
            self._on_startup_failure(frozenset(), detail=str(e))
            return
        self.on_started()
        self.ft.start_hang_monitor(self.hang_policy, on_hang=self._log_hang, end_job=self._end_job_from_monitor)

    def _on_startup_failure(self, dead: frozenset[int], detail: str = "") -> None:
        reason = f"rank(s) {sorted(dead)} died during start-up" if dead else f"start-up failed: {detail}"
        self.on_exit(EXIT_RESTART, reason)
        self._end_job(reason)

    def _end_job_from_monitor(self, reason: str) -> None:
        self.on_exit(EXIT_RESTART, f"hang: {reason}")
        self._end_job(f"hang: {reason}")

    def _log_hang(self, record: dict) -> None:
        """Any rank may detect a hang: append the event to the run's metrics.jsonl (one ``write`` of one line with
        O_APPEND, so it never interleaves with the logging rank's lines) and say it on stderr. A rank that found
        itself stuck also leaves its threads' stacks in ``hangs/`` of the run dir (named in the event)."""
        stacks = record.pop("stacks", None)
        if stacks is not None and self.run_dir is not None:
            path = run_folder.write_hang_stacks(self.run_dir, record["by_rank"], record.get("step", 0), stacks)
            record["stacks_file"] = str(path)
        sys.stderr.write(f"[nanotron-recover] {json.dumps(record, default=str)}\n" + (stacks or ""))
        sys.stderr.flush()
        if self.run_dir is not None:
            run_folder.append_metrics_record(self.run_dir, record)

    def progress(self, step: int, phase: str) -> None:
        self.ft.progress.busy(phase, step)

    def slow_io(self, what: str) -> AbstractContextManager[None]:
        return self.ft.progress.slow_io(what)

    def hang_margin(self) -> dict:
        monitor = self.ft.hang_monitor
        if monitor is None:
            return {}
        return {**monitor.margin.as_dict(), "timeout_s": self.hang_policy.timeout_s}

    # ------------------------------------------------------------------------------------------------- step
    def forward_backward_reduce(self, step: int, services: StepServices) -> CommittedStep:
        self._step_started = time.monotonic()
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
                repaired = self._repairs_that_pooled_me(services, step)
                if repaired is None:
                    raise
            gc.collect()  # the torch error's traceback held the old replica's process groups: now they close
            recoveries += 1
            work = LocalWork()  # what this rank computed belonged to its broken replica
            plan, todo = self._recover(services, step, plan, repaired)
        if self.buckets is not None:
            self.buckets.release(step)  # committed: the snapshots are no longer needed
        self.holders = set(plan)  # the replicas that computed and committed this step, still alive
        committed = int(round(self._stats[1]))
        loss = float(self._stats[0])
        if committed != self.M:
            if self.keep_global_batch:
                raise RuntimeError(f"step {step} committed {committed} microbatches, expected {self.M}")
            # shrinking-batch baseline: the average over what was committed
            self.buckets.flat.mul_(self.M / committed)
            loss *= self.M / committed
        return CommittedStep(
            loss=loss,
            microbatches=committed,
            epoch=self.ft.epoch,
            live_replicas=len(plan),
            recoveries=recoveries,
            quotas={r: len(v) for r, v in plan.items()} if self.recycle else None,
        )

    def join_repair_after_error(self) -> None:
        """After an unexpected error: if a process died, this rank's replica broke under it (a torch error from a
        dead replica-mate); take part in the survivors' repair, which evicts this rank (``ReplicaEvicted``).

        Returns normally when no process died (the error is a bug, not a fault) or when the repair kept this
        rank (then the error was not caused by the failure): the caller aborts.
        """
        # a torch error inside the replica: a replica-mate died, or hangs and the hang monitor will kill it
        if self.ft.starting or not self.ft.wait_for_failure_notice(extra_s=self.hang_policy.timeout_s + KILL_CONFIRM_S):
            return
        self.ft.repair_if_pending()  # unless the watcher already did

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

    def _plan(self, step: int) -> Plan:
        """Slots keep the failure-free ranges: a spare computes exactly what the replica it replaced did.

        A replica that took a slot but does not hold the committed state yet (its activation is still pending,
        e.g. after a death inside a checkpoint save) computes nothing: its slot's microbatches go to the holders,
        so the step still commits M. Shrinking-batch baseline: the failure-free plan minus the slots that were lost.
        """
        slots = self.roster.active_slots()
        by_slot = plan_step(step, self.M, slots if self.keep_global_batch else range(self.config.parallelism.dp))
        plan = {self.roster.replica_in_slot(slot): by_slot[slot] for slot in slots}
        waiting = [r for r in plan if r not in self.holders or r not in self.ft.active_replicas]
        if not waiting:
            return plan
        computing = [r for r in plan if r not in waiting]
        orphans = orphans_of(plan, waiting) if self.keep_global_batch else []
        return merge(plan, replan_orphans(orphans, computing, plan), waiting)

    def _reduce(self, services: StepServices, step: int, work: LocalWork) -> None:
        """SUM every bucket across the computing replicas, then the step's loss and microbatch count world-wide."""
        computing = self.computes()
        if computing:
            for i in range(self.buckets.num_buckets):
                self.buckets.snapshot_bucket(i, step, self.ft.epoch)
                self.ft.allreduce_sum_(self.buckets.to_host(i), "coord")
                self.buckets.from_host(i)
                if i == 0:
                    services.fault_point(step, Phase.REDUCE)
        self._stats[0] = work.loss_sum if (computing and self._reports_loss()) else 0.0
        self._stats[1] = work.microbatches if (computing and self.local_rank == 0) else 0.0
        self.ft.allreduce_sum_(self._stats, "world")

    def _repair(self, services: StepServices, step: int, phase: str, since_epoch: int | None = None) -> RepairEvent:
        """Repair the world (``ReplicaEvicted`` on a rank of a failed replica, unless recycling keeps it in the
        pool), update the roster, log the event. ``since_epoch``: see :meth:`FTWorld.repair`."""
        self.ft.repair_hook = lambda point, attempt: (
            services.fault_point(step, Phase.REPAIR) if point == "after_shrink" else None
        )
        event = self.ft.repair(since_epoch)
        self._log_repair(services, step, phase, event)
        return event

    def _log_repair(self, services: StepServices, step: int, phase: str, event: RepairEvent) -> None:
        """Apply the repair to the roster (and the pool) and log it. The new lowest live rank takes over logging,
        re-logging the last committed step in case the old logger died before writing it."""
        changes = self._apply_repairs(services)
        metrics = services.metrics
        logging = self.is_logging_rank()
        if logging and not metrics.enabled:
            metrics.set_logging(True)
            last = services.last_record()
            if last is not None:
                metrics.log_step(last)
        elif metrics.enabled and not logging:  # recycling: the logging rank's replica broke, it is in the pool now
            metrics.set_logging(False)
        record = {"event": "repair", "step": step, "phase": phase, **event.as_dict(),
                  "activated_spares": [s for change in changes for s in change.activated]}
        if not event.failed_ranks:
            # Seen (rarely, under heavy load and after failures): the commit Agree came back, uniformly, without
            # the healthy bit although no rank was repairing. Every rank then enters the repair alike, Shrink
            # finds nobody dead, and the step is reduced again from its snapshots: the trajectory is kept. It is
            # logged as what it is, apart from the repairs of real failures.
            record["event"] = REPAIR_WITHOUT_FAILURE
        metrics.log_event(record)
        if self.recycle and (event.pooled or set(event.failed_ranks) & set(self._pool_before)):
            metrics.log_event({"event": "pool_changed", "step": step, "epoch": event.epoch,
                               "joined": sorted(event.pooled),
                               "died": sorted(set(event.failed_ranks) & set(self._pool_before)),
                               "pool_ranks": self.pool.ranks})

    def _apply_repairs(self, services: StepServices) -> list:
        """Every repair this rank has not applied yet (the watcher's too) goes into the roster and the pool, in
        order; the same on every rank. A rank moved to the pool drops its replica's model and torch world."""
        changes = []
        self._pool_before = self.pool.ranks
        for event in self.ft.events[self._applied:]:
            changes.append(self.roster.on_failure(event.failed_replicas))
            self.holders -= set(event.failed_replicas)
            if self.recycle:
                self.pool.remove(event.failed_ranks)
                self.pool.add(event.pooled)
        self._applied = len(self.ft.events)
        if any(change.replacements for change in changes):
            self._pending_activation = True
        self._drop_replica_if_pooled(services)
        return changes

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

    def _recover(self, services: StepServices, step: int, plan: Plan, repaired: list[RepairEvent] | None = None,
                 since_epoch: int | None = None) -> tuple[Plan, list[int]]:
        """Repair (unless ``repaired`` says it was done), restore the local sums, and hand the failed replicas'
        microbatches to the survivors."""
        if repaired is not None:
            events = repaired
        else:
            event = self._repair(services, step, "in-step", since_epoch)
            # the watcher may have repaired more than once since the failure was raised: all of them count
            events = [e for e in self.ft.events if e.epoch > since_epoch] if since_epoch is not None else [event]
        failed = sorted({r for event in events for r in event.failed_replicas})
        survivors = [r for r in plan if r not in failed]
        if not survivors or self.roster.below_minimum(self.min_replicas):
            raise BelowMinimumReplicas(len(survivors), self.min_replicas, last_committed_step=step - 1)
        if self.buckets is not None and self.buckets.has_snapshot(step):
            self.buckets.restore(step)
        orphans = orphans_of(plan, failed) if self.keep_global_batch else []
        extra = replan_orphans(orphans, survivors, plan)
        return merge(plan, extra, failed), (extra.get(self.replica, []) if self.replica is not None else [])

    # ------------------------------------------------------------------------------------------------- commit
    def zero_grad(self, state: TrainingState) -> None:
        if self.buckets is None:  # in the pool: no model
            return
        self.buckets.zero_()
        accumulator = fp32_accumulator(state)
        if accumulator is not None:
            accumulator.bind_master_grads()

    def after_commit(self, step: int, state: TrainingState, services: StepServices) -> None:
        """Activate spares that replaced failed replicas: copy model and optimizer state, then widen the reduction."""
        if self.recycle:
            self._form_replicas(step, state, services)
        donors = set(self.ft.active_replicas)  # replicas that computed (and committed) this step, still alive
        self.progress(step, Phase.SPARE_ACTIVATION)
        while self._pending_activation:
            epoch = self.ft.epoch
            try:
                new = set(self.roster.active) - donors
                self.ft.set_active_replicas(self.roster.active)
                record = None
                if new and self.computes():  # over the coordinate groups of the active replicas
                    services.fault_point(step, Phase.TRANSFER)
                    record = self._copy_state_to_new_replicas(state, donor=min(donors), new=new)
                # each coordinate's broadcast ends on its own: one can complete while another lost its donor, so
                # every rank agrees that all of them did, or all repair and do the transfer again
                self.ft.agree(True, epoch)
                self.holders = set(self.roster.active)  # every new replica received the committed state
                if record is not None:
                    services.metrics.log_event(record)
                self._formed_at = None
                self._pending_activation = False
            except Exception as exc:  # noqa: BLE001 - a fault; or the watcher pooled this rank mid-transfer
                if not isinstance(exc, FailureDetected) and self.ft.epoch == epoch:
                    raise
                self._repair(services, step, Phase.SPARE_ACTIVATION, epoch)
                donors -= {r for e in self.ft.events if e.epoch > epoch for r in e.failed_replicas}
                if not donors:
                    raise BelowMinimumReplicas(
                        len(self.roster.active), self.min_replicas, step,
                        reason=f"no live replica holds the committed state of step {step}: the donors of the "
                               "state transfer were lost") from None
                if self.roster.below_minimum(self.min_replicas):
                    raise BelowMinimumReplicas(len(self.roster.active), self.min_replicas, step) from None
        if self.snapshots is not None and self.computes():  # an idle spare's state is not the committed one
            self.progress(step, Phase.SNAPSHOT)
            try:
                self.snapshots.after_commit(step, state, epoch=self.ft.epoch, log_event=services.metrics.log_event)
            except OSError as e:  # e.g. /dev/shm full: training goes on, relaunches use the disk checkpoint
                print(f"[nanotron-recover] local snapshots turned off: {e}", flush=True)
                self.snapshots = None
        self.hang_policy.record_step(time.monotonic() - self._step_started)

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

    def _copy_state_to_new_replicas(self, state: TrainingState, donor: int, new: set[int]) -> dict:
        """Broadcast parameters and Adam state from a replica that computed the committed step, tensor by tensor;
        -> the ``spare_activated`` record (logged once every rank agreed that the transfer completed)."""
        t0 = time.perf_counter()
        ensure_adam_state(state.optimizer)
        for tensor in state_tensors(state):
            _bcast_tensor(self.ft, tensor, donor)
        now = time.perf_counter()
        record = {"event": "spare_activated", "replicas": sorted(new), "donor": donor, "epoch": self.ft.epoch,
                  "transfer_ms": (now - t0) * 1e3}
        if self._formed_at is not None:  # a replica formed from the pool: its torch world, model build and state
            record["formed_to_active_ms"] = (now - self._formed_at) * 1e3
        return record

    def resume_from_local_snapshot(self, state: TrainingState, newer_than: int | None) -> int | None:
        self.snapshots = LocalSnapshots(self.config, self.run_dir or Path("."), self.ft, self.replica, self.local_rank)
        self.progress(0, Phase.LOCAL_SNAPSHOT_RESUME)
        return self.snapshots.resume(state, newer_than)

    def finish(self, step: int, services: StepServices) -> None:
        """A last agreement after the final step, so that a death after the last commit is known at shutdown; then
        this node's local snapshots of the run are deleted."""
        if self.snapshots is not None:
            self.snapshots.finish()
        try:
            self.ft.agree(True)
        except FailureDetected:
            self._repair(services, step, "end")
        if self.snapshots is not None:
            self.snapshots.remove()
        self.ft.progress.waiting("finish")  # closing the metrics (wandb) is judged by the stall limit only

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
        """The lowest replica holding the committed state writes; all agree it is done. If the writer dies, the
        next holder saves. A spare that replaced a replica lost in the save is activated at the step's end
        (:meth:`after_commit` of the next step); until then it computes nothing (:meth:`_plan`)."""
        while True:
            if not self.holders:
                raise BelowMinimumReplicas(0, self.min_replicas, step,
                                           reason=f"no live replica holds the committed state of step {step}")
            writer_replica = min(self.holders)
            write(
                self.replica == writer_replica,
                lambda: torch_dist.barrier(group=self.parallel_context.world_pg),
                self.replica == writer_replica and self.local_rank == 0,
                {"epoch": self.ft.epoch, "live_replicas": self.ft.live_replicas, **(extra_state or {})},
            )
            try:
                self.ft.agree(True)
                return
            except FailureDetected:
                self._repair(services, step, Phase.CHECKPOINT)
                if self.roster.below_minimum(self.min_replicas):
                    raise BelowMinimumReplicas(len(self.roster.active), self.min_replicas, step) from None

    def _on_evict(self, reason: BaseException) -> None:
        """The watcher evicts a rank stuck in its replica's torch traffic; it exits 0 right after this."""
        print(f"[nanotron-recover] replica {self.replica} rank {self.local_rank}: {reason}; exiting 0", flush=True)
        self.on_exit(0, f"evicted by watcher: {reason}")

    def shutdown(self, code: int = 0) -> None:
        """End this rank; within ``finalize_timeout_s`` even if its MPI daemon is frozen or gone."""
        arm_exit_deadline(self.config.fault_tolerance.finalize_timeout_s)
        self.ft.shutdown(code=code)


def _bcast_tensor(ft: FTWorld, tensor: torch.Tensor, donor: int) -> None:
    """Broadcast one tensor in place from ``donor``'s rank of this coordinate (CUDA tensors via a host copy).

    Coordinates match shard for shard: a rank of an FSDP replica receives its own shard from the donor replica's
    rank of the same shard index. A bf16 tensor travels as its raw 16-bit words (numpy has no bfloat16)."""
    tensor = local_tensor(tensor.detach())  # a sharded (FSDP) tensor: this rank's shard
    host = tensor.cpu() if needs_host_staging(tensor.device) else tensor  # zero-copy on CPU
    words = host.view(-1)
    if words.dtype == torch.bfloat16:
        words = words.view(torch.int16)
    ft.bcast_(words.numpy(), root_replica=donor, comm="coord")
    if host is not tensor:
        tensor.copy_(host)
