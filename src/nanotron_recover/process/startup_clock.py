"""How long this rank's start-up took: from its process's start (or a warm standby's release) until every rank
was ready to train. Summed world-wide with the step's stats (:mod:`nanotron_recover.recovery.rebalancing`), the
ranks' mean is the job's measured start-up: the most of what a relaunch costs (:mod:`nanotron_recover.recovery.regrow`).
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process started (unix time), from /proc; now where /proc cannot say."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """This rank's start-up: :meth:`ready` stops the clock once; :meth:`restart` for a released standby."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.seconds: float | None = None

    def restart(self) -> None:
        self.started, self.seconds = time.time(), None

    def ready(self) -> None:
        if self.seconds is None:
            self.seconds = max(0.0, time.time() - self.started)


STARTUP = StartupClock()  # the one of this process
