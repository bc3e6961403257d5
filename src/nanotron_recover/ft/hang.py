"""Hang detection: turn a frozen or stuck rank into a crash, which ULFM and the in-step recovery already handle.

MPI has no timeout, PRRTE's heartbeat watches daemons, not ranks, and a torch timeout fires only while a torch
collective is pending: a silent process would stall the whole job for ever. The design rests on four facts:

* a frozen process (SIGSTOP, a hung node) runs none of its threads: it stops sending heartbeats, and its peers
  notice the silence;
* a rank stuck in a kernel or in an intra-replica collective still runs its threads: its own monitor sees that
  the main thread has made no progress while *busy* (outside a cross-replica wait) and ends its own process;
* the replica is the unit of failure: killing any one rank of a hung replica removes that replica (the repair
  evicts the others), so the culprit need not be found exactly;
* a pid can only be killed on its own host: hosts and pids are exchanged when the world is built, and the kill of
  a rank on another host is asked of the live ranks on that host.

Every rank runs one :class:`HangMonitor` thread with its own duplicate of the world communicator. Every
``HEARTBEAT_PERIOD_S`` it sends a heartbeat, point to point, to its *peers*: its replica-mates and the ranks of its
coordinate in the other replicas, so each rank is watched from inside and from outside its replica, and the
traffic per rank grows with ``ranks_per_replica + replicas``, not with the world. The same pending
``ANY_SOURCE`` receive takes heartbeats, kill requests and goodbyes (a rank that stops cleanly says so).

Decisions, each reported through ``on_hang`` (the ``hang_detected`` event) before anything is killed:

* a peer silent for ``timeout`` -> SIGKILL it. Of a peer's watchers the lowest live rank acts first; the others
  act one heartbeat period later each, if the peer is still not known dead (a watcher may be frozen too);
* my own main thread busy with no progress for ``timeout`` -> SIGKILL myself (the record carries every thread's
  Python stack, so that the cause of the stall can be read afterwards), unless a watched peer is doing slow I/O
  (then the I/O allowance applies), or unless a watched peer looks frozen:
  then my stall is its doing and the silence path ends it (I may be the only live rank on its node, who must do
  the kill), and I end myself only ``timeout + KILL_CONFIRM_S`` later if that failed;
* a kill that did not lead to a death notice within ``KILL_CONFIRM_S`` (no live rank on the frozen host; a target
  on my own host counts as dead once the process table says so, however late the notice; a target that runs again
  and whose replica lost a rank meanwhile needs no death: the repair takes its replica out), or my
  main thread waiting in cross-replica MPI for ``stall_limit`` with nobody found hung -> ``end_job`` (restart).

The timeout (:class:`HangPolicy`) is fixed (``fault_tolerance.hang_timeout_s``) or derived from the measured step
time: ``max(HANG_FLOOR_S, HANG_STEP_FACTOR x the longest step so far)``, ``FIRST_STEP_TIMEOUT_S`` before a step
was measured. A checkpoint save may take up to ``io_allowance_s`` (``startup_timeout_s``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..run.phases import HEARTBEAT_ORDER, Phase
from ..run.procfs import process_is_gone
from .hang_policy import (
    BUSY,
    CHECK_INTERVAL_S,
    HEARTBEAT_PERIOD_S,
    KILL_CONFIRM_S,
    OWN_PAUSE_S,
    HangMargin,
    HangPolicy,
    MainThreadProgress,
    excuse_own_pause,
    kill_order_done,
    peers_of,
    runs_again,
)
from .layout import ReplicaAssignment, ReplicaLayout
from .watcher import cancel_quietly

HEARTBEAT_TAG = 0x4EA7
MAX_PENDING_SENDS = 4096
BYE_FLUSH_S = 0.5
# message kinds (int64[4]: kind, sender, a, b)
_HEARTBEAT, _KILL, _BYE = 1, 2, 3


@dataclass
class _Peer:
    last_heard: float
    last_step: int = 0  # where the peer's main thread was at its last heartbeat
    last_where: str = Phase.STARTING.value
    bye: bool = False
    reported: bool = False


_HEARTBEAT_CODE = {phase.value: i for i, phase in enumerate(HEARTBEAT_ORDER)}


def _where_code(where: str) -> int:
    """What a heartbeat says about the sender's main thread: an index into :data:`HEARTBEAT_ORDER`."""
    if where in _HEARTBEAT_CODE:
        return _HEARTBEAT_CODE[where]
    if "(" in where or where in ("agree", "barrier"):  # a cross-replica MPI operation, e.g. allreduce(coord)
        return _HEARTBEAT_CODE[Phase.WAITING]
    return _HEARTBEAT_CODE[Phase.OTHER]


