"""Which original world rank is which replica / local rank, and how to rebuild communicators from it.

``world_size = n_replicas * ranks_per_replica``: world rank ``r`` belongs to replica ``r // ranks_per_replica``
with local rank ``r % ranks_per_replica`` (its (pp, tp) coordinate, or its FSDP shard index).  All bookkeeping speaks of ORIGINAL world
ranks and replica ids; communicator ranks change after every ``Shrink`` and are translated back here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # the grid itself is pure; mpi4py (MPI_Init) is imported by the helpers that need it
    from mpi4py import MPI


@dataclass(frozen=True)
class ReplicaLayout:
    """The fixed replica grid of the original world."""

    world_size: int
    ranks_per_replica: int

    def __post_init__(self) -> None:
        if self.ranks_per_replica < 1 or self.world_size % self.ranks_per_replica != 0:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of ranks_per_replica {self.ranks_per_replica}"
            )

    @property
    def n_replicas(self) -> int:
        return self.world_size // self.ranks_per_replica

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_replica

    def ranks_of(self, replica: int) -> list[int]:
        base = replica * self.ranks_per_replica
        return list(range(base, base + self.ranks_per_replica))

    def replicas_of(self, ranks: Iterable[int]) -> list[int]:
        return sorted({self.replica_of(r) for r in ranks})

    def world_rank(self, replica: int, local_rank: int) -> int:
        return replica * self.ranks_per_replica + local_rank


def original_ranks(comm: "MPI.Comm", original_group: "MPI.Group") -> list[int]:
    """ORIGINAL world ranks of ``comm``'s members, in ``comm`` rank order."""
    from mpi4py import MPI

    group = comm.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), original_group))
    finally:
        group.Free()


def split_coord_comm(
    world_comm: "MPI.Comm", layout: ReplicaLayout, my_rank: int, active_replicas: Sequence[int]
) -> "MPI.Comm | None":
    """Collective over ``world_comm``: one communicator per local rank across the active replicas.

    Keyed by original rank, so coord rank ``i`` is the i-th active replica in ascending order.  A rank of an
    inactive (spare) replica gets ``None``.
    """
    from mpi4py import MPI

    active = layout.replica_of(my_rank) in set(active_replicas)
    color = layout.local_rank_of(my_rank) if active else MPI.UNDEFINED
    comm = world_comm.Split(color, my_rank)
    if comm == MPI.COMM_NULL:
        return None
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def try_revoke(comm: "MPI.Comm | None") -> None:
    """Revoke ``comm``, ignoring errors: revoking is how a rank pulls every peer out of a blocked operation."""
    from mpi4py import MPI

    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass
