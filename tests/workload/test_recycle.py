"""RankPool: which survivors form a new replica, with which coordinates; the roster entry of a formed replica."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.workload.planner import plan_step
from nanotron_recover.workload.recycle import RankPool
from nanotron_recover.workload.spares import ReplicaRoster

RPR = 4  # TP2 x PP2


def survivors(dead: int, rpr: int = RPR) -> dict[int, tuple[int, int]]:
    """The other ranks of ``dead``'s replica, with their (old replica, old coordinate)."""
    replica = dead // rpr
    return {r: (replica, r % rpr) for r in range(replica * rpr, (replica + 1) * rpr) if r != dead}


def test_the_acceptance_scenario_forms_one_replica_and_keeps_two():
    """12 ranks, 3 replicas: rank 5 (replica 1, coordinate 1) dies, then rank 9 (replica 2, coordinate 1)."""
    pool = RankPool(RPR)
    pool.add(survivors(5))
    assert pool.form(replica=3) is None  # 3 ranks: not enough yet
    pool.add(survivors(9))
    formed = pool.form(replica=3)
    assert formed is not None and formed.replica == 3
    assert formed.ranks == (4, 8, 6, 7)  # coordinate 1 was nobody's: the lowest remaining rank takes it
    assert {m.old_replica for m in formed.members} == {1, 2}
    assert [m.rank for m in formed.moved] == [8] and formed.moved[0].old_coordinate == 0
    assert pool.ranks == [10, 11]
    assert formed.as_dict()["members"][1] == {"rank": 8, "old_replica": 2, "old_coordinate": 0, "coordinate": 1}


def test_coordinates_are_kept_when_the_pool_has_them():
    pool = RankPool(RPR)
    pool.add(survivors(5))  # replica 1 without coordinate 1
    pool.add(survivors(10))  # replica 2 without coordinate 2
    formed = pool.form(replica=3)
    assert formed.ranks == (4, 9, 6, 7) and formed.moved == ()
    assert pool.ranks == [8, 11]


def test_members_come_from_one_node_when_it_has_enough():
    hosts = ["a"] * 4 + ["b"] * 8  # replica 0 on node a, replicas 1 and 2 on node b
    pool = RankPool(2, hosts=hosts)
    pool.add({0: (0, 0)})
    pool.add({5: (2, 1), 7: (3, 1)})
    assert pool.form(replica=6).ranks == (7, 5)  # node b's two, not ranks 0 and 5 across nodes; 5 keeps its 1
    pool.add({1: (0, 1)})
    assert pool.form(replica=7).ranks == (0, 1)


def test_pool_ranks_that_die_leave_it():
    pool = RankPool(RPR)
    pool.add(survivors(5))
    assert pool.remove([6, 0]) == [6]
    pool.add(survivors(9))
    assert pool.form(replica=3).ranks == (4, 8, 10, 7)
    assert pool.ranks == [11]


def test_bad_input_is_refused():
    pool = RankPool(2)
    with pytest.raises(ValueError, match="coordinate"):
        pool.add({3: (1, 2)})
    pool.add({3: (1, 1)})
    with pytest.raises(ValueError, match="already"):
        pool.add({3: (1, 1)})
    with pytest.raises(ValueError):
        RankPool(0)


@settings(max_examples=200, deadline=None)
@given(rpr=st.integers(1, 6), n_replicas=st.integers(2, 8), data=st.data())
def test_any_failure_history_forms_valid_replicas_deterministically(rpr, n_replicas, data):
    world = rpr * n_replicas
    dead = data.draw(st.lists(st.integers(0, world - 1), unique=True, max_size=world))
    broken: dict[int, set[int]] = {}
    for r in dead:
        broken.setdefault(r // rpr, set()).add(r)
    origin = {r: (rep, r % rpr) for rep, gone in broken.items()
              for r in range(rep * rpr, (rep + 1) * rpr) if r not in gone}
    pools = [RankPool(rpr), RankPool(rpr)]
    pools[0].add(origin)
    pools[1].add(dict(reversed(list(origin.items()))))  # the same history, told in another order
    formed_by = [[], []]
    for pool, out in zip(pools, formed_by):
        replica = n_replicas
        while (f := pool.form(replica)) is not None:
            out.append(f)
            replica += 1
    assert formed_by[0] == formed_by[1]  # every rank derives the same replicas
    used = [r for f in formed_by[0] for r in f.ranks]
    assert len(used) == len(set(used)) and set(used) <= set(origin)
    assert len(pools[0].ranks) < rpr and set(pools[0].ranks) | set(used) == set(origin)
    for f in formed_by[0]:
        assert [m.coordinate for m in f.members] == list(range(rpr))
        # a member moves only to a coordinate that no member had before (coordinates are kept where possible)
        assert all(m.coordinate not in {o.old_coordinate for o in f.members} for m in f.moved)


def test_a_formed_replica_takes_a_free_slot_or_waits_as_a_spare():
    roster = ReplicaRoster(active=[0, 1, 2])
    roster.on_failure([1])
    roster.on_failure([2])
    assert roster.add_replica(3) == 1  # the lowest free slot
    assert roster.add_replica(4) == 2
    by_slot = plan_step(7, 6, roster.active_slots())  # full width again: each computes its slot's failure-free samples
    failure_free = plan_step(7, 6, [0, 1, 2])
    assert (roster.replica_in_slot(1), roster.replica_in_slot(2)) == (3, 4)
    assert (by_slot[1], by_slot[2]) == (failure_free[1], failure_free[2])
    assert roster.add_replica(5) is None and roster.spares == [5]  # all slots held: a spare
    with pytest.raises(ValueError):
        roster.add_replica(5)
