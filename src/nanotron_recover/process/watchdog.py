"""Start-up guard and the last resort that ends a whole job: no fault may stall a run forever.

Before the fault-tolerant world is up nothing can recover a lost rank, and plain waiting never ends: a rank that
dies before ``MPI_Init`` leaves the others inside ``MPI_Init`` for ever, a frozen rank stalls the torch
rendezvous, and MPI has no timeout. So each rank forks a tiny watchdog process first thing, before it imports
torch or mpi4py (:class:`StartupWatchdog`). Unless the rank disarms it once every rank agreed that start-up is
complete, the watchdog says why and ends the job (:func:`end_job`) after ``startup_timeout_s``. The watchdog is a
process of its own, so it also ends a rank that was frozen (SIGSTOP runs none of a process's threads) or that is
stuck in C code holding the GIL.

:func:`end_job` ends every rank of the job at once, frozen ones included: it signals the rank's Open MPI daemon
(``prterun`` / ``prted``), which tears the whole job down (on another node, a lost daemon ends the job too; see
README, "Running on many nodes"). The run dir then holds no final step, so the Slurm outcome helper says "restart" and
the relaunch resumes from ``latest.txt``.

Standard library only: this module runs before ``MPI_Init``.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import sys
import time
from pathlib import Path

from nanotron_recover.run.run_folder import write_json_atomically

# Names of Open MPI 5's launcher / daemon processes (the parent of every rank it starts).
MPI_DAEMONS = frozenset({"prterun", "prted", "mpirun", "mpiexec"})
_DISARM = b"R"
_WAITING, _BUSY = b"W", b"B"  # the rank waits for its peers (a bound and where follow) / works on its own again
_WAITING_FORMAT = "<dB"
_WAITING_BYTES = struct.calcsize(_WAITING_FORMAT)
WAIT_POINTS = ("MPI_Init", "the start-up agreement")
# a rank that waits for its peers waits at most this many times its own start-up so far, and at least the floor:
# a peer frozen or dead in start-up then costs about a minute, not startup_timeout_s (600 s by default)
STARTUP_WAIT_FACTOR = 3.0
STARTUP_WAIT_FLOOR_S = 60.0  # fault_tolerance.startup_peer_wait_floor_s's default


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _say(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not stop us ending the job
        pass


def end_job(reason: str, rank_pid: int | None = None, daemon_pid: int | None = None,
            outcome: str = "restart outcome") -> None:
    """End the whole job now: SIGKILL ``rank_pid`` (default: this process) and end its MPI daemon: SIGTERM (a
    ``prted``), then SIGHUP (``mpirun`` itself, the daemon of a node's ranks where it runs: it is started with SIGTERM
    blocked, see :mod:`nanotron_recover.process.stop_request`, and ends its job on SIGHUP).

    When the parent is not an Open MPI daemon (a rank started by hand), only the rank is killed.
    """
    rank_pid = os.getpid() if rank_pid is None else rank_pid
    daemon_pid = os.getppid() if daemon_pid is None else daemon_pid
    _say(f"[nanotron-recover] ending the job ({outcome}): {reason}")
    if _process_name(daemon_pid) in MPI_DAEMONS:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                os.kill(daemon_pid, signum)
            except OSError:
                pass
    try:
        os.kill(rank_pid, signal.SIGKILL)
    except OSError:
        pass


def arm_exit_deadline(timeout_s: float, pid: int | None = None) -> None:
    """SIGKILL ``pid`` (default: this process) unless it has exited within ``timeout_s``.

    For the very end of a rank: ``MPI_Finalize`` waits for its Open MPI daemon, and a daemon that is frozen (a
    SIGSTOPped ``mpirun``, a stalled head node) or gone leaves a finished rank waiting for ever. The guard is a
    ``sh`` loop started with ``posix_spawn`` (no fork of a process that runs MPI and threads), in a session of its
    own and without our pipes, that ends by itself within a second of the rank's exit.
    """
    import subprocess

    pid = os.getpid() if pid is None else pid
    loop = ('i=0; while kill -0 "$0" 2>/dev/null; do if [ "$i" -ge "$1" ]; then kill -KILL "$0"; exit 0; fi; '
            'sleep 1; i=$((i+1)); done')
    try:
        subprocess.Popen(["/bin/sh", "-c", loop, str(pid), str(max(1, int(round(timeout_s))))],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError as e:  # no guard: the rank may still end normally
        _say(f"[nanotron-recover] could not arm the exit deadline: {e}")


def _write_exit_record(path: Path, reason: str) -> None:
    from nanotron_recover.run import fence
    from nanotron_recover.run.exit_codes import EXIT_RESTART

    if fence.replaced_by() is not None:  # the rank's launch was replaced: its record would land in the new one's
        return
    try:
        rank = int(path.stem.split("-")[-1])
        write_json_atomically(path, {"rank": rank, "code": EXIT_RESTART, "reason": reason})
    except (OSError, ValueError):
        pass


def _record_unless_written(path: Path | None, reason: str) -> None:
    """The rank's own exit record, if it wrote one, says more than the watchdog can."""
    if path is not None and not path.exists():
        _write_exit_record(path, reason)


