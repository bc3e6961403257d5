"""The pure side of hang detection: who watches whom, what the main thread is doing, how long is too long.

No MPI here (see :mod:`.hang` for the monitor thread), so these are unit-tested without processes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..run.phases import SLOW_IO_PHASES, Phase
from .layout import ReplicaAssignment, ReplicaLayout

HEARTBEAT_PERIOD_S = 1.0
# how often the monitor thread wakes: each wake takes the GIL from the main thread, which on an oversubscribed
# host costs a scheduler slice; at 0.1 s one breakdown run put it at ~7% of the step, 8 ranks on 2 cores (overhead.py
# --breakdown), and the timeouts it checks are 30 s and more
CHECK_INTERVAL_S = 0.5
KILL_CONFIRM_S = 10.0
HANG_FLOOR_S = 30.0
HANG_STEP_FACTOR = 5.0
FIRST_STEP_TIMEOUT_S = 60.0
# the hang bounds stay this far under collective_timeout_s: the kill, its confirmation and the mates' failure notice
CEILING_MARGIN_S = KILL_CONFIRM_S + 5.0
# the monitor's own loop running this late means its process (or its whole node) was paused: what it did not hear
# meanwhile says nothing about its peers (they may have been paused with it, or their beats are still in transit)
OWN_PAUSE_S = 2 * HEARTBEAT_PERIOD_S

BUSY, WAITING = "busy", "waiting"


class MainThreadProgress:
    """What the main thread is doing, written by it, read by the monitor (plain attribute writes: no lock).

    ``busy(where)``: computing or in intra-replica work at ``where`` (each call is progress); ``waiting(op)``: inside
    a cross-replica MPI operation, where a stall is somebody else's.
    """

    def __init__(self) -> None:
        self.state = BUSY
        self.where: str = Phase.STARTING
        self.step = 0
        self.since = time.monotonic()
        self._busy_where = self.where

    def busy(self, where: str, step: int) -> None:
        self.where = self._busy_where = where
        self.step, self.since, self.state = step, time.monotonic(), BUSY

    def waiting(self, op: str) -> None:
        self.where, self.since, self.state = op, time.monotonic(), WAITING

    def resume(self) -> None:
        """Back from a cross-replica wait to the busy phase it interrupted (which made progress)."""
        self.where, self.since, self.state = self._busy_where, time.monotonic(), BUSY

    @contextmanager
    def slow_io(self, what: str) -> Iterator[None]:
        """Inside: busy with slow I/O named ``what`` (judged by the I/O allowance); after: back to the phase it
        interrupted, which made progress."""
        where, step = self._busy_where, self.step
        self.busy(what, step)
        try:
            yield
        finally:
            self.busy(where, step)

    def describe(self) -> str:
        return f"step {self.step} {self.where}"


@dataclass
class HangPolicy:
    """How long is too long (seconds).

    ``ceiling_s``: what every bound stays under, so that the monitor ends a frozen rank before its replica-mates'
    own torch collectives time out (``collective_timeout_s``, which would end them with an error instead of a
    repair): ``collective_timeout_s - CEILING_MARGIN_S``. The timeout derived from the step times, a fixed
    ``hang_timeout_s`` and a silent peer's limit all stay under it. Only a peer silent inside a checkpoint save
    keeps the I/O allowance: serialising a large shard can hold its interpreter (no heartbeats) for longer, and its
    mates are its fellow writers."""

    fixed_timeout_s: float | None = None
    io_allowance_s: float = 600.0
    longest_step_s: float = 0.0
    ceiling_s: float | None = None

    @classmethod
    def of(cls, ft: Any) -> "HangPolicy":
        """From the ``fault_tolerance`` section."""
        return cls(fixed_timeout_s=ft.hang_timeout_s, io_allowance_s=ft.startup_timeout_s,
                   ceiling_s=max(HEARTBEAT_PERIOD_S * 3, ft.collective_timeout_s - CEILING_MARGIN_S))

    def record_step(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, seconds)

    @property
    def timeout_s(self) -> float:
        if self.fixed_timeout_s is not None:
            timeout = self.fixed_timeout_s
        elif self.longest_step_s <= 0:
            timeout = FIRST_STEP_TIMEOUT_S
        else:
            timeout = max(HANG_FLOOR_S, HANG_STEP_FACTOR * self.longest_step_s)
        return timeout if self.ceiling_s is None else min(timeout, self.ceiling_s)

    def busy_limit_s(self, where: str) -> float:
        timeout = self.timeout_s
        return max(timeout, self.io_allowance_s) if self.is_slow_io(where) else timeout

    def silence_limit_s(self, where: str) -> float:
        """How long a peer that last said it was at ``where`` may send nothing at all. A rank doing slow I/O (a
        snapshot, starting wandb) still sends heartbeats from its monitor thread: its silence means it is frozen,
        and the plain timeout applies, as anywhere but in a checkpoint save (seen: a rank frozen right after a step,
        its last word "snapshot", got the 600-s allowance, and its mates' torch timeout ended the job first; then,
        capped at the ceiling, 105 s where the hang timeout was 5 s: a heartbeat sent during the snapshot of the
        step before the freeze is all it takes)."""
        if where.startswith(Phase.CHECKPOINT.value):
            return self.busy_limit_s(where)
        return self.timeout_s

    @staticmethod
    def is_slow_io(where: str) -> bool:
        """Phases that may take up to the I/O allowance: a checkpoint save, starting wandb."""
        return where.startswith(Phase.CHECKPOINT.value) or where in SLOW_IO_PHASES

    @property
    def stall_limit_s(self) -> float:
        timeout = self.timeout_s
        return max(4 * timeout, timeout + self.io_allowance_s)


@dataclass
class HangMargin:
    """The closest any check came to firing in this run (seconds): the margin to the timeout."""

    max_silence_s: float = 0.0
    max_silence_of: str = ""  # which peer, at which of my steps (to explain a small margin)
    max_busy_s: float = 0.0
    max_waiting_s: float = 0.0
    checks: int = 0
    own_pauses: int = 0  # times this monitor itself was not running for over OWN_PAUSE_S (its silences excused)
    max_own_pause_s: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def peers_of(layout: "ReplicaLayout | ReplicaAssignment", rank: int) -> list[int]:
    """The ranks ``rank`` sends heartbeats to and watches: its replica-mates and its coordinate in other replicas.

    On the original grid (a :class:`ReplicaLayout`) or on the current assignment (recycled replicas have other
    mates and coordinates; a rank in the pool has no replica, hence no peers there)."""
    replica, local = layout.replica_of(rank), layout.local_rank_of(rank)
    if replica is None:
        return []
    mates = layout.ranks_of(replica)
    coords = [c for c, r in ((layout.world_rank(r, local), r) for r in layout.replica_ids)
              if layout.replica_of(c) == r]  # a broken replica's old ranks are not its coordinate any more
    return sorted(set(mates + coords) - {rank})


def excuse_own_pause(times: Sequence[float], paused_s: float, now: float) -> list[float]:
    """Times a watcher measures silence (or a kill's confirmation) from, moved forward by the ``paused_s`` it was
    not running itself, never past ``now``: after a pause only the time it was listening counts. Without this, a
    node that a hypervisor or the kernel stalled for longer than the hang timeout wakes up, hears nobody yet, and
    kills healthy peers on other nodes."""
    return [min(now, t + paused_s) for t in times]


def runs_again(heard_at: float, ordered_at: float, now: float) -> bool:
    """A peer whose kill was ordered at ``ordered_at`` runs now: heard after the order, and within two heartbeat
    periods of ``now`` (heard once and silent again is frozen again)."""
    return ordered_at < heard_at and now - heard_at <= 2 * HEARTBEAT_PERIOD_S


def kill_order_done(target_gone: bool, mates_at_order: Sequence[int], gone: Callable[[int], bool],
                    heard_at: float, ordered_at: float, now: float) -> bool:
    """Whether a kill order needs no more waiting: its target is gone, or it runs again (heard after the order, and
    within two heartbeat periods of ``now``) and one of the replica-mates it had when the order was given is gone, so
    the repair takes its replica out anyway.

    The second case is the replica as the unit of failure. Seen on CI: a whole node was paused, its two ranks were
    reported silent by the other node's ranks, each kill was asked of the other rank of the paused node, and when the
    node woke one of them killed its mate first; the survivor, running and beating again in the pool, was taken for
    a kill that failed, and the job ended. A target silent now is never excused, even if it was heard after the order:
    a frozen rank would hang the repair."""
    return target_gone or (runs_again(heard_at, ordered_at, now) and any(gone(m) for m in mates_at_order))
