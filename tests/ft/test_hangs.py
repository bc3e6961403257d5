"""No hang stalls a run: frozen (SIGSTOP) and stuck ranks are found and killed, then recovered in-step.

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``, 2 replicas x TP2 x PP2 (8 processes), real
signals from the fault schedule, a hard timeout on each run. Each run must commit every step with all M
microbatches, match the failure-free losses, log the ``hang_detected`` event, and resume committing within
``hang_timeout_s + 5 s`` of the signal, not counting Open MPI's own latency from the kill to the death notice
(measured in each run and printed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nanotron_recover.ft.hang_policy import CHECK_INTERVAL_S, HEARTBEAT_PERIOD_S
from nanotron_recover.launcher.runs import RunResult, run_training
from nanotron_recover.run.run_folder import read_exits, read_kills

pytestmark = pytest.mark.slow

STEPS = 6
FAULT_STEP = 3
HANG_TIMEOUT_S = 8.0  # tight, so that the tests are quick; real runs use the default (>= 30 s)
TIMEOUT_S = 240
TOL = 1e-5
RPR = 4  # ranks per replica: TP2 x PP2


def hang_config(tiny_config, inject: list[dict], collective_timeout_s: float = 120) -> dict:
    return tiny_config(
        dp=2, tp=2, pp=2, accumulation=2, steps=STEPS,
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "hang_timeout_s": HANG_TIMEOUT_S,
                         "collective_timeout_s": collective_timeout_s, "inject": inject},
    )


_REFERENCE: list[np.ndarray] = []


@pytest.fixture
def reference(tiny_config, tmp_path_factory) -> np.ndarray:
    """The failure-free run of the same config (once per module)."""
    if not _REFERENCE:
        result = run_training(hang_config(tiny_config, []), tmp_path_factory.mktemp("ref"), timeout_s=TIMEOUT_S,
                              extra_args=["--synthetic-data"])
        assert len(result.steps) == STEPS, result.output[-3000:]
        _REFERENCE.append(np.array(result.losses))
    return _REFERENCE[0]


def fault_time(run_dir: Path) -> float:
    """When the scheduled fault fired, as the injector recorded it."""
    (fault,) = read_kills(run_dir)
    return fault["time"]


def assert_recovered(result: RunResult, reference: np.ndarray, victim_replica: int, phase: str = "forward") -> float:
    """Every step committed, same losses, the victim's replica repaired away; returns the stall in seconds: from
    the signal to the commit of the first step that needed the victim (in the optimizer phase its step was already
    committed: the next one)."""
    tail = result.output[-5000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == 4 for s in result.steps), tail
    assert {r for e in result.events_of("repair") for r in e["failed_replicas"]} == {victim_replica}, tail
    diff = float(np.abs(np.array(result.losses) - reference).max())
    assert diff <= TOL, f"loss differs from the failure-free run by {diff:.2e}\n{tail}"
    fired = fault_time(result.run_dir)
    blocked = FAULT_STEP + (1 if phase == "optimizer" else 0)
    stall = next(s["time"] for s in result.steps if s["step"] == blocked) - fired
    notice = mpi_notice_s(result)
    assert stall - notice <= HANG_TIMEOUT_S + 5.0, (
        f"stall {stall:.1f} s ({notice:.1f} s of it Open MPI's death notice) > hang_timeout_s + 5 s\n{tail}")
    return stall


def mpi_notice_s(result: RunResult) -> float:
    """Seconds from the first kill the hang monitor did to the failure notice that started the repair: Open MPI's
    part of the stall (50-120 ms on an idle machine; 5.6 s once in a CI run on 2 busy cores), not the detector's."""
    killed = min(h["wall_time"] for h in result.events_of("hang_detected"))
    repair = result.events_of("repair")[0]
    return max(0.0, repair["wall_time"] - repair["detect_to_repaired_ms"] / 1e3 - killed)


