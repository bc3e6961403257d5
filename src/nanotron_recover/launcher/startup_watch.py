"""The launcher's watch over a launch's start-up: a rank that dies before its start-up guard is armed.

Each rank arms its start-up guard (:mod:`nanotron_recover.process.startup_guard`, a forked watchdog) within its
first fraction of a second; from then on its death during start-up ends the job at once. A rank killed before that
leaves no watchdog and no word, and its peers wait for it inside ``MPI_Init`` for the whole ``startup_timeout_s``
(600 s by default; seen on this machine). The launcher sees the ranks of its own node in ``/proc``: a rank seen
alive, never seen with its watchdog, and gone without an exit record, died in that window. The launcher then writes
its exit record (code 3) and ends the job, which is relaunched like any start-up failure.

A rank killed before the launcher first saw it (in its first milliseconds) is found when every rank runs on this
node (no hostfile, at most one Slurm node: :func:`ranks_here`): a rank of the job never seen
:data:`MISSING_S` after the first one appeared, and without an exit record, is taken as dead the same way.

A rank counts as started once it was seen with its watchdog and the watchdog is gone (disarmed: every rank was
ready); the watch ends once every rank seen has started, or once the run logged anything in this launch (its
logging rank writes only after start-up): deaths are the in-step recovery's business from then on. Ranks on other
nodes are not seen here. Standard library only (the launcher stays light).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import metrics_path, read_exits, record_exit

STARTUP_SCAN_S = 0.1  # how often /proc is read during start-up (a rank arms its guard ~0.3 s into its life)
MISSING_S = 10.0  # mpirun starts a node's ranks within milliseconds of each other: one not seen by then is gone
PLACING_ARGS = frozenset({"--hostfile", "--machinefile", "--host", "-H", "--default-hostfile"})


def ranks_here(cmd: Sequence[str]) -> int | None:
    """How many ranks the ``mpirun`` line ``cmd`` starts on this node, when all of them run here (no hosts named,
    at most one Slurm node); None when some may run elsewhere, or when it cannot tell."""
    if PLACING_ARGS & set(cmd) or int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1) > 1:
        return None
    try:
        return int(cmd[list(cmd).index("-n") + 1])
    except (ValueError, IndexError):
        return None


class StartupWatch:
    """Call :meth:`died_unarmed` every :data:`STARTUP_SCAN_S` while ``mpirun`` runs; it names a rank that died
    before its start-up guard was armed (once, after writing that rank's exit record), or returns None."""

    def __init__(self, run_dir: Path, expected: int | None = None) -> None:
        """``expected``: the job's world size when every rank runs on this node (:func:`ranks_here`), else None."""
        self.run_dir = run_dir
        self.expected = expected
        self._first_seen: float | None = None
        self.pids: dict[int, int] = {}  # world rank -> pid of the rank seen alive
        self.armed: set[int] = set()  # ranks seen with their start-up watchdog
        self.started: set[int] = set()  # ranks whose watchdog was seen, then gone with the rank alive
        self.done = False
        self._logged = _size(metrics_path(run_dir))

    def died_unarmed(self) -> str | None:
        if self.done or _size(metrics_path(self.run_dir)) != self._logged:
            self.done = True
            return None
        from nanotron_recover.launcher.runs import ranks_and_watchdogs  # reads /proc; light

        ranks, watchdogs = ranks_and_watchdogs(self.run_dir)
        self.armed |= watchdogs.keys()
        self.started |= {r for r in ranks if r in self.armed and r not in watchdogs}  # armed before, disarmed now
        self.pids.update(ranks)
        if self.pids and self._first_seen is None:
            self._first_seen = time.monotonic()
        gone = [r for r in self.pids if r not in ranks and r not in self.armed]
        missing = self._missing()
        if gone or missing:
            exits = read_exits(self.run_dir)
            dead = [r for r in gone + missing if r not in exits]
            if dead:
                self.done = True
                return self._record(dead[0])
        if self.pids and self.started >= set(self.pids):
            self.done = True
        return None

    def _missing(self) -> list[int]:
        """Ranks of an all-local job never seen :data:`MISSING_S` after the first one appeared."""
        if self.expected is None or self._first_seen is None or time.monotonic() - self._first_seen < MISSING_S:
            return []
        return [r for r in range(self.expected) if r not in self.pids]

    def _record(self, rank: int) -> str:
        seen = f"pid {self.pids[rank]}, seen gone" if rank in self.pids else f"never seen in {MISSING_S:g} s"
        reason = (f"rank {rank} died during start-up, before its start-up guard was armed ({seen} by the launcher)")
        record_exit(self.run_dir, rank, EXIT_RESTART, reason)
        return reason


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

