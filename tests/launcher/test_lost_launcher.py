"""A finished or orphaned job ends by itself (real ``nanotron-recover train`` jobs, real signals to ``mpirun``).

* ``mpirun`` SIGSTOPped mid-run (a frozen head node, a stalled log pipe): the ranks train to the last step, and
  then must not wait in ``MPI_Finalize`` for ever: every rank process is gone within ``finalize_timeout_s``.
  The launcher then ends the frozen ``mpirun`` itself, leaves nothing behind, and says "done" (exit 0).
* ``mpirun`` SIGSTOPped and then SIGKILLed mid-run: the ranks are orphans (their daemon is gone); they must end
  by themselves instead of training on beside a relaunch, and the launcher says "restart" (exit 3).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import mpirun_pid, rank_processes, write_config
from nanotron_recover.run.exit_codes import EXIT_DONE, EXIT_RESTART
from nanotron_recover.run.run_folder import last_logged_step, read_exits, record_external_fault

pytestmark = pytest.mark.slow

STEPS = 40
FINALIZE_TIMEOUT_S = 8
TIMEOUT_S = 240


def mpirun_of(launcher: subprocess.Popen) -> int:
    """The launcher's mpirun (PRRTE's ``prterun``), once it is started."""
    deadline = time.monotonic() + 60
    while (pid := mpirun_pid(launcher.pid)) is None:
        if time.monotonic() > deadline:
            raise AssertionError("mpirun did not start")
        time.sleep(0.05)
    return pid


def wait_until(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def launch(tiny_config, run_dir: Path, inject: list[dict] | None = None) -> subprocess.Popen:
    config = tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=STEPS,
                         fault_tolerance={"enabled": True, "local_snapshot_interval": 0,
                                          "finalize_timeout_s": FINALIZE_TIMEOUT_S, "inject": inject or []})
    path = write_config(config, run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    log = open(run_dir / "launcher.log", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def freeze_mpirun_after_step_2(launcher: subprocess.Popen, run_dir: Path, marker: str) -> int:
    """SIGSTOP the launcher's mpirun once step 2 is logged (the run's marker says so first); its pid. It is looked
    up once the job trains: a pid taken earlier was once gone by step 2 (another ``mpirun`` child of the launcher,
    seen in a full suite run)."""
    wait_until(lambda: last_logged_step(run_dir) >= 2, 120, "step 2")
    mpirun = mpirun_of(launcher)
    record_external_fault(run_dir, marker)
    os.kill(mpirun, signal.SIGSTOP)
    return mpirun


def end(launcher: subprocess.Popen, run_dir: Path) -> None:
    """Whatever happened: nothing of this run is left running."""
    for pid in rank_processes(run_dir):
        os.kill(pid, signal.SIGKILL)
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()


@pytest.mark.timeout(TIMEOUT_S)
def test_a_frozen_mpirun_does_not_keep_finished_ranks_alive_nor_the_launcher(tiny_config, tmp_path):
    """Nothing is done from outside after the freeze: the launcher itself ends the frozen mpirun once its ranks are
    gone (:mod:`nanotron_recover.launcher.mpirun_watch`) and judges the run (before: it waited on mpirun until
    killed)."""
    from nanotron_recover.launcher.mpirun_watch import RANKS_GONE_S
    from nanotron_recover.run.procfs import proc_stat

    launcher = launch(tiny_config, tmp_path)
    try:
        mpirun = freeze_mpirun_after_step_2(launcher, tmp_path, "stop-mpirun")
        wait_until(lambda: len(read_exits(tmp_path)) == 2, 120, "both ranks finished training")
        assert {e["code"] for e in read_exits(tmp_path).values()} == {EXIT_DONE}
        assert last_logged_step(tmp_path) == STEPS
        took = wait_until(lambda: not rank_processes(tmp_path), FINALIZE_TIMEOUT_S + 10,
                          "the finished ranks end although mpirun is frozen")
        t0 = time.monotonic()
        assert launcher.wait(timeout=RANKS_GONE_S + 30) == EXIT_DONE, (tmp_path / "launcher.log").read_text()[-3000:]
        waited = time.monotonic() - t0
        assert proc_stat(mpirun) is None, "the frozen mpirun is gone"
        assert ": ending it (SIGKILL)" in (tmp_path / "launcher.log").read_text()
        print(f"\nmpirun frozen: the finished ranks ended {took:.1f} s after their exit records "
              f"(finalize_timeout_s {FINALIZE_TIMEOUT_S}); the launcher ended mpirun and exited {waited:.1f} s later")
    finally:
        end(launcher, tmp_path)


@pytest.mark.timeout(TIMEOUT_S)
def test_ranks_orphaned_by_a_killed_mpirun_end_by_themselves(tiny_config, tmp_path):
    launcher = launch(tiny_config, tmp_path)
    try:
        # a frozen daemon cannot tear its ranks down when it is killed (the orphans' monitors report it gone)
        mpirun = freeze_mpirun_after_step_2(launcher, tmp_path, "stop-kill-mpirun")
        assert rank_processes(tmp_path), "the ranks run"
        os.kill(mpirun, signal.SIGKILL)
        took = wait_until(lambda: not rank_processes(tmp_path), 30, "the orphaned ranks end")
        code = launcher.wait(timeout=60)
        assert code == EXIT_RESTART, (tmp_path / "launcher.log").read_text()[-3000:]
        assert last_logged_step(tmp_path) < STEPS
        print(f"\nmpirun killed while frozen: the orphaned ranks ended within {took:.1f} s; launcher exit {code}")
    finally:
        end(launcher, tmp_path)


@pytest.mark.timeout(TIMEOUT_S)
def test_two_launches_never_write_one_run_folder(tiny_config, tmp_path, monkeypatch):
    """A second launch on a run folder that a running job holds (a requeue beside a job that is still alive, an
    operator's second command) is refused with exit 2, naming the holder; the job goes on untouched."""
    from nanotron_recover.run.exit_codes import EXIT_NEEDS_PERSON

    monkeypatch.setenv("NANOTRON_RECOVER_LOCK_WAIT_S", "1")
    slow = [{"step": 1, "replica": 0, "signal": "slow", "factor": 30}]  # a job that runs long enough
    launcher = launch(tiny_config, tmp_path, inject=slow)
    try:
        wait_until(lambda: last_logged_step(tmp_path) >= 1, 120, "step 1")
        second = subprocess.run([sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file",
                                 str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path), "--synthetic-data"],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == EXIT_NEEDS_PERSON, second.stdout[-2000:] + second.stderr[-2000:]
        assert "in use by another launch" in second.stderr and f"launcher pid {launcher.pid}" in second.stderr
        assert last_logged_step(tmp_path) < STEPS, "the first job was still running"
        assert launcher.wait(timeout=TIMEOUT_S - 60) == EXIT_DONE, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        end(launcher, tmp_path)
