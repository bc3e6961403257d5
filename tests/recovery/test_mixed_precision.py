"""bf16 under fault tolerance: nanotron's mixed-precision recipe keeps the trajectory through failures.

4 replicas of 1 rank in bf16 (fp32 masters, fp32 accumulation and reduction), replicas killed in ``backward`` and in
``reduce`` with a spare taking over the first (its state copy carries the masters), compared with the
failure-free bf16 run. The bar is the bf16 floor measured here: failure-free 4 replicas vs 2 replicas with doubled
quotas (the same samples summed in another order). Also: ReCoVer vs the stock path in bf16, and a resumed bf16
run continuing bit-identically.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from benchmarks import equivalence
from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from tests.conftest import make_tiny_config

STEPS = 20
TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(6 * TIMEOUT_S)]
SCHEDULE = [
    {"step": 6, "replica": 1, "rank": 0, "phase": "backward"},
    {"step": 13, "replica": 2, "rank": 0, "phase": "reduce"},
]


def bf16_config(*, spares: int = 0, inject: list | None = None) -> dict:
    config = make_tiny_config(
        dp=4, tp=1, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=STEPS,
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "spare_replicas": spares,
                         "inject": SCHEDULE if inject is None else inject},
    )
    config["model"]["dtype"] = "bfloat16"
    config["optimizer"]["learning_rate_scheduler"].update(learning_rate=0.003, lr_warmup_steps=5, lr_decay_steps=15)
    return config


def run(config: dict, run_dir: Path):
    return run_training(config, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def masters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights in a nanotron-format bf16 checkpoint (the optimizer's ``gradient_accumulator``)."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted((checkpoint / "optimizer").glob("optimizer_*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        for name, tensor in state["gradient_accumulator"].items():
            found[f"{path.name}:{name}"] = tensor
    return found


def max_relative_master_diff(a: Path, b: Path) -> float:
    ma, mb = masters(a), masters(b)
    assert ma and ma.keys() == mb.keys()
    assert all(t.dtype == torch.float32 for t in ma.values())
    return max(((ma[k].double() - mb[k].double()).abs().max() / (ma[k].abs().max() or 1.0)).item() for k in ma)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bf16")
    config = bf16_config(spares=1)
    return {
        "reference": run(equivalence.reference_config(config, "recover", reference_dp=4), base / "reference"),
        "two_replicas": run(equivalence.reference_config(config, "recover", reference_dp=2), base / "two"),
        "failed": run(config, base / "failed"),
        "stock": run(equivalence.reference_config(config, "stock", reference_dp=4), base / "stock"),
    }


def diffs(a, b) -> tuple[float, float, float]:
    """(max |dloss|, max relative d(bf16 weights), max relative d(fp32 masters)) of two runs."""
    ca, cb = final_checkpoint(a.run_dir), final_checkpoint(b.run_dir)
    return max_loss_diff(a, b), max_relative_param_diff(ca, cb), max_relative_master_diff(ca, cb)


@pytest.fixture(scope="module")
def floor(runs) -> tuple[float, float, float]:
    measured = diffs(runs["reference"], runs["two_replicas"])
    print(f"\nbf16 floor (4 vs 2 failure-free replicas): loss {measured[0]:.3e} weights {measured[1]:.3e} "
          f"masters {measured[2]:.3e}")
    return measured


def within(measured: tuple[float, float, float], floor: tuple[float, float, float]) -> bool:
    """Each difference within the measured floor of its kind (or fp32 noise, 1e-5, where the floor is smaller)."""
    return all(m <= max(1e-5, f) for m, f in zip(measured, floor))


def test_the_runs_train_in_bf16_with_fp32_masters(runs):
    checkpoint = final_checkpoint(runs["failed"].run_dir)
    weights = [p for p in checkpoint.rglob("*.safetensors")]
    from safetensors.torch import load_file

    assert weights and all(t.dtype == torch.bfloat16 for p in weights for t in load_file(p).values())
    assert masters(checkpoint)  # fp32, checked in max_relative_master_diff


def test_losing_two_replicas_in_bf16_keeps_the_trajectory(runs, floor):
    failed = runs["failed"]
    assert {r for e in failed.events_of("repair") for r in e["failed_replicas"]} == {1, 2}
    assert [e["replicas"] for e in failed.events_of("spare_activated")] == [[4]]
    assert all(s["microbatches"] == 8 for s in failed.steps)
    assert failed.steps[-1]["live_replicas"] == 3
    measured = diffs(runs["reference"], failed)
    print(f"\nbf16, 2 failures + a spare vs failure-free: loss {measured[0]:.3e} weights {measured[1]:.3e} "
          f"masters {measured[2]:.3e}")
    assert within(measured, floor)


def test_bf16_recover_matches_the_bf16_stock_path(runs, floor):
    measured = diffs(runs["stock"], runs["reference"])
    print(f"\nbf16 ReCoVer vs bf16 stock, failure-free: loss {measured[0]:.3e} weights {measured[1]:.3e} "
          f"masters {measured[2]:.3e}")
    assert within(measured, floor)


def test_the_floor_is_bf16_sized_not_a_different_trajectory(floor):
    loss, weights, master = floor
    assert loss < 1e-2 and master < 1e-3  # another summation order, never other samples


def test_a_resumed_bf16_run_continues_bit_identically(tmp_path):
    config = bf16_config(inject=[])
    config["parallelism"]["dp"] = 2
    config["tokens"]["train_steps"] = 8
    config["checkpoints"]["checkpoint_interval"] = 4
    full = run(config, tmp_path / "full")
    resumed_config = copy.deepcopy(config)
    resumed_config["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "full" / "checkpoints" / "4")
    resumed = run(resumed_config, tmp_path / "resumed")
    assert [s["step"] for s in resumed.steps] == [5, 6, 7, 8]
    assert resumed.losses == full.losses[4:]  # identical, not close: weights, masters and Adam all restored
    assert max_relative_master_diff(final_checkpoint(full.run_dir), final_checkpoint(resumed.run_dir)) == 0.0
