"""Back to full width (issue #40): the decision (pure, same inputs on every rank) and a real job that regrows.

The real job: 2 replicas, replica 1 SIGKILLed at step 20 with ``min_replicas: 1`` (survived in-step, then degraded),
``regrow: auto`` and a launcher that may relaunch in place once. The job stops at a step boundary a few steps later,
the launcher relaunches it at full width, and the run finishes with the failure-free losses, M microbatches every
step, every step logged once.
"""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.recovery.regrow import SETTLE_STEPS, STANDBY_WAIT_S, Regrow
from nanotron_recover.run.in_place import FULL_REPLICAS_ENV, IN_PLACE_ENV, RELAUNCH_S_ENV, STANDBY_READY_ENV
from nanotron_recover.run.run_folder import read_launches, read_metrics_jsonl
from tests.conftest import make_tiny_config


@pytest.fixture
def in_place(monkeypatch):
    monkeypatch.setenv(IN_PLACE_ENV, "1")
    monkeypatch.setenv(RELAUNCH_S_ENV, "30")


def test_regrow_waits_for_the_degraded_step_time_to_settle_then_stops_when_it_pays(in_place):
    regrow = Regrow("auto", full_width=4, mtbf_h=2.0)
    assert regrow.measured_relaunch_s == 30.0
    assert regrow.after_commit(1, 4, 0.10) is None and regrow.step_full_s == 0.10
    assert regrow.after_commit(2, 3, 0.50) is None  # the loss's own step (it holds the repair)
    for step in range(3, 2 + SETTLE_STEPS):
        assert regrow.after_commit(step, 3, 0.13) is None
    stop = regrow.after_commit(2 + SETTLE_STEPS, 3, 0.13)
    assert stop is not None and stop.event == "regrow_stop" and "back to 4 replicas" in stop.reason
    assert regrow.news["decision"] == "regrow" and regrow.news["relaunch_s"] == 30.0


def test_a_relaunch_that_costs_more_than_the_degraded_steps_waits(in_place, monkeypatch):
    monkeypatch.setenv(RELAUNCH_S_ENV, "3600")
    regrow = Regrow("auto", full_width=4, mtbf_h=0.5)  # 1800 s to the next failure: never pays 3600 s
    regrow.after_commit(1, 4, 0.10)
    decisions = [regrow.after_commit(step, 3, 0.13) for step in range(2, 40)]
    assert decisions == [None] * 38
    assert regrow.news is None or regrow.news["decision"] == "not yet"


def test_before_a_relaunch_was_measured_the_ranks_start_up_stands_for_its_cost(monkeypatch):
    monkeypatch.setenv(IN_PLACE_ENV, "1")
    monkeypatch.delenv(RELAUNCH_S_ENV, raising=False)
    regrow = Regrow("auto", full_width=2, mtbf_h=2.0)
    regrow.after_commit(1, 2, 0.1, startup_s=None)
    assert all(regrow.after_commit(s, 1, 0.2, startup_s=None) is None for s in range(2, 10))  # nothing to weigh
    stop = regrow.after_commit(10, 1, 0.2, startup_s=4.0)
    assert stop is not None and regrow.news["relaunch_s"] == 4.0


def test_a_launch_run_narrower_regrows_once_its_missing_node_is_back(in_place, monkeypatch):
    monkeypatch.setenv(FULL_REPLICAS_ENV, "2")  # the launcher left a node out: 1 replica of the job's 2
    regrow = Regrow("auto", full_width=1, mtbf_h=2.0)
    assert all(regrow.after_commit(s, 1, 0.2) is None for s in range(1, 20))  # at this launch's full width
    assert regrow.news is None
    decisions = [regrow.after_commit(s, 1, 0.2, nodes_back=True) for s in range(20, 20 + SETTLE_STEPS + 1)]
    assert decisions[:-1] == [None] * SETTLE_STEPS and decisions[-1] is not None
    assert "back to 2 replicas" in decisions[-1].reason
    news = regrow.news
    assert news["nodes_back"] and news["full_width"] == 2 and news["step_full_s"] == pytest.approx(0.1)  # estimated


def test_a_node_back_does_not_wait_for_a_standby_shaped_for_the_narrower_job(in_place, monkeypatch):
    monkeypatch.setenv(FULL_REPLICAS_ENV, "2")
    monkeypatch.setenv(STANDBY_READY_ENV, "/nonexistent/standby_ready")
    regrow = Regrow("auto", full_width=1, mtbf_h=2.0)
    regrow.after_commit(1, 1, 0.2)
    stops = [regrow.after_commit(s, 1, 0.2, nodes_back=True) for s in range(2, 3 + SETTLE_STEPS)]
    assert stops[-1] is not None and "waiting_for_standby" not in regrow.news


def test_regrow_is_off_without_a_relaunch_in_place_or_when_set_off(monkeypatch):
    monkeypatch.setenv(IN_PLACE_ENV, "0")
    monkeypatch.setenv(RELAUNCH_S_ENV, "1")
    assert not Regrow("auto", 4, 2.0).enabled  # the launcher has no relaunch left: a requeue is no quick way back
    monkeypatch.setenv(IN_PLACE_ENV, "2")
    assert Regrow("auto", 4, 2.0).enabled and not Regrow("off", 4, 2.0).enabled


def test_back_at_full_width_the_decision_starts_over(in_place):
    regrow = Regrow("auto", full_width=2, mtbf_h=2.0)
    regrow.after_commit(1, 2, 0.1)
    regrow.after_commit(2, 1, 0.2)
    regrow.after_commit(3, 2, 0.1)  # a spare took the slot: full width again
    assert regrow.degraded_since is None and regrow.after_commit(4, 2, 0.1) is None


