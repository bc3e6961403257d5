"""The launcher's watch over its ``mpirun``: a frozen or stuck ``mpirun`` is ended within a bound, never waited on.

When ``mpirun`` is frozen (SIGSTOP, a stalled head node), its ranks end by themselves within
``finalize_timeout_s``, but ``mpirun`` never returns, and a launcher that waits on it waits for ever (seen: until it
was killed from outside). Two signs, read from ``/proc``, end it:

* ``mpirun`` has been stopped (state ``T``) for longer than ``finalize_timeout_s`` plus a margin: it forwards
  nothing and reaps nothing while stopped;
* this node had ranks of the run, none is left, and ``mpirun`` has not returned for :data:`RANKS_GONE_S`: it
  normally returns within a second of its last rank.

Then ``mpirun`` and its local daemons are SIGKILLed and the launcher judges the run by what it wrote (a relaunch,
exit 3, unless the run was done).

The other way round, ranks can outlive ``mpirun``: when a node is lost, ``mpirun`` returns at once while the
daemons left SIGTERM their ranks, which stop gracefully (they commit the step in flight and save it). Measured on
the fake-node bed: the survivors committed two more steps and a checkpoint 0.2 s after the launcher had judged the
run, and on a slower machine a next launch resumed from a checkpoint they wrote after it started.
:func:`end_outliving_ranks` gives such ranks on this node their stop grace, then SIGKILLs them, so that the run is
judged, and the next launch started, only when nothing of this job writes into the run folder any more. Standard
library only (the launcher stays light).
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
OUTLIVING_POLL_S = 0.1
KILLED_GONE_S = 5.0


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


def end_outliving_ranks(run_dir: Path, bound_s: float) -> tuple[list[int], float]:
    """After ``mpirun`` returned: wait up to ``bound_s`` for this run's ranks on this node to end, then SIGKILL the
    ones left. -> (world ranks that outlived ``mpirun``, seconds waited). Ranks on other nodes see their daemon gone
    (the hang monitor's orphan check) and end themselves."""
    from nanotron_recover.launcher.runs import rank_processes  # reads /proc; light

    start = time.monotonic()
    left = rank_processes(run_dir)
    outlived = sorted(set(left.values()))
    while left and time.monotonic() - start < bound_s:
        time.sleep(OUTLIVING_POLL_S)
        left = rank_processes(run_dir)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    killed_at = time.monotonic()
    while left and time.monotonic() - killed_at < KILLED_GONE_S:  # a SIGKILLed process is gone within moments
        time.sleep(OUTLIVING_POLL_S)
        left = rank_processes(run_dir)
    return outlived, time.monotonic() - start
