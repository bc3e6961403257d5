"""Which original world rank is which replica / local rank, and how to rebuild communicators from it.

``world_size = n_replicas * ranks_per_replica``: world rank ``r`` belongs to replica ``r // ranks_per_replica``
with local rank ``r % ranks_per_replica`` (its (pp, tp) coordinate, or its FSDP shard index).  All bookkeeping speaks of
ORIGINAL world ranks and replica ids; communicator ranks change after every ``Shrink`` and are translated back here.
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

    @property
    def replica_ids(self) -> list[int]:
        return list(range(self.n_replicas))

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


class ReplicaAssignment:
    """Which replica and coordinate each live rank holds *now*: the original grid, until survivors of broken
    replicas are recycled (``fault_tolerance.recycle``): they then belong to no replica (the pool) until a new
    replica is formed from them, with a new id and possibly other coordinates.

    Same lookups as :class:`ReplicaLayout` (the repair and the communicator splits take either); every rank
    applies the same changes at the same points (repair, formation), so the assignment is the same everywhere.
    """

    def __init__(self, layout: ReplicaLayout) -> None:
        self.layout = layout
        self.ranks_per_replica = layout.ranks_per_replica
        self._of: dict[int, tuple[int, int] | None] = {
            r: (layout.replica_of(r), layout.local_rank_of(r)) for r in range(layout.world_size)}
        self._ranks: dict[int, list[int]] = {k: layout.ranks_of(k) for k in range(layout.n_replicas)}

    def replica_of(self, rank: int) -> int | None:
        slot = self._of.get(rank)
        return None if slot is None else slot[0]

    def local_rank_of(self, rank: int) -> int | None:
        slot = self._of.get(rank)
        return None if slot is None else slot[1]

    def ranks_of(self, replica: int) -> list[int]:
        return list(self._ranks[replica])

    def replicas_of(self, ranks: Iterable[int]) -> list[int]:
        return sorted({k for k in (self.replica_of(r) for r in ranks) if k is not None})

    def world_rank(self, replica: int, local_rank: int) -> int:
        return self._ranks[replica][local_rank]

    @property
    def next_replica_id(self) -> int:
        return max(self._ranks) + 1

    @property
    def replica_ids(self) -> list[int]:
        """Every replica id ever formed (the grid's and the recycled ones), in order."""
        return sorted(self._ranks)  # one C-level pass: safe to call from the hang monitor's thread

    def to_pool(self, ranks: Iterable[int]) -> dict[int, tuple[int, int]]:
        """These ranks leave their replicas for the pool; returns ``{rank: (old replica, old coordinate)}``."""
        origin = {}
        for rank in sorted(set(ranks)):
            slot = self._of.get(rank)
            if slot is not None:
                origin[rank] = slot
                self._of[rank] = None
        return origin

    def assign(self, replica: int, ranks: Sequence[int]) -> None:
        """A new replica of these pool ranks, ``ranks[i]`` taking coordinate ``i``."""
        if replica in self._ranks or len(ranks) != self.ranks_per_replica:
            raise ValueError(f"replica {replica}: id in use, or not {self.ranks_per_replica} ranks: {list(ranks)}")
        if any(self._of.get(r) is not None for r in ranks):
            raise ValueError(f"ranks {list(ranks)} are not all in the pool")
        self._ranks[replica] = list(ranks)
        for coordinate, rank in enumerate(ranks):
            self._of[rank] = (replica, coordinate)


def original_ranks(comm: "MPI.Comm", original_group: "MPI.Group") -> list[int]:
    """ORIGINAL world ranks of ``comm``'s members, in ``comm`` rank order."""
    from mpi4py import MPI

    group = comm.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), original_group))
    finally:
        group.Free()


def split_coord_comm(
    world_comm: "MPI.Comm", layout: "ReplicaLayout | ReplicaAssignment", my_rank: int, active_replicas: Sequence[int]
) -> "MPI.Comm | None":
    """Collective over ``world_comm``: one communicator per local rank across the active replicas.

    Keyed by replica id, so coord rank ``i`` is the i-th active replica in ascending order (on the original grid
    the same as keying by rank; a replica formed from recycled ranks has a new, higher id whatever its ranks).
    A rank of an inactive (spare) replica, or of the pool, gets ``None``.
    """
    from mpi4py import MPI

    replica = layout.replica_of(my_rank)
    active = replica is not None and replica in set(active_replicas)
    color = layout.local_rank_of(my_rank) if active else MPI.UNDEFINED
    comm = world_comm.Split(color, replica if active else 0)
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
