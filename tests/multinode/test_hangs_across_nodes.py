"""Hangs across nodes: a rank can only be killed from its own node.

Two isolated nodes (``nanotron_recover.testbed.isolated_nodes``: each its own pid namespace, so a pid means nothing
on another node) with 2 ranks each; 2 replicas x TP2, replica r on node r+1. A frozen rank's first watcher is its
coordinate peer on the other node: it asks the live rank on the frozen rank's node to kill it. When the whole node
is frozen nobody can, and the job ends with the restart outcome instead of waiting.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.run_folder import last_logged_step, read_exits, record_external_fault
from nanotron_recover.testbed import isolated_nodes as iso

pytestmark = pytest.mark.slow

STEPS = 5
FAULT_STEP = 3
HANG_TIMEOUT_S = 8.0  # tight, so that the tests are quick; real runs use the default (>= 30 s)
TIMEOUT_S = 240


def two_node_config(tiny_config, inject: list[dict]) -> dict:
    return tiny_config(dp=2, tp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance={
        "enabled": True, "reduce_bucket_mb": 0.01, "hang_timeout_s": HANG_TIMEOUT_S, "collective_timeout_s": 120,
        "inject": inject})


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_frozen_rank_is_killed_by_a_rank_of_its_own_node(tiny_config, tmp_path, monkeypatch, failure_free_run,
                                                           isolated_bed):
    # one node: the split over nodes changes no math (shared with the paused-node test below)
    reference = failure_free_run(two_node_config(tiny_config, []), timeout_s=TIMEOUT_S)
    for key, value in iso.launch_env(Path(isolated_bed([2, 2]).folder)).items():
        monkeypatch.setenv(key, value)
    inject = [{"step": FAULT_STEP, "replica": 1, "rank": 1, "phase": "backward", "signal": "stop"}]
    result = run_training(two_node_config(tiny_config, inject), tmp_path / "run", timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    tail = result.output[-5000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert np.abs(np.array(result.losses) - np.array(reference.losses)).max() <= 1e-5, tail
    hangs = result.events_of("hang_detected")
    # world rank 3 (node 2) is watched by rank 2 (node 2) and rank 1 (node 1); the lowest, rank 1, acts first
    first = min(hangs, key=lambda h: h["wall_time"])
    assert first["rank"] == 3 and first["by_rank"] == 1 and first["action"].startswith("ask ranks [2]"), hangs
    assert {r for e in result.events_of("repair") for r in e["failed_replicas"]} == {1}, tail


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_frozen_node_that_nobody_can_reach_ends_the_job_with_the_restart_outcome(tiny_config, tmp_path,
                                                                                   monkeypatch, isolated_bed):
    for key, value in iso.launch_env(Path(isolated_bed([2, 2]).folder)).items():
        monkeypatch.setenv(key, value)
    inject = [{"step": FAULT_STEP, "replica": 1, "rank": r, "phase": "forward", "signal": "stop"} for r in (0, 1)]
    t0 = time.monotonic()
    result = run_training(two_node_config(tiny_config, inject), tmp_path / "run", timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"], check=False)
    elapsed = time.monotonic() - t0
    tail = result.output[-5000:]
    assert [s["step"] for s in result.steps] == list(range(1, FAULT_STEP)), tail  # nothing after the freeze
    unresolvable = [h for h in result.events_of("hang_detected") if h["reason"] == "unresolvable"]
    assert unresolvable and "still alive" in unresolvable[0]["detail"], result.events_of("hang_detected")
    # the rank's own stderr line can be lost with its daemon; the exit record, repeated by the launcher, cannot
    exits = read_exits(tmp_path / "run")
    assert any(r.get("reason", "").startswith("hang: ") for r in exits.values()), exits
    why = [line for line in result.output.splitlines() if line.startswith("[nanotron-recover] why: ")]
    assert any("hang: " in line and "still alive" in line for line in why), tail
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end\n{tail}"


def _pause_node_then_resume(run_dir, bed: iso.Bed, node: str, after_step: int, paused_s: float,
                            log: list[str]) -> None:
    """SIGSTOP every process of ``node`` (its MPI daemon, its ranks and their watchdogs) once ``after_step`` is
    logged; SIGCONT them ``paused_s`` later: a node stalled as a whole (a VM or cgroup freeze), then running again."""
    deadline = time.monotonic() + TIMEOUT_S
    while last_logged_step(run_dir) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    init = bed.nodes[node].init
    pids = [pid for pid in iso.node_pids(bed.nodes[node]) if pid != init]  # scanned before: tens of ms
    while last_logged_step(run_dir) < after_step and time.monotonic() < deadline:
        time.sleep(0.01)
    record_external_fault(run_dir, f"stop-{node}")  # its hang events are provoked
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    log.append(f"paused {len(pids)} processes after step {after_step}")
    time.sleep(paused_s)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    log.append("resumed")


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_node_paused_past_the_hang_timeout_loses_its_replica_and_harms_no_other(tiny_config, tmp_path,
                                                                                  monkeypatch, failure_free_run,
                                                                                  isolated_bed):
    """Node 2 (replica 1) stalls whole for the hang timeout + 4 s, then runs again. Node 1's ranks hear the silence
    and ask node 2's ranks to kill their replica; those wake, do it, and must not judge node 1's ranks by the
    silence of their own pause (the case of a CI failure: a woken rank killed a healthy rank of the other node and
    the job lost both replicas). The run finishes on replica 0 with the failure-free losses.

    From the step of the pause on, every microbatch carries 19x its compute time as a sleep ("device time",
    ``signal: slow``: no number changes), so that the pause lands in the middle of training: with steps of ~35 ms,
    the job once reached its final agreement before the pauser's SIGSTOP, and the woken replica simply finished with
    the others. Not from step 1: a rank's first slowed call sleeps 19x that whole call, warm-up included, and on a
    loaded machine that passed the 8-s hang timeout (the rank ended itself as stuck before the pause)."""
    reference = failure_free_run(two_node_config(tiny_config, []), timeout_s=TIMEOUT_S)  # on one node
    bed = isolated_bed([2, 2])
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    log: list[str] = []
    pauser = threading.Thread(target=_pause_node_then_resume, daemon=True,
                              args=(tmp_path / "run", bed, "n2", FAULT_STEP - 1, HANG_TIMEOUT_S + 4.0, log))
    pauser.start()
    device_time = [{"step": FAULT_STEP, "replica": r, "signal": "slow", "factor": 20} for r in (0, 1)]
    result = run_training(two_node_config(tiny_config, device_time), tmp_path / "run", timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    heard = [h["last_step"] for h in result.events_of("hang_detected") if "last_step" in h]
    assert heard and min(heard) < STEPS, f"the pause did not land in the middle of training: {heard}\n{log}"
    pauser.join(timeout=60)
    tail = result.output[-5000:]
    assert len(log) == 2 and log[1] == "resumed" and int(log[0].split()[1]) >= 2, log  # both ranks paused
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert np.abs(np.array(result.losses) - np.array(reference.losses)).max() <= 1e-5, tail
    hangs = result.events_of("hang_detected")
    assert hangs and all(h.get("rank") in (2, 3) for h in hangs if "rank" in h), hangs
    assert {r for e in result.events_of("repair") for r in e["failed_replicas"]} == {1}, tail
