"""The rebalancer: EWMA, hysteresis, weights, persistent stragglers; unit tests plus hypothesis properties (the same
agreed speeds give the same quotas on every rank, quotas always sum to M, a drained or weight-0 replica gets 0)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.workload.planner import plan_step, quotas
from nanotron_recover.workload.rebalance import Rebalancer, RebalanceSettings, ewma, predicted_step_s

ON = RebalanceSettings(rebalance=True, smoothing=0.5, hysteresis=0.1)


def warm(M: int, settings: RebalanceSettings = RebalanceSettings()) -> Rebalancer:
    """A rebalancer past every replica's first measured step (which it leaves out)."""
    return Rebalancer(M, settings, warmed=set(range(64)))


def feed(balancer: Rebalancer, per_microbatch_s: dict[int, float], steps: int = 1) -> dict[int, int]:
    """``steps`` committed steps in which each replica computed its quota at the given speed; the last quotas."""
    for _ in range(steps):
        q = quotas(balancer.M, sorted(per_microbatch_s), balancer.weights(sorted(per_microbatch_s)))
        balancer.observe({r: q[r] * s for r, s in per_microbatch_s.items()}, q, computing=sorted(per_microbatch_s))
    return quotas(balancer.M, sorted(per_microbatch_s), balancer.weights(sorted(per_microbatch_s)))


def test_ewma_takes_the_first_value_then_moves_by_the_smoothing() -> None:
    assert ewma(None, 2.0, 0.3) == 2.0
    assert ewma(2.0, 4.0, 0.5) == 3.0
    assert predicted_step_s({0: 3, 1: 1}, {0: 1.0, 1: 4.0}) == 4.0


def test_each_replicas_first_measured_step_is_left_out() -> None:
    balancer = Rebalancer(12, ON)
    balancer.observe({0: 4.0, 1: 0.04}, {0: 4, 1: 4}, computing=[0, 1])  # replica 0's start-up costs
    assert balancer.estimates == {} and balancer.warmed == {0, 1}
    balancer.observe({0: 0.04, 1: 0.04, 2: 9.0}, {0: 4, 1: 4, 2: 4}, computing=[0, 1, 2])  # 2: a new spare
    assert balancer.estimates == {0: 0.01, 1: 0.01}
    assert balancer.weights([0, 1, 2]) is None  # equal speeds: the quotas in use stay


def test_off_nothing_changes_the_plan() -> None:
    balancer = warm(12)
    feed(balancer, {0: 0.01, 1: 0.01, 2: 0.04}, steps=5)
    assert balancer.weights([0, 1, 2]) is None  # the planner's equal split, untouched
    assert set(balancer.speeds([0, 1, 2])) == {0, 1, 2}  # still measured (logged)


def test_a_slow_replica_gets_fewer_microbatches_and_the_step_gets_shorter() -> None:
    balancer = warm(28, ON)
    speeds = {0: 0.01, 1: 0.01, 2: 0.01, 3: 0.02}  # replica 3 at half speed
    assert feed(balancer, speeds) == {0: 8, 1: 8, 2: 8, 3: 4}
    assert predicted_step_s({0: 8, 1: 8, 2: 8, 3: 4}, speeds) == pytest.approx(0.08)  # static: 7 x 0.02 = 0.14


def test_hysteresis_keeps_the_quotas_on_noise() -> None:
    balancer = warm(12, ON)
    seen = {tuple(sorted(feed(balancer, {r: 0.010 * (1 + 0.04 * ((k + r) % 3 - 1)) for r in range(3)}).items()))
            for k in range(30)}
    assert seen == {((0, 4), (1, 4), (2, 4))}  # +-4 % noise never moves a microbatch


