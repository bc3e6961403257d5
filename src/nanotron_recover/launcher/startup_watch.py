"""The launcher's watch over a launch's start-up: a rank that dies before its start-up guard is armed.

Each rank arms its start-up guard (:mod:`nanotron_recover.process.startup_guard`, a forked watchdog) within its
first fraction of a second; from then on its death during start-up ends the job at once. A rank killed before that
leaves no watchdog and no word, and its peers wait for it inside ``MPI_Init`` for the whole ``startup_timeout_s``
(600 s by default; seen on this machine). The launcher sees the ranks of its own node in ``/proc``: a rank seen
alive, never seen with its watchdog, and gone without an exit record, died in that window. The launcher then writes
its exit record (code 3) and ends the job, which is relaunched like any start-up failure.

A rank counts as started once it was seen with its watchdog and the watchdog is gone (disarmed: every rank was
ready); the watch ends once every rank seen has started, or once the run logged anything in this launch (its
logging rank writes only after start-up): deaths are the in-step recovery's business from then on. Ranks on other
nodes are not seen here. Standard library only (the launcher stays light).
"""

from __future__ import annotations

from pathlib import Path

from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.procfs import proc_stat
from nanotron_recover.run.run_folder import metrics_path, read_exits, record_exit

STARTUP_SCAN_S = 0.1  # how often /proc is read during start-up (a rank arms its guard ~0.3 s into its life)


class StartupWatch:
    """Call :meth:`died_unarmed` every :data:`STARTUP_SCAN_S` while ``mpirun`` runs; it names a rank that died
    before its start-up guard was armed (once, after writing that rank's exit record), or returns None."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.pids: dict[int, int] = {}  # world rank -> pid of the rank seen alive
        self.armed: set[int] = set()  # ranks seen with their start-up watchdog
        self.started: set[int] = set()  # ranks whose watchdog was seen, then gone with the rank alive
        self.done = False
        self._logged = _size(metrics_path(run_dir))

    def died_unarmed(self) -> str | None:
        if self.done or _size(metrics_path(self.run_dir)) != self._logged:
            self.done = True
            return None
        from nanotron_recover.launcher.runs import rank_processes  # reads /proc; light

        processes = rank_processes(self.run_dir)  # {pid: rank}: the ranks and their watchdogs
        ranks: dict[int, int] = {}
        for pid, rank in processes.items():
            parent = (proc_stat(pid) or (0,))[0]
            if processes.get(parent) == rank:
                self.armed.add(rank)  # its watchdog
            else:
                ranks[rank] = pid
        for rank, pid in ranks.items():
            if rank in self.armed and not any(r == rank and p != pid for p, r in processes.items()):
                self.started.add(rank)  # armed before, no watchdog now: disarmed
            self.pids[rank] = pid
        gone = [r for r in self.pids if r not in ranks and r not in self.armed]
        if gone and not (exits := read_exits(self.run_dir)).keys() >= set(gone):
            self.done = True
            rank = next(r for r in gone if r not in exits)
            reason = (f"rank {rank} (pid {self.pids[rank]}) died during start-up, before its start-up guard was "
                      "armed (seen gone by the launcher)")
            record_exit(self.run_dir, rank, EXIT_RESTART, reason)
            return reason
        if self.pids and self.started >= set(self.pids):
            self.done = True
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
