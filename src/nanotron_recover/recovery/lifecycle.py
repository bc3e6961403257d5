"""A resilient rank's life as a process: start-up, hang events, how it ends, and the exit record it leaves.

Two parts. :class:`ProcessLifecycle` is the object the resilient strategy holds (``strategy.lifecycle``), built
whole with what the entry point hands it (:class:`EntryHooks`: the run dir its records go to, its launch, the hook
``on_started``): building the worlds, the exit record, the hang monitor's events, eviction, the run's last
agreement, the bounded shutdown, so that the step logic in :mod:`.resilient` stays about steps. An object rather
than a base class: it owns those members, and the little of the strategy's state it needs (the FT world, the hang
policy, the replica coordinates, the snapshots) is handed to it by name.
:func:`run_resilient` is the rank's whole run: build the strategy, train, and turn whatever ended the run into an
exit code and an exit record (0 done or evicted, 3 relaunch to resume, 1 a bug that the same code would hit again:
the job is aborted at once).
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from nanotron_recover.ft import FailureDetected, ReplicaEvicted, ReplicaWorld
from nanotron_recover.ft.hang_policy import KILL_CONFIRM_S, HangPolicy
from nanotron_recover.process.startup_clock import STARTUP
from nanotron_recover.process.stop_request import StopRequested
from nanotron_recover.process.watchdog import arm_exit_deadline, end_job
from nanotron_recover.recovery.errors import EXIT_BELOW_MIN_REPLICAS, BelowMinimumReplicas, StragglerEvicted
from nanotron_recover.run import run_folder
from nanotron_recover.run.disk_space import full_disk_line, is_disk_full, written_path
from nanotron_recover.run.exit_codes import EXIT_ABORTED, EXIT_DONE, EXIT_NEEDS_PERSON, EXIT_RESTART, NeedsPerson
from nanotron_recover.run.launch_contract import LaunchContract

if TYPE_CHECKING:
    from nanotron_recover.config import RecoverConfig
    from nanotron_recover.snapshots.local_snapshot import LocalSnapshots
    from nanotron_recover.training.torch_world import ReplicaTorchWorld

# The entry point picks the classes (3D or HSDP strategy, the trainer) and hands them in: this module depends on
# neither, so the strategy can hold the lifecycle object below.
StrategyFactory = Callable[..., Any]  # (config, timeout_s, end_job=, launch=, entry=) -> a ResilientDataParallel
TrainerFactory = Callable[[Any, Path, Any, Any], Any]  # (config, run_dir, strategy, launch) -> a RecoverTrainer


@dataclass(frozen=True)
class EntryHooks:
    """What the entry point hands a rank's lifecycle: where its exit record and hang events go (None: nowhere, a
    test's strategy), its world rank (for a record written before the FT world exists), the launch every line it
    appends names, and what to call once every rank is ready (the entry point disarms its start-up watchdog)."""

    run_dir: Path | None = None
    rank: int = 0
    launch_token: str | None = None
    on_started: Callable[[], None] = field(default=lambda: None)


@dataclass(frozen=True)
class LifecycleSettings:
    """The two ``fault_tolerance`` settings a rank's lifecycle reads."""

    hang_monitor: bool  # off only to measure its cost (the same on every rank)
    finalize_timeout_s: float  # the most a rank's end may take, even with its MPI daemon frozen or gone

    @classmethod
    def of(cls, ft: Any) -> LifecycleSettings:
        return cls(hang_monitor=ft.hang_monitor, finalize_timeout_s=ft.finalize_timeout_s)


class ProcessLifecycle:
    """Start-up (the worlds, then completion), hang events, eviction and the end (the last agreement, the bounded
    shutdown) of a resilient rank: an object that :class:`~nanotron_recover.recovery.resilient.ResilientDataParallel`
    holds (``strategy.lifecycle``) and the entry point talks to.

    Owns what the entry point hands it (:class:`EntryHooks`), how the job is ended (``end_job``), its
    :class:`LifecycleSettings` and the FT world (``ft``: built by :meth:`start_worlds`, with this object's start-up
    failure and eviction callbacks, which is why it exists before the world; a test's in-memory world is set by the
    strategy). Given by the strategy: the hang policy, and two callbacks into its state: ``coordinates`` (this
    rank's replica and local rank, for the eviction's message) and ``snapshots`` (its node-local snapshots, None
    when off or not set up yet)."""

    def __init__(self, settings: LifecycleSettings, end_job: Callable[[str], None], hang_policy: HangPolicy,
                 entry: EntryHooks, *, coordinates: Callable[[], tuple[int | None, int | None]],
                 snapshots: Callable[[], LocalSnapshots | None]) -> None:
        self.settings, self.hang_policy, self.entry = settings, hang_policy, entry
        self.ft: ReplicaWorld | None = None
        self.run_dir = entry.run_dir  # where the exit record and hang events go
        self._end_job, self._coordinates, self._snapshots = end_job, coordinates, snapshots

    def record_exit(self, code: int, reason: str, **extra: Any) -> None:
        """This rank's exit record (how close it came to its hang timeout included); none without a run dir."""
        if self.run_dir is not None:
            rank = self.ft.rank if self.ft is not None else self.entry.rank
            run_folder.record_exit(self.run_dir, rank, code, reason, hang_margin=self.hang_margin(), **extra)

    def start_worlds(self, world: Any, replica: int, active: list[int], torch_world: ReplicaTorchWorld, *,
                     ranks_per_replica: int, recycle: bool, mpi_wait: str,
                     replica_context: Callable[[datetime.timedelta], Any]) -> tuple:
        """The FT world over every rank (its start-up failure and eviction callbacks are this object's), then this
        rank's replica's torch world and its nanotron groups (``replica_context``): ``(ft, parallel_context)``."""
        from nanotron_recover.ft import FTWorld, WorldOptions  # mpi4py: the entry point initialised MPI before

        self.ft = FTWorld(world, ranks_per_replica, active_replicas=active, on_evict=self.on_evict,
                          on_startup_failure=self.on_startup_failure,
                          options=WorldOptions(recycle=recycle, mpi_wait=mpi_wait))
        STARTUP.mark("FT world")
        replica_comm = self.ft.world_comm.Split(color=replica, key=world.Get_rank())  # rendezvous only
        torch_world.start(replica_comm)
        replica_comm.Free()
        STARTUP.mark("replica torch world")
        parallel_context = replica_context(datetime.timedelta(seconds=torch_world.timeout_s))
        STARTUP.mark("nanotron groups")
        return self.ft, parallel_context

    def startup_complete(self, fault_point: Callable[[], None] = lambda: None) -> None:
        """Every rank agrees it is ready (a death during start-up fails the agreement everywhere: the job ends with
        the restart outcome); then the start-up watchdog is disarmed and the hang monitor takes over. A death
        between the agreement and the monitor's start (a collective) ends the job with the restart outcome too:
        nothing was trained yet, and no monitor would watch the repair (before: an abort, exit 1)."""
        try:
            self.ft.complete_startup()
            STARTUP.ready()  # this rank's start-up ends (the logging rank's startup event: a relaunch's cost)
            self.entry.on_started()  # every rank is ready: the start-up watchdog is disarmed, a death is seen over MPI
            fault_point()  # startup:agreed
            if self.settings.hang_monitor:  # off only to measure its cost (the same on every rank)
                self.ft.start_hang_monitor(self.hang_policy, on_hang=self._log_hang,
                                           end_job=self._end_job_from_monitor)
        except FailureDetected as e:
            self.on_startup_failure(frozenset(), detail=str(e))

    def on_startup_failure(self, dead: frozenset[int], detail: str = "") -> None:
        reason = f"rank(s) {sorted(dead)} died during start-up" if dead else f"start-up failed: {detail}"
        self.record_exit(EXIT_RESTART, reason)
        self._end_job(reason)

    def _end_job_from_monitor(self, reason: str) -> None:
        self.record_exit(EXIT_RESTART, f"hang: {reason}")
        self._end_job(f"hang: {reason}")

    def _log_hang(self, record: dict[str, Any]) -> None:
        """Any rank may detect a hang: append the event to the run's metrics (one line, never interleaved with the
        logging rank's) and say it on stderr. A rank that found itself stuck also leaves its threads' stacks."""
        stacks = record.pop("stacks", None)
        if stacks is not None and self.run_dir is not None:
            path = run_folder.write_hang_stacks(self.run_dir, record["by_rank"], record.get("step", 0), stacks)
            record["stacks_file"] = str(path)
        sys.stderr.write(f"[nanotron-recover] {json.dumps(record, default=str)}\n" + (stacks or ""))
        sys.stderr.flush()
        if self.run_dir is not None:
            run_folder.append_metrics_record(self.run_dir, record, launch=self.entry.launch_token)

    def hang_margin(self) -> dict[str, Any]:
        """How close this rank came to its hang timeout (kept in its exit record)."""
        monitor = self.ft.hang_monitor if self.ft is not None else None
        if monitor is None:
            return {}
        return {**monitor.margin.as_dict(), "timeout_s": self.hang_policy.timeout_s}

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

    def on_evict(self, reason: BaseException) -> None:
        """The watcher evicts a rank stuck in its replica's torch traffic; it exits 0 right after this."""
        replica, local_rank = self._coordinates()
        print(f"[nanotron-recover] replica {replica} rank {local_rank}: {reason}; exiting 0", flush=True)
        self.record_exit(0, f"evicted by watcher: {reason}")
        self.drop_snapshots()

    def drop_snapshots(self) -> None:
        """Leaving while the others train on: this replica's node-local snapshot files on this node go (a finished
        run's are deleted by ``finish``; a node whose ranks all left kept them for ever)."""
        snapshots = self._snapshots()
        if snapshots is not None:
            try:
                snapshots.drop_replica()
            except OSError as e:  # best effort: leaving must not fail on it
                print(f"[nanotron-recover] rank {self.ft.rank}: snapshot files not deleted: {e}", flush=True)

    def finish(self, repair: Callable[[], Any]) -> None:
        """A last agreement after the final step, so that a death after the last commit is known at shutdown (then
        ``repair``); then this node's local snapshots of the run are deleted."""
        if self._snapshots() is not None:
            self._snapshots().finish()
        try:
            self.ft.agree(True)
        except FailureDetected:
            repair()  # it may have moved this rank to the pool, which drops its snapshots
        if self._snapshots() is not None:
            self._snapshots().remove()
        self.ft.progress.waiting("finish")  # closing the metrics (wandb) is judged by the stall limit only

    def shutdown(self, code: int = 0) -> None:
        """End this rank; within ``finalize_timeout_s`` even if its MPI daemon is frozen or gone."""
        arm_exit_deadline(self.settings.finalize_timeout_s)
        self.ft.shutdown(code=code)


