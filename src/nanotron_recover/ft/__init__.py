"""Layer 1: fault-tolerant cross-replica collectives over Open MPI ULFM.

Use :class:`FTWorld` for every cross-replica operation.  A collective either completes or raises
:class:`FailureDetected`; then every survivor calls :meth:`FTWorld.repair`, which returns a
:class:`RepairEvent` or raises :class:`ReplicaEvicted` on the alive ranks of a failed replica.
"""

from .errors import (
    ERR_PROC_FAILED,
    ERR_PROC_FAILED_PENDING,
    ERR_REVOKED,
    FailureDetected,
    ReplicaEvicted,
    error_class,
)
from .events import RepairEvent
from .layout import ReplicaLayout
from .watcher import FailureWatcher
from .world import FTWorld

__all__ = [
    "ERR_PROC_FAILED",
    "ERR_PROC_FAILED_PENDING",
    "ERR_REVOKED",
    "FTWorld",
    "FailureDetected",
    "FailureWatcher",
    "RepairEvent",
    "ReplicaEvicted",
    "ReplicaLayout",
    "error_class",
]