class _JobTornDown(Exception):
    """SIGTERM reached the watchdog: the job is being torn down (another rank's watchdog ended it)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _JobTornDown


def _watch(read_fd: int, timeout_s: float, label: str, exit_record: Path | None, rank_pid: int,
           daemon_pid: int, wait_floor_s: float = STARTUP_WAIT_FLOOR_S) -> int:
    """The watchdog's life: wait for the disarm byte; otherwise record why the rank ended and, on a timeout, on a
    wait for the peers past its bound, or on the rank's silent death, end the job. Every way a rank can end during
    start-up leaves its record: its own timeout, the job's teardown (SIGTERM, when another rank's watchdog fired
    first) and the rank's death (end of file before the byte)."""
    try:
        # Out of the rank's process group: Open MPI's teardown SIGKILLs that group right after the rank exits, which
        # would end the watchdog before it recorded anything (the end of file below still tells it the rank died).
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, _on_sigterm)
        for asks_to_stop in (signal.SIGINT, signal.SIGUSR1):  # a graceful stop is the rank's business
            signal.signal(asks_to_stop, signal.SIG_IGN)
        reason = _wait_for_disarm(read_fd, timeout_s, label, wait_floor_s)
        if reason is None:
            return 0
        if reason.endswith(_DIED):
            if exit_record is not None and exit_record.exists():
                return 0  # the rank ended on purpose: it wrote its record first
            _record_unless_written(exit_record, reason)
        elif exit_record is not None:
            _write_exit_record(exit_record, reason)
        end_job(reason, rank_pid=rank_pid, daemon_pid=daemon_pid)
    except _JobTornDown:
        _record_unless_written(exit_record, f"the job was ended during start-up, before {label} was ready to train")
    except BaseException:  # noqa: BLE001 - the watchdog must never run the rank's code
        return 1
    return 0


_DIED = "died during start-up, before it was ready to train"


def _wait_for_disarm(read_fd: int, timeout_s: float, label: str,
                     wait_floor_s: float = STARTUP_WAIT_FLOOR_S) -> str | None:
    """None once disarmed (or the rank ended on purpose: it wrote its record first), else why the job must end.

    The rank may say it waits for its peers (:data:`_WAITING`, with a bound in seconds, derived from its own
    measured start-up: :func:`nanotron_recover.process.startup_guard.waiting_for_peers`) and that it is busy again
    (:data:`_BUSY`); while it waits, the bound ends the wait before ``startup_timeout_s`` does."""
    deadline = time.monotonic() + timeout_s
    waiting: tuple[float, float, str] | None = None  # (until, bound, where)
    while True:
        until = deadline if waiting is None else min(deadline, waiting[0])
        ready, _, _ = select.select([read_fd], [], [], max(0.0, until - time.monotonic()))
        if not ready:
            if waiting is not None and waiting[0] < deadline:
                return (f"{label} waited {waiting[1]:.0f} s for its peers at {waiting[2]} (its bound: "
                        f"{STARTUP_WAIT_FACTOR:g} x its own start-up, at least {wait_floor_s:g} s): a rank "
                        "is frozen or dead in start-up")
            return (f"{label} not ready to train after startup_timeout_s={timeout_s:g} s (a rank died or hung "
                    "during start-up: imports, MPI_Init, rendezvous, model build or checkpoint load)")
        byte = os.read(read_fd, 1)
        if byte == _WAITING and (said := _read_waiting(read_fd)) is not None:
            waiting = (time.monotonic() + said[0], *said)
            continue
        if byte == _BUSY:
            waiting = None
            continue
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # disarmed or the rank is gone: a later teardown is not ours
        # End of file: the rank died during start-up without a word (a rank that ends on purpose writes its record
        # first, checked by the caller): its peers would wait for it (inside MPI_Init) for the whole
        # startup_timeout_s, so the job ends now, with the restart outcome.
        return None if byte == _DISARM else f"{label} {_DIED}"


