"""``FTWorld``: the one door for cross-replica communication over Open MPI ULFM.

It owns the world communicator (all live ranks, spares included), the coordinate communicator (my local rank
across the *active* replicas), the world epoch (+1 per repair) and the failure watcher.  Collectives either
complete or raise :class:`FailureDetected`; after that the caller runs :meth:`repair` on every survivor.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from .collectives import Collectives, CommName
from .detector import DETECTOR_HEARTBEAT_TIMEOUT_S
from .errors import FailureDetected, ReplicaEvicted
from .events import RepairEvent
from .hang import HangMonitor, PeerView
from .hang_policy import HangPolicy, MainThreadProgress
from .layout import ReplicaAssignment, ReplicaLayout, split_coord_comm
from .repair import run_repair
from .waiting import WATCHER_POLL_S, resolve_mpi_wait
from .watcher import FailureWatcher

STARTUP_AGREE_ATTEMPTS = 3
LogFn = Callable[[str], None]


def node_id() -> str:
    """Which node this process runs on, for the kill of a hung rank: the host name and the pid of the Open MPI
    daemon that started it (one per node; on a test bed of several "nodes" on one machine, one per fake node)."""
    return f"{socket.gethostname()}/{os.getppid()}"


def _stderr_log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class WorldOptions:
    """How an FT world behaves (each field is described under :class:`FTWorld`)."""

    watch: bool = True
    fail_fast: bool = True
    log: LogFn | None = None
    notice_timeout_s: float = DETECTOR_HEARTBEAT_TIMEOUT_S
    recycle: bool = False
    mpi_wait: str = "auto"


class FTWorld:
    """Replica-granular fault-tolerant world.

    Args:
        comm: the communicator to build on (duplicated; the original is never used for traffic).
        ranks_per_replica: ranks of one replica (TP x PP, or the FSDP shard size of an HSDP replica).
        active_replicas: replicas that take part in the data-parallel reduction; the others are spares.
            Default: all.
        on_evict: called (in the watcher thread) just before the watcher ends an evicted process with exit code 0.
        on_startup_failure: called (in the watcher thread) with the dead ranks when a rank dies before
            :meth:`complete_startup`; nothing can be recovered then (the caller ends the job). None: no special case.
        options (:class:`WorldOptions`):
        watch: start the early-notice watcher thread (needed to release a rank stuck in intra-replica torch
            traffic when a replica-mate dies).
        fail_fast: a collective refuses to start (revokes + raises) once the watcher knows of a death among the
            live ranks, instead of running into it.
        log: where one-line messages go (default: stderr, flushed).
        notice_timeout_s: the longest a death may take to be noticed (the launcher's failure-detector timeout).
        recycle: the alive ranks of a failed replica stay in the world as the *pool* (no replica) instead of
            leaving; :meth:`form_replica` makes a new replica of them (``fault_tolerance.recycle``).
        mpi_wait: this rank's wish for how collectives wait for the peers (``fault_tolerance.mpi_wait``): ``block``
            inside MPI, ``poll`` asleep, ``auto`` poll on an oversubscribed node (:mod:`.waiting`). The world polls
            if any rank wishes so (:attr:`mpi_wait` is the mode agreed at start-up).
    """

    def __init__(
        self,
        comm: MPI.Comm = MPI.COMM_WORLD,
        ranks_per_replica: int = 1,
        active_replicas: Sequence[int] | None = None,
        *,
        options: WorldOptions = WorldOptions(),
        on_evict: Callable[[ReplicaEvicted], None] | None = None,
        on_startup_failure: Callable[[frozenset[int]], None] | None = None,
    ) -> None:
        self.layout = ReplicaLayout(comm.Get_size(), ranks_per_replica)  # the original grid (the hang monitor's)
        self.assignment = ReplicaAssignment(self.layout)  # who holds which replica and coordinate now
        self.recycle = options.recycle
        self.rank: int = comm.Get_rank()
        self.epoch: int = 0
        self.events: list[RepairEvent] = []
        self.evicted: bool = False
        self.had_failure: bool = False
        self.fail_fast = options.fail_fast
        self._log = options.log or _stderr_log
        self._on_evict = on_evict
        self._on_startup_failure = on_startup_failure
        self.notice_timeout_s = options.notice_timeout_s
        self.starting = on_startup_failure is not None
        self.progress = MainThreadProgress()
        self.collectives = Collectives(self)  # every cross-replica operation, under its guard (held, one per world)
        self.hang_monitor: HangMonitor | None = None

        self.world_comm: MPI.Comm | None = comm.Dup()
        self.world_comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._original_group = self.world_comm.Get_group()
        self.live_ranks: list[int] = list(range(self.layout.world_size))
        self._live_set = frozenset(self.live_ranks)
        active = range(self.layout.n_replicas) if active_replicas is None else active_replicas
        self.active_replicas: list[int] = self._check_replicas(active)
        self.coord_comm: MPI.Comm | None = split_coord_comm(
            self.world_comm, self.layout, self.rank, self.active_replicas
        )
        self.hosts, self.pids, self.mpi_wait = self._placement(resolve_mpi_wait(options.mpi_wait))

        self._notice_times: dict[int, float] = {}
        # Test seam: called inside the repair protocol as hook(point, attempt); used to SIGKILL a rank mid-repair.
        self.repair_hook: Callable[[str, int], None] | None = None
        self.before_repair: list[Callable[[], None]] = []  # run by every survivor as it enters a repair
        self.watcher: FailureWatcher | None = None
        if options.watch:
            self.watcher = FailureWatcher(comm, self._on_notice, WATCHER_POLL_S[self.mpi_wait]).start()

    # --------------------------------------------------------------- start-up
    def _placement(self, my_wait: str) -> tuple[list[str], list[int], str]:
        """Who runs where (every rank's node and pid: a hung rank can only be killed by a process on its host), and
        how every rank waits: ``poll`` if any rank's node wants it. The choice must be the same world-wide (in
        ``poll`` mode every collective is preceded by an ``Ibarrier``), and nodes may differ in cores per rank."""
        placement = self.world_comm.allgather((node_id(), os.getpid(), my_wait))
        mode = "poll" if any(wait == "poll" for _, _, wait in placement) else "block"
        return [host for host, _, _ in placement], [pid for _, pid, _ in placement], mode

    def complete_startup(self) -> None:
        """Collective: every rank is ready to train. Raises FailureDetected if a rank died during start-up.

        Until this returns, a death notice goes to ``on_startup_failure`` instead of a repair.
        """
        for attempt in range(1, STARTUP_AGREE_ATTEMPTS + 1):
            try:
                self.agree(True)
                break
            except FailureDetected as e:
                # Seen here: the Agree came back, uniformly, without the healthy bit although nobody was repairing.
                # Every rank got the same value, so every rank is here: if no death is noticed, all retry alike.
                if e.error_class != -1 or attempt == STARTUP_AGREE_ATTEMPTS or self.wait_for_failure_notice():
                    raise
                self.collectives.commit_agree_failed, self.collectives.cause = False, None
                self._log(f"[ft rank {self.rank}] start-up agreement came back without the healthy bit and no rank "
                          f"failed: agreeing again ({attempt})")
        self.starting = False

    def start_hang_monitor(
        self, policy: HangPolicy, on_hang: Callable[[dict], None], end_job: Callable[[str], None]
    ) -> HangMonitor:
        """Collective (duplicates the world): heartbeats to the peers, SIGKILL of frozen or stuck ranks."""
        comm = self.collectives.comm("world")
        with self.collectives.guard("start_hang_monitor", comm):
            peers = PeerView(self.layout, lambda: self.assignment, self.hosts, self.pids,
                             live_ranks=lambda: self.live_ranks,
                             known_dead=lambda: self.watcher.dead_ranks if self.watcher is not None else frozenset())
            monitor = HangMonitor(comm, peers, progress=self.progress, policy=policy, on_hang=on_hang,
                                  end_job=end_job)
        self.hang_monitor = monitor.start()
        return monitor

    def wait_for_failure_notice(self, extra_s: float = 0.0) -> bool:
        """Wait up to ``notice_timeout_s + extra_s`` (+2 s) for the watcher to report a death; True if one came.

        ``extra_s``: time for the hang monitor to turn a hung peer into a dead one."""
        deadline = time.monotonic() + self.notice_timeout_s + extra_s + 2.0
        self.progress.waiting("failure notice")
        try:
            while not self.failure_pending():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
            return True
        finally:
            self.progress.resume()

    # ------------------------------------------------------------ collectives (held: :mod:`.collectives`)
    def allreduce_sum_(self, buf: np.ndarray, comm: CommName = "coord") -> np.ndarray:
        return self.collectives.allreduce_sum_(buf, comm)

    def bcast_(self, buf: np.ndarray, root_replica: int, comm: CommName = "coord") -> np.ndarray:
        return self.collectives.bcast_(buf, root_replica, comm)

    def allgather_coord(self, obj: Any) -> list:
        return self.collectives.allgather_coord(obj)

    def allgather_object(self, obj: Any) -> list:
        return self.collectives.allgather_object(obj)

    def exchange_bytes(self, sends: dict[int, bytes], recv_from: int | None, recv_size: int = 0) -> bytearray | None:
        return self.collectives.exchange_bytes(sends, recv_from, recv_size)

    def barrier(self) -> None:
        self.collectives.barrier()

    def agree(self, flag: bool = True, epoch: int | None = None) -> bool:
        return self.collectives.agree(flag, epoch)

    def wait_outside_mpi(self, op: str, is_done: Callable[[], bool], abandon: Callable[[], None],
                         comm: CommName = "coord") -> None:
        self.collectives.wait_outside_mpi(op, is_done, abandon, comm)

    # ------------------------------------------------------------------ views
    @property
    def replica(self) -> int | None:
        """My replica now (None: I am in the pool of recycled ranks)."""
        return self.assignment.replica_of(self.rank)

    @property
    def local_rank(self) -> int | None:
        return self.assignment.local_rank_of(self.rank)

    @property
    def pooled(self) -> bool:
        return not self.evicted and self.replica is None

    @property
    def pool_ranks(self) -> list[int]:
        return [r for r in self.live_ranks if self.assignment.replica_of(r) is None]

    @property
    def live_replicas(self) -> list[int]:
        return self.assignment.replicas_of(self.live_ranks)

    @property
    def spare_replicas(self) -> list[int]:
        return [r for r in self.live_replicas if r not in set(self.active_replicas)]

    @property
    def is_active(self) -> bool:
        return not self.evicted and self.replica in set(self.active_replicas)

    def failure_pending(self) -> bool:
        """True once the watcher knows of a dead rank that is still a member of the current world."""
        if self.watcher is None:
            return False
        return bool(self.watcher.dead_ranks & self._live_set)

    # ------------------------------------------------------------- membership
    def set_active_replicas(self, replicas: Sequence[int]) -> None:
        """Collective over the world: rebuild ``coord_comm`` for a new active set (e.g. activating a spare)."""
        active = self._check_replicas(replicas)
        c = self.collectives.comm("world")
        with self.collectives.guard("set_active_replicas", c):
            new_coord = split_coord_comm(c, self.assignment, self.rank, active)
        old, self.coord_comm, self.active_replicas = self.coord_comm, new_coord, active
        if old is not None:
            try:
                old.Free()
            except MPI.Exception:
                pass

    def form_replica(self, replica: int, ranks: Sequence[int]) -> MPI.Comm | None:
        """Collective over the world: pool ranks ``ranks`` become replica ``replica`` (``ranks[i]`` at coordinate
        ``i``); returns, on its members, a communicator over them in coordinate order (for the torch rendezvous).
        Every rank applies the same assignment; the caller then widens the reduction (:meth:`set_active_replicas`)."""
        self.assignment.assign(replica, ranks)
        c = self.collectives.comm("world")
        member = self.rank in set(ranks)
        with self.collectives.guard("form_replica", c):
            comm = c.Split(replica if member else MPI.UNDEFINED, self.assignment.local_rank_of(self.rank) or 0)
        if comm == MPI.COMM_NULL:
            return None
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        return comm

    # ----------------------------------------------------------------- repair
    def repair_if_pending(self) -> RepairEvent | None:
        """The main thread after an error in intra-replica torch traffic: repair, unless the watcher already did
        (a dead rank of the world that is no longer in it)."""
        with self.collectives.op_lock:
            if not self.failure_pending():
                return None
            self.progress.waiting("repair")
            try:
                return self._repair_locked(by_watcher=False)
            finally:
                self.progress.resume()

    def repair(self, since_epoch: int | None = None) -> RepairEvent:
        """Collective among ALL survivors of the world (active, spares, and alive ranks of failed replicas).

        Returns the event on a survivor; raises :class:`ReplicaEvicted` on a rank whose replica lost a member.
        After a return, the caller decides the active set (default: previously active minus failed).
        ``since_epoch``: the epoch of the :class:`FailureDetected` that the caller repairs. When the watcher took
        the operation lock first and repaired that failure (a replica-mate's death, recycling: this rank stays),
        its event is returned: a second repair here would be one that no peer joins.
        """
        with self.collectives.op_lock:
            if since_epoch is not None and self.epoch > since_epoch and not self.failure_pending():
                return self.events[-1]
            self.progress.waiting("repair")
            try:
                return self._repair_locked(by_watcher=False)
            finally:
                self.progress.resume()

    def _repair_locked(self, by_watcher: bool) -> RepairEvent:
        if self.evicted:
            raise RuntimeError("this rank was already evicted; it must exit")
        assert self.world_comm is not None
        for hook in self.before_repair:  # e.g. the torch data plane closes its group: no peer stays blocked in it
            hook()
        start = time.monotonic()
        self.had_failure = True
        entry_agree, self.collectives.commit_agree_failed = not self.collectives.commit_agree_failed, False
        outcome = run_repair(
            self.world_comm,
            self.coord_comm,
            self.live_ranks,
            self._original_group,
            self.assignment,
            self.rank,
            self.active_replicas,
            self.epoch + 1,
            entry_agree=entry_agree,
            hook=self.repair_hook,
            recycle=self.recycle,
        )
        event = outcome.event
        self.assignment.to_pool(event.pooled)
        event.by_watcher = by_watcher
        event.extra["cause"] = self.collectives.cause or {
            "op": "watcher" if by_watcher else "caller", "error_class": -1,
            "detail": "failure notice" if by_watcher else "repair requested"}
        self.collectives.cause = None
        event.wall_time = time.time()
        event.detect_ms = self._detect_ms(start, event.failed_ranks)
        self.epoch = event.epoch
        self.events.append(event)
        with self.collectives.state_lock:
            self.collectives.error_time = None
        if outcome.evicted:
            self.evicted = True
            self.world_comm = self.coord_comm = None
            self.live_ranks, self._live_set = [], frozenset()
            raise ReplicaEvicted(event, self.rank, self.replica)
        self.world_comm, self.coord_comm = outcome.world_comm, outcome.coord_comm
        self.live_ranks, self._live_set = outcome.live_ranks, frozenset(outcome.live_ranks)
        self.active_replicas = event.active_replicas
        if not event.failed_ranks:
            self._log(f"[ft rank {self.rank}] repair to epoch {event.epoch} found no dead rank; "
                      f"cause: {event.extra['cause']}")
        self._log(
            f"[ft rank {self.rank}] repaired to epoch {event.epoch}: failed ranks {event.failed_ranks} "
            f"(replicas {event.failed_replicas}), live replicas {event.live_replicas}, "
            f"detect+repair {event.detect_to_repaired_ms:.1f} ms"
        )
        return event

    def _detect_ms(self, start: float, failed: Sequence[int]) -> float:
        with self.collectives.state_lock:
            notices = [self._notice_times[r] for r in failed if r in self._notice_times]
            if self.collectives.error_time is not None:
                notices.append(self.collectives.error_time)
        first = min((t for t in notices if t <= start), default=None)
        return 0.0 if first is None else (start - first) * 1e3

    # ---------------------------------------------------------------- watcher
    def _on_notice(self, dead: frozenset[int], notice: float) -> None:
        """Watcher thread: record the notice; if my own replica lost a member, leave through the repair."""
        with self.collectives.state_lock:
            for r in dead:
                self._notice_times.setdefault(r, notice)
        mine = self.replica
        own = sorted(r for r in dead if r in self._live_set and mine is not None
                     and self.assignment.replica_of(r) == mine)
        if dead & self._live_set:
            self.had_failure = True
            if self.starting and self._on_startup_failure is not None:
                self._on_startup_failure(frozenset(dead & self._live_set))
                return
        if not own or self.evicted:
            return
        # The main thread may be blocked forever in intra-replica torch traffic: act for it.  If the main thread
        # is inside a collective, that ends soon (peers revoke or complete it) and then either its own repair
        # evicts this rank or it goes back to torch: we take over as soon as it holds no MPI operation.
        while not self.collectives.op_lock.acquire(timeout=0.01):
            if self.evicted:
                return
        try:
            if self.evicted or not (self.watcher.dead_ranks & self._live_set):  # the main thread repaired
                return
            try:
                self._repair_locked(by_watcher=True)  # recycle: I am in the pool now; the main thread follows
            except ReplicaEvicted as exc:
                self._exit_evicted(exc)
            except Exception as exc:  # noqa: BLE001 - we are leaving anyway; say why
                self._log(f"[ft rank {self.rank}] watcher repair failed while leaving: {exc!r}")
                self._exit_now(0)
        finally:
            self.collectives.op_lock.release()

    def _exit_evicted(self, exc: ReplicaEvicted) -> None:
        self._log(f"[ft rank {self.rank}] EVICTED by watcher: {exc}; exiting 0")
        if self._on_evict is not None:
            try:
                self._on_evict(exc)
            except Exception as cb_exc:  # noqa: BLE001
                self._log(f"[ft rank {self.rank}] on_evict callback failed: {cb_exc!r}")
        self._exit_now(0)

    def leave(self) -> None:
        """Leave the world without a word (a rank of the pool that cannot follow the others any more): the
        others see it as a death of a pool rank. :meth:`shutdown` then exits without the closing barrier."""
        self.evicted = True
        self.world_comm = self.coord_comm = None
        self.live_ranks, self._live_set = [], frozenset()

    # --------------------------------------------------------------- shutdown
    def shutdown(self, had_failure: bool | None = None, code: int = 0) -> None:
        """End this rank.  After any failure, never MPI_Finalize (it can hang): barrier, flush, ``os._exit``.

        Without failures, frees our communicators and finalizes MPI normally (and returns).
        """
        had = self.had_failure if had_failure is None else had_failure
        self.progress.waiting("shutdown")
        if self.watcher is not None:
            self.watcher.stop()  # before the barrier: it must never repair concurrently with it
        if had or self.evicted:
            if self.world_comm is not None:  # the hang monitor still runs: a rank frozen now cannot block this
                try:
                    self.collectives.barrier_on(self.world_comm)
                except MPI.Exception:
                    pass
            self._stop_hang_monitor()
            self._exit_now(code)
        self._stop_hang_monitor()
        for c in (self.coord_comm, self.world_comm):
            if c is not None:
                try:
                    c.Free()
                except MPI.Exception:
                    pass
        self.coord_comm = self.world_comm = None
        if not MPI.Is_finalized():
            MPI.Finalize()

    def _stop_hang_monitor(self) -> None:
        if self.hang_monitor is not None:
            self.hang_monitor.stop()  # says goodbye: a rank that ends is not taken for a frozen one

    @staticmethod
    def _exit_now(code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)

    # ---------------------------------------------------------------- helpers
    def _check_replicas(self, replicas: Sequence[int] | range) -> list[int]:
        out = sorted(set(int(r) for r in replicas))
        live = set(self.assignment.replicas_of(self.live_ranks))
        bad = [r for r in out if r not in live]
        if bad:
            raise ValueError(f"replicas {bad} are not live (live: {sorted(live)})")
        return out
