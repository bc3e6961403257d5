"""A graceful stop with real signals and a real job (``mpirun --with-ft ulfm``, 2 replicas), at the defaults of
the snapshot schedule (``local_snapshot_interval: auto``, which may have grown past 1 by the time of the signal).

* SIGTERM to the launcher alone, and SIGTERM to every process of the job at once (what Slurm does at preemption or
  at a time limit), at a random step: exit 3 within 30 s, no process left; the relaunch resumes at the step after
  the last logged one (no step computed twice) and its losses are the failure-free run's.
* A second SIGTERM to the launcher during the stop ends the job at once; what was committed stays usable.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import kill_run_processes, mpirun_pid, rank_pids, run_training, write_config
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import read_metrics, read_metrics_jsonl
from tests.conftest import make_tiny_config

STEPS = 40
TIMEOUT_S = 300
STOP_LIMIT_S = 30  # Slurm's default grace before SIGKILL
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * TIMEOUT_S)]
RESUMED = re.compile(r"resumed from the local snapshot of step (\d+)")


def config(tmp_path: Path) -> dict:
    ft = {"enabled": True, "reduce_bucket_mb": 0.01, "local_snapshot_dir": str(tmp_path / "shm")}
    return make_tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance=ft)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reference")
    return run_training(config(tmp_path), tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def launch(config_path: Path, run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        steps, _ = read_metrics(run_dir)
        if steps and steps[-1]["step"] >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the job did not reach step {step}")


def every_process(run_dir: Path, launcher: subprocess.Popen) -> list[int]:
    """The launcher, its mpirun and every rank (Open MPI puts ranks in process groups of their own)."""
    mpirun = mpirun_pid(launcher.pid)
    return [launcher.pid, *([mpirun] if mpirun else []), *rank_pids(run_dir).values()]


def stop_and_wait(proc: subprocess.Popen, run_dir: Path, targets: list[int]) -> float:
    """SIGTERM ``targets``; -> seconds until the launcher exited (every process of the run must be gone then)."""
    t0 = time.monotonic()
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_LIMIT_S)
    except subprocess.TimeoutExpired:
        kill_run_processes(run_dir, proc)
        raise AssertionError(f"the job did not stop within {STOP_LIMIT_S} s") from None
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5  # the ranks' daemon reaps them right after the launcher's mpirun ended
    while rank_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank_pids(run_dir), "ranks left after the stop"
    return took


@pytest.mark.parametrize("who", ["the launcher", "every process"])
def test_a_stop_signal_ends_the_job_at_a_step_and_the_relaunch_computes_no_step_twice(who, reference, tmp_path):
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path), run_dir / "config.yaml")
    proc = launch(config_path, run_dir, tmp_path / "stopped.log")
    at = random.Random(os.getpid()).randint(3, 12)
    wait_for_step(proc, run_dir, at)
    targets = [proc.pid] if who == "the launcher" else every_process(run_dir, proc)
    took = stop_and_wait(proc, run_dir, targets)
    output = (tmp_path / "stopped.log").read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]
    steps, events = read_metrics(run_dir)
    last = steps[-1]["step"]
    assert last < STEPS, "the job finished before the signal could stop it"
    stops = [e for e in events if e.get("event") == "stop_signal"]
    assert [e["step"] for e in stops] == [last], output[-3000:]

    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert RESUMED.findall(result.output) == [str(last)], result.output[-3000:]  # said once, for the launch
    logged = [r["step"] for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    assert logged == list(range(1, STEPS + 1)), "a step was computed twice, or one is missing"
    assert [s["loss"] for s in result.steps] == reference.losses  # the same state: bit-identical
    assert [s["time"] >= relaunched for s in result.steps].count(True) == STEPS - last
    print(f"\nSIGTERM to {who} after step {at} was logged: stopped after step {last} in {took:.1f} s, exit 3; "
          f"the relaunch resumed at step {last + 1}")


def test_a_second_sigterm_ends_the_job_at_once_and_loses_nothing_committed(reference, tmp_path):
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path), run_dir / "config.yaml")
    proc = launch(config_path, run_dir, tmp_path / "stopped.log")
    wait_for_step(proc, run_dir, 4)
    os.kill(proc.pid, signal.SIGTERM)
    # two signals within one bytecode of the launcher would reach its handler once; the job's graceful stop (a
    # step of a few ms, its snapshot, exit) took less than 0.3 s once, and the second signal then found it ended
    time.sleep(0.05)
    took = stop_and_wait(proc, run_dir, [proc.pid])  # the second one
    output = (tmp_path / "stopped.log").read_text()
    assert "ending the job now" in output, output[-3000:]
    assert proc.returncode == EXIT_RESTART, output[-3000:]
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert [s["loss"] for s in result.steps] == reference.losses  # whatever step it resumed from: the same losses
    print(f"\ntwo SIGTERMs: ended in {took:.1f} s, the relaunch {RESUMED.findall(result.output)}")
