"""HSDP recycling: 3 replicas x F=2 (6 ranks), two replicas broken; their two survivors form a new shard group.

Replica 1 loses shard 0 (rank 2) in backward at step 4, replica 2 loses shard 1 (rank 5) in the reduction at step
7. Survivors rank 3 (shard 1) and rank 4 (shard 0) form replica 3 after step 7, each keeping its shard index; each
receives its shard of the parameters and optimizer state from replica 0. Every step commits M, and the losses and
final shards match the failure-free HSDP run.
"""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from tests.hsdp.test_hsdp_training import SYNTHETIC, TIMEOUT_S, TOL, hsdp_config

STEPS = 12
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S + 60)]


def test_the_survivors_of_two_shard_groups_form_a_new_one(tiny_config, tmp_path):
    def config(inject):
        return hsdp_config(tiny_config, dp=3, steps=STEPS, inject=inject, recycle=True, local_snapshot_interval=0)

    reference = run_training(config([]), tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    inject = [{"step": 4, "replica": 1, "rank": 0, "phase": "backward"},
              {"step": 7, "replica": 2, "rank": 1, "phase": "reduce"}]
    result = run_training(config(inject), tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    tail = result.output[-6000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == 6 for s in result.steps), tail
    (formed,) = result.events_of("replica_formed")
    assert formed["step"] == 7 and [m["rank"] for m in formed["members"]] == [4, 3], formed
    assert all(m["old_coordinate"] == m["coordinate"] for m in formed["members"]), formed  # shard indices kept
    for s in result.steps:
        if s["step"] > 7:
            assert s["live_replicas"] == 2 and s["quotas"]["3"] > 0 and s["pool_ranks"] == [], s
    diff = max_loss_diff(result, reference)
    rel = max_relative_param_diff(final_checkpoint(result.run_dir), final_checkpoint(reference.run_dir))
    assert diff <= TOL and rel <= TOL, f"max |dloss| {diff:.2e}, shards {rel:.2e}\n{tail}"
    print(f"\nHSDP recycle: shard group 3 of ranks 4, 3 after step 7; max |dloss| {diff:.2e}; final shards rel. diff "
          f"{rel:.2e}")
