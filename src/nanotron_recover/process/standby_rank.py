"""A rank of a warm standby job: everything that does not need MPI done ahead, then wait to be released.

The launcher starts the next job beside the running one with the same launch line and
``NANOTRON_RECOVER_STANDBY=<folder>`` (``.standby/<id>`` in the run folder). Each of its ranks imports
torch, nanotron, mpi4py (with ``mpi4py.rc.initialize = False``: MPI is initialized only once released) and the
training stack, says so with ``ready-<rank>`` in that folder, and waits. When the running job ends with the restart
outcome, the launcher writes ``go``: the ranks initialize MPI and start as a cold launch would, from the start-up
guard on, seconds sooner (the imports were ~2.2 s of a rank's start here). It imports and waits at idle CPU and I/O
priority (:mod:`nanotron_recover.process.priority`): where a core is idle beside the training it costs the training
ranks nothing. Where none is (every core trains and its ranks wait for each other inside MPI, polling), the idle class
would never get the CPU: a rank not ready after :data:`IDLE_IMPORT_S` imports the rest at normal priority, a one-off
cost of its import's CPU seconds, so that the standby is ready in bounded time. A standby never outlives
its launcher: it exits as soon as the launcher is gone or writes ``cancel`` (and the launcher started its
``mpirun`` with a parent-death signal as well). A standby that a stop signal reached exits too: a launch started
from it would stop after its first step (the launcher sees it gone and replaces it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from nanotron_recover.process import priority
from nanotron_recover.process.startup_clock import STARTUP
from nanotron_recover.process.stop_request import STOP

RELEASE, CANCEL = "go", "cancel"
POLL_S = 0.005
IDLE_IMPORT_S = 5.0  # a rank's imports at idle priority take ~2-3 s where a core is idle; climbing costs nothing there


def ready_file(folder: Path, rank: int) -> Path:
    return folder / f"ready-{rank}"


def wait_until_released(folder: Path, launcher: int | None, launcher_node: str | None,
                        prepare: Callable[[], None]) -> None:
    """Do ``prepare`` (the imports) at idle priority (at normal priority after :data:`IDLE_IMPORT_S`), say ready,
    then return once released, at normal priority; exit at once when cancelled, when the ``launcher`` (its pid, on
    ``launcher_node``) is gone, or when this rank's MPI daemon is (it was reparented). On another node the
    launcher's pid means nothing (another pid space): there the daemon tells, as it ends with its ``mpirun``,
    which the launcher started with a parent-death signal."""
    # The timer's thread is started before this thread goes idle: it keeps the normal class, and so fires on time
    # however busy the cores are.
    climb = threading.Timer(IDLE_IMPORT_S, priority.to_normal)
    climb.daemon = True
    idle = priority.can_idle()
    if idle:
        climb.start()
        priority.to_idle()  # it runs on what the training leaves idle (process/priority.py)
    prepare()
    climb.cancel()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))  # Open MPI's: MPI is not initialized yet
    # pid and node: the launcher watches the rank by pid; the class it got ready at, for the launcher's log
    at = "idle" if idle and _still_idle() else "normal"
    ready_file(folder, rank).write_text(f"{os.getpid()} {socket.gethostname()} {at}")
    parent = os.getppid()
    watch_launcher = launcher if launcher_node in (None, socket.gethostname()) else None
    checked = 0.0
    while not (folder / RELEASE).exists():
        if (folder / CANCEL).exists() or STOP.requested:  # asked to stop: carry that into no launch, leave
            os._exit(0)
        now = time.monotonic()
        if now - checked > 0.1:  # the launcher gone, or this rank's MPI daemon (then it was reparented)
            checked = now
            if (watch_launcher and not _alive(watch_launcher)) or os.getppid() != parent:
                os._exit(0)
        time.sleep(POLL_S)
    if idle:
        priority.to_normal()  # the job it becomes trains at full speed
    STARTUP.restart()  # its start-up, as a relaunch's cost, counts from here


def _still_idle() -> bool:
    return os.sched_getscheduler(0) == os.SCHED_IDLE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

