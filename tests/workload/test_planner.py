"""Planner: unit tests plus hypothesis properties (coverage, balance, proportionality, determinism)."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.workload.planner import merge, orphans_of, plan_step, quotas, replan_orphans

replica_sets = st.lists(st.integers(0, 63), min_size=1, max_size=12, unique=True)


@st.composite
def weighted_sets(draw):
    live = draw(replica_sets)
    ws = {r: draw(st.one_of(st.just(0.0), st.floats(0.01, 100.0))) for r in live}
    if all(w == 0 for w in ws.values()):
        ws[live[0]] = 1.0
    return live, ws


def _flat(plan):
    return sorted(i for ix in plan.values() for i in ix)


# ---- unit tests ---------------------------------------------------------------------------------------------


def test_failure_free_matches_nanotron_chunks():
    assert plan_step(0, 8, [0, 1, 2, 3]) == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}


def test_uneven_lowest_ids_get_extra():
    assert plan_step(3, 7, [5, 2, 9]) == {2: [0, 1, 2], 5: [3, 4], 9: [5, 6]}


def test_more_replicas_than_microbatches():
    assert plan_step(0, 2, [0, 1, 2]) == {0: [0], 1: [1], 2: []}


def test_weighted_example():
    # exact shares 2, 6 of 8 -> contiguous in id order
    assert plan_step(0, 8, [1, 0], {0: 1.0, 1: 3.0}) == {0: [0, 1], 1: [2, 3, 4, 5, 6, 7]}


def test_weighted_tie_breaks_by_lowest_id():
    # shares 1.5 / 1.5 -> remainder goes to replica 3 (lower id)
    assert quotas(3, [7, 3], {3: 1.0, 7: 1.0}) == {3: 2, 7: 1}


def test_zero_weight_gets_nothing():
    assert quotas(4, [0, 1], {0: 0.0, 1: 2.0}) == {0: 0, 1: 4}


def test_positive_weight_may_get_zero_when_share_below_one():
    q = quotas(10, [0, 1, 2], {0: 0.01, 1: 0.01, 2: 9.98})
    assert q == {0: 0, 1: 0, 2: 10}


@pytest.mark.parametrize(
    "args",
    [
        (0, 4, []),
        (0, 0, [0]),
        (-1, 4, [0]),
        (0, 4, [0, 0]),
        (0, 4, [-1]),
    ],
)
def test_invalid_inputs(args):
    with pytest.raises(ValueError):
        plan_step(*args)


@pytest.mark.parametrize(
    "weights", [{0: -1.0, 1: 1.0}, {0: 0.0, 1: 0.0}, {0: 1.0}, {0: float("nan"), 1: 1.0}, {0: float("inf"), 1: 1.0}]
)
def test_invalid_weights(weights):
    with pytest.raises(ValueError):
        plan_step(0, 4, [0, 1], weights)


def test_extra_weight_keys_ignored():
    assert plan_step(0, 4, [0, 1], {0: 1.0, 1: 1.0, 5: 100.0}) == plan_step(0, 4, [0, 1])


def test_replan_example():
    plan = plan_step(0, 8, [0, 1, 2, 3])
    orph = orphans_of(plan, [1])
    assert orph == [2, 3]
    new = replan_orphans(orph, [0, 2, 3], plan)
    assert new == {0: [2], 2: [3], 3: []}
    eff = merge(plan, new, failed=[1])
    assert _flat(eff) == list(range(8))
    assert sorted(len(v) for v in eff.values()) == [2, 3, 3]


def test_replan_fills_newcomer_first():
    plan = {0: [0, 1, 2], 1: [3, 4, 5]}
    new = replan_orphans([6, 7, 8], [0, 9], plan)  # 9: a just-activated spare with no work yet
    assert new == {0: [], 9: [6, 7, 8]}


def test_replan_errors():
    plan = {0: [0, 1], 1: [2, 3]}
    with pytest.raises(ValueError):
        replan_orphans([2], [], plan)
    with pytest.raises(ValueError):
        replan_orphans([0], [0], plan)  # still owned by a survivor
    with pytest.raises(ValueError):
        replan_orphans([2, 2], [0], plan)
    assert replan_orphans([], [1, 0], plan) == {0: [], 1: []}


def test_replan_zero_weight_survivor_gets_nothing():
    new = replan_orphans([4, 5, 6], [0, 1], {0: [0, 1], 1: [2, 3]}, {0: 0.0, 1: 1.0})
    assert new == {0: [], 1: [4, 5, 6]}


# ---- properties ---------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(replica_sets, st.integers(1, 200), st.integers(0, 10**6), st.randoms(use_true_random=False))
def test_prop_equal_weights(live, M, step, rnd):
    plan = plan_step(step, M, live)
    assert set(plan) == set(live)
    assert _flat(plan) == list(range(M))  # coverage + uniqueness
    sizes = [len(v) for v in plan.values()]
    assert max(sizes) - min(sizes) <= 1
    # contiguous ranges in replica-id order
    assert [i for r in sorted(plan) for i in plan[r]] == list(range(M))
    shuffled = list(live)
    rnd.shuffle(shuffled)
    assert plan_step(step, M, shuffled) == plan  # input-order independence / determinism
    assert plan_step(step + 1, M, live) == plan  # stable across steps


@settings(max_examples=300, deadline=None)
@given(weighted_sets(), st.integers(1, 200), st.randoms(use_true_random=False))
def test_prop_weighted(lw, M, rnd):
    live, ws = lw
    plan = plan_step(0, M, live, ws)
    assert _flat(plan) == list(range(M))
    assert [i for r in sorted(plan) for i in plan[r]] == list(range(M))
    total = sum(Fraction(w) for w in ws.values())
    for r in live:
        exact = M * Fraction(ws[r]) / total
        assert abs(len(plan[r]) - exact) < 1
        if ws[r] == 0:
            assert plan[r] == []
    shuffled = list(live)
    rnd.shuffle(shuffled)
    assert plan_step(0, M, shuffled, dict(reversed(list(ws.items())))) == plan


@settings(max_examples=300, deadline=None)
@given(replica_sets, st.integers(1, 200), st.data())
def test_prop_replan_orphans_equal(live, M, data):
    plan = plan_step(0, M, live)
    failed = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=len(live) - 1))
    survivors = [r for r in live if r not in failed]
    orph = orphans_of(plan, failed)
    new = replan_orphans(orph, survivors, plan)
    assert set(new) == set(survivors)
    assert _flat(new) == orph  # exactly the orphans, once each
    eff = merge(plan, new, failed)
    assert _flat(eff) == list(range(M))
    sizes = [len(v) for v in eff.values()]
    assert max(sizes) - min(sizes) <= 1  # started balanced -> stays balanced
    random.Random(M).shuffle(survivors)
    assert replan_orphans(list(reversed(orph)), survivors, plan) == new


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 20), st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 60))
def test_prop_replan_from_unbalanced(loads, n_orph):
    # arbitrary (unbalanced) current loads: whoever receives work ends within 1 of the least loaded
    start = 0
    plan = {}
    for r in sorted(loads):
        plan[r] = list(range(start, start + loads[r]))
        start += loads[r]
    orph = list(range(start, start + n_orph))
    new = replan_orphans(orph, list(loads), plan)
    assert _flat(new) == orph
    final = {r: loads[r] + len(new[r]) for r in loads}
    lo = min(final.values())
    for r in loads:
        if new[r]:
            assert final[r] <= lo + 1


@settings(max_examples=200, deadline=None)
@given(weighted_sets(), st.integers(1, 100), st.data())
def test_prop_replan_weighted_min_max(lw, M, data):
    live, ws = lw
    plan = plan_step(0, M, live, ws)
    failed = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=len(live) - 1))
    survivors = [r for r in live if r not in failed]
    if all(ws[r] == 0 for r in survivors):
        with pytest.raises(ValueError):
            replan_orphans([10**6], survivors, plan, ws)
        return
    orph = orphans_of(plan, failed)
    new = replan_orphans(orph, survivors, plan, ws)
    assert _flat(new) == orph
    # greedy optimality: moving one orphan from a receiver to any other survivor never lowers the finish time
    # of the receiver below the other's new finish time (no improving single move exists).
    fin = {r: Fraction(len(plan[r]) + len(new[r])) / Fraction(ws[r]) for r in survivors if ws[r] > 0}
    for r in survivors:
        if new[r]:
            assert ws[r] > 0
            for o in fin:
                if o != r:
                    assert Fraction(len(plan[o]) + len(new[o]) + 1) / Fraction(ws[o]) >= fin[r]
