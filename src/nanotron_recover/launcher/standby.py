"""The warm standby: the next job, started beside the running one with the same launch line, waiting before MPI is
initialized (its ranks: :mod:`nanotron_recover.process.standby_rank`), and the launcher's watch over it. Its folder
is in the run folder (``.standby/``, on the cluster's shared file system): the standby's ranks on every node write
their ready files there.

A standby is ready when every rank has imported and said so (``ready-<rank>`` in its folder, holding the rank's pid,
its node and the CPU class it got ready at). It can never become ready again once one of its ranks died while it
waited: its ``mpirun`` runs under ULFM and lives on with the rest, so the launcher watches the ranks it can see
(those on its own node, by pid) and calls such a standby *broken* at once; the relauncher then replaces it or
launches cold, instead of waiting for it until a bound runs out (seen: 60 s, then a cold launch). Standard library
only (the launcher stays light).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from nanotron_recover.launcher.mpirun import with_env
from nanotron_recover.launcher.mpirun_job import MpirunJob
from nanotron_recover.process.standby_rank import CANCEL, RELEASE, ready_file
from nanotron_recover.run.launch_contract import STANDBY_ENV, TOKEN_ENV, LaunchContract
from nanotron_recover.run.procfs import proc_stat, process_is_gone
from nanotron_recover.run.run_folder import token_in

LOOK_EVERY_S = 0.5  # how often the launcher looks for a standby's dead ranks (a /proc scan)
STANDBY_RSS_GB = 0.6  # a standby rank after its imports, measured (benchmarks/relaunch_bench.py): ~0.35-0.45 GB
CANCEL_WAIT_S = 2.0  # a cancelled standby's mpirun: SIGHUP, then SIGKILL after this long


def standby_fits(world_size: int, meminfo: Path = Path("/proc/meminfo")) -> bool:
    """``auto``: a standby of ``world_size`` ranks fits beside the job in the memory available now, with room."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available_gb = int(fields["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return False
    return available_gb > 2.0 * world_size * STANDBY_RSS_GB + 2.0


def standby_rank_pids(folder: Path) -> dict[int, int]:
    """``{world rank: pid}`` of the live ranks on this node of the standby waiting in ``folder``: the processes of
    ``nanotron_recover.train`` that name the folder, less those started by another of them (a rank's own children
    inherit its environment: wandb's service, which the logging rank of a standby starts while it waits; its
    ``mpirun`` names the folder too, but runs no rank)."""
    from nanotron_recover.launcher.runs import environ_of  # reads /proc; light

    mine = f"{STANDBY_ENV}={folder}".encode()
    found: dict[int, tuple[int, int]] = {}  # pid -> (world rank, parent pid)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        environ = environ_of(pid)
        stat = proc_stat(pid)
        if environ is None or mine not in environ or stat is None or stat[2] in ("Z", "X") \
                or not _runs_a_rank(pid):
            continue
        rank = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None and rank.isdigit():
            found[pid] = (int(rank), stat[0])
    return {rank: pid for pid, (rank, parent) in found.items() if parent not in found}


def _runs_a_rank(pid: int) -> bool:
    try:
        return b"nanotron_recover.train" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


