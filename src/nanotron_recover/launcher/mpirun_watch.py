"""The launcher's watch over its ``mpirun``: a frozen or stuck ``mpirun`` is ended within a bound, never waited on.

When ``mpirun`` is frozen (SIGSTOP, a stalled head node), its ranks end by themselves within
``finalize_timeout_s``, but ``mpirun`` never returns, and a launcher that waits on it waits for ever (seen: until it
was killed from outside). Two signs, read from ``/proc``, end it:

* ``mpirun`` has been stopped (state ``T``) for longer than ``finalize_timeout_s`` plus a margin: it forwards
  nothing and reaps nothing while stopped;
* this node had ranks of the run, none is left, and ``mpirun`` has not returned for :data:`RANKS_GONE_S`: it
  normally returns within a second of its last rank.

Then ``mpirun`` and its local daemons are SIGKILLed and the launcher judges the run by what it wrote (a relaunch,
exit 3, unless the run was done). Standard library only (the launcher stays light).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from nanotron_recover.run.procfs import proc_stat

STOPPED_STATES = frozenset({"T", "t"})
RANKS_GONE_S = 15.0
STOPPED_MARGIN_S = 10.0
SCAN_EVERY_S = 1.0


class MpirunWatch:
    """Call :meth:`overdue` while waiting on ``mpirun``; it says why ``mpirun`` must be ended now, or None."""

    def __init__(self, pid: int, run_dir: Path | None, finalize_timeout_s: float) -> None:
        self.pid = pid
        self.run_dir = run_dir
        self.stopped_bound_s = finalize_timeout_s + STOPPED_MARGIN_S
        self._stopped_since: float | None = None
        self._seen_ranks = False
        self._ranks_gone_since: float | None = None
        self._next_scan = 0.0

    def overdue(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        stat = proc_stat(self.pid)
        if stat is None:
            return None
        if stat[2] in STOPPED_STATES:
            self._stopped_since = self._stopped_since if self._stopped_since is not None else now
            if now - self._stopped_since > self.stopped_bound_s:
                return f"mpirun (pid {self.pid}) has been stopped for {now - self._stopped_since:.0f} s"
        else:
            self._stopped_since = None
        if self.run_dir is None or now < self._next_scan:
            return None
        self._next_scan = now + SCAN_EVERY_S
        from nanotron_recover.launcher.runs import rank_processes  # reads /proc; light

        if rank_processes(self.run_dir):
            self._seen_ranks, self._ranks_gone_since = True, None
        elif self._seen_ranks:
            self._ranks_gone_since = self._ranks_gone_since if self._ranks_gone_since is not None else now
            if now - self._ranks_gone_since > RANKS_GONE_S:
                return f"every rank on this node ended {now - self._ranks_gone_since:.0f} s ago and mpirun " \
                       f"(pid {self.pid}) has not returned"
        return None


def end_mpirun(pid: int) -> None:
    """SIGKILL ``mpirun`` and the MPI daemons it started on this node (their ranks, orphaned, end by themselves)."""
    from nanotron_recover.process.watchdog import MPI_DAEMONS

    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[0] == pid and stat[1] in MPI_DAEMONS:
                children.append(int(entry))
    for target in [pid, *children]:
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
