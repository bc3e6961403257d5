"""Back to full width (issue #40): the launcher's decision (pure: the launcher's facts and the logged step times) and
a real job that regrows.

The real job: 2 replicas, replica 1 SIGKILLed at step 20 with ``min_replicas: 1`` (survived in-step, then degraded),
``regrow: auto`` and a launcher that may relaunch in place once. The launcher stops the job at a step boundary a few
steps later (the graceful stop), relaunches it at full width, and the run finishes with the failure-free losses, M
microbatches every step, every step logged once.
"""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.regrow import SETTLE_STEPS, STANDBY_WAIT_S, Regrow
from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.run_folder import read_launches, read_metrics_jsonl
from tests.conftest import make_tiny_config

STOP_LANDS_S = 2.0  # decision read from a step record -> the job's last step (SIGUSR1, next step's sums): measured
# Microbatches per replica in the real jobs: enough compute that one replica's step is clearly slower than two's
# (measured on 2 cores, 2 layers: 26 ms at full width, 49 ms degraded; with 2, 8 ms and 13 ms, close enough for the
# load of a busy machine to hide the difference, and the regrow then rightly does not pay).
ACCUMULATION = 8


def regrow(full_width: int, mtbf_h: float = 2.0, *, job_width: int | None = None, restarts_left: int = 1,
           relaunch_s: float | None = 30.0, standby_follows: bool = False, setting: str = "auto") -> Regrow:
    """The launcher's regrow for a launch of ``full_width`` replicas (of a job of ``job_width``)."""
    decision = Regrow(setting, job_width or full_width, mtbf_h)
    decision.begin(full_width, restarts_left=restarts_left, relaunch_s=relaunch_s, standby_follows=standby_follows)
    return decision


def test_regrow_waits_for_the_degraded_step_time_to_settle_then_stops_when_it_pays():
    decision = regrow(4)
    assert decision.measured_relaunch_s == 30.0
    assert decision.after_commit(1, 4, 0.10) is None and decision.step_full_s == 0.10
    assert decision.after_commit(2, 3, 0.50) is None  # the loss's own step (it holds the repair)
    for step in range(3, 2 + SETTLE_STEPS):
        assert decision.after_commit(step, 3, 0.13) is None
    why = decision.after_commit(2 + SETTLE_STEPS, 3, 0.13)
    assert why is not None and "back to 4 replicas" in why
    assert decision.news["decision"] == "regrow" and decision.news["relaunch_s"] == 30.0
    assert decision.after_commit(3 + SETTLE_STEPS, 3, 0.13) is None  # asked once per launch


def test_a_decision_is_news_once_the_records_after_it_are_events():
    decision = regrow(2)
    decision.observe({"step": 1, "live_replicas": 2, "step_time_s": 0.1})
    for step in range(2, 3 + SETTLE_STEPS):
        decision.observe({"step": step, "live_replicas": 1, "step_time_s": 0.2})
    assert decision.news is not None and decision.news["decision"] == "regrow"
    decision.observe({"event": "local_snapshot", "step": 2 + SETTLE_STEPS})  # the step's own event, read after it
    assert decision.news is None  # said once: the launcher logs each decision once


def test_a_relaunch_that_costs_more_than_the_degraded_steps_waits():
    decision = regrow(4, mtbf_h=0.5, relaunch_s=3600)  # 1800 s to the next failure: never pays 3600 s
    decision.after_commit(1, 4, 0.10)
    decisions = [decision.after_commit(step, 3, 0.13) for step in range(2, 40)]
    assert decisions == [None] * 38
    assert decision.news is None or decision.news["decision"] == "not yet"


def test_before_a_relaunch_was_measured_the_launchs_start_up_stands_for_its_cost():
    decision = regrow(2, relaunch_s=None)
    assert decision.observe({"step": 1, "live_replicas": 2, "step_time_s": 0.1}) is None
    assert all(decision.observe({"step": s, "live_replicas": 1, "step_time_s": 0.2}) is None for s in range(2, 10))
    decision.observe({"event": "startup", "step": 0, "seconds": 4.0})  # the launch's start-up event
    why = decision.observe({"step": 10, "live_replicas": 1, "step_time_s": 0.2})
    assert why is not None and decision.news["relaunch_s"] == 4.0


