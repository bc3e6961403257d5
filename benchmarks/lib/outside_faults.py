"""Faults sent from outside a running system, the same way to every system a benchmark compares.

A fault is a SIGKILL of one replica's process by pid (or a SIGSTOP, then a SIGCONT ``stop_s`` later: a frozen
process, as a paused VM or a stalled node freezes it), from the benchmark's own process (no cooperation from the
victim: no injection schedule, no marker), fired either when the system has committed a given step (the
one-fault experiment: "the same replica at the same step") or at a given time after the system's launch (the
Clockwork protocol: the same seeded times for every system). The victim is a fixed replica, or drawn: a number
``u`` in [0, 1) from the seed picks among the replicas live at that moment (sorted), so two systems see the same
draw even when different replicas are alive. Nothing here knows which system it drives: the caller passes
``progress`` (last committed step) and ``targets`` (live replica -> pid).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

KILL, STOP = "kill", "stop"


@dataclass
class Fault:
    """SIGKILL ``replica`` (or the ``u``-th of the live ones) once ``after_step`` is committed, or at
    ``at_s`` seconds after launch; ``kind`` STOP: SIGSTOP it instead, and SIGCONT it ``stop_s`` later."""

    after_step: int | None = None
    at_s: float | None = None
    replica: int | None = None
    u: float = 0.0
    kind: str = KILL
    stop_s: float = 0.0

    def due(self, elapsed_s: float, committed: int) -> bool:
        if self.after_step is not None:
            return committed >= self.after_step
        return self.at_s is not None and elapsed_s >= self.at_s

    def victim(self, live: list[int]) -> int | None:
        if not live:
            return None
        if self.replica is not None:
            return self.replica if self.replica in live else None
        return sorted(live)[int(self.u * len(live))]


@dataclass
class SentKill:
    """What was sent: when (unix time), to whom, and the system's committed step at that moment."""

    time: float
    replica: int | None
    pid: int | None
    committed: int
    planned_s: float | None = None
    kind: str = KILL


@dataclass
class FaultDriver:
    """Fires ``faults`` in order as their moments come; call :meth:`poll` from the caller's wait loop, and
    :meth:`release` when the run ends (no process stays stopped). ``before_signal``: what the system's runner
    leaves before a signal goes (ReCoVer's runner: the run folder's marker of a fault sent from outside).

    ``t0`` is where the clock of ``at_s`` starts; None: at the first committed step (so that systems whose
    first launch takes different times are hit at the same points of their training)."""

    faults: list[Fault]
    t0: float | None = None
    sent: list[SentKill] = field(default_factory=list)
    stopped: list[tuple[float, int]] = field(default_factory=list)  # (SIGCONT due, pid)
    before_signal: Callable[[int, Fault], None] = lambda n, fault: None  # the n-th fault, about to be sent

    def poll(self, progress: Callable[[], int], targets: Callable[[], dict[int, int]]) -> None:
        self._continue(time.time())
        if self.t0 is None:
            if progress() < 1:
                return
            self.t0 = time.time()
        while len(self.sent) < len(self.faults):
            fault = self.faults[len(self.sent)]
            if not fault.due(time.time() - self.t0, progress()):
                return
            live = targets()
            who = fault.victim(list(live))
            pid = live.get(who) if who is not None else None
            if pid is not None:
                self.before_signal(len(self.sent), fault)
                if not _signal(pid, signal.SIGSTOP if fault.kind == STOP else signal.SIGKILL):
                    pid = None
            sent_t = time.time()  # the committed step is read after the kill: the last one before it landed
            if pid is not None and fault.kind == STOP:  # stopped again: its latest stop decides when it goes on
                self.stopped = [(at, p) for at, p in self.stopped if p != pid] + [(sent_t + fault.stop_s, pid)]
            self.sent.append(SentKill(sent_t, who if pid is not None else None, pid, progress(), fault.at_s,
                                      fault.kind))

    def release(self) -> None:
        """SIGCONT every process still stopped (the run ended before its stop did)."""
        self._continue(float("inf"))

    def _continue(self, now: float) -> None:
        due = [pid for at, pid in self.stopped if at <= now]
        self.stopped = [(at, pid) for at, pid in self.stopped if at > now]
        for pid in due:
            _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> bool:
    """Whether ``sig`` reached ``pid``. A SIGCONT may find the pid gone (a frozen ReCoVer rank is killed by its
    peers) or, rarely, reused: a SIGCONT changes nothing for a process that runs."""
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def clockwork_faults(seed: int, every_s: float, horizon_s: float) -> list[Fault]:
    """The Clockwork schedule: a kill every ``every_s`` seconds after launch (the k-th at ``k * every_s``, up to
    ``horizon_s``), each with its victim draw ``u`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out = []
    k = 1
    while k * every_s <= horizon_s:
        out.append(Fault(at_s=k * every_s, u=rng.random()))
        k += 1
    return out


def fault_mix(seed: int, mean_gap_s: float, horizon_s: float, stop_share: float, stop_s: float) -> list[Fault]:
    """Faults at random times (a Poisson process: exponential gaps of mean ``mean_gap_s`` after the first committed
    step, up to ``horizon_s``), each a SIGSTOP of ``stop_s`` with probability ``stop_share``, else a SIGKILL, its
    victim drawn among the live replicas; all from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out, at = [], rng.expovariate(1 / mean_gap_s)
    while at <= horizon_s:
        stop = rng.random() < stop_share
        out.append(Fault(at_s=at, u=rng.random(), kind=STOP if stop else KILL, stop_s=stop_s if stop else 0.0))
        at += rng.expovariate(1 / mean_gap_s)
    return out


def pid_alive(pid: int) -> bool:
    """A live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