class Standby:
    """The next job, waiting: started with ``cmd`` (the next launch's line), for ``world_size`` ranks."""

    def __init__(self, cmd: list[str], world_size: int, *, root: Path, graceful: bool, pass_fds: tuple[int, ...],
                 nodes_out: tuple[str, ...] = ()) -> None:
        self.nodes_out = nodes_out  # the nodes its launch line leaves out
        root.mkdir(exist_ok=True)  # in the run folder: the ranks of every node reach it
        self.folder = Path(tempfile.mkdtemp(prefix="standby-", dir=root))
        self.world_size = world_size
        self.token = token_in(cmd)
        self.started, self.announced = time.time(), False  # when it was started; its readiness logged
        self.waited = False  # a launch waited for it once already (a second wait would only repeat the first)
        self._seen: dict[int, int] = {}  # world rank -> pid, of its ranks seen alive on this node
        self._looked_at, self._broken = 0.0, None  # the last look at its ranks (a /proc scan: at most every 0.5 s)
        # the launch contract's standby fields (its token is the launch line's already)
        env = LaunchContract(standby_folder=self.folder, launcher_pid=os.getpid(),
                             launcher_node=socket.gethostname()).as_env()
        del env[TOKEN_ENV]  # the launch line says its own
        # In a Slurm allocation its mpirun starts the daemons of the other nodes as a second job step, which must
        # share the allocation's CPUs with the running job's (srun --overlap; without it the step waited for the
        # job's end on the test cluster, and the standby never got ready). On the batch node it forks its ranks.
        overlap = {"SLURM_OVERLAP": "1"} if os.environ.get("SLURM_JOB_ID") else None
        self.job = MpirunJob(with_env(cmd, env), graceful=graceful, pass_fds=pass_fds, env=overlap,
                             die_with_launcher=True)

    def ended(self) -> bool:
        return self.job.proc.poll() is not None

    def ready(self) -> bool:
        return not self.ended() and all(ready_file(self.folder, r).exists() for r in range(self.world_size)) \
            and self.broken() is None

    def broken(self) -> str | None:
        """Why this standby can never become ready (a rank of it died while it waited), or None. Ranks on other
        nodes are not seen here: their pids mean nothing on this node."""
        if self._broken is not None or time.monotonic() - self._looked_at < LOOK_EVERY_S:
            return self._broken  # broken stays broken
        self._looked_at = time.monotonic()
        self._broken = self._dead_ranks()
        return self._broken

    def look_now(self) -> None:
        """The next :meth:`broken` looks at the ranks again (before the standby is released: a rank may have died
        a moment ago, with the job)."""
        self._looked_at = 0.0

    def _dead_ranks(self) -> str | None:
        alive = standby_rank_pids(self.folder)
        for rank, pid in alive.items():
            self._seen.setdefault(rank, pid)
        gone = {r for r, pid in self._seen.items() if alive.get(r) != pid}
        here = socket.gethostname()
        for rank in range(self.world_size):
            said = _ready_pid_and_node(self.folder, rank)
            if said is not None and said[1] == here and process_is_gone(said[0]):
                gone.add(rank)
        return f"rank(s) {sorted(gone)[:8]} of it died while it waited" if gone else None

    def why_not(self) -> str:
        if self.ended():
            return f"its mpirun ended with {self.job.proc.returncode}"
        broken = self.broken()
        if broken is not None:
            return broken
        missing = [r for r in range(self.world_size) if not ready_file(self.folder, r).exists()]
        return f"rank(s) {missing[:8]} still importing"

    def ready_at(self) -> str:
        """The CPU class its ranks got ready at (said in their ready files): ``idle`` (on what the training left
        idle), ``normal`` (no core was idle beside the training, or this user may not use the idle class), or
        ``idle and normal`` when its ranks differ."""
        said = set()
        for rank in range(self.world_size):
            try:
                said.update(ready_file(self.folder, rank).read_text().split()[2:3])
            except OSError:
                continue
        return " and ".join(sorted(said)) or "unknown"

    def release(self) -> MpirunJob:
        (self.folder / RELEASE).touch()
        return self.job

    def cancel(self) -> None:
        (self.folder / CANCEL).touch()
        # nothing of a standby needs saving: its mpirun gets a short while to end its ranks, then SIGKILL (one still
        # starting a daemon on a node that does not answer holds SIGHUP until ssh gives up: seen 10 s on the bed)
        try:
            self.job.end(timeout_s=CANCEL_WAIT_S)
        except subprocess.TimeoutExpired:  # SIGKILLed and still not reaped (uninterruptible I/O): it goes on its own
            pass
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _ready_pid_and_node(folder: Path, rank: int) -> tuple[int, str] | None:
    """(pid, node) that rank ``rank`` wrote into its ready file (None: not ready, or an unreadable file)."""
    try:
        pid, node, *_ = ready_file(folder, rank).read_text().split()
        return int(pid), node
    except (OSError, ValueError):
        return None