def test_a_node_back_early_in_a_slow_start_is_weighed_on_the_launchs_recent_steps():
    """The node answers again 3 steps into the narrower launch, whose first steps were slow (warm-up, a standby
    importing beside them): the job's full-width step is estimated from the same recent steps, so the regrow pays
    (seen on the Slurm bed: estimated from the slow first steps, 0.12 s against 0.076 s now, it never did)."""
    decision = regrow(1, job_width=2)
    assert all(decision.after_commit(s, 1, 0.25) is None for s in range(1, 4))
    decisions = [decision.after_commit(s, 1, 0.076, nodes_back=True) for s in range(4, 4 + SETTLE_STEPS + 1)]
    assert decisions[-1] is not None and decision.news["step_full_s"] == pytest.approx(0.038)


def test_a_launch_run_narrower_regrows_once_its_missing_node_is_back():
    decision = regrow(1, job_width=2)  # the launcher left a node out: 1 replica of the job's 2
    assert all(decision.after_commit(s, 1, 0.2) is None for s in range(1, 20))  # at this launch's full width
    assert decision.news is None
    decisions = [decision.after_commit(s, 1, 0.2, nodes_back=True) for s in range(20, 20 + SETTLE_STEPS + 1)]
    assert decisions[:-1] == [None] * SETTLE_STEPS and decisions[-1] is not None
    assert "back to 2 replicas" in decisions[-1]
    news = decision.news
    assert news["nodes_back"] and news["full_width"] == 2 and news["step_full_s"] == pytest.approx(0.1)  # estimated


def test_a_node_back_does_not_wait_for_a_standby_shaped_for_the_narrower_job():
    decision = regrow(1, job_width=2, standby_follows=True)
    decision.after_commit(1, 1, 0.2)
    stops = [decision.after_commit(s, 1, 0.2, nodes_back=True) for s in range(2, 3 + SETTLE_STEPS)]
    assert stops[-1] is not None and "waiting_for_standby" not in decision.news


def test_regrow_is_off_without_a_relaunch_in_place_or_when_set_off():
    assert not regrow(4, restarts_left=0).enabled  # no relaunch left: a requeue is no quick way back
    assert regrow(4, restarts_left=2).enabled and not regrow(4, setting="off").enabled


def test_back_at_full_width_the_decision_starts_over():
    decision = regrow(2)
    decision.after_commit(1, 2, 0.1)
    decision.after_commit(2, 1, 0.2)
    decision.after_commit(3, 2, 0.1)  # a spare took the slot: full width again
    assert decision.degraded_since is None and decision.after_commit(4, 2, 0.1) is None


def test_with_a_standby_started_after_the_loss_regrow_waits_until_it_is_ready():
    decision = regrow(2, standby_follows=True)
    decision.after_commit(1, 2, 0.1)
    said = []
    for step in range(2, 30):
        assert decision.after_commit(step, 1, 0.2, standby_ready=False) is None
        said += [decision.news] if decision.news is not None else []
    assert [(n["step"], n["decision"], n.get("waiting_for_standby")) for n in said] == [
        (2 + SETTLE_STEPS, "not yet", True)]  # it pays, but the standby is not ready: said once
    why = decision.after_commit(30, 1, 0.2, standby_ready=True)
    assert why is not None and decision.news["decision"] == "regrow" and "waiting_for_standby" not in decision.news


def test_a_standby_that_never_gets_ready_is_waited_for_a_bounded_time_then_a_cold_relaunch_is_weighed():
    decision = regrow(2, standby_follows=True)
    decision.observe({"event": "startup", "step": 0, "seconds": 5.0})
    decision.after_commit(1, 2, 0.1)
    step_s, why, step = 0.5, None, 1
    while why is None and step < 1000:
        step += 1
        why = decision.after_commit(step, 1, step_s, standby_ready=False)
    assert why is not None and (step - 2) * step_s >= STANDBY_WAIT_S
    assert decision.news["relaunch_s"] == 5.0  # the ranks' own (cold) start-up, not the warm relaunch measured


