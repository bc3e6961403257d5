"""Faults sent from outside a running system, the same way to every system a benchmark compares.

A fault is a SIGKILL of one replica's process by pid, from the benchmark's own process (no cooperation from the
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


@dataclass
class Fault:
    """SIGKILL ``replica`` (or the ``u``-th of the live ones) once ``after_step`` is committed, or at
    ``at_s`` seconds after launch."""

    after_step: int | None = None
    at_s: float | None = None
    replica: int | None = None
    u: float = 0.0

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


@dataclass
class FaultDriver:
    """Fires ``faults`` in order as their moments come; call :meth:`poll` from the caller's wait loop.

    ``t0`` is where the clock of ``at_s`` starts; None: at the first committed step (so that systems whose
    first launch takes different times are hit at the same points of their training)."""

    faults: list[Fault]
    t0: float | None = None
    sent: list[SentKill] = field(default_factory=list)

    def poll(self, progress: Callable[[], int], targets: Callable[[], dict[int, int]]) -> None:
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
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pid = None
            sent_t = time.time()  # the committed step is read after the kill: the last one before it landed
            self.sent.append(SentKill(sent_t, who if pid is not None else None, pid, progress(), fault.at_s))


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


def pid_alive(pid: int) -> bool:
    """A live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
