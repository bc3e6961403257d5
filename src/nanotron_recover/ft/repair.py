"""The ULFM repair protocol: Revoke -> Shrink -> commit Agree -> rebuild, repeated until it sticks.

Runs on every survivor of the world communicator, including the alive ranks of a failed replica: they take
part so that ``Shrink`` never waits on them, and leave through a ``Split`` with ``MPI.UNDEFINED`` only after
the commit ``Agree`` (before it, a new failure restarts the loop and still needs them).

Why the failed set is identical everywhere: it is ``members(before) - members(Shrink result)`` and ``Shrink``
returns the same group on every survivor; every loop round starts from the same communicator because the
commit ``Agree`` is uniform (all survivors retry, or none does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from mpi4py import MPI

from .errors import FailureDetected, error_class
from .events import RepairEvent
from .layout import ReplicaAssignment, ReplicaLayout, original_ranks, split_coord_comm, try_revoke

MAX_ATTEMPTS = 16
# Agree flags on the world communicator: bit 0 is the caller's flag, bit 1 says "not repairing".
HEALTHY_BIT = 2
ENTRY_FLAG = 0


@dataclass
class RepairOutcome:
    """What the caller installs after a repair (``world_comm``/``coord_comm`` are None for an evicted rank)."""

    world_comm: MPI.Comm | None
    coord_comm: MPI.Comm | None
    live_ranks: list[int]
    event: RepairEvent
    evicted: bool


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@dataclass
class _Exclusion:
    """Who leaves, as derived from one ``Shrink`` result (identical on every survivor)."""

    members: list[int]
    dead: list[int]
    failed_replicas: list[int]
    evicted_ranks: list[int]
    new_active: list[int]
    pooled: list[int]


def _release_peers(world_comm: MPI.Comm, coord_comm: MPI.Comm | None, entry_agree: bool) -> None:
    """Revoke, so that every peer leaves its blocked operation, and match a peer's pending commit Agree.

    Revoke interrupts every operation except Agree: a peer may sit in its commit ``FTWorld.agree`` on this
    communicator and would wait there for us forever. Our matching Agree (with the "repairing" bit clear)
    completes it, uniformly, as a failure everywhere; then everybody meets in Shrink.
    """
    try_revoke(coord_comm)
    try_revoke(world_comm)
    if entry_agree:
        try:
            world_comm.Agree(ENTRY_FLAG)
        except MPI.Exception:
            pass


def _exclusion(shrunk: MPI.Comm, original_group: MPI.Group, before: set[int], layout: ReplicaLayout | ReplicaAssignment,
               active_replicas: Sequence[int], recycle: bool) -> _Exclusion:
    """The dead ranks, their whole replicas, and the alive ranks of those replicas, who leave too (or, with
    ``recycle``, stay in the world as the pool: :attr:`_Exclusion.evicted_ranks` is then empty)."""
    members = original_ranks(shrunk, original_group)
    dead = sorted(before - set(members))
    failed_replicas = layout.replicas_of(dead)  # a dead pool rank breaks no replica
    orphaned = sorted(r for r in members if layout.replica_of(r) in set(failed_replicas))
    new_active = [r for r in active_replicas if r not in set(failed_replicas)]
    return _Exclusion(members, dead, failed_replicas, [] if recycle else orphaned, new_active,
                      pooled=orphaned if recycle else [])


def _rebuild(shrunk: MPI.Comm, layout: ReplicaLayout | ReplicaAssignment, my_rank: int, evicted: bool,
             new_active: Sequence[int]) -> tuple[MPI.Comm | None, MPI.Comm | None, int]:
    """The new world and coordinate communicators (the evicted take part in the first split only, with
    UNDEFINED); ``ok`` is 0 if this rank's rebuild failed (a new failure): the commit Agree then retries."""
    new_world: MPI.Comm | None = None
    new_coord: MPI.Comm | None = None
    try:
        new_world = shrunk.Split(MPI.UNDEFINED if evicted else 0, my_rank)
        if new_world == MPI.COMM_NULL:
            new_world = None
        if new_world is not None:
            new_world.Set_errhandler(MPI.ERRORS_RETURN)
            new_coord = split_coord_comm(new_world, layout, my_rank, new_active)
    except MPI.Exception:
        try_revoke(new_world)  # a peer may be blocked in the coord split: release it
        try_revoke(shrunk)
        return new_world, new_coord, 0
    return new_world, new_coord, 1


