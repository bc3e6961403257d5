"""Layer 1: fault-tolerant cross-replica collectives over Open MPI ULFM.

Use :class:`FTWorld` for every cross-replica operation.  A collective either completes or raises
:class:`FailureDetected`; then every survivor calls :meth:`FTWorld.repair`, which returns a
:class:`RepairEvent` or raises :class:`ReplicaEvicted` on the alive ranks of a failed replica.
A frozen or stuck rank is turned into a crash by the :class:`HangMonitor` (see :mod:`.hang`).

The names below are loaded on first use: importing :mod:`mpi4py` runs ``MPI_Init``, which the launcher (it
reads :mod:`.detector`) and the start-up guard must not do.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ERR_PROC_FAILED": "errors",
    "ERR_PROC_FAILED_PENDING": "errors",
    "ERR_REVOKED": "errors",
    "FailureDetected": "errors",
    "ReplicaEvicted": "errors",
    "error_class": "errors",
    "RepairEvent": "events",
    "HangMonitor": "hang",
    "HangPolicy": "hang_policy",
    "MainThreadProgress": "hang_policy",
    "ReplicaLayout": "layout",
    "FailureWatcher": "watcher",
    "FTWorld": "world",
    "WorldOptions": "world",
    "ReplicaWorld": "protocol",
    "make_data_plane": "data_plane",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
