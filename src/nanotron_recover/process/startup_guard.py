"""A rank's start-up guard, armed before torch or MPI is imported: the start-up watchdog and the start-up faults.

A rank that stalls before every rank is ready (a frozen peer in the rendezvous, a dead node's ranks) is ended
by the watchdog with the restart outcome and an exit record (within :func:`wait_bound_s` where it waits for its
peers: ``MPI_Init`` and the start-up agreement); the fault injector fires the schedule's
``phase: startup`` entries at their points. Standard library (and YAML) only.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nanotron_recover.process.inject import FailureInjector
from nanotron_recover.process.startup_clock import STARTUP
from nanotron_recover.process.watchdog import STARTUP_WAIT_FACTOR, STARTUP_WAIT_FLOOR_S, StartupWatchdog
from nanotron_recover.run.job_shape import ranks_per_replica
from nanotron_recover.run.run_folder import exit_record_path


@dataclass
class StartupGuard:
    """This rank's start-up watchdog and its start-up fault injector (``phase: startup`` entries)."""

    watchdog: StartupWatchdog
    injector: FailureInjector


def _peek_fault_tolerance(config_file: str) -> tuple[dict, int] | None:
    """The raw ``fault_tolerance`` section and the ranks per replica, read with YAML alone (no torch yet);
    None when fault tolerance is off or the file cannot be read (the full load reports that)."""
    import yaml

    try:
        with open(config_file) as f:
            raw = yaml.safe_load(f)
        ft = raw.get("fault_tolerance")
        if not isinstance(ft, dict) or not ft.get("enabled", True):
            return None
        return ft, ranks_per_replica(raw)
    except Exception:  # noqa: BLE001 - the real loader gives the error message
        return None


def arm_startup_guard(config_file: str, run_dir: str | None, launch_token: str = "0") -> StartupGuard | None:
    """Under mpirun with fault tolerance on: fork the start-up watchdog, then fire a ``before_mpi_init`` fault."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")  # Open MPI's: MPI is not initialized yet
    peek = _peek_fault_tolerance(config_file) if rank is not None else None
    if peek is None:
        return None
    ft, rpr = peek
    record = exit_record_path(Path(run_dir), rank) if run_dir else None
    watchdog = StartupWatchdog(float(ft.get("startup_timeout_s", 600.0)), label=f"rank {rank}", exit_record=record,
                               wait_floor_s=float(ft.get("startup_peer_wait_floor_s", STARTUP_WAIT_FLOOR_S)))
    try:
        injector = FailureInjector(ft.get("inject") or [], int(rank) // rpr, int(rank) % rpr, run_dir=run_dir,
                                   launch_token=launch_token)
    except (ValueError, TypeError, KeyError):  # a bad schedule: the config loader names the key
        injector = FailureInjector([], 0, 0)
    injector.maybe_fail(0, "startup:before_mpi_init")
    global _ARMED
    _ARMED = StartupGuard(watchdog, injector)
    return _ARMED


_ARMED: StartupGuard | None = None  # this process's guard, once armed


def wait_bound_s() -> float:
    """How long this rank may wait for its peers during start-up: a multiple of its own start-up so far (process
    start, or a warm standby's release), at least a floor (``fault_tolerance.startup_peer_wait_floor_s``). Its peers
    do the same work: one that takes several times longer is frozen or dead (seen: a rank frozen in start-up held
    the others for the whole startup_timeout_s)."""
    floor = _ARMED.watchdog.wait_floor_s if _ARMED is not None else STARTUP_WAIT_FLOOR_S
    return max(floor, STARTUP_WAIT_FACTOR * max(0.0, time.time() - STARTUP.started))


@contextmanager
def waiting_for_peers(where: str) -> Iterator[None]:
    """Inside: this rank waits for every other rank at ``where`` (``MPI_Init``, the start-up agreement); its
    watchdog ends the job if the wait lasts :func:`wait_bound_s`. A no-op without an armed guard."""
    watchdog = _ARMED.watchdog if _ARMED is not None else None
    STARTUP.mark(f"before {where}")
    if watchdog is not None:
        watchdog.waiting(wait_bound_s(), where)
    try:
        yield
    finally:
        STARTUP.mark(where)
        if watchdog is not None:
            watchdog.busy()  # nothing once disarmed
