"""Each replica's quota: logged (recycling), else re-planned by the workload planner from the repair events."""

from __future__ import annotations

from nanotron_recover.report.cli import load_timeline
from nanotron_recover.report.quotas import quota_series
from tests.report.fake_run import FakeRun


def test_quotas_are_replanned_through_a_failure_and_a_spare_activation(tmp_path):
    """2 replicas + a spare (replica 2), M = 4: replica 1 dies in step 2, replica 0 computes its orphans, the spare
    is activated at the end of step 2 and computes from step 3 on."""
    run = FakeRun(tmp_path, m=4, live=2)
    run.step(1, 8.0, first=True)
    run.repair(2, [1], detect_ms=1.0, total_ms=2.0, after=0.05, active_replicas=[0])
    run.event("spare_activated", after=0.01, replicas=[2], donor=0, transfer_ms=3.0)
    run.t -= 0.06
    run.live = 1
    run.step(2, 7.0, recoveries=1)
    run.live = 2
    run.step(3, 6.0)
    run.close()
    series, logged = quota_series(load_timeline(tmp_path), 4)
    assert not logged
    assert series == {1: {"0": 2, "1": 2}, 2: {"0": 4}, 3: {"0": 2, "2": 2}}


def test_a_replan_that_disagrees_with_the_record_is_left_out_and_logged_quotas_win(tmp_path):
    run = FakeRun(tmp_path / "a", m=4, live=2)
    run.step(1, 8.0, first=True)
    run.step(2, 7.0, microbatches=3)  # not what the planner gives 2 replicas
    run.close()
    assert quota_series(load_timeline(tmp_path / "a"), 4)[0] == {1: {"0": 2, "1": 2}}
    run = FakeRun(tmp_path / "b", m=4, live=2)
    run.step(1, 8.0, first=True, quotas={"0": 3, "3": 1}, pool_ranks=[5])
    run.close()
    tl = load_timeline(tmp_path / "b")
    assert quota_series(tl, 4) == ({1: {"0": 3, "3": 1}}, True)
    assert tl.final[0].pool_size == 1
