"""The launcher's start-up watch over real processes (stand-ins for ranks: the same command-line marks and rank
variable, no MPI): a rank gone before it forked its watchdog is named once, with an exit record; a rank whose
watchdog came and went has started, and a watch whose ranks all started ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nanotron_recover.launcher import startup_watch
from nanotron_recover.launcher.runs import rank_processes
from nanotron_recover.launcher.startup_watch import StartupWatch, ranks_here
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import append_metrics_record, read_exits

# a rank's stand-in: with "arm", it forks a watchdog child that lives for the given seconds (then "disarmed")
RANK = """
import os, sys, time
if sys.argv[1] == "arm" and os.fork() == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
time.sleep(60)
"""


def stand_in(run_dir: Path, rank: int, arm: bool, watchdog_s: float = 60.0) -> subprocess.Popen:
    args = [sys.executable, "-c", RANK, "arm" if arm else "no", str(watchdog_s), "nanotron_recover.train", str(run_dir)]
    return subprocess.Popen(args, env={**os.environ, "OMPI_COMM_WORLD_RANK": str(rank)})


def watchdog_seen(watch: StartupWatch, rank: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while rank not in watch.armed:
        assert time.monotonic() < deadline, "the stand-in's watchdog was never seen"
        assert watch.died_unarmed() is None
        time.sleep(0.02)


def stop(run_dir: Path, *procs: subprocess.Popen) -> None:
    """End the stand-ins and their forked watchdogs: every process whose command line names this test's folder."""
    for pid in rank_processes(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait(timeout=10)


def test_a_rank_gone_before_its_watchdog_is_named_once_with_an_exit_record(tmp_path):
    armed, unarmed = stand_in(tmp_path, 0, arm=True), stand_in(tmp_path, 1, arm=False)
    try:
        watch = StartupWatch(tmp_path)
        watchdog_seen(watch, 0)
        deadline = time.monotonic() + 10
        while 1 not in watch.pids:
            assert time.monotonic() < deadline, vars(watch)
            assert watch.died_unarmed() is None, vars(watch)
            time.sleep(0.02)
        unarmed.send_signal(signal.SIGKILL)
        unarmed.wait(timeout=10)
        why = watch.died_unarmed()
        assert why is not None and why.startswith("rank 1 died during start-up"), (why, vars(watch))
        assert f"pid {unarmed.pid}," in why, why
        record = read_exits(tmp_path)[1]
        assert record["code"] == EXIT_RESTART and "seen gone by the launcher" in record["reason"], record
        assert watch.done and watch.died_unarmed() is None  # named once
    finally:
        stop(tmp_path, armed, unarmed)


def test_an_armed_rank_that_dies_is_left_to_its_own_watchdog(tmp_path):
    armed = stand_in(tmp_path, 0, arm=True)
    try:
        watch = StartupWatch(tmp_path)
        watchdog_seen(watch, 0)
        armed.send_signal(signal.SIGKILL)
        armed.wait(timeout=10)
        assert watch.died_unarmed() is None and not read_exits(tmp_path)
    finally:
        stop(tmp_path, armed)


def test_the_watch_ends_once_every_rank_started(tmp_path):
    procs = [stand_in(tmp_path, r, arm=True, watchdog_s=1.0) for r in range(2)]
    try:
        watch = StartupWatch(tmp_path)
        for rank in range(2):
            watchdog_seen(watch, rank)
        deadline = time.monotonic() + 20
        while not watch.done:  # both watchdogs exit after 1 s: "disarmed", the ranks alive
            assert time.monotonic() < deadline, (watch.armed, watch.started)
            assert watch.died_unarmed() is None
            time.sleep(0.05)
        assert watch.started == {0, 1}
        procs[0].kill()  # a death after start-up is not the watch's business
        procs[0].wait(timeout=10)
        assert watch.died_unarmed() is None and not read_exits(tmp_path)
    finally:
        stop(tmp_path, *procs)


def test_the_watch_ends_once_the_run_logged_in_this_launch(tmp_path):
    unarmed = stand_in(tmp_path, 0, arm=False)
    try:
        watch = StartupWatch(tmp_path)
        deadline = time.monotonic() + 10
        while 0 not in watch.pids:
            assert time.monotonic() < deadline
            watch.died_unarmed()
            time.sleep(0.02)
        append_metrics_record(tmp_path, {"step": 1})
        unarmed.kill()
        unarmed.wait(timeout=10)
        assert watch.died_unarmed() is None and watch.done and not read_exits(tmp_path)
    finally:
        stop(tmp_path, unarmed)


def test_a_rank_of_an_all_local_job_never_seen_is_taken_as_dead(tmp_path, monkeypatch):
    monkeypatch.setattr(startup_watch, "MISSING_S", 0.5)
    armed = stand_in(tmp_path, 0, arm=True)  # rank 1 of the 2 never appears (killed before the launcher looked)
    try:
        watch = StartupWatch(tmp_path, expected=2)
        watchdog_seen(watch, 0)
        time.sleep(0.6)
        why = watch.died_unarmed()
        assert why is not None and why.startswith("rank 1 died during start-up") and "never seen" in why, why
        assert read_exits(tmp_path)[1]["code"] == EXIT_RESTART
    finally:
        stop(tmp_path, armed)


def test_only_an_mpirun_line_without_hosts_puts_every_rank_here(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    assert ranks_here(["mpirun", "-n", "8", "--oversubscribe", "python", "-m", "x"]) == 8
    assert ranks_here(["mpirun", "-n", "8", "--hostfile", "h", "python"]) is None
    assert ranks_here(["mpirun", "--host", "a,b", "-n", "4", "python"]) is None
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert ranks_here(["mpirun", "-n", "8", "python"]) is None
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    assert ranks_here(["mpirun", "-n", "8", "python"]) == 8
