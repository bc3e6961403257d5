"""A real straggler is rebalanced away, and the trajectory is kept (issue #26).

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``: 3 replicas x 1 rank, M = 12, 8 steps. From
step 2 replica 2's rank computes 4x slower for real (``signal: slow``: a sleep of 3x its own time per microbatch);
with ``rebalance: true`` it must get fewer than its equal share (4) within a few steps, every step must still commit
M, and the losses must be the failure-free run's (summation order aside).
"""

from __future__ import annotations

import numpy as np
import pytest

from nanotron_recover.runs import run_training

pytestmark = pytest.mark.slow

STEPS = 8
M = 12  # dp 3 x accumulation 4
TIMEOUT_S = 150
TOL = 1e-5


def straggler_config(tiny_config, **ft) -> dict:
    config = tiny_config(dp=3, accumulation=4, steps=STEPS, layers=2, fault_tolerance={
        "enabled": True, "local_snapshot_interval": 0, "hang_timeout_s": 30, "collective_timeout_s": 30, **ft})
    config["model"]["model_config"].update(hidden_size=64, intermediate_size=256)  # a microbatch is tens of ms
    config["tokens"].update(sequence_length=64, micro_batch_size=4)
    return config


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_a_slowed_replica_gets_fewer_microbatches_and_the_trajectory_is_kept(tiny_config, tmp_path) -> None:
    reference = run_training(straggler_config(tiny_config), tmp_path / "reference", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    slow = [{"step": 2, "replica": 2, "rank": 0, "signal": "slow", "factor": 4}]
    result = run_training(straggler_config(tiny_config, rebalance=True, inject=slow), tmp_path / "slowed",
                          timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    tail = result.output[-4000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert "[inject] SLOW x4 replica 2 local rank 0" in result.output, tail
    assert all(s["microbatches"] == M and sum(s["quotas"].values()) == M for s in result.steps), tail
    quota = [s["quotas"]["2"] for s in result.steps]
    assert quota[:2] == [M // 3] * 2, quota  # the equal split until a step after the first was measured
    assert all(q < M // 3 for q in quota[4:]), f"replica 2's quotas per step: {quota}"
    last = result.steps[-1]["speeds"]
    assert last["2"] < min(last["0"], last["1"]), last  # microbatches per second, smoothed
    diff = float(np.abs(np.array(result.losses) - np.array(reference.losses)).max())
    assert diff <= TOL, f"max |dloss| {diff:.2e} against the failure-free run"
    print(f"\nslowed replica 2 (x4 from step 2): quotas {quota}, speeds {last}, max |dloss| {diff:.2e}")
