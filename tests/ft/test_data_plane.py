"""The torch data plane (``fault_tolerance.data_plane: torch``): gloo carries the gradient bytes, ULFM decides.

Real jobs under ``mpirun --with-ft ulfm`` with real SIGKILLs, each compared with the failure-free run on the MPI
plane: the same losses within the summation-order floor, every step commits M, and the group is rebuilt after each
change of the coordinate's members (a repair, a spare's activation, a replica formed from recycled ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanotron_recover.config import ConfigError, config_from_dict
from nanotron_recover.ft.data_plane import MpiDataPlane, make_data_plane
from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.devices import data_plane_backend, default_data_plane

TIMEOUT_S = 300
TOL = 1e-5


# ---------------------------------------------------------------------------------------------- choice (fast)
def test_auto_picks_mpi_on_cpu_and_torch_on_gpu() -> None:
    assert default_data_plane(torch.device("cpu")) == "mpi"
    assert default_data_plane(torch.device("cuda", 0)) == "torch"
    assert data_plane_backend(torch.device("cpu")) == "gloo"
    assert data_plane_backend(torch.device("cuda", 0)) == "nccl"
    assert isinstance(make_data_plane("auto", object(), torch.device("cpu"), 10.0), MpiDataPlane)
    with pytest.raises(ValueError, match="unknown data plane"):
        make_data_plane("nccl", object(), torch.device("cpu"), 10.0)


def test_an_unknown_data_plane_is_refused_with_its_key(tiny_config) -> None:
    config = tiny_config(dp=2, fault_tolerance={"enabled": True, "data_plane": "nccl"})
    with pytest.raises(ConfigError, match="fault_tolerance.data_plane.*auto, mpi, torch"):
        config_from_dict(config)


# ----------------------------------------------------------------------------------- the collective alone
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_killed_inside_a_gloo_reduction_releases_every_survivor_at_once() -> None:
    """6 ranks in one gloo group; rank 2 is SIGKILLed 20 ms into a 32 MB reduction. A dead peer's sockets fail
    only its direct partners' collective; every other survivor is released by the closes that cascade from them
    (else it would wait for the group's 60 s timeout). Then the repaired world reduces on a rebuilt group."""
    from benchmarks.data_plane_bench import run_worker

    rows = run_worker(6, {"victim": 2, "mb": 32}, timeout_s=180)
    assert sorted(r["rank"] for r in rows) == [0, 1, 3, 4, 5], rows
    for r in rows:
        assert r["failed_after_s"] is not None and r["failed_after_s"] < 5.0, r
        assert r["failed_ranks"] == [2] and r["survivors"] == 5 and r["sum_after"] == 5.0, r
    print(f"\ngloo plane, kill inside a 32 MB reduction: survivors released after "
          f"{max(r['failed_after_s'] for r in rows) * 1e3:.0f} ms at most, rebuilt group in "
          f"{max(r['rebuild_ms'] for r in rows):.0f} ms")


# ---------------------------------------------------------------------------------------------- real jobs
def _ft(plane: str, inject: list[dict], **extra) -> dict:
    return {"enabled": True, "reduce_bucket_mb": 0.01, "data_plane": plane, "inject": inject, **extra}


def _run(config: dict, run_dir):
    return run_training(config, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def _assert_same_trajectory(result, reference, steps: int, m: int) -> float:
    tail = result.output[-5000:]
    assert [s["step"] for s in result.steps] == list(range(1, steps + 1)), tail
    assert all(s["microbatches"] == m for s in result.steps), tail
    diff = float(np.abs(np.array(result.losses) - np.array(reference.losses)).max())
    assert diff <= TOL, f"max |dloss| {diff:.2e}\n{tail}"
    return diff


def _groups(result) -> list[tuple[int, int]]:
    """(epoch, members) of every group the logging rank's coordinate built."""
    return [(g["epoch"], g["members"]) for g in result.events_of("data_plane_group")]


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_kills_in_backward_and_inside_the_reduction_with_a_spare_and_a_recycled_replica(tiny_config, tmp_path):
    """2 replicas + 1 spare, TP2: replica 0 loses a rank in backward (the spare takes its slot), then replica 1
    one after its first bucket of step 6, while its coordinate's peer is inside a gloo reduction with it; the two
    healthy mates form a new replica, which enters like a spare. Each change of members rebuilds the group."""
    steps, inject = 12, [{"step": 3, "replica": 0, "rank": 1, "phase": "backward"},
                         {"step": 6, "replica": 1, "rank": 0, "phase": "reduce"}]
    shape = dict(dp=2, tp=2, accumulation=2, steps=steps, layers=2)
    reference = _run(tiny_config(**shape, fault_tolerance=_ft("mpi", [], spare_replicas=1)), tmp_path / "mpi")
    result = _run(tiny_config(**shape, fault_tolerance=_ft("torch", inject, spare_replicas=1)), tmp_path / "torch")
    diff = _assert_same_trajectory(result, reference, steps, m=4)
    repairs = result.events_of("repair")
    assert [(r["step"], r["failed_replicas"]) for r in repairs] == [(3, [0]), (6, [1])], repairs
    assert repairs[0]["activated_spares"] == [2], repairs
    assert repairs[1]["extra"]["cause"]["op"] == "torch_allreduce(coord)", repairs[1]  # noticed inside gloo
    (formed,) = result.events_of("replica_formed")
    assert sorted(m["rank"] for m in formed["members"]) == [0, 3], formed
    assert result.steps[-1]["live_replicas"] == 2, result.steps[-1]
    # the start, each repair (one survivor left), the spare's entry, the formed replica's entry
    assert [n for _, n in _groups(result)] == [2, 1, 2, 1, 2], result.events_of("data_plane_group")
    print(f"\ntorch plane, kills in backward and reduce, a spare and a formed replica: max |dloss| vs the MPI "
          f"plane {diff:.2e}; group builds {[round(g['ms']) for g in result.events_of('data_plane_group')]} ms")


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_bf16_hsdp_replicas_reduce_each_shard_on_its_own_group(tiny_config, tmp_path) -> None:
    """3 HSDP replicas x 2 shards in bf16 (fp32 gradient buckets): a kill inside the reduction."""
    steps, inject = 8, [{"step": 4, "replica": 1, "rank": 1, "phase": "reduce"}]

    def config(plane: str, faults: list[dict]) -> dict:
        c = tiny_config(dp=3, accumulation=2, steps=steps, layers=2,
                        fault_tolerance=_ft(plane, faults, replica="fsdp", fsdp_shard_size=2, recycle=False))
        c["model"]["dtype"] = "bfloat16"
        return c

    reference = _run(config("mpi", []), tmp_path / "mpi")
    result = _run(config("torch", inject), tmp_path / "torch")
    _assert_same_trajectory(result, reference, steps, m=6)
    assert _groups(result) == [(0, 3), (1, 2)], result.events_of("data_plane_group")

