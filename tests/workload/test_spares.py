"""ReplicaRoster: spare activation order, shrinking, slots, minimum width."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.workload.planner import plan_step
from nanotron_recover.workload.spares import ReplicaRoster, RosterChange


def test_spares_replace_lowest_first():
    ro = ReplicaRoster(active=[0, 1, 2, 3], spares=[6, 4, 5])
    ch = ro.on_failure([2, 1])
    assert ch.failed_active == (1, 2)
    assert ch.replacements == ((4, 1), (5, 2))
    assert ch.activated == (4, 5)
    assert ro.active == [0, 3, 4, 5] and ro.spares == [6]


def test_shrinks_when_spares_run_out():
    ro = ReplicaRoster(active=[0, 1, 2], spares=[3])
    ch = ro.on_failure([0, 2])
    assert ch.replacements == ((3, 0),)
    assert ro.active == [1, 3]
    assert ro.below_minimum(3) and not ro.below_minimum(2)


def test_failed_spare_just_disappears():
    ro = ReplicaRoster(active=[0, 1], spares=[2, 3])
    ch = ro.on_failure([2])
    assert ch.failed_active == () and ch.replacements == ()
    assert ro.spares == [3] and ro.retired == [2]
    ch = ro.on_failure([1])
    assert ch.replacements == ((3, 1),)


def test_failed_spare_and_active_together_use_next_spare():
    ro = ReplicaRoster(active=[0, 1], spares=[2, 3])
    ch = ro.on_failure([1, 2])
    assert ch.replacements == ((3, 1),)
    assert ro.active == [0, 3] and ro.spares == []


def test_every_active_replica_lost_is_replaced_while_spares_last():
    ro = ReplicaRoster(active=[0, 1], spares=[2, 3])
    ch = ro.on_failure([0, 1])
    assert ch.replacements == ((2, 0), (3, 1)) and ro.active == [2, 3]


def test_retired_ignored_unknown_rejected():
    ro = ReplicaRoster(active=[0, 1], spares=[])
    ro.on_failure([1])
    ch = ro.on_failure([1])
    assert ch == RosterChange((), ()) and ro.active == [0]
    with pytest.raises(ValueError):
        ro.on_failure([7])


def test_invalid_construction():
    with pytest.raises(ValueError):
        ReplicaRoster(active=[0, 1], spares=[1])
    with pytest.raises(ValueError):
        ReplicaRoster(active=[], spares=[1])


def test_slots_reproduce_failure_free_ranges():
    ro = ReplicaRoster(active=[0, 1, 2, 3], spares=[4])
    before = plan_step(0, 8, [0, 1, 2, 3])
    ro.on_failure([1])
    assert ro.replica_in_slot(1) == 4 and ro.active_slots() == [0, 1, 2, 3]
    by_slot = plan_step(1, 8, ro.active_slots())
    by_replica = {ro.replica_in_slot(s): ix for s, ix in by_slot.items()}
    assert by_replica[4] == before[1]
    with pytest.raises(KeyError):
        ro.replica_in_slot(9)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 6),
    st.lists(st.lists(st.integers(0, 13), max_size=4), max_size=5),
)
def test_prop_roster(n_active, n_spare, rounds):
    ro = ReplicaRoster(active=list(range(n_active)), spares=list(range(n_active, n_active + n_spare)))
    known = set(range(n_active + n_spare))
    for failed in rounds:
        failed = [f for f in failed if f in known]
        width, spares_before = len(ro.active), list(ro.spares)
        ch = ro.on_failure(failed)
        live_spares = [s for s in spares_before if s not in failed]
        # spares activated lowest id first, one per failed active replica while they last
        assert list(ch.activated) == live_spares[: len(ch.failed_active)]
        assert [d for _, d in ch.replacements] == list(ch.failed_active[: len(ch.replacements)])
        shrunk_by = max(0, len(ch.failed_active) - len(live_spares))
        assert len(ro.active) == width - shrunk_by
        assert not set(ro.active) & set(ro.retired) and not set(ro.spares) & set(ro.retired)
        assert set(ro.active) | set(ro.spares) | set(ro.retired) == known
        assert len(set(ro.active_slots())) == len(ro.active)  # slots stay unique
        assert all(ro.replica_in_slot(s) in ro.active for s in ro.active_slots())
