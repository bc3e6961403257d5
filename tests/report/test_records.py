"""What the report cannot read, it says: a torn line of metrics.jsonl, a missing file, no run folder at all."""

from __future__ import annotations

import json

import pytest

from nanotron_recover.report.cli import load_timeline
from nanotron_recover.report.records import ReportError, read_run_records
from nanotron_recover.report.summary import format_summary, summarize
from nanotron_recover.run import run_folder
from nanotron_recover.training.metrics import MetricsLogger
from tests.report.fake_run import FakeRun


def test_a_last_line_cut_short_by_a_kill_is_named_and_the_rest_is_read(tmp_path):
    run = FakeRun(tmp_path)
    for step in (1, 2, 3):
        run.step(step, 8.0 - step, first=step == 1)
    run.close()
    with open(run_folder.metrics_path(tmp_path), "a") as f:
        f.write('{"step": 4, "time": 1000000.5, "lo')  # the logging rank SIGKILLed mid-write
    records = read_run_records(tmp_path)
    assert len([r for r in records.records if "event" not in r]) == 3
    (problem,) = [p for p in records.problems if "cut short" in p]
    assert "the last line" in problem and "killed while writing it" in problem
    text = format_summary(summarize(load_timeline(tmp_path)))
    assert "could not read:" in text and "the last line" in text


def test_a_torn_line_that_the_next_logger_continued_after_is_named_by_its_number(tmp_path):
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    run.close()
    with open(run_folder.metrics_path(tmp_path), "a") as f:
        f.write('{"step": 2, "ti')
    run.logger = MetricsLogger(tmp_path, enabled=True)  # a new logging process starts on a fresh line
    run.step(2, 7.0)
    run.close()
    records = read_run_records(tmp_path)
    assert [r["step"] for r in records.records if "event" not in r] == [1, 2]
    assert any("line 3 " in p and "the next logging process went on" in p for p in records.problems), records.problems


def test_missing_files_are_said_not_raised(tmp_path):
    records = read_run_records(tmp_path)
    assert any("no metrics.jsonl" in p for p in records.problems)
    assert any("no exits/" in p for p in records.problems)
    assert any("no config" in p for p in records.problems)
    text = format_summary(summarize(load_timeline(tmp_path)))
    assert "0 step records" in text and "no metrics.jsonl" in text


def test_no_run_folder_is_an_error(tmp_path):
    with pytest.raises(ReportError, match="is not a folder"):
        read_run_records(tmp_path / "nothing")


def test_the_run_size_comes_from_the_config_else_from_the_checkpoint(tmp_path):
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    run.close()
    checkpoint = tmp_path / "checkpoints" / "1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 1, "microbatches_per_step": 6}))
    (tmp_path / "checkpoints" / "latest.txt").write_text("1\n")
    size = read_run_records(tmp_path).size
    assert (size.microbatches_per_step, size.train_steps) == (6, None) and "checkpoint" in size.source
    run.config(dp=3, accumulation=4, train_steps=9, micro_batch_size=2)
    records = read_run_records(tmp_path)
    assert (records.size.microbatches_per_step, records.size.train_steps, records.size.micro_batch_size) == (12, 9, 2)
    assert records.latest_checkpoint == 1
    other = tmp_path / "other.yaml"
    other.write_text(": not yaml: [")
    assert any("cannot be read" in p for p in read_run_records(tmp_path, other).problems)
    assert any("does not exist" in p for p in read_run_records(tmp_path, tmp_path / "none.yaml").problems)


def test_an_exit_record_that_is_not_ours_is_named(tmp_path):
    run = FakeRun(tmp_path)
    run.step(1, 8.0, first=True)
    run.close()
    run.exits(2)
    foreign = tmp_path / "exits" / "rank-9.json"
    foreign.write_text(json.dumps({"code": 0}))  # no rank
    try:
        records = read_run_records(tmp_path)
    finally:
        foreign.unlink()  # the suite's own scan of run folders reads exits/ too, at the end of the session
    assert sorted(records.exits) == [0, 1]  # the ranks' own records are still read
    assert any("exits/ holds records that cannot be read: rank-9.json" in p for p in records.problems)
