"""Recycling the survivors of broken replicas (issue #15): the pure, deterministic part.

When one rank of a replica dies, the replica's other ranks are healthy. Instead of leaving, they would join a
*pool*; as soon as the pool holds ``ranks_per_replica`` ranks, they form a new replica at a step boundary. Every
rank must derive the same pool, the same members and the same coordinates from the agreed failure history alone
(the repair's ``Shrink`` result), so this module is pure: no MPI, no torch.

Choices, each for a reason:

* a member keeps its old coordinate (its (pp, tp) position, or its shard index) where it can: the parameters of
  that coordinate are the ones its memory was sized for, and a GPU keeps its device layout; the coordinates no
  pool rank had are filled by the lowest remaining ranks (their coordinate changes);
* members come from one node when one node's pool ranks suffice (a replica never spans nodes, so a node loss
  takes whole replicas: see ``mpirun.replica_placement``); else from the lowest ranks overall;
* the rest waits in the pool for the next failure's survivors.

Not wired into the trainer yet: see the closing note of this round (the static ``ReplicaLayout`` must become a
mapping that changes at formation, and a recycled rank needs a new torch world and a model of its new
coordinate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Member:
    """One rank of a new replica: where it came from and the coordinate it takes."""

    rank: int
    old_replica: int
    old_coordinate: int
    coordinate: int

    @property
    def moved(self) -> bool:
        return self.coordinate != self.old_coordinate


@dataclass(frozen=True)
class Formation:
    """A new replica made of pool ranks; ``members`` in coordinate order (member i has coordinate i)."""

    replica: int
    members: tuple[Member, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        """World ranks in coordinate order (the order of the new replica's torch world)."""
        return tuple(m.rank for m in self.members)

    @property
    def moved(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.moved)

    def as_dict(self) -> dict:
        """For the ``replica_formed`` event."""
        return {"replica": self.replica,
                "members": [{"rank": m.rank, "old_replica": m.old_replica, "old_coordinate": m.old_coordinate,
                             "coordinate": m.coordinate} for m in self.members]}


@dataclass
class RankPool:
    """Free ranks: survivors of broken replicas, waiting to form new ones.

    Args:
        ranks_per_replica: ranks one replica needs.
        hosts: the node of every world rank (optional): members then come from one node when possible.
    """

    ranks_per_replica: int
    hosts: Sequence[str] | None = None
    _origin: dict[int, tuple[int, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.ranks_per_replica < 1:
            raise ValueError(f"ranks_per_replica must be >= 1, got {self.ranks_per_replica}")

    @property
    def ranks(self) -> list[int]:
        return sorted(self._origin)

    def add(self, origin: Mapping[int, tuple[int, int]]) -> None:
        """Survivors of broken replicas: ``{world rank: (old replica, old coordinate)}``."""
        for rank, (replica, coordinate) in origin.items():
            if not 0 <= coordinate < self.ranks_per_replica:
                raise ValueError(f"rank {rank}: coordinate {coordinate} outside 0..{self.ranks_per_replica - 1}")
            if rank in self._origin:
                raise ValueError(f"rank {rank} is already in the pool")
            self._origin[int(rank)] = (int(replica), int(coordinate))

    def remove(self, dead: Iterable[int]) -> list[int]:
        """Pool ranks that died while waiting leave the pool; returns those that were in it."""
        gone = sorted(r for r in set(dead) if r in self._origin)
        for rank in gone:
            del self._origin[rank]
        return gone

    def form(self, replica: int) -> Formation | None:
        """Take ``ranks_per_replica`` ranks out of the pool as new replica ``replica`` (None: not enough yet)."""
        candidates = self._candidates()
        if candidates is None:
            return None
        n = self.ranks_per_replica
        by_coordinate: dict[int, int] = {}
        for rank in candidates:  # ascending: the lowest rank that had a coordinate keeps it
            by_coordinate.setdefault(self._origin[rank][1], rank)
        kept = set(by_coordinate.values())
        rest = [r for r in candidates if r not in kept]
        chosen: dict[int, int] = dict(by_coordinate)
        for coordinate in range(n):
            if coordinate not in chosen:
                chosen[coordinate] = rest.pop(0)
        members = tuple(Member(rank, *self._origin[rank], coordinate=c) for c, rank in sorted(chosen.items()))
        for m in members:
            del self._origin[m.rank]
        return Formation(replica, members)

    def _candidates(self) -> list[int] | None:
        """The ranks to choose from: one node's pool ranks when a node has enough, else the whole pool."""
        ranks = self.ranks
        if len(ranks) < self.ranks_per_replica:
            return None
        if self.hosts is not None:
            by_host: dict[str, list[int]] = {}
            for rank in ranks:
                by_host.setdefault(self.hosts[rank], []).append(rank)
            for host_ranks in sorted(by_host.values()):  # the node of the lowest such rank first
                if len(host_ranks) >= self.ranks_per_replica:
                    return host_ranks
        return ranks
