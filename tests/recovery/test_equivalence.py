"""The invariant: losing half of the replicas changes nothing but floating-point summation order.

4 replicas x TP2 (8 ranks), 40 steps, one replica SIGKILLed in ``backward`` and one in ``reduce``; compared with
the failure-free run: per-step loss and final weights. Also with a spare (used first), with PP2 + 1F1B, against
the stock nanotron path, and the noise floor (4 replicas vs 2 replicas with doubled quotas, both failure-free).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from benchmarks import equivalence
from nanotron_recover.launcher.runs import (
    RunResult,
    final_checkpoint,
    max_loss_diff,
    max_relative_param_diff,
    run_training,
)
from nanotron_recover.run.run_folder import read_metrics
from tests.conftest import make_tiny_config

STEPS = 40
TOL = 1e-5
TIMEOUT_S = 600
# a test run alone waits for the two module fixtures (three runs) and up to two runs of its own
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5 * TIMEOUT_S + 60)]
SCHEDULE = [
    {"step": 10, "replica": 1, "rank": 0, "phase": "backward"},
    {"step": 25, "replica": 2, "rank": 1, "phase": "reduce"},
]
def base_config(*, tp: int = 2, pp: int = 1, engine: str = "afab", spares: int = 0) -> dict:
    config = make_tiny_config(
        dp=4, tp=tp, pp=pp, engine=engine, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=STEPS,
        # recycling off: the two faults' healthy mates would form a new replica (its own tests cover that)
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "spare_replicas": spares, "inject": SCHEDULE,
                         "recycle": False},
    )
    config["optimizer"]["learning_rate_scheduler"].update(learning_rate=0.003, lr_warmup_steps=5, lr_decay_steps=35)
    return config


def loaded(run_dir: Path) -> RunResult:
    steps, events = read_metrics(run_dir)
    return RunResult(run_dir, 0, "", 0.0, steps, events)


@pytest.fixture(scope="module")
def main_comparison(tmp_path_factory):
    """``benchmarks/equivalence.py`` on 4 replicas x TP2 with 2 failures: its last line and its two runs."""
    out = tmp_path_factory.mktemp("equivalence")
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(base_config()))
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert equivalence.main(["--config-file", str(config_path), "--out", str(out), "--synthetic-data",
                                 "--timeout", str(TIMEOUT_S)]) == 0
    last = buffer.getvalue().strip().splitlines()[-1]
    return last, loaded(out / "reference"), loaded(out / "with_failures")


@pytest.fixture(scope="module")
def noise_floor(main_comparison, tmp_path_factory) -> float:
    """Failure-free 4 replicas vs failure-free 2 replicas with doubled quotas: the summation-order noise."""
    _, reference, _ = main_comparison
    two = equivalence.reference_config(base_config(), "recover", reference_dp=2)
    result = run_training(two, tmp_path_factory.mktemp("two_replicas"), timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"])
    floor = max_loss_diff(reference, result)
    print(f"\nnoise floor (4 vs 2 replicas, failure-free): max_abs_loss_diff={floor:.3e}")
    return floor


def bar(floor: float) -> float:
    return max(TOL, floor)


def test_losing_half_the_replicas_keeps_the_trajectory(main_comparison, noise_floor):
    last, reference, failed = main_comparison
    match = re.fullmatch(
        r"max_abs_loss_diff=(\S+) max_rel_param_diff=(\S+) steps=(\d+) failures=(\d+)", last
    )
    assert match, last
    loss_diff, param_diff, steps, failures = float(match[1]), float(match[2]), int(match[3]), int(match[4])
    print(f"\n4x TP2, 2 failures: {last} (noise floor {noise_floor:.3e})")
    assert (steps, failures) == (STEPS, 2)
    assert all(s["microbatches"] == 8 for s in failed.steps)
    assert [s["live_replicas"] for s in failed.steps][-1] == 2
    assert loss_diff <= bar(noise_floor)
    assert param_diff <= bar(noise_floor)


def test_a_spare_is_used_first_and_the_result_is_equally_close(main_comparison, noise_floor, tmp_path):
    _, reference, _ = main_comparison
    result = run_training(base_config(spares=1), tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    live = {s["step"]: s["live_replicas"] for s in result.steps}
    assert live[9] == 4 and live[11] == 4, "after the first failure the spare keeps 4 replicas computing"
    assert live[STEPS] == 3, "after the second failure no spare is left: 3 replicas share M"
    activations = result.events_of("spare_activated")
    assert len(activations) == 1 and activations[0]["replicas"] == [4]
    assert all(s["microbatches"] == 8 for s in result.steps)
    assert max_loss_diff(reference, result) <= bar(noise_floor)
    # the spare (replica 4) and the survivors hold the same weights as the failure-free run
    assert max_relative_param_diff(final_checkpoint(reference.run_dir), final_checkpoint(tmp_path)) <= bar(noise_floor)


def test_pp2_with_1f1b_keeps_the_trajectory(tmp_path, noise_floor):
    config = base_config(tp=1, pp=2, engine="1f1b")
    ref_config = copy.deepcopy(config)
    ref_config["fault_tolerance"]["inject"] = []
    reference = run_training(ref_config, tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    failed = run_training(config, tmp_path / "failed", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert {r for e in failed.events_of("repair") for r in e["failed_replicas"]} == {1, 2}
    assert max_loss_diff(reference, failed) <= bar(noise_floor)
    param_diff = max_relative_param_diff(final_checkpoint(reference.run_dir), final_checkpoint(failed.run_dir))
    assert param_diff <= bar(noise_floor)


def test_failure_run_matches_the_stock_nanotron_path(main_comparison, noise_floor, tmp_path):
    _, _, failed = main_comparison
    stock = equivalence.reference_config(base_config(), "stock", reference_dp=None)
    reference = run_training(stock, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert not reference.events_of("repair"), "the stock path has no repairs"
    assert max_loss_diff(reference, failed) <= bar(noise_floor)
    param_diff = max_relative_param_diff(final_checkpoint(reference.run_dir), final_checkpoint(failed.run_dir))
    assert param_diff <= bar(noise_floor)


def test_noise_floor_is_measured_and_small(noise_floor):
    assert np.isfinite(noise_floor)
    assert noise_floor < 1e-3  # a different split may only change summation order, never the samples
