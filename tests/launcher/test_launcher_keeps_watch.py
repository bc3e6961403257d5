"""The launcher keeps watch over its job whatever goes wrong beside it (real jobs, real faults, real signals).

* Its own work between two looks at ``mpirun`` (starting a standby, a file in the run folder) fails: it says so
  and goes on supervising; the job finishes under its watch and the launcher judges it (exit 0), instead of dying
  with a traceback and leaving the job training with nobody to forward a stop signal or judge the run.
* A stop signal while it waits between two launches (for a standby that is still importing): no launch is
  started any more, exit 3 at once.
* A rank of the waiting standby killed, then the job lost: the standby is known to be broken at once, and the next
  launch comes within seconds (warm from a replacement when one got ready), not after the 60 s wait for a standby
  that can never become ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_recover.launcher.runs import kill_run_processes, mpirun_pid, rank_pids, write_config
from nanotron_recover.run.exit_codes import EXIT_NEEDS_PERSON, EXIT_RESTART
from nanotron_recover.run.run_folder import (
    last_logged_step,
    read_launches,
    read_metrics,
)
from tests.conftest import make_tiny_config
from tests.launcher.test_relaunch import standby_ranks, stop_once_the_relaunch_trains, wait_for_ready_standby

pytestmark = pytest.mark.slow
TIMEOUT_S = 300
LONG = 20000  # steps the standby tests' runs never reach: each is stopped once its relaunch trains


def config(tmp_path: Path, steps: int, **ft) -> dict:
    return make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2,
                            fault_tolerance={"enabled": True, "local_snapshot_dir": str(tmp_path / "shm"), **ft})


@contextmanager
def launched(tmp_path: Path, cfg: dict, restarts: int) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """(launcher, run folder, its log); nothing of the job outlives the block."""
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    path = write_config(cfg, tmp_path / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", str(restarts)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, run_dir, log
    finally:
        kill_run_processes(run_dir, proc)


def wait_for(predicate, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}\n{log.read_text()[-3000:]}"
        assert proc.poll() is None, f"the launcher ended (exit {proc.returncode}) before: {what}\n" \
                                    f"{log.read_text()[-3000:]}"
        time.sleep(0.02)


def test_a_failure_of_the_launchers_own_work_does_not_end_its_watch(tmp_path):
    """Once the job trains, the launcher starts a warm standby in the run folder's ``.standby/``; here that folder
    cannot be made (a file stands in its way, as a full or read-only file system would refuse it)."""
    steps = 600
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".standby").write_text("in the way")
    with launched(tmp_path, config(tmp_path, steps), restarts=1) as (proc, run_dir, log):
        proc.wait(timeout=TIMEOUT_S)
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    assert "the launcher's own work failed" in output and "FileExistsError" in output, output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert [s["step"] for s in read_metrics(run_dir)[0]] == list(range(1, steps + 1))


def test_a_stop_signal_while_the_launcher_waits_for_its_standby_starts_no_launch(tmp_path):
    """The job ends (below ``min_replicas``) while its standby still imports; the launcher waits for it. The
    standby's ranks are held (SIGSTOP) so that the wait lasts; a SIGTERM to the launcher then ends it with exit 3,
    and no second launch was begun."""
    cfg = config(tmp_path, 6000, min_replicas=2)
    with launched(tmp_path, cfg, restarts=1) as (proc, run_dir, log):
        wait_for(lambda: last_logged_step(run_dir) >= 1 and standby_ranks(proc.pid), "a standby starting", proc, log)
        held = list(standby_ranks(proc.pid))
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
        wait_for(lambda: "waiting for the warm standby" in log.read_text(), "the wait for the standby", proc, log)
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - stopped
        for pid in held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    output = log.read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]
    assert len(read_launches(run_dir)) == 1, output[-3000:]
    assert took < 15, f"the launcher took {took:.1f} s to stop"


def test_a_standby_that_lost_a_rank_is_not_waited_for(tmp_path):
    """One rank of the ready standby SIGKILLed (its mpirun lives on: a standby runs under ULFM too) at the moment
    the job's mpirun is lost: the next launch starts within 15 s and trains (the test then stops it): cold, or warm
    from the replacement standby when the launcher saw the broken one first and the replacement got ready in time
    (seen on a loaded machine); never from the broken one."""
    cfg = config(tmp_path, LONG)
    with launched(tmp_path, cfg, restarts=1) as (proc, run_dir, log):
        wait_for_ready_standby(proc, ranks=2)
        os.kill(_a_standby_rank(proc.pid), signal.SIGKILL)
        took = lose_the_job_and_time_the_next_launch(proc, run_dir, log)
    output = log.read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]
    assert "died while it waited" in output, output[-3000:]
    warm = read_launches(run_dir)[1]["warm"]
    assert not warm or "died while it waited); starting another" in output, output[-3000:]
    print(f"\nstandby rank and job lost at once: next launch {took:.1f} s later ({'warm' if warm else 'cold'})")


def test_a_standby_that_lost_a_rank_is_replaced_and_the_relaunch_is_warm(tmp_path):
    """One rank of the ready standby SIGKILLed: the launcher replaces the standby; the job's mpirun lost once the
    replacement is ready: the next launch is warm, within 15 s."""
    cfg = config(tmp_path, LONG)
    with launched(tmp_path, cfg, restarts=1) as (proc, run_dir, log):
        wait_for_ready_standby(proc, ranks=2)
        first = set(standby_ranks(proc.pid).values())
        os.kill(_a_standby_rank(proc.pid), signal.SIGKILL)
        wait_for(lambda: set(standby_ranks(proc.pid).values()) - first, "a replacement standby", proc, log)
        wait_for_ready_standby(proc, ranks=2)
        took = lose_the_job_and_time_the_next_launch(proc, run_dir, log)
    output = log.read_text()
    assert proc.returncode == EXIT_RESTART and read_launches(run_dir)[1]["warm"] is True, output[-3000:]
    assert "died while it waited" in output and "starting another" in output, output[-3000:]
    print(f"\nstandby rank lost, replaced; then the job lost: next launch {took:.1f} s later (warm)")


def lose_the_job_and_time_the_next_launch(proc: subprocess.Popen, run_dir: Path, log: Path) -> float:
    """SIGKILL the job's mpirun (a lost node), stop the run once the next launch trains (exit 3); -> seconds to the
    next launch (<= 15)."""
    os.kill(mpirun_pid(proc.pid), signal.SIGKILL)
    killed = time.time()
    wait_for(lambda: len(read_launches(run_dir)) >= 2, "the next launch", proc, log, timeout_s=120)
    stop_once_the_relaunch_trains(proc, run_dir)
    took = read_launches(run_dir)[1]["time"] - killed
    assert took <= 15, f"the next launch began {took:.1f} s after the loss:\n{log.read_text()[-3000:]}"
    return took


def _a_standby_rank(launcher_pid: int) -> int:
    """A rank of the launcher's standby (not its mpirun, the launcher's own child)."""
    from nanotron_recover.run.procfs import proc_stat

    return next(pid for pid in standby_ranks(launcher_pid) if (proc_stat(pid) or (0,))[0] != launcher_pid)


def test_a_stop_signal_that_reaches_only_the_ranks_is_the_launchers_stop_too(tmp_path):
    """``scancel --signal=TERM`` (no ``--batch``) signals the job's steps, not the batch script: the ranks (and
    the waiting standby's) get SIGTERM, the launcher does not. The ranks stop at a step boundary (exit 3); the
    launcher must not relaunch in place what the scheduler asked to stop: exit 3, one launch."""
    cfg = config(tmp_path, LONG)
    with launched(tmp_path, cfg, restarts=2) as (proc, run_dir, log):
        wait_for_ready_standby(proc, ranks=2)
        ranks = [*rank_pids(run_dir).values(), *(p for p in standby_ranks(proc.pid)
                                                 if (_parent(p) or 0) != proc.pid)]
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]
    assert len(read_launches(run_dir)) == 1, output[-3000:]
    assert "the job's ranks were asked to stop" in output, output[-3000:]


def _parent(pid: int) -> int | None:
    from nanotron_recover.run.procfs import proc_stat

    stat = proc_stat(pid)
    return stat[0] if stat else None


def test_a_crash_that_comes_back_at_the_same_step_is_a_persons_turn(tmp_path):
    """Replica 1 SIGKILLed at step 6 in every launch (``every_launch``: a bad sample, a faulty device brings the
    crash back), with ``min_replicas: 2``: the job stops at step 6; each relaunch resumes at step 5 and stops at 6
    again. On the third launch in a row the launcher exits 2 naming the step, instead of exit 3 for ever."""
    kill_at_6 = [{"step": 6, "replica": 1, "rank": 0, "phase": "forward", "every_launch": True}]
    cfg = config(tmp_path, 20, local_snapshot_interval=1, min_replicas=2, inject=kill_at_6)
    with launched(tmp_path, cfg, restarts=5) as (proc, run_dir, log):
        proc.wait(timeout=TIMEOUT_S)
    output = log.read_text()
    assert proc.returncode == EXIT_NEEDS_PERSON, output[-3000:]
    assert "step 6 failed on 3 launches in a row; its microbatches [2, 3] were being computed" in output, \
        output[-3000:]
    assert len(read_launches(run_dir)) == 3 and last_logged_step(run_dir) == 5, output[-3000:]


def test_a_standby_whose_logging_rank_runs_wandbs_service_is_not_taken_for_broken(tmp_path, monkeypatch):
    """wandb offline (the users' default): the standby's rank 0 starts wandb's service while it waits, a child
    process with the rank's environment. The launcher's watch over the standby's ranks must not take that child for
    the rank (seen: every standby called broken, every relaunch cold): the relaunch after the job is lost is warm."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    with launched(tmp_path, config(tmp_path, LONG), restarts=1) as (proc, run_dir, log):
        wait_for_ready_standby(proc, ranks=2)
        time.sleep(3.0)  # several looks at the standby's ranks
        took = lose_the_job_and_time_the_next_launch(proc, run_dir, log)
    output = log.read_text()
    assert "died while it waited" not in output, output[-3000:]
    assert proc.returncode == EXIT_RESTART and read_launches(run_dir)[1]["warm"] is True, output[-3000:]
    print(f"\nwandb offline: the job lost, the next launch {took:.1f} s later, warm")