# ------------------------------------------------------------------------------------------------ the rank's run
def run_resilient(make_strategy: StrategyFactory, make_trainer: TrainerFactory, config: "RecoverConfig",
                  run_dir: Path, timeout_s: float, launch: LaunchContract,
                  on_started: Callable[[], None] | None = None) -> int:
    """Build the resilient strategy over ULFM, train, and end: the rank's exit code (its record is written)."""
    from mpi4py import MPI  # MPI_Init (the entry point fired its after_mpi_init fault right before)

    entry = EntryHooks(run_dir=run_dir, rank=MPI.COMM_WORLD.Get_rank(), launch_token=launch.token,
                       **({"on_started": on_started} if on_started is not None else {}))
    dp = _build_strategy(make_strategy, config, timeout_s, launch, entry)
    trainer, extra = None, {}
    try:
        trainer = make_trainer(config, run_dir, dp, launch)
        trainer.train()
        code, reason = EXIT_DONE, "finished"
    except NeedsPerson as e:  # agreed by every rank: damaged state with no fallback, a non-finite step
        code, reason, extra = _stop_for_person(trainer, e)
    except ReplicaEvicted as e:
        code, reason = _leave_evicted(dp, e)
    except StragglerEvicted as e:
        code, reason = _leave_as_straggler(dp, e)
    except BelowMinimumReplicas as e:
        code, reason = _stop_below_minimum(dp, trainer, e)
    except StopRequested as e:  # agreed by every rank: the step's snapshot is written
        code, reason = _stop_on_request(dp, trainer, e)
    except Exception as error:  # noqa: BLE001 - a fault seen as a torch error, or a bug
        code, reason = _after_error(dp, error)
    dp.lifecycle.record_exit(code, reason, **extra)
    sys.stdout.flush()
    dp.lifecycle.shutdown(code=code)
    return code