def test_replicas_without_a_measurement_are_estimated_from_the_others() -> None:
    balancer = warm(12, RebalanceSettings(rebalance=True, hysteresis=0.0, fixed={0: 1.0, 1: 1.0, 2: 2.0}))
    assert balancer.weights([0, 1, 2]) == {0: 1.0, 1: 1.0, 2: 2.0}  # the prior before anything was measured
    feed(balancer, {0: 0.02, 1: 0.02})
    weights = balancer.weights([0, 1, 2])  # replica 2 (a spare that just took a slot) counts as twice as fast
    assert weights[2] == pytest.approx(2 * weights[0])


def test_fixed_weights_without_rebalancing_are_the_plan_and_formed_replicas_get_the_smallest() -> None:
    balancer = warm(12, RebalanceSettings(fixed={0: 2.0, 1: 1.0}))
    feed(balancer, {0: 0.5, 1: 0.01}, steps=3)  # measurements do not move a fixed plan
    assert balancer.weights([0, 1, 5]) == {0: 2.0, 1: 1.0, 5: 1.0}


def test_a_persistent_straggler_is_drained_after_k_steps_and_never_all() -> None:
    balancer = warm(12, RebalanceSettings(straggler_factor=3.0, straggler_steps=3))
    speeds = {0: 0.01, 1: 0.01, 2: 0.05}
    feed(balancer, speeds, steps=2)
    assert not balancer.drained
    assert feed(balancer, speeds) == {0: 6, 1: 6, 2: 0}  # weight 0 from the third slow step on
    assert balancer.drained == {2}
    assert quotas(12, [2], balancer.weights([2])) == {2: 12}  # alone, a drained replica computes (somebody must)


def test_a_slow_step_between_fast_ones_resets_the_straggler_count() -> None:
    balancer = warm(12, RebalanceSettings(smoothing=1.0, straggler_factor=2.0, straggler_steps=2))
    for slow in (0.05, 0.01, 0.05, 0.01):
        feed(balancer, {0: 0.01, 1: 0.01, 2: slow})
    assert not balancer.drained


# ---- properties ------------------------------------------------------------------------------------------------
speed = st.floats(1e-4, 10.0, allow_nan=False, allow_infinity=False)
observations = st.lists(st.dictionaries(st.integers(0, 5), st.tuples(speed, st.integers(0, 8)), min_size=1),
                        min_size=1, max_size=8)
config = st.builds(RebalanceSettings, rebalance=st.booleans(), smoothing=st.floats(0.05, 1.0),
                   hysteresis=st.floats(0.0, 0.5), straggler_factor=st.one_of(st.none(), st.floats(1.1, 5.0)),
                   straggler_steps=st.integers(1, 4))


@given(config, observations, st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_the_same_agreed_speeds_give_the_same_quotas_on_every_rank(cfg, steps, M) -> None:
    """Three ranks, built alike, fed the same committed stats: the same weights and quotas after every step; the
    quotas sum to M and every drained replica gets 0."""
    ranks = [Rebalancer(M, cfg) for _ in range(3)]
    live = list(range(6))
    for step in steps:
        seconds = {r: s * n for r, (s, n) in step.items()}
        counts = {r: n for r, (s, n) in step.items()}
        for balancer in ranks:
            balancer.observe(dict(seconds), dict(counts), computing=live)
        weights = [b.weights(live) for b in ranks]
        assert weights[0] == weights[1] == weights[2]
        plans = [plan_step(1, M, live, w) for w in weights]
        assert plans[0] == plans[1] == plans[2]
        q = quotas(M, live, weights[0])
        assert sum(q.values()) == M
        assert all(q[r] == 0 for r in ranks[0].drained)
        assert len(ranks[0].drained) < len(live)
        assert all(math.isfinite(w) and w >= 0 for w in (weights[0] or {}).values())


@given(st.dictionaries(st.integers(0, 9), st.floats(0.0, 100.0), min_size=1), st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_a_replica_with_weight_0_gets_0(weights, M) -> None:
    if all(w == 0 for w in weights.values()):
        weights[min(weights)] = 1.0
    q = quotas(M, sorted(weights), weights)
    assert sum(q.values()) == M
    assert all(q[r] == 0 for r, w in weights.items() if w == 0)
