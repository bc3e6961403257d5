"""The snapshot schedule: Young's rule, the fixed interval, the auto schedule's steps, and that every rank decides the
same from the step's world-wide sums whatever order MPI adds them in."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.config import config_from_dict
from nanotron_recover.recovery.step_sums import StepStats
from nanotron_recover.snapshots.schedule import SnapshotSchedule, next_interval, young_interval
from nanotron_recover.training.seam import LocalWork
from tests.conftest import make_tiny_config

HOUR = 3600.0


def test_young_interval_is_the_square_root_rule_in_steps_within_its_bounds():
    assert young_interval(0.5, 10.0, HOUR, 100) == 6  # sqrt(2 * 0.5 * 3600) = 60 s = 6 steps of 10 s
    assert young_interval(0.5, 10.0, 4 * HOUR, 100) == 12  # 4x the MTBF: 2x the interval
    assert young_interval(0.5, 10.0, HOUR, 4) == 4  # the cap: what a relaunch may lose
    assert young_interval(0.0, 10.0, HOUR, 10) == 1  # free snapshots: every step
    assert young_interval(1e-6, 10.0, HOUR, 10) == 1
    assert young_interval(0.5, 0.0, HOUR, 10) == 1  # no step time measured
    assert young_interval(0.5, 10.0, math.inf, 10) == 10  # not a number of steps (config refuses it): the cap


def test_a_fixed_interval_snapshots_the_multiples_of_it_and_zero_none():
    every3 = SnapshotSchedule.of(3, max_interval=10, mtbf_h=2.0)
    every3.observe(10**6, 1, 10**5, 1)  # measurements change nothing
    assert [s for s in range(1, 13) if every3.due(s)] == [3, 6, 9, 12]
    off = SnapshotSchedule.of(0, max_interval=10, mtbf_h=2.0)
    assert not any(off.due(s) for s in range(1, 13))


def test_auto_snapshots_every_step_until_a_write_is_measured_then_every_young_interval():
    schedule = SnapshotSchedule.of("auto", max_interval=4, mtbf_h=2.0)
    due = []
    for step in range(11, 25):  # a launch that resumed at step 10
        if step >= 13:  # from here on, writes of 0.2 s in steps of 0.1 s: Young says ~537 steps, capped at 4
            schedule.observe(2 * 200_000, 2, 4 * 100_000, 4)
        else:
            schedule.observe(0, 0, 4 * 100_000, 4)
        due.append(step) if schedule.due(step) else None
    assert due == [11, 12, 16, 20, 24]
    assert schedule.interval == 4 and schedule.cost_s == pytest.approx(0.2) and schedule.step_s == pytest.approx(0.1)


def test_auto_with_cheap_writes_and_frequent_faults_stays_near_every_step():
    schedule = SnapshotSchedule.of("auto", max_interval=10, mtbf_h=0.001)  # a fault every 3.6 s
    schedule.observe(1_000, 1, 1_000_000, 1)  # 1 ms writes, 1 s steps: sqrt(2 * 0.001 * 3.6) = 0.08 s
    assert schedule.interval == 1
    assert all(schedule.due(s) for s in range(1, 6))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=30.0), min_size=1, max_size=64), st.randoms())
def test_every_rank_decides_the_same_whatever_order_the_sums_come_in(costs, rnd):
    """Whole microseconds summed in float64 are exact in any order (MPI's reduction order is not fixed), so the
    interval that each rank draws from them is the same."""
    micros = [float(round(c * 1e6)) for c in costs]
    orders = [list(micros), list(reversed(micros)), rnd.sample(micros, len(micros))]
    intervals = set()
    for order in orders:
        total = 0.0
        for value in order:
            total += value
        pairwise = float(np.sum(np.array(order)))  # numpy sums pairwise: another order again
        assert total == pairwise == math.fsum(micros)
        schedule = SnapshotSchedule.of("auto", max_interval=50, mtbf_h=0.01)
        schedule.observe(total, len(order), 250_000.0 * len(order), len(order))
        intervals.add(schedule.interval)
    assert len(intervals) == 1


def test_the_step_stats_carry_a_ranks_write_cost_and_step_time_in_microseconds():
    stats = StepStats.of(config_from_dict(make_tiny_config(dp=2, accumulation=2, fault_tolerance={"enabled": True})))
    stats.fill(1.0, LocalWork(), counts=True, slot=0, snapshot_cost_s=0.0123456, step_s=0.5)
    assert stats.snapshot_sums() == (12346.0, 1.0, 500000.0, 1.0)
    stats.fill(1.0, LocalWork(), counts=True, slot=0)  # nothing measured yet: nothing counted
    assert stats.snapshot_sums() == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("bad", ["every", -1, 2.5, True])
def test_a_bad_interval_setting_is_refused_before_launch(bad):
    with pytest.raises(ValueError, match="local_snapshot_interval"):
        config_from_dict(make_tiny_config(dp=2, accumulation=2,
                                          fault_tolerance={"enabled": True, "local_snapshot_interval": bad}))


def test_auto_is_the_default_and_its_bounds_are_checked():
    raw = make_tiny_config(dp=2, accumulation=2, fault_tolerance={"enabled": True})
    assert config_from_dict(raw).fault_tolerance.local_snapshot_interval == "auto"
    for key, value in (("local_snapshot_max_interval", 0), ("relaunch_mtbf_h", 0), ("relaunch_mtbf_h", math.inf)):
        with pytest.raises(ValueError, match=key):
            config_from_dict(make_tiny_config(dp=2, accumulation=2,
                                              fault_tolerance={"enabled": True, key: value}))


def test_shuffled_sums_in_a_random_world_give_one_schedule_per_step():
    """A world of ranks with different costs and step times, their contributions added in a new random order each
    step on each rank: every rank's schedule snapshots the same steps."""
    rng = random.Random(5)
    ranks = 12
    schedules = [SnapshotSchedule.of("auto", max_interval=8, mtbf_h=0.002) for _ in range(ranks)]
    due: list[list[int]] = [[] for _ in range(ranks)]
    for step in range(1, 60):
        costs = [float(rng.randrange(0, 400_000)) for _ in range(ranks)]
        times = [float(rng.randrange(50_000, 400_000)) for _ in range(ranks)]
        for rank, schedule in enumerate(schedules):
            order = rng.sample(range(ranks), ranks)
            schedule.observe(sum(costs[i] for i in order), ranks, sum(times[i] for i in order), ranks)
            if schedule.due(step):
                due[rank].append(step)
    assert all(d == due[0] for d in due) and 1 < len(due[0]) < 59


def test_a_changed_auto_interval_is_reported_once_and_a_fixed_one_never():
    schedule = SnapshotSchedule.of("auto", max_interval=5, mtbf_h=2.0)
    assert schedule.commit(1, (0, 0, 100_000, 1)) and schedule.news(1) is None  # nothing measured: every step
    assert not schedule.commit(2, (50_000, 1, 100_000, 1))  # 50 ms writes in 0.1 s steps: the cap, 5
    assert schedule.news(2) == {"event": "snapshot_interval", "step": 2, "interval": 5, "write_cost_s": 0.05,
                                "step_s": 0.1}
    assert schedule.news(3) is None
    fixed = SnapshotSchedule.of(2, max_interval=5, mtbf_h=2.0)
    assert fixed.commit(2, (50_000, 1, 100_000, 1)) and fixed.due_now and fixed.news(2) is None


def test_the_auto_interval_moves_only_when_youngs_value_leaves_the_band_around_it():
    def cost(steps: float) -> float:  # the write cost for which Young says ``steps`` steps of 0.1 s (MTBF 1 s)
        return (0.1 * steps) ** 2 / 2

    assert next_interval(2, cost(2.9), 0.1, 1.0, 10) == 2  # within [2 / 1.5, 2 x 1.5]: kept
    assert next_interval(2, cost(1.4), 0.1, 1.0, 10) == 2
    assert next_interval(2, cost(3.1), 0.1, 1.0, 10) == 3  # outside: Young's interval
    assert next_interval(2, cost(1.3), 0.1, 1.0, 10) == 1
    assert next_interval(4, 0.2, 0.1, HOUR, 10) == 10  # far more than the cap: the cap
    assert next_interval(10, 0.2, 0.1, HOUR, 10) == 10


def test_write_costs_that_wander_near_a_rounding_boundary_change_the_interval_once():
    """Young's value hovering between 1.4 and 1.7 steps (writes of 1.1-1.6 ms, steps of 0.1 s, a fault every 9 s):
    without the band the interval flipped between 1 and 2 every step, with an event each time; now it moves once."""
    schedule = SnapshotSchedule.of("auto", max_interval=10, mtbf_h=9 / HOUR)
    intervals, events = [], 0
    for step in range(1, 41):
        cost_us = 1_090 if step % 2 else 1_605  # sqrt(2 x cost x 9 s) = 0.140 s and 0.170 s: 1.40 and 1.70 steps
        schedule.commit(step, (cost_us, 1, 100_000, 1))
        events += schedule.news(step) is not None
        intervals.append(schedule.interval)
    assert intervals == [1] + [2] * 39 and events == 1
    assert young_interval(0.001090, 0.1, 9.0, 10) == 1 and young_interval(0.001605, 0.1, 9.0, 10) == 2  # the flip


def test_the_settings_read_a_config_and_say_what_0_means() -> None:
    from types import SimpleNamespace

    from nanotron_recover.config import FaultToleranceArgs
    from nanotron_recover.snapshots.settings import SnapshotSettings

    config = SimpleNamespace(fault_tolerance=FaultToleranceArgs(local_snapshot_interval=0, relaunch_mtbf_h=3.0))
    off = SnapshotSettings.of(config)
    assert not off.enabled and off.fixed == 0 and off.mtbf_h == 3.0
    assert not SnapshotSchedule.of_settings(off).commit(4, (0.0, 0.0, 0.0, 0.0))
    stand_in = SimpleNamespace(fault_tolerance=SimpleNamespace(local_snapshot_interval="auto", local_snapshot_dir="/x"))
    defaults, stock = SnapshotSettings.of(stand_in), FaultToleranceArgs()  # a stand-in takes the config's defaults
    assert (defaults.max_interval, defaults.mtbf_h, defaults.max_gb) == (
        stock.local_snapshot_max_interval, stock.relaunch_mtbf_h, stock.local_snapshot_max_gb)
    assert defaults.enabled and defaults.fixed is None
