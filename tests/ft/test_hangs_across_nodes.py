"""Hangs across nodes: a rank can only be killed from its own node.

Two fake nodes (one real ``prted`` each, see ``fake_nodes.py``) with 2 ranks each; 2 replicas x TP2, replica r on
node r+1. A frozen rank's first watcher is its coordinate peer on the other node: it asks the live rank on the
frozen rank's node to kill it. When the whole node is frozen nobody can, and the job ends with the restart outcome
instead of waiting.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from nanotron_recover.runs import run_training

from .fake_nodes import fake_nodes_env

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
def test_a_frozen_rank_is_killed_by_a_rank_of_its_own_node(tiny_config, tmp_path, monkeypatch):
    reference = run_training(two_node_config(tiny_config, []), tmp_path / "ref", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])  # one node: the split over nodes changes no math
    for key, value in fake_nodes_env(tmp_path / "nodes", [2, 2]).items():
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
                                                                                   monkeypatch):
    for key, value in fake_nodes_env(tmp_path / "nodes", [2, 2]).items():
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
    assert "ending the job (restart outcome)" in result.output, tail
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end\n{tail}"
