"""How long this rank's start-up took: from its process's start (or a warm standby's release) until every rank
was ready to train. The logging rank writes it, phase by phase, as the launch's ``startup`` event: the most of what a
relaunch costs, which the launcher's regrow weighs until it has measured one (:mod:`nanotron_recover.launcher.regrow`).
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process started (unix time), from /proc; now where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """This rank's start-up: :meth:`ready` stops the clock once; :meth:`restart` for a released standby.
    :meth:`mark` ends a named phase of it (MPI's start-up, the worlds, the model, the state load): the logging rank
    writes the phases' durations into the run's metrics once every rank is ready, what a relaunch's cost is made of."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.seconds: float | None = None
        self._marks: list[tuple[str, float]] = []

    def restart(self) -> None:
        self.started, self.seconds, self._marks = time.time(), None, []

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began at the previous mark, or at the start)."""
        if self.seconds is None:
            self._marks.append((phase, time.time()))

    def ready(self) -> None:
        if self.seconds is None:
            self.mark("start-up agreement")
            self.seconds = max(0.0, self._marks[-1][1] - self.started)  # the phases add up to it

    def phases_s(self) -> dict[str, float]:
        """Each marked phase's duration in seconds, in order (a phase marked twice: summed)."""
        out: dict[str, float] = {}
        before = self.started
        for phase, at in self._marks:
            out[phase] = out.get(phase, 0.0) + max(0.0, at - before)
            before = at
        return out


STARTUP = StartupClock()  # the one of this process
