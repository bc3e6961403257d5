"""The launcher's process watches see the job's ranks whatever run folder it is given (real jobs, real SIGKILLs).

The ranks are started with the resolved run folder; the launcher finds them in ``/proc`` by that path. README's
quickstart passes a relative one (``runs/tiny_llama``), and a cluster's scratch is often reached through a symlink
(``/scratch -> /lustre/scratch``): with either, a rank killed in its first moments must cost a relaunch within
seconds, not the ranks' start-up bound, and the ranks of a launch whose ``mpirun`` was SIGKILLed must be gone
before the next launch starts (no line of theirs in ``metrics.jsonl`` after it).
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
from nanotron_recover.run.run_folder import last_logged_step, read_launches, read_metrics, read_metrics_jsonl
from tests.conftest import make_tiny_config

pytestmark = pytest.mark.slow
TIMEOUT_S = 240
RELAUNCH_BOUND_S = 15.0  # a relaunch "within seconds": the start-up bound it replaces is 60 s and more


def tiny(tmp_path: Path, steps: int) -> dict:
    return make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2,
                            fault_tolerance={"enabled": True, "local_snapshot_dir": str(tmp_path / "shm")})


def run_dir_as_given(tmp_path: Path, how: str) -> tuple[Path, str]:
    """(the working directory, the ``--run-dir`` argument) for a run folder given ``relative`` to the working
    directory, as README's quickstart does, or through a ``symlink``; the real folder is ``tmp_path/real/run``."""
    (tmp_path / "real").mkdir()
    if how == "relative":
        return tmp_path / "real", "run"
    (tmp_path / "link").symlink_to(tmp_path / "real")
    return tmp_path, str(tmp_path / "link" / "run")


@contextmanager
def launched(cwd: Path, run_dir_arg: str, config_path: Path, real: Path) -> Iterator[subprocess.Popen]:
    """The quickstart's command shape (``train --config-file ... --run-dir ...``) from ``cwd``, one relaunch in
    place allowed; the block waits for the launcher, and nothing of the job outlives it."""
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file",
           os.path.relpath(config_path, cwd), "--run-dir", run_dir_arg, "--synthetic-data", "--max-restarts", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the package, as the suite imports it
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=open(cwd / "launcher.log", "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        yield proc
        proc.wait(timeout=TIMEOUT_S - 60)
    finally:
        if proc.poll() is None:
            kill_run_processes(real, proc)
    assert proc.returncode == 0, (cwd / "launcher.log").read_text()[-3000:]
    assert len(read_launches(real)) == 2, (cwd / "launcher.log").read_text()[-3000:]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("how", ["relative", "symlink"])
def test_a_rank_killed_in_its_first_moments_costs_a_relaunch_within_seconds(tmp_path, how):
    cwd, run_dir_arg = run_dir_as_given(tmp_path, how)
    real = (tmp_path / "real" / "run").resolve()
    config_path = write_config(tiny(tmp_path, 20), tmp_path / "config.yaml")
    with launched(cwd, run_dir_arg, config_path, real):
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline:
            victim = rank_pids(real).get(1)
            time.sleep(0.002)
        assert victim is not None, "rank 1 never appeared"
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
    took = read_launches(real)[1]["time"] - killed
    assert took <= RELAUNCH_BOUND_S, f"relaunched {took:.1f} s after the kill:\n{(cwd / 'launcher.log').read_text()}"
    assert [s["step"] for s in read_metrics(real)[0]] == list(range(1, 21))
    print(f"\n{how} run folder: rank 1 killed in its first moments, relaunched {took:.1f} s later")


@pytest.mark.timeout(TIMEOUT_S)
def test_no_rank_of_a_launch_whose_mpirun_was_killed_writes_after_the_next_launch_started(tmp_path):
    """``mpirun`` SIGKILLed mid-run (a lost head node's daemon): its ranks, orphaned, may go on for moments; the
    launcher waits for them to end before it judges the run and starts the next launch."""
    cwd, run_dir_arg = run_dir_as_given(tmp_path, "relative")
    real = (tmp_path / "real" / "run").resolve()
    config_path = write_config(tiny(tmp_path, 400), tmp_path / "config.yaml")
    with launched(cwd, run_dir_arg, config_path, real) as proc:
        deadline = time.monotonic() + 120
        while last_logged_step(real) < 5:
            assert time.monotonic() < deadline and proc.poll() is None, (cwd / "launcher.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(mpirun_pid(proc.pid), signal.SIGKILL)
    launches = read_launches(real)
    assert launches[0].get("token") and launches[1].get("token"), launches
    first_token, second_started = launches[0]["token"], launches[1]["time"]
    late = [r for r in read_metrics_jsonl(real) if r.get("launch") == first_token and r["time"] >= second_started]
    assert not late, f"the first launch wrote {len(late)} line(s) after the second started: {late[:3]}"
    assert all("launch" in r for r in read_metrics_jsonl(real)), "every line names the launch that wrote it"
