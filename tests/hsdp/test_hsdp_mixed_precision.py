"""HSDP replicas in bf16: FSDP2 mixed precision (fp32 sharded parameters = masters, bf16 compute, fp32
reduce-scatter into the same fp32 buckets) through two kills and a shard-checkpoint resume.

3 replicas x F=2: one replica killed in ``backward``, one in ``reduce``, compared with the failure-free bf16 HSDP
run within the floor measured here (failure-free, 1 replica computing all M microbatches: another summation
order); a resumed shard checkpoint continues with identical losses.
"""

from __future__ import annotations

import copy

import pytest

from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from tests.conftest import make_tiny_config

STEPS = 12
SAVE_AT = 6
TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5 * TIMEOUT_S)]
KILLS = [{"step": 4, "replica": 1, "rank": 0, "phase": "backward"},
         {"step": 9, "replica": 2, "rank": 1, "phase": "reduce"}]


def bf16_hsdp(*, dp: int = 3, accumulation: int = 2, inject: list | None = None) -> dict:
    config = make_tiny_config(
        dp=dp, accumulation=accumulation, steps=STEPS, checkpoint_interval=SAVE_AT,
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "replica": "fsdp", "fsdp_shard_size": 2,
                         "inject": inject or []},
    )
    config["model"]["dtype"] = "bfloat16"
    return config


def run(config: dict, run_dir):
    return run_training(config, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def test_bf16_hsdp_keeps_the_trajectory_through_two_kills_and_resumes_exactly(tmp_path):
    reference = run(bf16_hsdp(), tmp_path / "reference")
    one_replica = run(bf16_hsdp(dp=1, accumulation=6), tmp_path / "one")
    failed = run(bf16_hsdp(inject=KILLS), tmp_path / "failed")
    ref_ckpt = final_checkpoint(reference.run_dir)
    floor_loss = max_loss_diff(reference, one_replica)
    floor_weights = max_relative_param_diff(ref_ckpt, final_checkpoint(one_replica.run_dir))
    loss = max_loss_diff(reference, failed)
    weights = max_relative_param_diff(ref_ckpt, final_checkpoint(failed.run_dir))
    print(f"\nbf16 HSDP, 2 kills vs failure-free: loss {loss:.3e} weights {weights:.3e} "
          f"(floor, 3 vs 1 replica: loss {floor_loss:.3e} weights {floor_weights:.3e})")
    assert {r for e in failed.events_of("repair") for r in e["failed_replicas"]} == {1, 2}
    assert all(s["microbatches"] == 6 for s in failed.steps)
    assert loss <= max(1e-5, floor_loss) and weights <= max(1e-5, floor_weights)
    assert abs(reference.losses[0] - failed.losses[0]) == 0.0  # the same bf16 model before any failure

    resumed_config = copy.deepcopy(bf16_hsdp())
    resumed_config["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "reference" / "checkpoints" / str(SAVE_AT))
    resumed = run(resumed_config, tmp_path / "resumed")
    assert [s["step"] for s in resumed.steps] == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed.losses == reference.losses[SAVE_AT:]  # fp32 shards (the masters) and Adam restored exactly
