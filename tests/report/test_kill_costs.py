"""What each kill cost, in parts, from a run folder written by the real writers on a synthetic clock (so every part
is known exactly): a kill in step 4, two degraded steps, a stop to regrow, a relaunch 0.6 s later, a slower first
step."""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest

from nanotron_recover.report.cli import load_timeline
from nanotron_recover.report.kill_costs import PARTS, full_width_step_s, kill_cost_lines, kill_costs
from nanotron_recover.report.summary import format_summary, summarize
from nanotron_recover.run import run_folder
from tests.report.fake_run import FakeRun


def begin_launch(run: FakeRun) -> None:
    with mock.patch.object(time, "time", return_value=run.t):
        run_folder.begin_launch(run.run_dir, {"by": "test"})


def write_regrown_run(run_dir: Path) -> FakeRun:
    run = FakeRun(run_dir)
    run.config(dp=2, accumulation=2, train_steps=9)
    begin_launch(run)
    run.step(1, 8.0, first=True)
    for step in (2, 3):
        run.step(step, 8.0 - step / 10)
    run.repair(4, [1], detect_ms=20.0, total_ms=30.0, after=0.05)
    run.t -= 0.05  # step 4 commits 0.5 s after its start
    run.live = 1
    run.step(4, 7.5, step_time=0.5, recoveries=1)
    run.step(5, 7.4, step_time=0.2)
    run.step(6, 7.3, step_time=0.2)
    run.event("regrow_stop", after=0.05, step=6, reason="regrow: back to 2 replicas")
    run.relaunch(gap=0.6)
    begin_launch(run)
    run.live = 2
    run.step(7, 7.2, step_time=0.15, first=True)
    run.step(8, 7.1)
    run.step(9, 7.0)
    run.close()
    return run


def test_each_part_of_a_kill_is_read_from_the_records(tmp_path: Path) -> None:
    tl = load_timeline(write_regrown_run(tmp_path / "run").run_dir)
    assert full_width_step_s(tl) == pytest.approx(0.1)  # steps 2, 3, 8, 9: each launch's first left out
    (cost,) = kill_costs(tl)
    assert (cost.step, cost.launch, cost.degraded_steps) == (4, 1, 2)
    want = {"failure step": 0.4, "degraded": 0.2, "stop": 0.05, "start-up": 0.61, "first step": 0.05, "replayed": 0.0}
    assert cost.seconds == pytest.approx(want)
    assert cost.total_s == pytest.approx(sum(want.values()))


def test_the_report_prints_the_cost_of_a_kill(tmp_path: Path) -> None:
    text = format_summary(summarize(load_timeline(write_regrown_run(tmp_path / "run").run_dir)))
    line = next(line for line in text.splitlines() if line.startswith("cost of a kill"))
    assert line.startswith("cost of a kill (mean of 1): 1.31 s = failure step 0.40, degraded 0.20"), line
    assert all(part in line for part in PARTS)


def test_a_run_without_kills_has_no_cost_lines(tmp_path: Path) -> None:
    run = FakeRun(tmp_path / "run")
    for step in (1, 2, 3):
        run.step(step, 5.0)
    run.close()
    assert kill_costs(load_timeline(run.run_dir)) == [] and kill_cost_lines([]) == []
