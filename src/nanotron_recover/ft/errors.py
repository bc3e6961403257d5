"""Exceptions of the fault-tolerant layer.

A cross-replica collective never hangs and never returns a half-reduced buffer silently: when ULFM reports
trouble it raises :class:`FailureDetected`, and the caller runs :meth:`FTWorld.repair`.  A rank whose own
replica lost a member is told so by :class:`ReplicaEvicted` (it should log and exit with code 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpi4py import MPI

if TYPE_CHECKING:
    from .events import RepairEvent

# ULFM error classes (Open MPI 5): a peer died, a pending ANY_SOURCE op saw a death, the comm was revoked.
ERR_PROC_FAILED: int = MPI.ERR_PROC_FAILED  # 75
ERR_PROC_FAILED_PENDING: int = MPI.ERR_PROC_FAILED_PENDING  # 76
ERR_REVOKED: int = MPI.ERR_REVOKED  # 77
ULFM_ERROR_CLASSES = frozenset({ERR_PROC_FAILED, ERR_PROC_FAILED_PENDING, ERR_REVOKED})


def error_class(exc: BaseException) -> int:
    """The MPI error class of ``exc`` (-1 if it is not an MPI error)."""
    if isinstance(exc, MPI.Exception):
        try:
            return int(exc.Get_error_class())
        except Exception:  # noqa: BLE001 - a broken exception object must not hide the failure
            return -1
    return -1


class FailureDetected(RuntimeError):
    """A cross-replica operation failed because a peer died (or the communicator was revoked).

    Every MPI error inside a collective counts: under failures Open MPI also returns e.g. ``MPI_ERR_OTHER`` (16),
    and a result we cannot trust must never be used.  The buffer passed to the collective is garbage afterwards.
    """

    def __init__(self, op: str, err_class: int = -1, epoch: int = -1, detail: str = "") -> None:
        self.op = op
        self.error_class = err_class
        self.epoch = epoch
        tail = f": {detail}" if detail else ""
        super().__init__(f"{op} failed in world epoch {epoch} (MPI error class {err_class}){tail}")


class ReplicaEvicted(RuntimeError):
    """This rank's replica lost a member: the rank took part in the survivors' repair and must now stop.

    The caller should log ``str(exc)`` and end the process with exit code 0 via :meth:`FTWorld.shutdown`.
    """

    def __init__(self, event: "RepairEvent", world_rank: int, replica: int) -> None:
        self.event = event
        self.world_rank = world_rank
        self.replica = replica
        dead = sorted(event.failed_ranks)
        super().__init__(
            f"world rank {world_rank} evicted: replica {replica} lost rank(s) {dead} (repair to epoch {event.epoch})"
        )