def run_repair(
    world_comm: MPI.Comm,
    coord_comm: MPI.Comm | None,
    live_ranks: Sequence[int],
    original_group: MPI.Group,
    layout: ReplicaLayout | ReplicaAssignment,
    my_rank: int,
    active_replicas: Sequence[int],
    new_epoch: int,
    entry_agree: bool = True,
    hook: Callable[[str, int], None] | None = None,
    recycle: bool = False,
) -> RepairOutcome:
    """Collective among all survivors of ``world_comm``; see the module docstring.

    ``entry_agree`` must be False when this rank's failure was reported by its commit Agree itself: that Agree
    already matched the peers' entry Agree (each rank performs exactly one Agree per step/repair boundary).
    ``hook(point, attempt)`` is called at "after_shrink" and "after_rebuild" (failure injection for tests).
    ``recycle``: the alive ranks of failed replicas stay (``event.pooled``); the caller moves them to the pool of
    a :class:`ReplicaAssignment` (the coordinate split already leaves them out: their replica is not active).
    """
    t_start = time.perf_counter()
    event = RepairEvent(new_epoch, [], [], [], [], [])
    t0 = time.perf_counter()
    _release_peers(world_comm, coord_comm, entry_agree)
    event.revoke_ms = _ms(t0)

    comm, before, last_class = world_comm, set(live_ranks), -1
    for attempt in range(1, MAX_ATTEMPTS + 1):
        event.attempts = attempt
        result = _attempt(comm, original_group, before, layout, my_rank, active_replicas, recycle, hook, event)
        if isinstance(result, RepairOutcome):
            event.total_ms = _ms(t_start)
            return result
        comm, last_class = result  # try again on the shrunk communicator (or the same one)
    raise FailureDetected("repair", last_class, new_epoch - 1, f"gave up after {MAX_ATTEMPTS} attempts")


def _attempt(comm: MPI.Comm, original_group: MPI.Group, before: set[int], layout: ReplicaLayout | ReplicaAssignment,
             my_rank: int, active_replicas: Sequence[int], recycle: bool, hook: Callable[[str, int], None] | None,
             event: RepairEvent) -> RepairOutcome | tuple[MPI.Comm, int]:
    """One Shrink -> exclusion -> rebuild -> Agree round: the outcome, or (the communicator to try again on, the
    MPI error class) when a process died during it."""
    t0 = time.perf_counter()
    try:
        shrunk = comm.Shrink()
    except MPI.Exception as exc:  # should not happen (Shrink is fault tolerant); try again on the same comm
        event.shrink_ms += _ms(t0)
        return comm, error_class(exc)
    event.shrink_ms += _ms(t0)
    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
    if hook is not None:
        hook("after_shrink", event.attempts)
    out = _exclusion(shrunk, original_group, before, layout, active_replicas, recycle)
    evicted = my_rank in out.evicted_ranks

    t0 = time.perf_counter()
    new_world, new_coord, ok = _rebuild(shrunk, layout, my_rank, evicted, out.new_active)
    event.rebuild_ms += _ms(t0)
    if hook is not None:
        hook("after_rebuild", event.attempts)

    # Commit: uniform agreement that every survivor (evicted included) finished the rebuild.
    t0 = time.perf_counter()
    last_class = -1
    try:
        ok = shrunk.Agree(ok)
    except MPI.Exception as exc:
        ok, last_class = 0, error_class(exc)
    event.agree_ms += _ms(t0)
    if not ok:
        try_revoke(new_coord)
        try_revoke(new_world)
        try_revoke(shrunk)
        return shrunk, last_class

    event.failed_ranks = out.dead
    event.failed_replicas = out.failed_replicas
    event.evicted_ranks = out.evicted_ranks
    event.pooled = {r: (layout.replica_of(r), layout.local_rank_of(r)) for r in out.pooled}
    event.active_replicas = out.new_active
    live = [] if evicted else original_ranks(new_world, original_group)  # type: ignore[arg-type]
    leaving = set(out.evicted_ranks) | set(out.pooled)
    event.live_replicas = layout.replicas_of(r for r in out.members if r not in leaving)
    return RepairOutcome(new_world, new_coord, live, event, evicted)