@pytest.mark.timeout(TIMEOUT_S + 60)
# backward is compute like forward and the optimizer (tests/multinode/test_hangs_across_nodes.py freezes a rank there)
@pytest.mark.parametrize("phase, rank", [("forward", 0), ("reduce", 2), ("optimizer", 3)])
def test_a_frozen_rank_is_killed_and_the_step_recovered(phase, rank, tiny_config, reference, tmp_path):
    """SIGSTOP in each phase, on ranks of different (pp, tp) coordinates. In forward, the frozen rank's TP peer
    waits inside the TP all-reduce (an intra-replica collective); in reduce, the other replica waits inside the
    cross-replica reduction."""
    inject = [{"step": FAULT_STEP, "replica": 1, "rank": rank, "phase": phase, "signal": "stop"}]
    result = run_training(hang_config(tiny_config, inject), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    stall = assert_recovered(result, reference, victim_replica=1, phase=phase)
    hangs = result.events_of("hang_detected")
    victim = 1 * RPR + rank
    silent = [h for h in hangs if h["reason"] == "silent" and h["rank"] == victim]
    assert silent, hangs
    # where the frozen rank was when last heard: its monitor beats at least every HEARTBEAT_PERIOD_S and sends news
    # of the main thread at its next wake (CHECK_INTERVAL_S), so the report is at most ~1.5 s old (2 s allowed)
    fired = fault_time(result.run_dir)
    done_by_then = sum(1 for s in result.steps if s["time"] <= fired - (HEARTBEAT_PERIOD_S + CHECK_INTERVAL_S + 0.5))
    assert done_by_then <= silent[0]["last_step"] <= FAULT_STEP and silent[0]["last_where"] != "other", silent
    print(f"\nSIGSTOP {phase} rank {rank}: stall {stall:.2f} s (hang_timeout_s {HANG_TIMEOUT_S:g}, Open MPI's death "
          f"notice {mpi_notice_s(result):.2f} s); last heard at "
          f"step {silent[0]['last_step']} {silent[0]['last_where']}")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_main_thread_stuck_in_compute_kills_its_own_rank(tiny_config, reference, tmp_path):
    """The main thread blocks for ever in backward (as in a hung kernel) while the process's threads run: its own
    monitor sees no progress and SIGKILLs the process."""
    inject = [{"step": FAULT_STEP, "replica": 0, "rank": 3, "phase": "backward", "signal": "hang"}]
    result = run_training(hang_config(tiny_config, inject), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    stall = assert_recovered(result, reference, victim_replica=0)
    stuck = [h for h in result.events_of("hang_detected") if h["reason"] == "stuck"]
    # ranks of replica 0 (world ranks 0-3) found themselves stuck at that step: the hung one, or the stage-0 ranks
    # waiting for its gradients (whichever timer ran out first); the replica left either way
    assert stuck and all(h["rank"] in range(RPR) and h["step"] == FAULT_STEP for h in stuck), stuck
    # each left its threads' stacks; the hung rank's main thread is in the injector's endless wait
    stacks = {h["rank"]: Path(h["stacks_file"]).read_text() for h in stuck}
    assert all(text.startswith("thread MainThread:") and "thread hang-monitor:" in text
               for text in stacks.values()), stacks
    assert 3 not in stacks or "maybe_fail" in stacks[3].split("\nthread ")[0], stacks[3]
    exits = read_exits(tmp_path)
    assert 3 not in exits or "evicted" in exits[3]["reason"], exits  # the hung rank is gone
    print(f"\nstuck main thread: stall {stall:.2f} s; hang events {json.dumps(stuck)[:300]}")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_torch_timeout_before_the_hang_timeout_waits_for_the_kill(tiny_config, reference, tmp_path):
    """With ``collective_timeout_s`` (3 s) below ``hang_timeout_s`` (8 s) the frozen rank's replica-mates get a
    torch timeout first; they must not abort the job but wait for the hang monitor's kill, then leave with the
    repair."""
    inject = [{"step": FAULT_STEP, "replica": 1, "rank": 0, "phase": "forward", "signal": "stop"}]
    result = run_training(hang_config(tiny_config, inject, collective_timeout_s=3), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    assert_recovered(result, reference, victim_replica=1)
    exits = read_exits(tmp_path)
    assert all(exits[r]["code"] == 0 for r in (0, 1, 2, 3)), exits  # the healthy replica finished
    assert "aborted" not in result.output, result.output[-4000:]


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_rank_frozen_right_after_a_step_at_the_default_settings_is_survived_in_step(tiny_config, reference,
                                                                                       tmp_path):
    """The default timeouts (hang timeout derived from the steps, ``collective_timeout_s`` 60 s): the logging rank
    SIGSTOPped from outside as soon as step 2 is logged (its last word is then "snapshot", which once gave a silent
    rank the 600-s I/O allowance: its mates' gloo timeout ended the job with exit 1). Every hang bound stays under
    the collective timeout now: the monitor kills it and the step is recovered in-step."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from nanotron_recover.ft.hang_policy import CEILING_MARGIN_S
    from nanotron_recover.launcher.runs import rank_pids, read_metrics, write_config
    from nanotron_recover.run.run_folder import last_logged_step, record_external_fault

    config = tiny_config(dp=2, tp=2, pp=2, accumulation=2, steps=STEPS,
                         fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01})  # default timeouts
    path = write_config(config, tmp_path / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(path), "--run-dir",
           str(tmp_path), "--synthetic-data"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while last_logged_step(tmp_path) < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        record_external_fault(tmp_path, "stop-0")
        frozen_at = time.time()
        os.kill(rank_pids(tmp_path)[0], signal.SIGSTOP)
        output, _ = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    steps, events = read_metrics(tmp_path)
    assert launcher.returncode == 0 and "aborted" not in output, output[-5000:]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)) and all(s["microbatches"] == 4 for s in steps)
    assert float(np.abs(np.array([s["loss"] for s in steps]) - reference).max()) <= TOL
    silent = [e for e in events if e.get("event") == "hang_detected" and e.get("rank") == 0]
    assert silent and silent[0]["wall_time"] - frozen_at <= 60 - CEILING_MARGIN_S + 2 * HEARTBEAT_PERIOD_S, silent
    print(f"\nlogging rank frozen after step 2 at the defaults: killed {silent[0]['wall_time'] - frozen_at:.1f} s "
          f"later (last heard at step {silent[0]['last_step']} {silent[0]['last_where']}), survived in-step")