def thread_stacks() -> str:
    """Every thread's Python stack, the main thread first: what a rank was doing when it was found stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    return "\n".join(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in frames)


@dataclass(frozen=True)
class PeerView:
    """What the monitor reads of the FT world: the replica grid, who holds which replica now (called each round:
    recycling forms replicas of other ranks, and a rank watches its peers on the grid and on the current
    assignment; None: the grid only), every original rank's host and pid (exchanged when the world was built), the
    live original ranks and the ranks already known dead (each called each round: the FT world's and the failure
    watcher's views)."""

    layout: ReplicaLayout
    assignment: Callable[[], ReplicaAssignment] | None
    hosts: Sequence[str]
    pids: Sequence[int]
    live_ranks: Callable[[], Sequence[int]]
    known_dead: Callable[[], frozenset[int]]


@dataclass
class _KillOrder:
    target: int
    at: float
    mates: tuple[int, ...] = ()  # the target's live replica-mates when the order was given
    confirmed: bool = False


class HangMonitor:
    """One thread per rank: heartbeats out, silence and stalls in; see the module docstring.

    Args:
        comm: the original world communicator (duplicated here; collective over it).
        peers: what it reads of the FT world (:class:`PeerView`).
        progress: the main thread's state.
        policy: the timeouts.
        on_hang: called with a ``hang_detected`` record before a kill (or before ``end_job``).
        end_job: ends the whole job (restart outcome); called with a reason.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        peers: PeerView,
        progress: MainThreadProgress,
        policy: HangPolicy,
        on_hang: Callable[[dict], None],
        end_job: Callable[[str], None],
    ) -> None:
        self._comm = comm.Dup()
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._group = self._comm.Get_group()
        self.rank = self._comm.Get_rank()
        self.layout = peers.layout
        self.hosts, self.pids = list(peers.hosts), list(peers.pids)
        self._live_ranks, self._known_dead = peers.live_ranks, peers.known_dead
        self.progress, self.policy = progress, policy
        self._on_hang, self._end_job = on_hang, end_job
        self.margin = HangMargin()
        self._assignment = peers.assignment
        self._peers: dict[int, _Peer] = {}
        self._dead: set[int] = set()
        self._kills: list[_KillOrder] = []
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []
        self._inbox = np.zeros(4, dtype=np.int64)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-monitor", daemon=True)
        self._ended = False
        self._daemon_pid = os.getppid()  # the rank's Open MPI daemon: if it goes, the job is gone

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "HangMonitor":
        self._watch_current_peers(time.monotonic(), joined=False)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and tell the peers (a goodbye), so that a rank that ends early is not taken for frozen."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self._send_to(self._recipients(), _BYE, 0, 0)
        deadline = time.monotonic() + BYE_FLUSH_S  # MPI_Finalize or an exit may follow: let the goodbyes leave
        while self._pending and time.monotonic() < deadline:
            self._pending = [(r, buf) for r, buf in self._pending if not _done(r)]
            time.sleep(0.01)

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        req = self._post()
        next_beat, last_where, errors = 0.0, (-1, -1), 0
        previous = time.monotonic()
        while not self._stop.is_set():
            req = self._drain(req)
            now = time.monotonic()
            if now - previous > OWN_PAUSE_S:
                self._excuse_own_pause(now - previous - CHECK_INTERVAL_S, now)
            previous = now
            progress = self.progress
            where = (progress.step, _where_code(progress.where))
            if now >= next_beat or where != last_where:  # a beat, or news of where the main thread is
                self._send_to(self._recipients(), _HEARTBEAT, *where)
                next_beat, last_where = now + HEARTBEAT_PERIOD_S, where
            try:
                self._check(now)
            except Exception as exc:  # noqa: BLE001 - a monitor bug must not take the rank down silently
                if not errors:
                    self._report({"reason": "monitor error", "detail": repr(exc)})
                errors += 1
            self._stop.wait(CHECK_INTERVAL_S)
        cancel_quietly(req)

    def _excuse_own_pause(self, paused_s: float, now: float) -> None:
        """I was not running for ``paused_s``: silences and kill confirmations count from when I listen again."""
        peers = list(self._peers.values())
        for peer, heard in zip(peers, excuse_own_pause([p.last_heard for p in peers], paused_s, now)):
            peer.last_heard = heard
        for order, at in zip(self._kills, excuse_own_pause([k.at for k in self._kills], paused_s, now)):
            order.at = at
        self.margin.own_pauses += 1
        self.margin.max_own_pause_s = max(self.margin.max_own_pause_s, paused_s)

    def _post(self) -> MPI.Request:
        return self._comm.Irecv([self._inbox, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG)

    def _drain(self, req: MPI.Request) -> MPI.Request:
        while True:
            try:
                if not req.Test():
                    return req
            except MPI.Exception:  # a death interrupted the ANY_SOURCE receive: learn who, listen again on a
                self._learn_failed()  # fresh request (re-testing the interrupted one kept failing: deaf for good)
                cancel_quietly(req)
                return self._post()
            kind, sender, a, b = (int(x) for x in self._inbox)
            self._handle(kind, sender, a, b)
            req = self._post()

    def _handle(self, kind: int, sender: int, a: int, b: int) -> None:
        peer = self._peers.get(sender)
        if kind == _HEARTBEAT and peer is not None:
            peer.last_heard, peer.last_step = time.monotonic(), a
            peer.last_where = HEARTBEAT_ORDER[b].value if 0 <= b < len(HEARTBEAT_ORDER) else "?"
        elif kind == _BYE and peer is not None:
            peer.bye = True
        elif kind == _KILL and self.hosts[a] == self.hosts[self.rank] and a != self.rank:
            self._kill_local(a)

    def _learn_failed(self) -> None:
        try:
            self._comm.Ack_failed()
            failed = self._comm.Get_failed()
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), self._group)
            failed.Free()
            self._dead.update(int(r) for r in ranks)
        except MPI.Exception:
            pass

    # ---------------------------------------------------------------- who
    def _peers_of(self, rank: int) -> list[int]:
        """``rank``'s peers on the grid and on the current assignment (the same rule on every rank: symmetric)."""
        current = peers_of(self._assignment(), rank) if self._assignment is not None else []
        return sorted(set(peers_of(self.layout, rank)) | set(current))

    def _watch_current_peers(self, now: float, joined: bool = True) -> None:
        """A new replica-mate or coordinate peer (a recycled replica was formed) is watched from now on. Until it is
        first heard it counts as building its replica (the I/O allowance, under the ceiling): a rank leaving the
        pool learns of the formation, and starts beating to its new peers, on its own schedule (seen: a pooled
        survivor judged by the 15-s step timeout from the moment its new peer began to watch it, never heard,
        killed as "silent" at "step 0 start-up", which broke the replica just formed)."""
        for rank in self._peers_of(self.rank):
            if rank not in self._peers:
                self._peers[rank] = _Peer(last_heard=now, last_where=Phase.REPLICA_BUILD.value if joined
                                          else Phase.STARTING.value)

    # ---------------------------------------------------------------- decisions
    def _check(self, now: float) -> None:
        if self._ended:
            return
        if os.getppid() != self._daemon_pid:  # orphaned: mpirun / prted was killed; nobody will collect our work
            self._give_up(f"rank {self.rank}: its MPI daemon (pid {self._daemon_pid}) is gone")
            return
        self.margin.checks += 1
        self._watch_current_peers(now)
        dead = self._dead | set(self._known_dead())
        live = set(self._live_ranks()) - dead
        for order in self._kills:
            if not order.confirmed and self._order_done(order, dead, live, now):
                order.confirmed = True
                peer = self._peers.get(order.target)
                if peer is not None and runs_again(peer.last_heard, order.at, now):
                    peer.reported = False  # it runs again (in the pool): watched again, killed if silent again
        self._check_peers(now, live)
        self._check_self(now, live)
        self._check_kills(now)

    def _check_peers(self, now: float, live: set[int]) -> None:
        for rank, peer in self._peers.items():
            if peer.bye or peer.reported or rank not in live:
                continue
            silence = now - peer.last_heard
            # under the ceiling, except for a peer that said it is saving a checkpoint (serialisation may hold its
            # interpreter): the io allowance
            limit = self.policy.silence_limit_s(peer.last_where)
            if silence > self.margin.max_silence_s:
                self.margin.max_silence_s = silence
                self.margin.max_silence_of = (f"rank {rank} (last heard at step {peer.last_step} {peer.last_where}), "
                                              f"me at step {self.progress.step} {self.progress.where}")
            if silence < limit:  # the common case: no need to work out whose turn a kill would be
                continue
            watchers = [w for w in self._peers_of(rank) if w in live]  # sorted
            turn = watchers.index(self.rank) if self.rank in watchers else len(watchers)
            if silence < limit + turn * HEARTBEAT_PERIOD_S:
                continue
            peer.reported = True
            helpers = self._helpers_for(rank)
            self._report({
                "reason": "silent", "rank": rank, "host": self.hosts[rank], "pid": self.pids[rank],
                "silent_s": round(silence, 3), "timeout_s": limit,
                "last_step": peer.last_step, "last_where": peer.last_where,
                "action": "kill" if helpers is None else f"ask ranks {helpers} on its node to kill it",
            })
            self._kill(rank, now, helpers, live)

    def _frozen_peers(self, now: float, live: set[int]) -> list[int]:
        """Watched peers that look frozen (no heartbeat for two periods)."""
        return [r for r, peer in self._peers.items()
                if r in live and not peer.bye and now - peer.last_heard > 2 * HEARTBEAT_PERIOD_S]

    def _frozen_peers_killed_by(self, now: float, live: set[int]) -> float | None:
        """When the silence path has ended every frozen watched peer at the latest (its silence limit, by its last
        watcher's turn, plus the kill's confirmation), or None if none looks frozen. The limit depends on what the
        peer last said: one that froze within a heartbeat of building its recycled replica last said
        "replica-build" and keeps the (capped) I/O allowance (seen on CI: a 45-s silence limit, while its new mate's
        own stall limit ran out after 26 s and it killed itself as stuck)."""
        frozen = self._frozen_peers(now, live)
        if not frozen:
            return None
        return max(self._peers[r].last_heard + self.policy.silence_limit_s(self._peers[r].last_where)
                   + len(self._peers_of(r)) * HEARTBEAT_PERIOD_S + KILL_CONFIRM_S for r in frozen)

    def _peer_in_slow_io(self, now: float, live: set[int]) -> str | None:
        """Where a live, recently heard watched peer is doing slow I/O, if one is (else None)."""
        return next((p.last_where for r, p in self._peers.items()
                     if r in live and not p.bye and now - p.last_heard <= 2 * HEARTBEAT_PERIOD_S
                     and self.policy.is_slow_io(p.last_where)), None)

    def _check_self(self, now: float, live: set[int]) -> None:
        progress = self.progress
        state, where, since, step = progress.state, progress.where, progress.since, progress.step
        idle = now - since
        if state == BUSY:
            self.margin.max_busy_s = max(self.margin.max_busy_s, idle)
            limit = self.policy.busy_limit_s(where)
            # A frozen peer explains my stall (I wait for it inside the replica): the silence path ends it, and I may
            # be the one who must kill it (the only live rank on its node). Only if that fails, end myself.
            if idle >= limit and (due := self._frozen_peers_killed_by(now, live)) is not None:
                limit = max(limit + self.policy.timeout_s + KILL_CONFIRM_S, due - since)
            # a peer doing slow I/O (a checkpoint save, a new logging rank starting wandb) explains it as well
            if idle >= limit and (io := self._peer_in_slow_io(now, live)) is not None:
                limit = max(limit, self.policy.busy_limit_s(io))
            if idle >= limit:
                self._report({"reason": "stuck", "rank": self.rank, "host": self.hosts[self.rank],
                              "pid": os.getpid(), "step": step, "where": where, "stuck_s": round(idle, 3),
                              "timeout_s": limit, "stacks": thread_stacks()})
                self._ended = True
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            self.margin.max_waiting_s = max(self.margin.max_waiting_s, idle)
            limit = self.policy.stall_limit_s
            if idle >= limit and not any(not k.confirmed for k in self._kills):
                self._give_up(f"rank {self.rank} waited {idle:.0f} s in {where} at step {step} "
                              f"(stall limit {limit:.0f} s) and no rank was found frozen or stuck")

    def _check_kills(self, now: float) -> None:
        for order in self._kills:
            if not order.confirmed and now - order.at > KILL_CONFIRM_S:
                self._give_up(f"rank {order.target} on host {self.hosts[order.target]} was found hung but is still "
                              f"alive {KILL_CONFIRM_S:g} s after its kill was ordered (no live rank on that host?)")
                return

    def _order_done(self, order: _KillOrder, dead: set[int], live: set[int], now: float) -> bool:
        def gone(rank: int) -> bool:
            return rank in dead or rank not in live

        peer = self._peers.get(order.target)
        return kill_order_done(gone(order.target) or self._gone_here(order), order.mates, gone,
                               peer.last_heard if peer is not None else order.at, order.at, now)

    def _gone_here(self, order: "_KillOrder") -> bool:
        """A target on my host is confirmed dead by the process table: Open MPI's death notice may come many
        seconds later on a loaded node (it was seen to take over ``KILL_CONFIRM_S`` on 2 busy cores), and a kill
        that worked is not a hang we cannot resolve. A target on another host is confirmed by the notice alone."""
        return self.hosts[order.target] == self.hosts[self.rank] and process_is_gone(self.pids[order.target])

    # ---------------------------------------------------------------- actions
    def _helpers_for(self, target: int) -> list[int] | None:
        """None if I can kill ``target`` myself (same node), else the live ranks on its node that can."""
        if self.hosts[target] == self.hosts[self.rank]:
            return None
        return [r for r in self._live_ranks() if self.hosts[r] == self.hosts[target] and r != target
                and r not in self._dead]

    def _kill(self, target: int, now: float, helpers: list[int] | None, live: set[int]) -> None:
        if helpers is None:
            self._kill_local(target)
        else:
            self._send_to(helpers, _KILL, target, 0)
        grid = self._assignment() if self._assignment is not None else self.layout
        replica = grid.replica_of(target)
        mates = () if replica is None else tuple(r for r in grid.ranks_of(replica) if r != target and r in live)
        self._kills.append(_KillOrder(target, now, mates))

    def _kill_local(self, target: int) -> None:
        try:
            os.kill(self.pids[target], signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        except OSError as exc:
            self._report({"reason": "kill failed", "rank": target, "detail": repr(exc)})

    def _give_up(self, reason: str) -> None:
        self._ended = True
        self._report({"reason": "unresolvable", "detail": reason})
        self._end_job(reason)

    def _report(self, record: dict) -> None:
        record = {"event": "hang_detected", "by_rank": self.rank, "wall_time": time.time(), **record}
        try:
            self._on_hang(record)
        except Exception:  # noqa: BLE001 - reporting must never stop the kill
            pass

    # ---------------------------------------------------------------- sending
    def _recipients(self) -> list[int]:
        live = set(self._live_ranks()) - self._dead
        return [p for p in list(self._peers) if p in live]

    def _send_to(self, ranks: Sequence[int], kind: int, a: int, b: int) -> None:
        self._pending = [(r, buf) for r, buf in self._pending if not _done(r)]
        if len(self._pending) > MAX_PENDING_SENDS:
            return
        for dest in ranks:
            buf = np.array([kind, self.rank, a, b], dtype=np.int64)
            try:
                self._pending.append((self._comm.Isend([buf, MPI.INT64_T], dest=dest, tag=HEARTBEAT_TAG), buf))
            except MPI.Exception:
                pass  # deaths are learnt from the failure notices only, never guessed from a failed send


def _done(req: MPI.Request) -> bool:
    try:
        return bool(req.Test())
    except MPI.Exception:
        return True
