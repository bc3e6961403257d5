"""The summary's numbers against the records of a run folder written with the real writers."""

from __future__ import annotations

import pytest

from nanotron_recover.report.cli import load_timeline
from nanotron_recover.report.summary import (
    LOST_BETWEEN,
    LOST_DETECT_REPAIR,
    LOST_HANG,
    LOST_LAUNCH_END,
    LOST_RECOVERY,
    LOST_RELAUNCH,
    LOST_REPLAYED,
    _regrow_line,
    format_summary,
    summarize,
)
from nanotron_recover.run import run_folder
from tests.report.fake_run import FakeRun


def test_faults_repairs_and_hangs_are_counted_from_the_records(relaunched_run):
    s = summarize(load_timeline(relaunched_run.run_dir))
    assert s.faults_by_kind == {"kill": 1, "stop": 1}
    assert s.faults_by_phase == {"backward": 1, "forward": 1}
    assert s.hang_events_by_reason == {"silent": 1} and s.hang_killed_ranks == [1]
    assert (s.repairs, s.repairs_without_failure) == (2, 0)
    assert s.detect_repair_median_ms == pytest.approx(30.0) and s.detect_repair_max_ms == pytest.approx(50.0)
    # injector's record -> the end of the repair that took the fault's replica out
    assert s.fault_to_repaired_s == pytest.approx([0.05, 4.0])


def test_relaunches_replays_and_samples(relaunched_run):
    s = summarize(load_timeline(relaunched_run.run_dir))
    assert [la.index for la in s.launches] == [1, 2]
    assert s.launches[1].resumed_from == 2 and s.launches[0].stopped.startswith("0 live replica")
    assert s.replayed_steps == [3, 4]
    assert s.final_steps == [1, 2, 3, 4, 5, 6] and s.step_records == 8
    assert (s.microbatches_per_step, s.failure_free_steps, s.micro_batch_size) == (4, 6, 2)
    assert s.committed_microbatches == s.failure_free_microbatches == 24
    assert s.short_steps == [] and s.missing_steps == []


def test_the_wall_time_is_split_by_cause(relaunched_run):
    s = summarize(load_timeline(relaunched_run.run_dir))
    lost = s.time_lost_s
    assert s.wall_s == pytest.approx(10.48, abs=1e-6)
    assert s.useful_s == pytest.approx(0.6, abs=1e-6)  # steps 1-2 of launch 1, 3-6 of launch 2
    assert lost[LOST_REPLAYED] == pytest.approx(0.6, abs=1e-6)  # launch 1's steps 3 and 4
    assert lost[LOST_BETWEEN] == pytest.approx(0.06, abs=1e-6)
    assert lost[LOST_HANG] == pytest.approx(4.0, abs=1e-6)  # last commit -> the hang kill
    assert lost[LOST_LAUNCH_END] == pytest.approx(0.21, abs=1e-6)
    assert lost[LOST_RELAUNCH] == pytest.approx(5.01, abs=1e-6)
    assert s.useful_s + sum(lost.values()) == pytest.approx(s.wall_s, abs=1e-6)
    assert s.effective_ratio == pytest.approx(0.6 / 10.48)


def test_a_failure_step_in_the_final_trajectory_books_its_excess(tmp_path):
    """Undisturbed steps 0.1 s; the failure step 0.5 s: 50 ms detect + repair, the rest recovery; a step with a hang
    event 4.2 s: the rest of it is the hang timeout."""
    run = FakeRun(tmp_path)
    for step in (1, 2):
        run.step(step, 8.0 - step, first=step == 1)
    run.repair(3, [1], detect_ms=20.0, total_ms=30.0, after=0.3)
    run.t -= 0.3
    run.step(3, 7.0, step_time=0.5, recoveries=1)
    run.fault("step4-replica0-rank2-backward-hang", after=0.02, step=4, replica=0, rank=2, phase="backward",
              signal="hang")
    run.t -= 0.02
    stacks = run_folder.write_hang_stacks(tmp_path, 2, 4, "thread MainThread:\n  ...\n")
    run.hang(after=4.0, reason="stuck", rank=2, step=4, stuck_s=4.0, stacks_file=str(stacks))
    run.hang(after=0.0, reason="stuck", rank=3, step=4, stuck_s=4.0, stacks_file=str(tmp_path / "hangs" / "gone.txt"))
    run.repair(4, [0], detect_ms=5.0, total_ms=5.0)
    run.t -= 4.0
    run.step(4, 6.9, step_time=4.2, recoveries=1)
    run.step(5, 6.8)
    run.close()
    s = summarize(load_timeline(tmp_path))
    assert s.time_lost_s[LOST_DETECT_REPAIR] == pytest.approx(0.05 + 0.01)
    assert s.time_lost_s[LOST_RECOVERY] == pytest.approx(0.35)
    assert s.time_lost_s[LOST_HANG] == pytest.approx(4.1 - 0.01)
    assert s.useful_s == pytest.approx(0.5)
    assert s.hang_stack_files == ["rank-2-step-4.txt"] and s.hang_killed_ranks == [2, 3]
    assert any("gone.txt, which is not there" in p for p in s.problems), s.problems