def _build_strategy(make_strategy: StrategyFactory, config: "RecoverConfig", timeout_s: float,
                    launch: LaunchContract, entry: EntryHooks) -> Any:
    """The resilient strategy, its lifecycle built with the entry point's hooks. A peer that dies or hangs while
    the worlds are built leaves nothing to recover yet: the job ends with the restart outcome."""
    try:
        return make_strategy(config, timeout_s, end_job=end_job, launch=launch, entry=entry)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        reason = f"start-up failed: {type(error).__name__}: {error}"
        if entry.run_dir is not None:
            run_folder.record_exit(entry.run_dir, entry.rank, EXIT_RESTART, reason)
        end_job(reason)
        raise SystemExit(EXIT_RESTART) from error


def _leave_evicted(dp: Any, e: ReplicaEvicted, after: str = "") -> tuple[int, str]:
    print(f"[nanotron-recover] rank {dp.ft.rank} (replica {dp.replica}) leaves: {e}", flush=True)
    dp.lifecycle.drop_snapshots()
    return EXIT_DONE, f"evicted{after}: {e}"


def _leave_as_straggler(dp: Any, e: StragglerEvicted) -> tuple[int, str]:
    """Leave the world without a word, at once: the others, blocked on this rank in the step's reduction, see its
    ranks die, repair around them and activate the spare promised to its slot (the straggler had quota 0 already:
    nothing is orphaned). A logging rank does not finish wandb (seconds): its JSONL lines are flushed as written,
    and the next logging rank replays them into wandb."""
    print(f"[nanotron-recover] rank {dp.ft.rank}: {e}", flush=True)
    dp.ft.leave()
    dp.lifecycle.drop_snapshots()
    return EXIT_DONE, f"evicted: {e}"


def _stop_below_minimum(dp: Any, trainer: Any,
                        e: BelowMinimumReplicas) -> tuple[int, str]:
    """Too few replicas, or none holding the committed state: a holder saves the last committed step (a checkpoint
    from anyone else would publish another state under that step's name), then the job stops for a relaunch."""
    step = e.last_committed_step
    if not dp.can_checkpoint():
        print(f"[nanotron-recover] stopping: {e}; no checkpoint is written (a relaunch resumes from the newest "
              "committed snapshot or checkpoint)", flush=True)
    elif step > 0 and trainer is not None:
        print(f"[nanotron-recover] stopping: {e}; saving a checkpoint of step {step}", flush=True)
        try:  # collective over the live ranks: a holder writes
            trainer.save_checkpoint(step, extra_state={"stopped": "below_min_replicas"})
        except Exception as again:  # noqa: BLE001 - another death (seen by MPI or as a torch error), a full disk
            if is_disk_full(again):
                _end_for_full_disk(dp, again)
            print(f"[nanotron-recover] fallback checkpoint not saved: {type(again).__name__}: {again}", flush=True)
    if trainer is not None:
        trainer.metrics.log_event({"event": "stopped", "reason": str(e), "step": step})
        trainer.metrics.close()
    return EXIT_BELOW_MIN_REPLICAS, str(e)


