"""nanotron v0.4's own example config trains here: bf16, tied embeddings, TP2 x PP2 with REDUCE_SCATTER and 1F1B.

It crashed at step 1 on CPU before (nanotron's ``clip_grad_norm`` builds a CUDA zero on a rank that owns no
gradient: every tied copy but the owner's is skipped). Added: a ``fault_tolerance:`` section with one kill, a
local checkpoints folder instead of the example's ``/fsx/...``, and ``--synthetic-data`` instead of the hub dataset.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from nanotron_recover.launcher.runs import final_checkpoint, run_training

FIXTURE = Path(__file__).parent / "fixtures" / "nanotron_v0.4_tiny_llama.yaml"
TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S)]
KILL = {"step": 5, "replica": 1, "rank": 1, "phase": "backward"}


def example(*, dtype: str | None = None, fault_tolerance: bool = True) -> dict:
    config = copy.deepcopy(yaml.safe_load(FIXTURE.read_text()))
    config["checkpoints"]["checkpoints_path"] = "checkpoints"
    if dtype is not None:
        config["model"]["dtype"] = dtype
    if fault_tolerance:
        config["fault_tolerance"] = {"enabled": True, "inject": [KILL]}
    return config


def train(config: dict, run_dir: Path):
    return run_training(config, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def test_the_example_config_is_bf16_with_tied_embeddings_on_tp2_pp2():
    config = example(fault_tolerance=False)
    assert config["model"]["dtype"] == "bfloat16"
    assert config["model"]["model_config"]["tie_word_embeddings"] is True
    assert (config["parallelism"]["tp"], config["parallelism"]["pp"], config["parallelism"]["dp"]) == (2, 2, 2)


def test_the_example_config_trains_and_survives_a_kill(tmp_path):
    dtype = "bfloat16"  # the example's own; float32 runs are the rest of the suite
    result = train(example(dtype=dtype), tmp_path)
    steps = example()["tokens"]["train_steps"]
    assert [s["step"] for s in result.steps] == list(range(1, steps + 1))
    assert [e["failed_replicas"] for e in result.events_of("repair")] == [[1]]
    M = 2 * example()["tokens"]["batch_accumulation_per_replica"]
    assert all(s["microbatches"] == M for s in result.steps), "every step commits the full global batch"
    assert result.steps[-1]["live_replicas"] == 1
    assert_trained_in(dtype, tmp_path)


def assert_trained_in(dtype: str, run_dir: Path) -> None:
    """The checkpoint says so, and its weights are stored in that dtype (no forced change of precision)."""
    import json

    import torch
    from safetensors.torch import load_file

    checkpoint = final_checkpoint(run_dir)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["dtype"] == dtype
    stored = {t.dtype for path in checkpoint.rglob("*.safetensors") for t in load_file(path).values()}
    assert stored == {getattr(torch, dtype)}


@pytest.mark.parametrize("fp32_accumulation", [True, False])
def test_the_example_config_trains_on_the_stock_path_in_bf16(fp32_accumulation, tmp_path):
    config = example(fault_tolerance=False)
    config["optimizer"]["accumulate_grad_in_fp32"] = fp32_accumulation
    result = train(config, tmp_path)
    assert [s["step"] for s in result.steps] == list(range(1, example()["tokens"]["train_steps"] + 1))
    assert not result.events_of("repair")
    assert_trained_in("bfloat16", tmp_path)