def test_with_a_standby_started_after_the_loss_regrow_waits_until_a_rank_sees_it_ready(in_place, monkeypatch,
                                                                                     tmp_path):
    monkeypatch.setenv(STANDBY_READY_ENV, str(tmp_path / "standby_ready"))
    regrow = Regrow("auto", full_width=2, mtbf_h=2.0)
    regrow.after_commit(1, 2, 0.1)
    said = []
    for step in range(2, 30):
        assert regrow.after_commit(step, 1, 0.2, standby_ready=False) is None
        said += [regrow.news] if regrow.news is not None else []
    assert [(n["step"], n["decision"], n.get("waiting_for_standby")) for n in said] == [
        (2 + SETTLE_STEPS, "not yet", True)]  # it pays, but the standby is not ready: said once
    stop = regrow.after_commit(30, 1, 0.2, standby_ready=True)
    assert stop is not None and regrow.news["decision"] == "regrow" and "waiting_for_standby" not in regrow.news


def test_a_standby_that_never_gets_ready_is_waited_for_a_bounded_time_then_a_cold_relaunch_is_weighed(
        in_place, monkeypatch, tmp_path):
    monkeypatch.setenv(STANDBY_READY_ENV, str(tmp_path / "standby_ready"))
    regrow = Regrow("auto", full_width=2, mtbf_h=2.0)
    regrow.after_commit(1, 2, 0.1)
    step_s, stop, step = 0.5, None, 1
    while stop is None and step < 1000:
        step += 1
        stop = regrow.after_commit(step, 1, step_s, startup_s=5.0, standby_ready=False)
    assert stop is not None and (step - 2) * step_s >= STANDBY_WAIT_S
    assert regrow.news["relaunch_s"] == 5.0  # the ranks' own (cold) start-up, not the warm relaunch measured


def _kill_with_regrow(tmp_path, steps: int, kill_at: int, standby: str):
    """A failure-free reference, then the same job with replica 1 SIGKILLed at ``kill_at`` and one relaunch in
    place allowed: (reference, the launcher's result, run dir, metrics records, step records, regrow stops)."""
    ft = {"enabled": True, "min_replicas": 1, "local_snapshot_dir": str(tmp_path / "shm"), "standby": standby}
    reference = run_training(make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2, fault_tolerance=ft),
                             tmp_path / "reference", timeout_s=300, extra_args=["--synthetic-data"])
    inject = [{"step": kill_at, "replica": 1, "rank": 0, "phase": "backward"}]
    config = make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2, fault_tolerance={**ft, "inject": inject})
    run_dir = tmp_path / "run"
    result = run_training(config, run_dir, timeout_s=300, extra_args=["--synthetic-data", "--max-restarts", "1"])
    records = read_metrics_jsonl(run_dir)
    stops = [r for r in records if r.get("event") == "regrow_stop"]
    assert len(stops) == 1, result.output[-3000:]
    logged = [r for r in records if "event" not in r and "step" in r]
    return reference, result, run_dir, records, logged, stops


def _assert_the_failure_free_steps(logged, reference, steps: int) -> None:
    assert [r["step"] for r in logged] == list(range(1, steps + 1)), "a step computed twice, or one missing"
    assert all(r["microbatches"] == 4 for r in logged)  # M every step, degraded or not
    for got, want in zip([r["loss"] for r in logged], reference.losses, strict=True):
        assert abs(got - want) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_replica_comes_back_at_a_step_boundary_with_the_failure_free_losses(tmp_path):
    steps, kill_at = 120, 20
    reference, result, run_dir, records, logged, stops = _kill_with_regrow(tmp_path, steps, kill_at, "off")
    stopped_at = stops[0]["step"]
    assert kill_at + SETTLE_STEPS <= stopped_at <= kill_at + SETTLE_STEPS + 3  # a few steps after the loss
    assert [r["decision"] for r in records if r.get("event") == "regrow"][-1] == "regrow"
    assert len(read_launches(run_dir)) == 2
    _assert_the_failure_free_steps(logged, reference, steps)
    widths = {r["step"]: r["live_replicas"] for r in logged}
    assert all(widths[s] == 1 for s in range(kill_at + 1, stopped_at + 1))
    assert all(widths[s] == 2 for s in range(stopped_at + 1, steps + 1)), "back to full width after the stop"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_with_standby_after_loss_the_standby_starts_after_the_loss_and_the_regrow_is_warm(tmp_path):
    """``standby: after_loss``: no standby while the job trains at full width; after the kill the launcher starts
    one, the job trains degraded until a rank sees it ready, then stops and is relaunched from it (warm)."""
    steps, kill_at = 400, 20
    reference, result, run_dir, records, logged, stops = _kill_with_regrow(tmp_path, steps, kill_at, "after_loss")
    decisions = [r for r in records if r.get("event") == "regrow"]
    assert decisions[0]["decision"] == "not yet" and decisions[0].get("waiting_for_standby"), decisions
    assert decisions[-1]["decision"] == "regrow" and decisions[-1]["step"] == stops[0]["step"], decisions
    launches = read_launches(run_dir)
    assert [launch.get("warm") for launch in launches] == [False, True], (launches, result.output[-3000:])
    assert "waiting for the warm standby" not in result.output  # the job stopped once it was ready
    _assert_the_failure_free_steps(logged, reference, steps)
    widths = [r["live_replicas"] for r in logged]
    assert widths[-1] == 2 and widths.count(1) == stops[0]["step"] - kill_at + 1  # the loss's step too
