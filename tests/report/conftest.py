"""Run folders for the report's fast tests, written with the real writers on a synthetic clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.report.fake_run import FakeRun


def write_relaunched_run(run_dir: Path) -> FakeRun:
    """Launch 1: steps 1-4 on 2 replicas (M = 4), a kill in backward at step 3 (repair 50 ms inside a 0.5 s step),
    then a frozen rank at step 5, found after 4 s, below min_replicas: stopped. Launch 2, 5 s later, resumes from a
    checkpoint of step 2 and trains steps 3-6 (3 and 4 replayed)."""
    run = FakeRun(run_dir)
    run.config(dp=2, accumulation=2, train_steps=6)
    run.step(1, 8.0, first=True)
    run.step(2, 7.5)
    run.fault("step3-replica1-rank0-backward", after=0.05, step=3, replica=1, rank=0, phase="backward")
    run.repair(3, [1], detect_ms=20.0, total_ms=30.0, after=0.05)
    run.t -= 0.1  # the step record below commits 0.5 s after its start
    run.live = 1
    run.step(3, 7.2, step_time=0.5, recoveries=1)
    run.step(4, 7.0)
    run.fault("step5-replica0-rank1-forward-stop", after=0.01, step=5, replica=0, rank=1, phase="forward",
              signal="stop")
    run.hang(after=3.99, reason="silent", rank=1, silent_s=4.0, timeout_s=4, action="kill")
    run.repair(5, [0], detect_ms=1.0, total_ms=9.0, after=0.01)
    run.event("stopped", after=0.2, reason="0 live replica(s) < fault_tolerance.min_replicas=1", step=4)
    run.relaunch(gap=5.0)
    run.live = 2
    run.step(3, 7.2, first=True)
    for step, loss in ((4, 7.0), (5, 6.8), (6, 6.7)):
        run.step(step, loss)
    run.exits(4)
    run.close()
    return run


@pytest.fixture
def relaunched_run(tmp_path: Path) -> FakeRun:
    return write_relaunched_run(tmp_path / "run")
