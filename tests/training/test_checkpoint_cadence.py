"""The ``auto`` checkpoint cadence as a pure function of the steps' agreed sums."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.training.checkpoint_cadence import CheckpointCadence, cadence_interval_s


def test_the_interval_is_young_daly_on_the_mtbf_within_its_bounds() -> None:
    week = 168 * 3600.0
    assert cadence_interval_s(0.5, week, 60.0, 3600.0) == pytest.approx(math.sqrt(2 * 0.5 * week))  # ~778 s
    assert cadence_interval_s(1e-4, week, 60.0, 3600.0) == 60.0  # a cheap save: at most once a minute
    assert cadence_interval_s(100.0, week, 60.0, 3600.0) == 3600.0  # a costly one: at least once an hour
    assert cadence_interval_s(None, week, 60.0, 3600.0) == 60.0  # not measured yet: the first save measures it


def test_saves_come_when_the_training_since_the_newest_checkpoint_reaches_the_interval() -> None:
    cadence = CheckpointCadence(mtbf_s=200.0, min_s=1.0, max_s=100.0, last_saved=10)  # resumed: newest checkpoint 10
    saved = []
    for step in range(11, 60):
        cadence.observe(0.25, 0.04 if saved else None)  # a save measured from the first one on
        if cadence.due(step):
            saved.append(step)
    # first: the minimum (1 s = 4 steps of 0.25 s) since step 10; then sqrt(2 x 0.04 x 200) = 4 s = 16 steps
    assert saved == [14, 30, 46]
    assert cadence.event(46) == {"event": "checkpoint_cadence", "step": 46, "interval_s": 4.0, "stall_s": 0.04,
                                 "step_s": 0.25, "mtbf_h": round(200 / 3600, 3)}


def test_nothing_is_saved_before_a_step_time_is_known() -> None:
    cadence = CheckpointCadence(mtbf_s=1.0, min_s=1e-9, max_s=1.0)
    cadence.observe(None, None)
    assert not cadence.due(1)


@given(st.floats(0.001, 10.0), st.integers(1, 300), st.floats(0.0, 50.0), st.floats(1.0, 1e6))
def test_the_same_sums_give_the_same_steps_and_the_gaps_follow_the_rule(step_s, n, stall_s, mtbf_s) -> None:
    runs = [CheckpointCadence(mtbf_s=mtbf_s, min_s=5.0, max_s=600.0) for _ in range(2)]  # two ranks, same sums
    saved: list[list[int]] = [[], []]
    for step in range(1, n + 1):
        for rank, cadence in enumerate(runs):
            cadence.observe(step_s, stall_s)
            if cadence.due(step):
                saved[rank].append(step)
    assert saved[0] == saved[1]
    interval = cadence_interval_s(stall_s, mtbf_s, 5.0, 600.0)
    gap = max(1, math.ceil(interval / step_s))  # the fewest steps that span the interval (float rounding aside:)
    while gap > 1 and (gap - 1) * step_s >= interval:
        gap -= 1
    while gap * step_s < interval:
        gap += 1
    assert all(b - a == gap for a, b in zip([0, *saved[0]], saved[0]))  # each save exactly one interval on
    assert n - (saved[0] or [0])[-1] < gap  # and no interval's worth of steps left unsaved at the end