def test_short_and_missing_steps_and_the_loss_difference(tmp_path):
    a, b = FakeRun(tmp_path / "a", m=4), FakeRun(tmp_path / "b", m=4)
    a.config(dp=2, accumulation=2, train_steps=5)
    for step, loss in ((1, 8.0), (2, 7.0), (4, 6.0)):
        a.step(step, loss, first=step == 1, **({"microbatches": 3} if step == 2 else {}))
    for step, loss in ((1, 8.0), (2, 7.25), (3, 6.5), (4, 6.0)):
        b.step(step, loss, first=step == 1)
    a.close(), b.close()
    s = summarize(load_timeline(tmp_path / "a"), load_timeline(tmp_path / "b"))
    assert s.short_steps == [2] and s.missing_steps == [3]
    assert s.committed_microbatches == 11 and s.failure_free_microbatches == 20
    assert s.max_abs_dloss == pytest.approx(0.25) and s.compared_steps == 3
    text = format_summary(s)
    assert "max |dloss| vs --compare run: 0.25 over 3 common steps" in text
    assert "the run is not finished: step 4 of train_steps 5" in text


def test_the_text_names_every_number(relaunched_run):
    text = format_summary(summarize(load_timeline(relaunched_run.run_dir)))
    for expected in ("2 launch(es), 8 step records, final trajectory steps 1..6",
                     "by kind: kill 1, stop 1; by phase: backward 1, forward 1",
                     "hang events: silent 1; ranks killed as hung: [1]",
                     "detect + repair median 30.0 ms, max 50.0 ms",
                     "steps replayed after relaunches: 2 (3, 4)",
                     "launch 2 resumed from step 2 (launch 1 logged steps 1..4 after stopping",
                     "effective training time ratio: 0.057",
                     "committed: 48 samples (24 microbatches) of the failure-free 48 samples (24 microbatches)"):
        assert expected in text, text


def test_regrow_decisions_and_the_stop_they_end_a_launch_with_are_shown_with_their_numbers(tmp_path):
    """A replica lost after step 2: "not yet" at step 3, "regrow" at step 4 (the launch's last step, its
    regrow_stop event), the relaunch at full width resumes at step 5."""
    run = FakeRun(tmp_path)
    for step in (1, 2):
        run.step(step, 8.0 - step, first=step == 1)
    decision = {"computing_replicas": 1, "full_width": 2, "step_full_s": 0.1, "horizon_s": 36.0}
    for step, verdict, cost in ((3, "not yet", 0.9), (4, "regrow", 1.8)):
        run.step(step, 8.0 - step, step_time=0.2)
        run.event("regrow", step=step, decision=verdict, step_now_s=0.2, relaunch_s=1.25, degraded_cost_s=cost,
                  **decision, **({"waiting_for_standby": True} if step == 3 else {}))
    run.event("regrow_stop", step=4, reason="regrow: back to 2 replicas after step 4")
    run.relaunch(gap=1.5)
    for step in (5, 6):
        run.step(step, 8.0 - step, first=step == 5)
    run.close()
    s = summarize(load_timeline(tmp_path))
    assert [(e["step"], e["decision"]) for e in s.regrow_decisions] == [(3, "not yet"), (4, "regrow")]
    text = format_summary(s)
    assert "regrow decisions (fault_tolerance.regrow): not yet 1, regrow 1" in text, text
    assert ("step 4: regrow (1 of 2 replicas computing; step 200 ms against 100 ms at full width; degraded until the "
            "next failure (36 s) costs 1.80 s, a relaunch 1.25 s)") in text, text
    assert "launch 2 resumed from step 4 (launch 1 logged steps 1..4 after stopping: regrow: back to 2" in text, text
    assert "step 3: not yet (1 of 2 replicas computing, waiting for the standby; step 200 ms" in text, text


def test_a_regrow_decision_of_a_job_run_narrower_says_its_node_is_back():
    line = _regrow_line({"step": 9, "decision": "regrow", "computing_replicas": 1, "full_width": 2, "nodes_back": True,
                         "step_now_s": 0.2, "step_full_s": 0.1, "horizon_s": 7200, "degraded_cost_s": 3600,
                         "relaunch_s": 3.0})
    assert line.startswith("step 9: regrow (1 of 2 replicas computing, a node left out answers again (full-width "
                           "step estimated); step 200 ms against 100 ms at full width"), line
