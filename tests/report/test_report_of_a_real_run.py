"""The report of a real run with a kill, a hang and a relaunch, checked against that run's own records.

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``, the smallest shape: 3 one-rank replicas,
M = 3, 6 steps, ``min_replicas: 2``. Launch 1: replica 2 is SIGKILLed in backward at step 2 (repaired in-step),
replica 1 SIGSTOPped in forward at step 4; the hang monitor kills it after ``hang_timeout_s``, one replica is left,
below ``min_replicas``: a checkpoint of step 3 and exit 3. Launch 2 (the relaunch) resumes it and trains to step 6.
A failure-free run of the same config is the ``--compare`` run.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.report.cli import add_report_arguments, load_timeline, run_report
from nanotron_recover.report.summary import summarize
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import read_kills, read_metrics, read_metrics_jsonl
from tests.conftest import make_tiny_config

pytestmark = pytest.mark.slow

STEPS = 6
M = 3
TIMEOUT_S = 120
TOL = 1e-5
INJECT = [{"step": 2, "replica": 2, "rank": 0, "phase": "backward"},
          {"step": 4, "replica": 1, "rank": 0, "phase": "forward", "signal": "stop"}]


def config(inject: list[dict], hang_timeout_s: float | None) -> dict:
    ft = {"enabled": True, "min_replicas": 2, "reduce_bucket_mb": 0.01, "collective_timeout_s": 30,
          "hang_timeout_s": hang_timeout_s, "local_snapshot_interval": 0, "inject": inject}
    return make_tiny_config(dp=3, accumulation=1, steps=STEPS, layers=1, fault_tolerance=ft)


def report(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    return run_report(parser.parse_args(list(argv)))


@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_the_report_of_a_run_with_a_kill_a_hang_and_a_relaunch(tmp_path: Path, capsys):
    reference = run_training(config([], None), tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    run_dir = tmp_path / "run"
    faulty = config(INJECT, hang_timeout_s=5)
    first = run_training(faulty, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    assert first.returncode == EXIT_RESTART, first.output[-4000:]
    launch1 = [r for r in read_metrics_jsonl(run_dir) if "event" not in r]
    run_training(faulty, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])

    out = tmp_path / "report.html"
    assert report(str(run_dir), "--compare", str(tmp_path / "ref"), "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert out.stat().st_size > 10_000 and "data:image/png;base64," in out.read_text()
    s = summarize(load_timeline(run_dir), load_timeline(tmp_path / "ref"))
    assert not s.problems, s.problems

    steps, events = read_metrics(run_dir)
    kills = read_kills(run_dir)
    repairs = [e for e in events if e["event"] in ("repair", "repair_without_failure")]
    hangs = [e for e in events if e["event"] == "hang_detected"]
    resumed = launch1[-1]["step"]  # the fallback checkpoint is of the last committed step
    # faults, hangs and repairs as the records have them
    assert s.faults_by_kind == {"kill": 1, "stop": 1} == {k["signal"]: 1 for k in kills}
    assert s.faults_by_phase == {"backward": 1, "forward": 1}
    assert sum(s.hang_events_by_reason.values()) == len(hangs) >= 1 and 1 in s.hang_killed_ranks
    assert s.repairs + s.repairs_without_failure == len(repairs) >= 2
    ms = [e["detect_ms"] + e["total_ms"] for e in repairs]
    assert s.detect_repair_median_ms == pytest.approx(statistics.median(ms))
    assert s.detect_repair_max_ms == pytest.approx(max(ms))
    # the relaunch: two launches, the second resumed from launch 1's checkpoint, what it logged again is replayed
    assert [(la.first_step, la.last_step) for la in s.launches] == [(1, resumed), (resumed + 1, STEPS)]
    assert s.launches[0].stopped is not None and "min_replicas" in s.launches[0].stopped
    assert s.replayed_steps == [r["step"] for r in launch1 if r["step"] > resumed]
    # samples, time, and the comparison with the failure-free run
    assert s.final_steps == [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert s.committed_microbatches == sum(r["microbatches"] for r in steps) == M * STEPS == s.failure_free_microbatches
    first_start = launch1[0]["time"] - launch1[0]["step_time_s"]
    last = max(float(r.get("time") or r.get("wall_time")) for r in read_metrics_jsonl(run_dir))
    assert s.wall_s == pytest.approx(last - first_start)
    assert s.useful_s + sum(s.time_lost_s.values()) == pytest.approx(s.wall_s, rel=1e-3)
    assert 0 < s.effective_ratio < 1
    assert s.time_lost_s["relaunch (next start-up, requeue wait)"] > 1.0  # a whole start-up of launch 2
    assert s.time_lost_s["hang timeout (a frozen or stuck rank)"] >= 4.0  # hang_timeout_s 5, from the last commit
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference.steps))
    assert s.max_abs_dloss == pytest.approx(dloss) and dloss <= TOL
    assert "steps replayed after relaunches" in printed and "max |dloss| vs --compare run" in printed
    print(f"\n{printed}")
