"""Layer 1 in real training runs: SIGKILL a rank in every phase; the survivors finish every step.

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``, real SIGKILLs from the failure schedule, a
hard timeout on each run. Every run is also compared with the failure-free run of the same config: with the
global batch kept, the per-step losses must match (the trajectory does not change).
"""

from __future__ import annotations

import numpy as np
import pytest

from nanotron_recover.launcher.runs import RunResult, run_training
from nanotron_recover.run.run_folder import read_exits, read_logged_step
from nanotron_recover.training.metrics import find_wandb_run_files

STEPS = 6
FAIL_STEP = 3
TIMEOUT_S = 240
TOL = 1e-5


def ft_config(tiny_config, *, dp: int, tp: int = 1, pp: int = 1, inject: list[dict], **ft) -> dict:
    return tiny_config(
        dp=dp, tp=tp, pp=pp, accumulation=2, steps=STEPS, checkpoint_interval=FAIL_STEP,
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "inject": inject, **ft},
    )


_REFERENCES: dict[tuple, np.ndarray] = {}


def reference_losses(tiny_config, tmp_path_factory, *, dp: int, tp: int = 1, pp: int = 1) -> np.ndarray:
    """The failure-free run of the same layout (cached per layout for the module)."""
    key = (dp, tp, pp)
    if key not in _REFERENCES:
        config = ft_config(tiny_config, dp=dp, tp=tp, pp=pp, inject=[])
        result = run_training(config, tmp_path_factory.mktemp("ref"), timeout_s=TIMEOUT_S,
                              extra_args=["--synthetic-data"])
        assert len(result.steps) == STEPS, result.output[-3000:]
        _REFERENCES[key] = np.array(result.losses)
    return _REFERENCES[key]


def run_with_failures(tiny_config, tmp_path, **kwargs) -> RunResult:
    config = ft_config(tiny_config, **kwargs)
    return run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def assert_survived(result: RunResult, reference: np.ndarray, *, m: int, failed_replicas: set[int]) -> None:
    tail = result.output[-4000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == m for s in result.steps), tail
    repaired = {r for e in result.events_of("repair") for r in e["failed_replicas"]}
    assert repaired == failed_replicas, tail
    diff = np.abs(np.array(result.losses) - reference).max()
    assert diff <= TOL, f"loss differs from the failure-free run by {diff:.2e}\n{tail}"


# backward: the same shape and kill in test_with_recycling_off_the_healthy_rank_of_a_broken_replica_leaves below
@pytest.mark.parametrize("phase", ["forward", "reduce", "optimizer", "checkpoint", "dataload"])
def test_three_replicas_tp2_survive_a_kill_in_each_phase(phase, tiny_config, tmp_path, tmp_path_factory):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=3, tp=2)
    # replica 1 = world ranks 2, 3; its local rank 1 (world rank 3) dies
    result = run_with_failures(
        tiny_config, tmp_path, dp=3, tp=2, inject=[{"step": FAIL_STEP, "replica": 1, "rank": 1, "phase": phase}]
    )
    assert_survived(result, reference, m=6, failed_replicas={1})
    # recycling is on by default: the healthy mate (world rank 2) waits in the pool (one rank, a replica needs two)
    pooled = result.events_of("pool_changed")
    assert [e["joined"] for e in pooled] == [[2]], pooled
    assert all(s["pool_ranks"] == [2] for s in result.steps if s["step"] > FAIL_STEP), result.steps
    ended = read_exits(tmp_path)
    assert 3 not in ended, "the victim was SIGKILLed and cannot have exited normally"
    for rank in (0, 1, 2, 4, 5):
        assert (ended[rank]["code"], ended[rank]["reason"]) == (0, "finished"), ended


def test_with_recycling_off_the_healthy_rank_of_a_broken_replica_leaves(tiny_config, tmp_path, tmp_path_factory):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=3, tp=2)
    result = run_with_failures(tiny_config, tmp_path, dp=3, tp=2, recycle=False,
                               inject=[{"step": FAIL_STEP, "replica": 1, "rank": 1, "phase": "backward"}])
    assert_survived(result, reference, m=6, failed_replicas={1})
    assert not result.events_of("pool_changed") and all("pool_ranks" not in s for s in result.steps), result.steps
    ended = read_exits(tmp_path)
    assert ended[2]["code"] == 0 and "evicted" in ended[2]["reason"], ended


def test_victim_is_world_rank_zero_logging_moves_on(tiny_config, tmp_path, tmp_path_factory, monkeypatch):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=3, tp=2)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the new logging rank starts wandb inside a step (conftest.py)
    result = run_with_failures(
        tiny_config, tmp_path, dp=3, tp=2, inject=[{"step": FAIL_STEP, "replica": 0, "rank": 0, "phase": "backward"}]
    )
    # steps after the failure were logged by the new lowest live rank (world rank 2)
    assert_survived(result, reference, m=6, failed_replicas={0})
    assert read_exits(tmp_path)[1]["code"] == 0
    assert find_wandb_run_files(tmp_path) and read_logged_step(tmp_path) == STEPS  # and wandb's copy moved with it


def test_two_replicas_die_in_the_same_step(tiny_config, tmp_path, tmp_path_factory):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=4)
    result = run_with_failures(
        tiny_config, tmp_path, dp=4,
        inject=[
            {"step": FAIL_STEP, "replica": 1, "phase": "backward"},
            {"step": FAIL_STEP, "replica": 2, "phase": "reduce"},
        ],
    )
    assert_survived(result, reference, m=8, failed_replicas={1, 2})


def test_a_second_failure_during_the_first_repair_is_survived(tiny_config, tmp_path, tmp_path_factory):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=4)
    result = run_with_failures(
        tiny_config, tmp_path, dp=4,
        inject=[
            {"step": FAIL_STEP, "replica": 1, "phase": "backward"},
            {"step": FAIL_STEP, "replica": 3, "phase": "repair"},  # dies inside the survivors' repair
        ],
    )
    assert_survived(result, reference, m=8, failed_replicas={1, 3})


def test_pp2_failure_releases_the_other_stage_before_the_torch_timeout(tiny_config, tmp_path, tmp_path_factory):
    reference = reference_losses(tiny_config, tmp_path_factory, dp=2, pp=2)
    # replica 1 = world ranks 2 (stage 0), 3 (stage 1); stage 0 dies in forward, stage 1 waits on its activations
    result = run_with_failures(
        tiny_config, tmp_path, dp=2, pp=2, collective_timeout_s=200,
        inject=[{"step": FAIL_STEP, "replica": 1, "rank": 0, "phase": "forward"}],
    )
    assert_survived(result, reference, m=4, failed_replicas={1})
    assert read_exits(tmp_path)[3]["code"] == 0
    assert result.wall_s < 100, f"stage 1 was not released early: the run took {result.wall_s:.0f} s"


def test_with_the_hang_monitor_off_a_kill_is_still_recovered_in_step(tiny_config, tmp_path, tmp_path_factory):
    """``hang_monitor: false`` (for measuring its cost): no heartbeat thread, so no rank reports a hang margin; a
    crash is still noticed by ULFM and repaired in-step with the same trajectory."""
    reference = reference_losses(tiny_config, tmp_path_factory, dp=4)
    result = run_with_failures(tiny_config, tmp_path, dp=4, hang_monitor=False,
                               inject=[{"step": FAIL_STEP, "replica": 2, "phase": "backward"}])
    assert_survived(result, reference, m=8, failed_replicas={2})
    ended = read_exits(tmp_path)
    assert sorted(ended) == [0, 1, 3] and all(e["code"] == 0 and "hang_margin" not in e for e in ended.values()), ended
