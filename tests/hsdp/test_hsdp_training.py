"""HSDP replicas (FSDP2 shard groups) under the three layers, in real runs.

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm`` with real SIGKILLs and a hard timeout each:

* 3 replicas x F=2 lose one replica in ``backward`` and another in ``reduce`` (no spare): every step still
  commits M microbatches and the loss curve and final weights match the failure-free HSDP run;
* the failure-free HSDP run matches the 3D mode (TP1 PP1, same replicas, same data);
* a spare replica takes over a failed one, its shards copied from the same shard index of a live replica;
* the shard checkpoint resumes exactly; below ``min_replicas`` the survivors save one and exit 3.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from nanotron_recover.run.run_folder import read_exits
from nanotron_recover.training.checkpoint import LATEST, STATE_FILE
from tests.conftest import make_tiny_config

STEPS = 30
SHORT = 10
TIMEOUT_S = 300
TOL = 1e-5
SYNTHETIC = ["--synthetic-data"]
# each test waits for at most its module reference run and one run of its own
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S + 60)]


def hsdp_config(tiny_config, *, dp: int, steps: int = STEPS, inject: list[dict] = (), interval: int | None = None,
                **ft) -> dict:
    return tiny_config(
        dp=dp, accumulation=2, steps=steps, checkpoint_interval=interval or steps,
        fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "replica": "fsdp", "fsdp_shard_size": 2,
                         "inject": list(inject), **ft},
    )


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    return run_training(hsdp_config(make_tiny_config, dp=3), tmp_path_factory.mktemp("hsdp-ref"),
                        timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)


def test_hsdp_matches_the_3d_mode_failure_free(hsdp_reference, tiny_config, tmp_path):
    three_d = tiny_config(dp=3, accumulation=2, steps=STEPS, checkpoint_interval=STEPS,
                          fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01})
    result = run_training(three_d, tmp_path, timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    assert len(hsdp_reference.steps) == STEPS, hsdp_reference.output[-3000:]
    assert "HSDP replicas of 2 FSDP shards" in hsdp_reference.output
    assert max_loss_diff(hsdp_reference, result) <= TOL
    assert max_relative_param_diff(final_checkpoint(tmp_path), final_checkpoint(hsdp_reference.run_dir)) <= TOL
    assert hsdp_reference.losses[-1] < hsdp_reference.losses[0] - 0.05, "the model did not learn"


def test_hsdp_survives_a_backward_and_a_reduce_kill(hsdp_reference, tiny_config, tmp_path):
    # replica 1 = world ranks 2, 3 (its shard 1 dies mid-backward); replica 2 = ranks 4, 5 (shard 0 dies in reduce)
    inject = [{"step": 8, "replica": 1, "rank": 1, "phase": "backward"},
              {"step": 17, "replica": 2, "rank": 0, "phase": "reduce"}]
    # recycling off: the two healthy shards would form a third replica (tests/hsdp/test_hsdp_recycle.py)
    result = run_training(hsdp_config(tiny_config, dp=3, inject=inject, recycle=False), tmp_path,
                          timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    tail = result.output[-4000:]
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == 6 for s in result.steps), tail
    assert [e["failed_replicas"] for e in result.events_of("repair")] == [[1], [2]], tail
    assert [s["live_replicas"] for s in result.steps][-1] == 1
    assert max_loss_diff(hsdp_reference, result) <= TOL, tail
    assert max_relative_param_diff(final_checkpoint(hsdp_reference.run_dir), final_checkpoint(tmp_path)) <= TOL
    ended = read_exits(tmp_path)
    assert 3 not in ended and 4 not in ended, "the victims were SIGKILLed"
    assert ended[2]["code"] == 0 and "evicted" in ended[2]["reason"], ended
    assert ended[5]["code"] == 0 and "evicted" in ended[5]["reason"], ended
    assert ended[0]["reason"] == ended[1]["reason"] == "finished", ended


@pytest.fixture(scope="module")
def two_replica_reference(tmp_path_factory):
    config = hsdp_config(make_tiny_config, dp=2, steps=SHORT, interval=5)
    return run_training(config, tmp_path_factory.mktemp("hsdp2-ref"), timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)


def test_a_spare_replica_takes_over_shard_by_shard(two_replica_reference, tiny_config, tmp_path):
    inject = [{"step": 4, "replica": 0, "rank": 1, "phase": "backward"}]
    config = hsdp_config(tiny_config, dp=2, steps=SHORT, interval=5, spare_replicas=1, inject=inject)
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    tail = result.output[-4000:]
    activated = result.events_of("spare_activated")
    assert len(activated) == 1 and activated[0]["replicas"] == [2] and activated[0]["donor"] == 1, tail
    assert [s["live_replicas"] for s in result.steps][-1] == 2, tail
    assert max_loss_diff(two_replica_reference, result) <= TOL, tail
    assert max_relative_param_diff(final_checkpoint(two_replica_reference.run_dir), final_checkpoint(tmp_path)) <= TOL


def test_the_shard_checkpoint_resumes_exactly(two_replica_reference, tiny_config, tmp_path):
    saved = two_replica_reference.run_dir / "checkpoints" / "5"
    state = json.loads((saved / STATE_FILE).read_text())
    assert state["layout"] == "hsdp" and state["fsdp_shard_size"] == 2
    assert sorted(p.name for p in (saved / "hsdp").iterdir()) == [
        "lr_scheduler.pt", "manifest.json", "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    config = hsdp_config(tiny_config, dp=2, steps=SHORT, interval=5)
    config["checkpoints"]["resume_checkpoint_path"] = str(saved)
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=SYNTHETIC)
    assert [s["step"] for s in result.steps] == list(range(6, SHORT + 1)), result.output[-3000:]
    expected = np.array(two_replica_reference.losses[5:])
    assert np.abs(np.array(result.losses) - expected).max() <= TOL


def test_below_min_replicas_the_survivors_save_shards_and_exit_3(tiny_config, tmp_path):
    inject = [{"step": 4, "replica": 1, "rank": 0, "phase": "reduce"}]
    config = hsdp_config(tiny_config, dp=2, steps=SHORT, min_replicas=2, inject=inject)
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=SYNTHETIC, check=False)
    assert result.returncode == 3, result.output[-3000:]
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == "3"
    manifest = json.loads((tmp_path / "checkpoints" / "3" / "hsdp" / "manifest.json").read_text())
    assert manifest["fsdp_shard_size"] == 2 and manifest["step"] == 3
