"""The run folder read back: metrics.jsonl (one reader, torn lines skipped), the injector's records,
the resume step, and the Slurm outcome helper built on them. In-process, no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_recover.process.inject import FailureInjector, FailureSpec, marker_name
from nanotron_recover.run.exit_codes import EXIT_ABORTED, EXIT_RESTART
from nanotron_recover.run.run_folder import (
    begin_launch,
    exit_reasons,
    hang_provoked_at,
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
    assert hang_provoked_at(tmp_path) is None  # kills end a rank: no hang is expected
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
    hang_fault = next(k for k in found if k["signal"] == "hang")
    assert hang_provoked_at(tmp_path) == hang_fault["time"]  # the first of the hang and the outside stop
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


def test_a_torn_line_in_launches_leaves_every_later_launch_its_record(tmp_path: Path) -> None:
    """A launcher killed while it appended its launch record left a line without its end: each later launch
    still gets its record (its own line), and moving the previous launch's exit records never fails."""
    (tmp_path / "launches.jsonl").write_text('{"launch": 1, "time": 1.0, "by": "nanotron-recover tr')
    for n in range(4):
        begin_launch(tmp_path, {"by": "test", "n": n})
        record_exit(tmp_path, 0, EXIT_RESTART, "the job ended")
    assert [r["n"] for r in read_launches(tmp_path)] == [0, 1, 2, 3]
    archived = sorted(p.parent.name for p in (tmp_path / "launches").glob("*/exits/rank-0.json"))
    assert len(archived) == 3, archived  # the exit records of the first three launches, none lost


def test_records_after_an_offset_pass_a_line_longer_than_one_read(tmp_path: Path) -> None:
    from nanotron_recover.run.run_folder import read_records_after

    path = tmp_path / "metrics.jsonl"
    long_event = json.dumps({"event": "checkpoint_damaged", "files": ["x" * 200] * 500})  # ~100 KB
    path.write_text(long_event + "\n" + json.dumps({"step": 7, "live_replicas": 1}) + "\n" + '{"step": 8, "li')
    records, offset = read_records_after(path, 0, max_bytes=4096)
    assert [r.get("event", r.get("step")) for r in records] == ["checkpoint_damaged", 7]
    assert offset == len(path.read_bytes()) - len('{"step": 8, "li')  # the torn line waits for its end
    assert read_records_after(path, offset, max_bytes=4096) == ([], offset)
