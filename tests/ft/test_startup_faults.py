"""A fault before every rank is ready to train ends the whole job within ``startup_timeout_s``, with the restart
outcome; the relaunch (same run dir) trains to the end.

Before the fault-tolerant world is up nothing can be recovered, and without a guard a death before ``MPI_Init``
leaves the other ranks inside ``MPI_Init`` for ever. Real ``mpirun --with-ft ulfm`` jobs, real SIGKILL / SIGSTOP
from the fault schedule (``phase: startup``), hard timeouts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.process.watchdog import STARTUP_WAIT_FLOOR_S
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import read_exits

pytestmark = pytest.mark.slow

STEPS = 4
STARTUP_TIMEOUT_S = 20.0
OUTCOME = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "recover_job.py"


def startup_config(tiny_config, inject: list[dict]) -> dict:
    return tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance={
        "enabled": True, "startup_timeout_s": STARTUP_TIMEOUT_S, "inject": inject})


def outcome(run_dir: Path, rc: int) -> str:
    out = subprocess.run([sys.executable, str(OUTCOME), "outcome", "--run-dir", str(run_dir), "--train-steps",
                          str(STEPS), "--mpirun-rc", str(rc)], capture_output=True, text=True, timeout=60)
    return out.stdout.split()[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at, signal", [
    ("before_mpi_init", "kill"),   # the others wait inside MPI_Init: only the watchdogs end them
    ("after_mpi_init", "kill"),    # noticed over ULFM while the worlds are built
    ("checkpoint_load", "stop"),   # frozen after the model build: its own watchdog ends it
    ("agreed", "kill"),            # after the start-up agreement, before the hang monitor's collective start
])
def test_a_startup_fault_ends_the_job_with_the_restart_outcome(at, signal, tiny_config, tmp_path):
    inject = [{"step": 0, "replica": 1, "rank": 0, "phase": "startup", "at": at, "signal": signal}]
    config = startup_config(tiny_config, inject)
    t0 = time.monotonic()
    first = run_training(config, tmp_path, timeout_s=STARTUP_TIMEOUT_S + 60, extra_args=["--synthetic-data"],
                         check=False)
    ended = time.monotonic() - t0
    tail = first.output[-4000:]
    assert first.steps == [], tail
    assert ended <= STARTUP_TIMEOUT_S + 10 + 15, f"job took {ended:.1f} s to end\n{tail}"  # + 15 s interpreter start
    # said by the launcher from the exit records: a rank's own last line can be lost with its daemon
    assert "[nanotron-recover] why: " in first.output and f"(exit {EXIT_RESTART})" in first.output, tail
    assert outcome(tmp_path, first.returncode) == "restart"
    survivors = {r: e for r, e in read_exits(tmp_path).items() if r != 1}
    assert survivors and all(e["code"] == EXIT_RESTART for e in survivors.values()), survivors
    print(f"\nstartup {signal} at {at}: job ended after {ended:.1f} s (startup_timeout_s {STARTUP_TIMEOUT_S:g})")

    again = run_training(config, tmp_path, timeout_s=240, extra_args=["--synthetic-data"])  # the fault fired once
    assert [s["step"] for s in again.steps] == list(range(1, STEPS + 1)), again.output[-4000:]
    assert outcome(tmp_path, again.returncode) == "done"


@pytest.mark.timeout(600)
def test_the_same_startup_failure_on_three_launches_stops_requeueing(tiny_config, tmp_path):
    """A start-up failure that comes back on every launch (here: the fault's marker removed before each relaunch,
    as a broken node would do it again) exits 3 twice, then 2: a requeue loop would burn the allocation."""
    import shutil

    from nanotron_recover.run.exit_codes import EXIT_NEEDS_PERSON

    inject = [{"step": 0, "replica": 1, "rank": 0, "phase": "startup", "at": "after_mpi_init", "signal": "kill"}]
    config = startup_config(tiny_config, inject)
    codes = []
    for _ in range(3):
        shutil.rmtree(tmp_path / "injected", ignore_errors=True)
        result = run_training(config, tmp_path, timeout_s=STARTUP_TIMEOUT_S + 90, extra_args=["--synthetic-data"],
                              check=False)
        assert result.steps == [], result.output[-3000:]
        codes.append(result.returncode)
    assert codes == [EXIT_RESTART, EXIT_RESTART, EXIT_NEEDS_PERSON], result.output[-3000:]
    assert "the same start-up failure on 3 launches in a row" in result.output
    assert outcome(tmp_path, 1) == "needs_person"  # the Slurm helper reads the same count from the run folder


def at_the_defaults(tiny_config, at: str, signal: str) -> dict:
    """The settings a user gets (``startup_timeout_s`` 600 s), with one start-up fault of rank 0 of replica 1."""
    inject = [{"step": 0, "replica": 1, "rank": 0, "phase": "startup", "at": at, "signal": signal}]
    return tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance={"enabled": True,
                                                                                    "inject": inject})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", ["before_mpi_init", "model_build"])
def test_a_death_during_startup_at_the_default_timeout_costs_seconds(at, tiny_config, tmp_path):
    """``startup_timeout_s`` at its default (600 s): a rank SIGKILLed during start-up (before ``MPI_Init`` the
    others wait inside it for the dead rank) ends the attempt within seconds: the rank's start-up watchdog sees it
    die without a word and ends the job (before: the others waited the whole timeout); the relaunch finishes."""
    config = at_the_defaults(tiny_config, at, "kill")
    t0 = time.monotonic()
    first = run_training(config, tmp_path, timeout_s=240, extra_args=["--synthetic-data"], check=False)
    ended = time.monotonic() - t0
    assert first.returncode == EXIT_RESTART and first.steps == [], first.output[-3000:]
    assert ended <= 45, f"the attempt took {ended:.1f} s to end\n{first.output[-3000:]}"  # 15 s of it start-up
    again = run_training(config, tmp_path, timeout_s=240, extra_args=["--synthetic-data"])
    assert [s["step"] for s in again.steps] == list(range(1, STEPS + 1))
    print(f"\nstartup kill at {at}, default startup_timeout_s: the attempt ended after {ended:.1f} s")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("at, floor_s", [("before_mpi_init", 15), ("checkpoint_load", None)])
def test_a_rank_frozen_in_startup_at_the_default_timeout_costs_a_bounded_wait(at, floor_s, tiny_config, tmp_path):
    """``startup_timeout_s`` at its default (600 s): a rank SIGSTOPped during start-up (before ``MPI_Init``, where
    the others then wait inside it; or after its model build, where they wait in the start-up agreement). The
    others' watchdogs end the job once their wait outlasts its bound (3 x their own start-up, at least 60 s, or
    ``startup_peer_wait_floor_s``: 15 s for the wait inside ``MPI_Init``, a minute less of idle cores in the suite),
    with the restart outcome and the reason in their exit records; the relaunch finishes."""
    config = at_the_defaults(tiny_config, at, "stop")
    if floor_s is not None:
        config["fault_tolerance"]["startup_peer_wait_floor_s"] = floor_s
    t0 = time.monotonic()
    first = run_training(config, tmp_path, timeout_s=300, extra_args=["--synthetic-data"], check=False)
    ended = time.monotonic() - t0
    tail = first.output[-3000:]
    assert first.returncode == EXIT_RESTART and first.steps == [], tail
    floor = floor_s or STARTUP_WAIT_FLOOR_S
    assert ended <= floor + 60, f"the attempt took {ended:.1f} s to end\n{tail}"  # the bound: the floor or 3 x start-up
    waited = [e for r, e in read_exits(tmp_path).items() if r != 1 and "for its peers at" in e["reason"]]
    assert waited and all(e["code"] == EXIT_RESTART for e in waited), read_exits(tmp_path)
    assert all(f"at least {floor:g} s" in e["reason"] for e in waited), waited
    again = run_training(config, tmp_path, timeout_s=240, extra_args=["--synthetic-data"])
    assert [s["step"] for s in again.steps] == list(range(1, STEPS + 1))
    print(f"\nstartup freeze at {at}, default startup_timeout_s: the attempt ended after {ended:.1f} s "
          f"({waited[0]['reason']})")
