"""The run folder read back: metrics.jsonl (one reader, torn lines skipped), the injector's records,
the resume step, and the Slurm outcome helper built on them. In-process, no training."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.process.inject import FailureInjector, FailureSpec, marker_name
from nanotron_recover.run.exit_codes import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART
from nanotron_recover.run.run_folder import (
    begin_launch,
    exit_reasons,
    has_provoked_hang,
    last_logged_step,
    read_exits,
    read_kills,
    read_launches,
    read_metrics,
    read_metrics_jsonl,
    record_exit,
    record_external_fault,
    record_fired_fault,
    resumed_from,
    run_outcome,
)
from nanotron_recover.training.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]


def _write(run: Path, text: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(text)


def test_a_torn_last_line_is_skipped_by_every_reader(tmp_path: Path) -> None:
    _write(tmp_path, '{"step": 1, "loss": 2.0}\n{"event": "repair", "step": 2}\n{"step": 2, "loss": 1.5}\n'
                     '{"step": 3, "lo')
    assert [r.get("event", "step") for r in read_metrics_jsonl(tmp_path)] == ["step", "repair", "step"]
    steps, events = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [1, 2] and [e["event"] for e in events] == ["repair"]
    assert read_metrics_jsonl(tmp_path / "missing") == [] and read_metrics(tmp_path / "missing") == ([], [])


def test_read_metrics_keeps_the_last_record_of_a_replayed_step(tmp_path: Path) -> None:
    _write(tmp_path, "".join(json.dumps({"step": s, "loss": loss}) + "\n"
                             for s, loss in [(1, 3.0), (2, 2.0), (2, 2.5), (3, 1.0)]))
    steps, _ = read_metrics(tmp_path)
    assert [(s["step"], s["loss"]) for s in steps] == [(1, 3.0), (2, 2.5), (3, 1.0)]


def test_a_new_logging_process_does_not_append_to_a_torn_line(tmp_path: Path) -> None:
    _write(tmp_path, '{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # the old logging rank died mid-line
    with MetricsLogger(tmp_path, True, None) as heir:
        heir.log_step({"step": 2, "loss": 1.5})
    assert [(r["step"], r["loss"]) for r in read_metrics_jsonl(tmp_path)] == [(1, 2.0), (2, 1.5)]


def test_read_kills_reads_the_injectors_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kills = []
    monkeypatch.setattr("os.kill", lambda pid, sig: kills.append(sig))  # the record is written before the kill
    monkeypatch.setattr("time.sleep", lambda s: None)
    FailureInjector([{"step": 3, "replica": 1, "rank": 0, "phase": "backward"}], 1, 0,
                    run_dir=tmp_path).maybe_fail(3, "backward")
    FailureInjector([{"step": 2, "replica": 0, "rank": 1, "phase": "reduce"}], 0, 1,
                    run_dir=tmp_path).maybe_fail(2, "reduce")
    assert len(kills) == 2
    assert not has_provoked_hang(tmp_path)  # kills end a rank: no hang is expected
    startup = FailureSpec.from_dict({"step": 0, "replica": 1, "rank": 0, "phase": "startup", "at": "after_mpi_init",
                                     "signal": "hang"})
    record_fired_fault(tmp_path, marker_name(startup), {"step": 0, "replica": 1, "rank": 0, "phase": "startup",
                                                         "at": "after_mpi_init", "signal": "hang"})
    record_external_fault(tmp_path, "stop-4")
    (tmp_path / "injected" / "notes.txt").write_text("not a record")
    found = read_kills(tmp_path)
    assert [(k["step"], k["replica"], k["rank"], k["phase"], k["at"], k["signal"]) for k in found] == [
        (3, 1, 0, "backward", None, "kill"), (2, 0, 1, "reduce", None, "kill"),
        (0, 1, 0, "startup", "after_mpi_init", "hang")]  # the external marker is not a scheduled fault
    assert all(isinstance(k["time"], float) for k in found) and found[0]["time"] <= found[1]["time"]
    assert has_provoked_hang(tmp_path)
    assert read_kills(tmp_path / "elsewhere") == []


def test_a_fired_fault_does_not_fire_again_in_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.kill", lambda pid, sig: None)
    monkeypatch.setattr("time.sleep", lambda s: None)
    schedule = [{"step": 3, "replica": 0, "rank": 0, "phase": "forward"}]
    FailureInjector(schedule, 0, 0, run_dir=tmp_path).maybe_fail(3, "forward")
    assert not FailureInjector(schedule, 0, 0, run_dir=tmp_path).will_fail(3, "forward")  # the relaunch's
    assert FailureInjector(schedule, 0, 0, run_dir=tmp_path / "other").will_fail(3, "forward")


def test_resumed_from_is_one_less_than_the_first_logged_step() -> None:
    assert resumed_from([{"step": 5}, {"step": 6}]) == 4
    assert resumed_from([{"step": 1}]) == 0 and resumed_from([]) == 0


@pytest.mark.parametrize(
    "logged, rc, verdict, code",
    [(4, 0, "done", EXIT_DONE), (3, 0, "restart", EXIT_RESTART), (3, 3, "restart", EXIT_RESTART),
     (0, 2, "needs_person", EXIT_BAD_INPUT)],
)
def test_slurm_outcome_helper(tmp_path: Path, logged: int, rc: int, verdict: str, code: int) -> None:
    lines = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, logged + 1))
    _write(tmp_path, lines + '{"event": "stopped", "step": 9}\n{"step": 4, "lo')  # an event and a torn line never count
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "slurm" / "recover_job.py"), "outcome", "--run-dir",
                           str(tmp_path), "--train-steps", "4", "--mpirun-rc", str(rc)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and proc.stdout.split()[0] == verdict, proc.stdout + proc.stderr


def test_records_that_are_not_ours_are_skipped(tmp_path: Path) -> None:
    _write(tmp_path, '{"step": "x", "loss": 1.0}\n{"step": 2, "loss": 1.5}\n')
    (tmp_path / "exits").mkdir()
    (tmp_path / "exits" / "rank-0.json").write_text('{"code": 0}')  # no rank
    (tmp_path / "exits" / "rank-1.json").write_text('{"rank": 1, "code": 3, "reason": "r"}')
    steps, _ = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == [2] and last_logged_step(tmp_path) == 2
    assert list(read_exits(tmp_path)) == [1]


def test_exit_reasons_group_the_ranks_that_gave_the_same_reason(tmp_path: Path) -> None:
    record_exit(tmp_path, 3, EXIT_RESTART, "hang: rank 5 is still alive")
    for rank in (0, 2, 1):
        record_exit(tmp_path, rank, EXIT_RESTART, "below min_replicas")
    record_exit(tmp_path, 4, EXIT_ABORTED, "")
    assert exit_reasons(tmp_path) == ["ranks [0, 1, 2] (exit 3): below min_replicas",
                                      "rank 3 (exit 3): hang: rank 5 is still alive",
                                      f"rank 4 (exit {EXIT_ABORTED}): no reason given"]
    assert exit_reasons(tmp_path, limit=1) == ["ranks [0, 1, 2] (exit 3): below min_replicas"]


def test_a_new_launch_is_judged_by_its_own_exit_records(tmp_path: Path) -> None:
    """A bug recorded by launch 1 (exit 1) must not make launch 2, torn down by a lost node (no records, mpirun
    rc 0), read as aborted: the relaunch would not be requeued."""
    assert begin_launch(tmp_path, {"by": "test", "world_size": 4}) == 1
    record_exit(tmp_path, 0, EXIT_ABORTED, "aborted: a bug")
    assert run_outcome(tmp_path, 10, 0)[0] == "aborted"
    assert begin_launch(tmp_path, {"by": "test", "world_size": 4}) == 2
    assert read_exits(tmp_path) == {} and run_outcome(tmp_path, 10, 0)[0] == "restart"
    assert json.loads((tmp_path / "launches" / "1" / "exits" / "rank-0.json").read_text())["code"] == EXIT_ABORTED
    assert [(r["launch"], r["world_size"]) for r in read_launches(tmp_path)] == [(1, 4), (2, 4)]


def test_a_run_that_checkpoints_is_done_only_once_its_last_step_is_on_disk(tmp_path: Path) -> None:
    """A job torn down inside its final save logged every step but holds step 4 on disk: done would hand the user
    an older model, so it is a restart (the relaunch writes the final checkpoint)."""
    _write(tmp_path, "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.txt").write_text("4\n")
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=True)[0] == "restart"
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=False)[0] == "done"  # a run that keeps no checkpoints
    (tmp_path / "checkpoints" / "latest.txt").write_text("8\n")
    assert run_outcome(tmp_path, 8, 0, needs_final_checkpoint=True)[0] == "done"


def test_the_same_startup_failure_stops_requeueing_on_the_third_launch(tmp_path: Path) -> None:
    """Launches that end in a restart without committing a step, for the same reasons, count up across launchers
    (the count lives in the run folder); a launch judged twice counts once; a step committed resets the count."""
    from nanotron_recover.run.run_folder import begin_launch, judge_launch

    def launch(reason: str, stepped: bool = False) -> str:
        begin_launch(tmp_path, {"by": "test"})
        if stepped:
            _write(tmp_path, json.dumps({"step": 1, "loss": 1.0, "time": time.time()}) + "\n")
        record_exit(tmp_path, 0, EXIT_RESTART, reason)
        verdict = judge_launch(tmp_path, 10, 3, max_startup_failures=3)[0]
        assert judge_launch(tmp_path, 10, 3, max_startup_failures=3)[0] == verdict  # judged again: same answer
        return verdict

    assert launch("rank(s) [3] died during start-up") == "restart"
    assert launch("rank(s) [3] died during start-up") == "restart"
    assert launch("rank(s) [5] died during start-up") == "needs_person"  # digits aside, the same failure
    assert launch("start-up failed: another reason") == "restart"
    assert launch("start-up failed: another reason", stepped=True) == "restart"
    assert launch("start-up failed: another reason") == "restart"  # the count began again after the step


def _outcome(launch: int, reasons: list[str], verdict: str = "restart", stepped: bool = False) -> dict:
    return {"launch": launch, "verdict": verdict, "stepped": stepped, "reasons": reasons}


def test_a_start_up_failure_counts_as_repeated_when_a_reason_comes_back():
    from nanotron_recover.run.run_folder import repeated_startup_failures

    died, secondary = "rank # died during start-up", "start-up failed: MPI_ERR_PROC_FAILED"
    # which survivor wrote its secondary reason before the job was ended is a race: the cause still repeats
    assert repeated_startup_failures([_outcome(1, [died, secondary]), _outcome(2, [died]),
                                      _outcome(3, [died, secondary])]) == 3
    assert repeated_startup_failures([_outcome(1, ["disk gone"]), _outcome(2, [died])]) == 1
    assert repeated_startup_failures([_outcome(1, [died]), _outcome(2, [died], stepped=True),
                                      _outcome(3, [died])]) == 1
    assert repeated_startup_failures([_outcome(1, [died]), _outcome(2, [died], verdict="done")]) == 0
    assert repeated_startup_failures([_outcome(1, []), _outcome(2, [])]) == 2  # no exit record at all, twice
    old = {"launch": 1, "verdict": "restart", "stepped": False, "signature": f"{died}; {secondary}"}
    assert repeated_startup_failures([old, _outcome(2, [died])]) == 2  # a record from before "reasons" existed
