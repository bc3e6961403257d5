"""Launches, re-logs and the placement of events on the step axis."""

from __future__ import annotations

from nanotron_recover.report.cli import load_timeline
from tests.report.fake_run import FakeRun


def test_a_relaunch_that_resumes_where_the_last_one_stopped_is_a_new_launch(tmp_path):
    """Steps 1-3, then 4-6 from a checkpoint of step 3: the steps go on; the training_state event says a launch
    began."""
    run = FakeRun(tmp_path)
    for step in (1, 2, 3):
        run.step(step, 8.0 - step, first=step == 1)
    run.relaunch(gap=7.0)
    for step in (4, 5, 6):
        run.step(step, 8.0 - step, first=step == 4)
    run.close()
    tl = load_timeline(tmp_path)
    assert [(la.first_step, la.last_step, la.resumed_from) for la in tl.launches] == [(1, 3, 0), (4, 6, 3)]
    assert tl.replayed == []
    assert [m.x for m in tl.markers if m.kind == "resume"] == [3.5]


def test_a_new_logging_ranks_relog_is_not_a_relaunch(tmp_path):
    """After a repair the new logging rank logs the last committed step again (the same record)."""
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    last = run.step(2, 7.0)
    run.repair(3, [0], detect_ms=2.0, total_ms=3.0, after=0.05)
    run.logger.log_step(last)
    run.step(3, 6.5, recoveries=1)
    run.close()
    tl = load_timeline(tmp_path)
    assert len(tl.launches) == 1 and [p.step for p in tl.records] == [1, 2, 3]


def test_events_without_a_step_are_placed_by_their_time(tmp_path):
    """A silent-rank hang event and a spare activation carry no step: each goes to the step in flight."""
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    run.fault("step2-replica1-rank0-forward-stop", after=0.02, step=2, replica=1, rank=0, phase="forward",
              signal="stop")
    run.hang(after=0.05, reason="silent", rank=2, action="kill")
    run.repair(2, [1], detect_ms=1.0, total_ms=2.0)
    run.event("spare_activated", after=0.01, replicas=[2], donor=0, transfer_ms=3.0)
    run.t -= 0.08
    run.step(2, 7.0, recoveries=1)
    run.step(3, 6.0)
    run.event("stopped", after=0.1, reason="below min_replicas", step=3)
    run.close()
    tl = load_timeline(tmp_path)
    kinds = {m.kind: m.x for m in tl.markers}
    assert kinds == {"fault": 2.0, "hang": 2.0, "repair": 2.0, "spare_activated": 2.0, "stopped": 3.5}
    assert tl.kills[0]["launch"] == 1
    assert tl.launches[0].stopped == "below min_replicas"


def test_a_job_torn_down_with_its_node_then_relaunched_on_fewer_replicas(tmp_path):
    """What the fake-node bed's lost-node runs leave: launch 1 (3 replicas) ends with no stopped event and its last
    line cut short; the relaunch on 2 replicas (``--replicas 2``, M kept) resumes from a checkpoint of step 3."""
    from nanotron_recover.run import run_folder

    run = FakeRun(tmp_path, m=6, live=3)
    for step in (1, 2, 3, 4, 5):
        run.step(step, 8.0 - step / 10, first=step == 1)
    run.close()
    with open(run_folder.metrics_path(tmp_path), "a") as f:
        f.write('{"step": 6, "time": 10')
    run.relaunch(gap=10.0)
    run.live = 2
    for step in (4, 5, 6, 7):
        run.step(step, 8.0 - step / 10, first=step == 4)
    run.close()
    tl = load_timeline(tmp_path)
    assert [(la.first_step, la.last_step, la.stopped) for la in tl.launches] == [(1, 5, None), (4, 7, None)]
    assert [p.step for p in tl.replayed] == [4, 5]
    assert [p.live_replicas for p in tl.final] == [3, 3, 3, 2, 2, 2, 2]
    assert any("line 7 " in p and "cut short" in p for p in tl.problems), tl.problems


def test_a_step_record_that_cannot_be_placed_is_named_and_left_out(tmp_path):
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    run.logger.log_step({"step": "two", "loss": 7.0})
    run.step(2, 7.0)
    run.close()
    tl = load_timeline(tmp_path)
    assert len(tl.launches) == 1 and [p.step for p in tl.records] == [1, 2]
    assert any("without a step number or a time" in p for p in tl.problems)


def test_launch_records_say_where_a_launch_began(tmp_path):
    """With ``launches.jsonl`` (the launcher's records) a relaunch that replays the same step as the last one's
    first step is still told apart, and the size comes from the last launch's record."""
    import json

    run = FakeRun(tmp_path)
    launches = [{"launch": 1, "time": run.t, "microbatches_per_step": 4, "train_steps": 4, "micro_batch_size": 2}]
    run.step(1, 8.0)  # no training_state events: only the launch records can tell the launches apart
    run.step(2, 7.0)
    run.relaunch(gap=5.0)
    launches.append({**launches[0], "launch": 2, "time": run.t})
    run.step(3, 6.0)
    run.step(4, 5.0)
    run.close()
    (tmp_path / "launches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in launches))
    tl = load_timeline(tmp_path)
    assert [(la.first_step, la.last_step) for la in tl.launches] == [(1, 2), (3, 4)]
    assert tl.size.microbatches_per_step == 4 and tl.size.train_steps == 4
