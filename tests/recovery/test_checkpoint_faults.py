"""Faults inside a checkpoint save (real jobs, real SIGKILLs at the save's own fault points): a writer's part
written but not yet agreed (``checkpoint-write``), the folder renamed into place but ``latest.txt`` not yet
written (``checkpoint-publish``), and the final save. Every job finishes with exit 0, M microbatches per step, the
failure-free losses and final weights, and a verified final checkpoint; with recycling, the healthy mate of a
writer that died mid-write waits in the pool (it used to leave the job)."""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.runs import final_checkpoint, max_loss_diff, max_relative_param_diff, run_training
from nanotron_recover.run.run_folder import read_exits
from nanotron_recover.training.checkpoint_integrity import read_state, verify_share

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 3
TIMEOUT_S = 300
TOL = 1e-5


def save_config(tiny_config, inject: list[dict], pp: int = 1) -> dict:
    raw = tiny_config(dp=3, tp=2 // pp, pp=pp, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=EVERY,
                      fault_tolerance={"enabled": True, "recycle": pp == 1, "reduce_bucket_mb": 0.01,
                                       "local_snapshot_interval": 0, "inject": inject})
    raw["checkpoints"]["async_save"] = False  # the save in the step (background saves: test_background_checkpoint)
    return raw


_REFERENCE: dict = {}


@pytest.fixture
def reference(tiny_config, tmp_path_factory):
    def of(pp: int):
        if pp not in _REFERENCE:
            _REFERENCE[pp] = run_training(save_config(tiny_config, [], pp), tmp_path_factory.mktemp(f"ref{pp}"),
                                          timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
        return _REFERENCE[pp]
    return of


def assert_finished_like(result, reference) -> None:
    tail = result.output[-6000:]
    assert result.returncode == 0, tail
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == 3 * 2 for s in result.steps), tail
    assert max_loss_diff(result, reference) <= TOL
    final = final_checkpoint(result.run_dir)
    assert final.name == str(STEPS) and verify_share(final, read_state(final)) == []
    assert max_relative_param_diff(final, final_checkpoint(reference.run_dir)) <= TOL


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_writers_mate_dying_mid_write_pools_the_healthy_writer(tiny_config, reference, tmp_path):
    inject = [{"step": EVERY, "replica": 0, "rank": 1, "phase": "checkpoint-write"}]
    result = run_training(save_config(tiny_config, inject), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"], check=False)
    assert_finished_like(result, reference(1))
    assert read_exits(tmp_path)[0]["reason"] == "finished", read_exits(tmp_path)[0]  # waited in the pool
    assert (tmp_path / "checkpoints" / str(EVERY) / "trainer_state.json").is_file()  # the next holder saved it


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("step, phase", [(EVERY, "checkpoint-publish"), (STEPS, "checkpoint-write")],
                         ids=["between-rename-and-pointer", "final-save"])
def test_a_death_inside_the_save_is_repaired_and_the_save_done_by_the_next_holder(step, phase, tiny_config,
                                                                                    reference, tmp_path):
    inject = [{"step": step, "replica": 0, "rank": 0, "phase": phase}]  # the publisher
    result = run_training(save_config(tiny_config, inject, pp=2), tmp_path, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data"], check=False)
    assert_finished_like(result, reference(2))
    assert [e for e in result.events_of("repair") if e["step"] == step], result.events


@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_death_in_the_fallback_save_below_min_replicas_still_ends_bounded(tiny_config, reference, tmp_path):
    """min_replicas = dp: a replica lost at step 6 stops the job, a holder saves step 5, and its writer dies in that
    save. The next holder saves it (or, with none, nothing is published); the job ends with exit 3 and exit records,
    and the relaunch finishes with the failure-free trajectory (before: a second death here escaped the rank's error
    handling, with no record and an unbounded exit through MPI_Finalize)."""
    inject = [{"step": 6, "replica": 2, "rank": 0, "phase": "backward"},
              {"step": 5, "replica": 0, "rank": 1, "phase": "checkpoint-write"}]
    config = save_config(tiny_config, inject, pp=2)
    config["fault_tolerance"]["min_replicas"] = 3
    first = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    assert first.returncode == 3, first.output[-5000:]
    exits = read_exits(tmp_path)
    survivors = {r: e["code"] for r, e in exits.items() if r not in (1, 4)}
    assert sorted(survivors) == [0, 2, 3, 5] and set(survivors.values()) <= {0, 3} and 3 in survivors.values(), exits
    again = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    assert again.returncode == 0, again.output[-5000:]
    assert max_loss_diff(again, reference(2)) <= TOL
