"""The graceful stop's parts, with real signals: the rank's flag, the step's world-wide count, the forced snapshot
of the last step, and the launcher's turn of a stop signal into SIGUSR1 (then SIGHUP) to a real child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from nanotron_recover.config import config_from_dict
from nanotron_recover.process.stop_request import LauncherStop, StopRequest, blocked_for_mpirun
from nanotron_recover.recovery.step_sums import StepStats
from nanotron_recover.snapshots.schedule import SnapshotSchedule
from nanotron_recover.training.seam import LocalWork
from tests.conftest import make_tiny_config


def test_a_stop_signal_sets_the_flag_and_uninstall_restores_the_defaults():
    stop = StopRequest()
    stop.install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.name == "SIGUSR1" and stop.at is not None
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's warning and the launcher's: the same stop
        assert stop.name == "SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_second_sigterm_to_a_rank_ends_it():
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from nanotron_recover.process.stop_request import STOP
        STOP.install()
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
            if STOP.requested:
                print("asked", flush=True)
                STOP.signum = STOP.signum  # stays asked
    """)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "asked\n"  # the first one only asks
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM


def stats(stop: bool) -> StepStats:
    config = make_tiny_config(dp=2, accumulation=2, steps=4, fault_tolerance={"enabled": True})
    s = StepStats.of(config_from_dict(config))
    s.fill(1.0, LocalWork(microbatches=2), True, 0, stop=stop)
    return s


def test_the_step_sums_tell_every_rank_how_many_were_asked_to_stop():
    asked, not_asked = stats(True), stats(False)
    assert not_asked.stop_at(5) is None
    total = asked.stats + asked.stats + not_asked.stats  # three ranks' contributions, as the world-wide SUM
    asked.stats[:] = total
    stop = asked.stop_at(5)
    assert stop is not None and stop.event == "stop_signal"
    assert "2 rank(s)" in stop.reason and "resumes at step 6" in stop.reason
    assert asked.nonfinite() is None  # the entries do not mix
    np.testing.assert_array_equal(asked.snapshot_sums(), (0.0, 0.0, 0.0, 0.0))


def test_the_last_step_is_snapshotted_whatever_the_interval_unless_snapshots_are_off():
    sums = (0.0, 0.0, 0.0, 0.0)
    fixed = SnapshotSchedule.of(5, max_interval=10, mtbf_h=2.0)
    assert not fixed.commit(3, sums) and fixed.commit(4, sums, last=True)
    auto = SnapshotSchedule.of("auto", max_interval=10, mtbf_h=2.0)
    auto.interval = 8
    assert not auto.commit(1, sums) and not auto.commit(2, sums)
    assert auto.commit(3, sums, last=True) and auto.last == 3  # the interval counts from the stop's snapshot
    off = SnapshotSchedule.of(0, max_interval=10, mtbf_h=2.0)
    assert not off.commit(3, sums, last=True)


# The handlers only record a signal; the main loop says it. A handler that printed could run while the main code
# held stdout's buffer (a signal just after the "open" line was written): "reentrant call", the child dead.
CHILD = """
import signal, time
caught = []
for s in (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: caught.append(n))
print("blocked" if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()) else "open", flush=True)
while True:
    time.sleep(0.01)
    while caught:
        print(signal.Signals(caught.pop(0)).name, flush=True)
"""


def child_with_mask(graceful: bool) -> subprocess.Popen:
    """The child as ``mpirun`` starts (its mask), with a buffered stdout whatever PYTHONUNBUFFERED says here (CI
    sets it, a plain shell does not): the same child in both, the one where a printing handler would re-enter."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked_for_mpirun(graceful))
    try:
        return subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_the_launcher_asks_mpirun_with_sigusr1_then_ends_it_with_sighup(tmp_path: Path):
    child, said = child_with_mask(graceful=True), []
    try:
        assert child.stdout.readline() == "blocked\n"  # as mpirun: a SIGTERM to every process leaves it running
        stop = LauncherStop(child, grace_s=30.0, say=said.append)
        stop.on_signal(signal.SIGTERM)
        assert child.stdout.readline() == "SIGUSR1\n" and not stop.ended and "within 30 s" in said[0]
        stop.on_signal(signal.SIGUSR1)  # the time-limit warning again: still the same stop
        assert not stop.ended and not stop.overdue()
        stop.on_signal(signal.SIGTERM)  # a second SIGTERM: now
        assert child.stdout.readline() == "SIGHUP\n" and stop.ended and "now" in said[-1]
    finally:
        child.kill()
        child.wait()


def test_the_launcher_ends_a_job_that_outlives_its_grace():
    child, said = child_with_mask(graceful=True), []
    try:
        child.stdout.readline()
        stop = LauncherStop(child, grace_s=0.2, say=said.append)
        stop.on_signal(signal.SIGINT)
        assert child.stdout.readline() == "SIGUSR1\n"
        time.sleep(0.3)
        assert stop.overdue() and child.stdout.readline() == "SIGHUP\n"
        assert "stop_grace_s=0.2" in said[-1]
    finally:
        child.kill()
        child.wait()


def test_the_stock_path_ends_the_job_at_the_first_signal():
    child, said = child_with_mask(graceful=False), []
    try:
        assert child.stdout.readline() == "open\n"
        LauncherStop(child, grace_s=None, say=said.append).on_signal(signal.SIGTERM)
        assert child.stdout.readline() == "SIGTERM\n"
    finally:
        child.kill()
        child.wait()