def _read_waiting(read_fd: int) -> tuple[float, str] | None:
    """The bound and the wait point that follow a :data:`_WAITING` byte; None at end of file (the rank died)."""
    payload = b""
    while len(payload) < _WAITING_BYTES:
        chunk = os.read(read_fd, _WAITING_BYTES - len(payload))
        if not chunk:
            return None
        payload += chunk
    bound, where = struct.unpack(_WAITING_FORMAT, payload)
    return bound, WAIT_POINTS[where] if 0 <= where < len(WAIT_POINTS) else "?"


class StartupWatchdog:
    """A forked child that ends the job unless :meth:`disarm` is called within ``timeout_s``.

    The child holds only the read end of a pipe: a byte means "start-up complete" (it exits quietly), end of file
    means the rank is gone (it records that and ends the job, unless the rank left its own record: then it ended
    on purpose). A SIGTERM (the job torn down because another rank's watchdog fired first) is recorded as well, so
    every rank of a job ended during start-up says how it ended. Forking happens before any thread or MPI exists in
    the rank, so it is safe.
    """

    def __init__(self, timeout_s: float, label: str, exit_record: Path | None = None,
                 wait_floor_s: float = STARTUP_WAIT_FLOOR_S) -> None:
        """``exit_record``: where to write ``{"rank", "code": 3, "reason"}`` if the watchdog fires (the rank's own
        record, ``<run_dir>/exits/rank-<r>.json``); ``wait_floor_s``: the floor of a wait for the peers (for its
        message; the rank computes the bound)."""
        self.timeout_s = timeout_s
        self.wait_floor_s = wait_floor_s
        self.label = label
        self.started = time.monotonic()
        read_fd, self._write_fd = os.pipe()
        rank_pid, daemon_pid = os.getpid(), os.getppid()
        self.child_pid = os.fork()
        if self.child_pid == 0:  # the watchdog
            os.close(self._write_fd)
            os._exit(_watch(read_fd, timeout_s, label, exit_record, rank_pid, daemon_pid, wait_floor_s))
        os.close(read_fd)

    @property
    def armed(self) -> bool:
        return self._write_fd is not None

    def waiting(self, bound_s: float, where: str) -> None:
        """From now on this rank waits for its peers at ``where`` (one of :data:`WAIT_POINTS`): the job ends if the
        wait lasts ``bound_s``."""
        self._tell(_WAITING + struct.pack(_WAITING_FORMAT, bound_s, WAIT_POINTS.index(where)))

    def busy(self) -> None:
        """The wait is over: this rank works on its own again (``startup_timeout_s`` alone applies)."""
        self._tell(_BUSY)

    def _tell(self, message: bytes) -> None:
        if self._write_fd is not None:
            try:
                os.write(self._write_fd, message)
            except OSError:
                pass

    def disarm(self) -> None:
        """Start-up is complete: the watchdog exits."""
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, _DISARM)
            os.close(self._write_fd)
        except OSError:
            pass
        self._write_fd = None
        try:
            os.waitpid(self.child_pid, 0)
        except ChildProcessError:
            pass