def _stop_on_request(dp: Any, trainer: Any, e: StopRequested) -> tuple[int, str]:
    if dp.ft.rank == 0:
        print(f"[nanotron-recover] {e}: exit {EXIT_RESTART}", file=sys.stderr, flush=True)
    trainer.metrics.close()
    return EXIT_RESTART, str(e)


def _stop_for_person(trainer: Any, e: NeedsPerson) -> tuple[int, str, dict]:
    """Every rank stops alike (the decision was agreed): say it once, log it, close the metrics."""
    if trainer is None or trainer.metrics.enabled:
        print(f"[nanotron-recover] stopping for a person (exit {EXIT_NEEDS_PERSON}, not requeued): {e}",
              file=sys.stderr, flush=True)
    if trainer is not None:
        trainer.metrics.log_event({"event": "needs_person", "what": e.what, "detail": str(e), **e.record})
        trainer.metrics.close()
    return EXIT_NEEDS_PERSON, str(e), dict(e.record)


def _end_for_full_disk(dp: Any, error: Exception) -> None:
    """A write of this rank found no space: say it in one line, record it (when the checkpoint's own write found
    it, its partial folder is gone and the record fits; when another write did, a save in flight may still hold the
    space, and the launcher looks at the free space itself), and end the whole job at once: nobody waits for this
    rank to be judged hung."""
    config, run_dir = dp.config, dp.lifecycle.run_dir or Path(".")
    path = str(config.checkpoints.checkpoints_path) if config.checkpoints is not None else "checkpoints"
    latest = run_folder.latest_checkpoint_step(run_dir, path)
    kept = (f"the checkpoint of step {latest} ({run_folder.checkpoints_root(run_dir, path) / 'latest.txt'}) and "
            "the node-local snapshots")
    line = full_disk_line(written_path(error, run_dir), kept)
    print(f"[nanotron-recover] rank {dp.ft.rank}: {line}", file=sys.stderr, flush=True)
    try:
        dp.lifecycle.record_exit(EXIT_NEEDS_PERSON, line, disk_full=True)
    except OSError:  # no room even for the record: the launcher checks the free space itself
        pass
    end_job(line, outcome="a person must act")


def _after_error(dp: Any, error: Exception) -> tuple[int, str]:
    """An error that is not one of ours: a full disk (the job ends for a person), a replica-mate's death seen as a
    torch error (join the repair, which evicts this rank), a pooled rank's (leave), or a bug (abort the whole job
    now rather than leave the other ranks to wait out their torch timeouts: the same error would hit every
    replica)."""
    if is_disk_full(error):
        _end_for_full_disk(dp, error)
    if dp.ft.starting:  # before every rank was ready there is no recovery: the job restarts
        traceback.print_exc()
        reason = f"start-up failed: {type(error).__name__}: {error}"
        dp.lifecycle.record_exit(EXIT_RESTART, reason)
        end_job(reason)
    try:
        dp.lifecycle.join_repair_after_error()  # a dead replica-mate broke our torch traffic: leave with the repair
    except ReplicaEvicted as e:
        return _leave_evicted(dp, e, after=f" after {type(error).__name__}")
    if dp.ft.pooled:  # recycling: moved to the pool at a point it cannot rejoin from; the others see it go
        reason = f"left the pool after {type(error).__name__}: {error}"
        print(f"[nanotron-recover] rank {dp.ft.rank}: {reason}; raised at:\n"
              + "".join(traceback.format_tb(error.__traceback__)[-4:]), flush=True)
        dp.ft.leave()
        dp.lifecycle.drop_snapshots()
        return EXIT_DONE, reason
    traceback.print_exc()
    sys.stderr.flush()
    try:
        dp.lifecycle.record_exit(EXIT_ABORTED, f"aborted: {type(error).__name__}: {error}")
    except OSError:  # no record, but the job must still end now
        pass
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(EXIT_ABORTED)
    return EXIT_ABORTED, "aborted"  # not reached: Abort ends the job