def _kill_with_regrow(tmp_path, steps: int, kill_at: int, standby: str):
    """A failure-free reference, then the same job with replica 1 SIGKILLed at ``kill_at`` and one relaunch in
    place allowed: (reference, the launcher's result, run dir, metrics records, step records, regrow stops)."""
    ft = {"enabled": True, "min_replicas": 1, "local_snapshot_dir": str(tmp_path / "shm"), "standby": standby}
    shape = {"dp": 2, "accumulation": ACCUMULATION, "steps": steps, "layers": 2}
    reference = run_training(make_tiny_config(**shape, fault_tolerance=ft), tmp_path / "reference", timeout_s=300,
                             extra_args=["--synthetic-data"])
    inject = [{"step": kill_at, "replica": 1, "rank": 0, "phase": "backward"}]
    config = make_tiny_config(**shape, fault_tolerance={**ft, "inject": inject})
    run_dir = tmp_path / "run"
    result = run_training(config, run_dir, timeout_s=300, extra_args=["--synthetic-data", "--max-restarts", "1"])
    records = read_metrics_jsonl(run_dir)
    stops = [r for r in records if r.get("event") == "regrow_stop"]
    assert len(stops) == 1, result.output[-3000:]
    logged = [r for r in records if "event" not in r and "step" in r]
    return reference, result, run_dir, records, logged, stops


def assert_the_stop_lands_soon_after_the_decision(logged, decided_at: int, stopped_at: int) -> None:
    """The launcher decides on a step's record, after its commit; the job's last step comes within
    :data:`STOP_LANDS_S` of that step (the launcher's look, the signal through mpirun, the next step's sums)."""
    times = {r["step"]: r["time"] for r in logged}
    took = times[stopped_at] - times[decided_at]
    assert stopped_at > decided_at and took <= STOP_LANDS_S, (decided_at, stopped_at, took)
    print(f"\nregrow decided at step {decided_at}, the job's last step {stopped_at} ({took:.2f} s later)")


def _assert_the_failure_free_steps(logged, reference, steps: int) -> None:
    assert [r["step"] for r in logged] == list(range(1, steps + 1)), "a step computed twice, or one missing"
    assert all(r["microbatches"] == 2 * ACCUMULATION for r in logged)  # M every step, degraded or not
    for got, want in zip([r["loss"] for r in logged], reference.losses, strict=True):
        assert abs(got - want) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_replica_comes_back_at_a_step_boundary_with_the_failure_free_losses(tmp_path):
    steps, kill_at = 120, 20
    reference, result, run_dir, records, logged, stops = _kill_with_regrow(tmp_path, steps, kill_at, "off")
    stopped_at, decided_at = stops[0]["step"], stops[0]["decided_at_step"]
    assert kill_at + SETTLE_STEPS <= decided_at <= kill_at + SETTLE_STEPS + 3  # decided a few steps after the loss
    assert_the_stop_lands_soon_after_the_decision(logged, decided_at, stopped_at)
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
    assert decisions[-1]["decision"] == "regrow" and decisions[-1]["step"] == stops[0]["decided_at_step"], decisions
    assert_the_stop_lands_soon_after_the_decision(logged, stops[0]["decided_at_step"], stops[0]["step"])
    launches = read_launches(run_dir)
    assert [launch.get("warm") for launch in launches] == [False, True], (launches, result.output[-3000:])
    assert "waiting for the warm standby" not in result.output  # the job stopped once it was ready
    _assert_the_failure_free_steps(logged, reference, steps)
    widths = [r["live_replicas"] for r in logged]
    assert widths[-1] == 2 and widths.count(1) == stops[0]["step"] - kill_at + 1  # the loss's step too
