"""Checkpoints: save at step k, resume, continue -> the same losses as the uninterrupted run; atomic files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.launcher.runs import max_relative_param_diff, run_training
from nanotron_recover.run.run_folder import read_metrics_jsonl, write_atomically
from nanotron_recover.training.checkpoint import (
    LATEST,
    STATE_FILE,
    CheckpointManager,
    check_resumable,
    resolve_checkpoint,
)
from nanotron_recover.training.checkpoint_integrity import PUBLISHING_MARKER, read_state, verify_share

STEPS, SAVE_AT = 8, 4
TIMEOUT_S = 300


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
@pytest.mark.parametrize("ft", [{"enabled": True}, None], ids=["recover", "stock"])
def test_resume_reproduces_the_uninterrupted_run(ft, tiny_config, tmp_path, failure_free_run):
    config = tiny_config(dp=2, tp=2, pp=1, accumulation=2, steps=STEPS, checkpoint_interval=SAVE_AT, fault_tolerance=ft)
    # the uninterrupted run (recover: the same job as the reference of the resume_checkpoint_path test below)
    full = failure_free_run(config, timeout_s=TIMEOUT_S)
    assert (full.run_dir / "checkpoints" / LATEST).read_text().strip() == str(STEPS)

    config["checkpoints"]["resume_checkpoint_path"] = str(full.run_dir / "checkpoints" / str(SAVE_AT))
    resumed = run_training(config, tmp_path / "resumed", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert f"resumed from {full.run_dir / 'checkpoints' / str(SAVE_AT)} at step {SAVE_AT}" in resumed.output
    assert [s["step"] for s in resumed.steps] == list(range(SAVE_AT + 1, STEPS + 1))
    diff = np.abs(np.array(resumed.losses) - np.array(full.losses[SAVE_AT:])).max()
    assert diff <= 1e-5, f"resumed losses differ by {diff:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_the_last_step_is_always_saved_and_a_lost_final_save_is_redone(tiny_config, tmp_path):
    """The trained model is the job's product: a run whose last step is not a multiple of the interval still ends
    with it on disk, and a job torn down inside that save (its folder never published, ``latest.txt`` still at the
    interval's step, every step logged) is a restart for the launcher, whose relaunch writes the same weights."""
    steps = SAVE_AT + 2
    config = tiny_config(dp=2, accumulation=2, steps=steps, checkpoint_interval=SAVE_AT,
                         fault_tolerance={"enabled": True})
    full = run_training(config, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    root = tmp_path / "run" / "checkpoints"
    assert (root / LATEST).read_text().strip() == str(steps) and (root / str(SAVE_AT) / STATE_FILE).is_file()
    shutil.copytree(root / str(steps), tmp_path / "final")
    # what a teardown between the last step's log line and the final publish leaves on disk
    shutil.rmtree(root / str(steps))
    write_atomically(root / LATEST, f"{SAVE_AT}\n")
    relaunch = run_training(config, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert f"at step {SAVE_AT}" in relaunch.output and (root / LATEST).read_text().strip() == str(steps)
    logged = [int(r["step"]) for r in read_metrics_jsonl(tmp_path / "run") if "event" not in r]
    assert logged == [*range(1, steps + 1), *range(SAVE_AT + 1, steps + 1)]  # replayed from the interval's save
    assert [s["loss"] for s in relaunch.steps] == [s["loss"] for s in full.steps]
    assert max_relative_param_diff(root / str(steps), tmp_path / "final") <= 1e-6


def test_latest_naming_a_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / STATE_FILE).write_text("{}")
    write_atomically(tmp_path / LATEST, "4\n")
    assert resolve_checkpoint(tmp_path) == tmp_path / "4"
    write_atomically(tmp_path / LATEST, "8\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_checkpoint(tmp_path)


def test_write_atomically_leaves_no_temporary_file(tmp_path: Path):
    write_atomically(tmp_path / LATEST, "12\n")
    write_atomically(tmp_path / LATEST, "13\n")
    assert [p.name for p in tmp_path.iterdir()] == [LATEST]
    assert (tmp_path / LATEST).read_text() == "13\n"


@pytest.mark.parametrize(
    "saved, ft, error",
    [
        ({"layout": "nanotron"}, {"enabled": True}, None),
        ({}, None, None),  # a checkpoint from before the layout key: nanotron's format
        ({"layout": "hsdp", "fsdp_shard_size": 2}, {"replica": "fsdp", "fsdp_shard_size": 2}, None),
        ({"layout": "hsdp", "fsdp_shard_size": 2}, {"replica": "fsdp", "fsdp_shard_size": 1}, "fsdp_shard_size=1"),
        ({"layout": "hsdp", "fsdp_shard_size": 2}, {"enabled": True}, "nanotron format"),
        ({"layout": "nanotron"}, {"replica": "fsdp", "fsdp_shard_size": 2}, "HSDP shards"),
    ],
)
def test_a_checkpoint_resumes_only_in_its_own_layout(saved, ft, error, tiny_config, tmp_path):
    config = config_from_dict(tiny_config(dp=2, accumulation=2, fault_tolerance=ft))
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 4, "microbatches_per_step": 4, **saved}))
    if error is None:
        check_resumable(tmp_path, config)
    else:
        with pytest.raises(ValueError, match=error):
            check_resumable(tmp_path, config)


@pytest.mark.parametrize(
    "saved, dtype, error",
    [
        ({}, "float32", None),  # a checkpoint from before the dtype key: a float32 run
        ({"dtype": "bfloat16"}, "bfloat16", None),
        ({"dtype": "bfloat16"}, "float32", "trained with model.dtype: bfloat16"),
        ({}, "bfloat16", "trained with model.dtype: float32"),
    ],
)
def test_a_checkpoint_resumes_only_in_its_own_dtype(saved, dtype, error, tiny_config, tmp_path):
    raw = tiny_config(dp=2, accumulation=2, fault_tolerance={"enabled": True})
    raw["model"]["dtype"] = dtype
    config = config_from_dict(raw)
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 4, "microbatches_per_step": 4, **saved}))
    if error is None:
        check_resumable(tmp_path, config)
    else:
        with pytest.raises(ValueError, match=error):
            check_resumable(tmp_path, config)


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_a_run_started_from_resume_checkpoint_path_relaunches_from_its_own_state(tiny_config, tmp_path,
                                                                                  failure_free_run):
    """``resume_checkpoint_path`` starts a run; the relaunch after a stop resumes from the run's own state (its
    checkpoint or node-local snapshot of the last committed step), not from that path again (before: every
    relaunch was pinned to it, with node-local snapshots off, and recomputed every step since)."""
    ft = {"enabled": True}
    config = tiny_config(dp=2, tp=2, pp=1, accumulation=2, steps=STEPS, checkpoint_interval=SAVE_AT, fault_tolerance=ft)
    full = failure_free_run(config, timeout_s=TIMEOUT_S)  # shared with test_resume_reproduces_..._run[recover]
    started = tiny_config(dp=2, tp=2, pp=1, accumulation=2, steps=STEPS, checkpoint_interval=SAVE_AT,
                          fault_tolerance={**ft, "min_replicas": 2,
                                           "inject": [{"step": SAVE_AT + 2, "replica": 1, "phase": "backward"}]})
    started["checkpoints"]["resume_checkpoint_path"] = str(full.run_dir / "checkpoints" / str(SAVE_AT))
    first = run_training(started, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    assert first.returncode == 3, first.output[-4000:]  # below min_replicas: stopped after step SAVE_AT + 1
    again = run_training(started, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert f"at step {SAVE_AT + 1}" in again.output and "checkpoints of its own" in again.output, again.output[-4000:]
    logged = [int(r["step"]) for r in read_metrics_jsonl(tmp_path / "run") if "event" not in r]
    assert logged == list(range(SAVE_AT + 1, STEPS + 1))  # no step computed twice
    diff = np.abs(np.array(again.losses) - np.array(full.losses[SAVE_AT:])).max()
    assert diff <= 1e-5, f"losses differ by {diff:.2e}"


# ------------------------------------------------------------------ the save path, in one process on real files
class FileLayout:
    """Two plain files per checkpoint: what ``save`` does with folders, markers and the pointer does not depend on
    nanotron's format (the real format is saved by the jobs above)."""

    def __init__(self) -> None:
        self.fill = 1

    def write(self, trainer, folder: Path, step: int) -> None:
        (folder / "model").mkdir()
        (folder / "model" / "w.bin").write_bytes(bytes([self.fill]) * 8192)
        (folder / "optimizer.pt").write_bytes(b"adam" * (1000 + step))

    def read(self, trainer, folder: Path) -> None:
        pass


class Killed(Exception):
    """The publisher's death at a fault point of the save."""


def _manager(tiny_config, run_dir: Path) -> CheckpointManager:
    config = config_from_dict(tiny_config(dp=2, accumulation=2, fault_tolerance={"enabled": True}))
    return CheckpointManager(config, run_dir, layout=FileLayout())


def _save(manager: CheckpointManager, step: int, die_at: str | None = None) -> None:
    """One writer that is also the publisher (a replica of one rank)."""
    def fault_point(phase: str) -> None:
        if phase == die_at:
            raise Killed(phase)

    manager.save(SimpleNamespace(M=4), step, writer=True, barrier=lambda: None, publisher=True,
                 fault_point=fault_point)


def test_a_publish_marks_its_folder_until_the_pointer_names_it(tiny_config, tmp_path):
    """The marker is what lets a relaunch tell a writer's unfinished publish from a pointer a person moved back:
    present from before the rename until ``latest.txt`` names the step, never in the checksummed manifest."""
    manager = _manager(tiny_config, tmp_path)
    _save(manager, 2)
    with pytest.raises(Killed):
        _save(manager, 4, die_at="checkpoint-publish")  # renamed into place, the pointer not yet written
    root = manager.root
    assert (root / "4" / PUBLISHING_MARKER).is_file() and (root / LATEST).read_text().strip() == "2"
    assert PUBLISHING_MARKER not in read_state(root / "4")["files"]
    assert verify_share(root / "4", read_state(root / "4")) == []
    _save(manager, 4)  # the next holder saves: the folder is its own unfinished publish, the pointer follows
    assert (root / LATEST).read_text().strip() == "4"
    assert not (root / "4" / PUBLISHING_MARKER).exists() and not (root / "2" / PUBLISHING_MARKER).exists()


def test_an_intact_folder_of_the_step_is_trusted_by_the_next_save(tiny_config, tmp_path):
    """The fallback save right after an interval save of the same step writes nothing again."""
    manager = _manager(tiny_config, tmp_path)
    _save(manager, 4)
    before = (manager.root / "4" / STATE_FILE).stat().st_mtime_ns
    _save(manager, 4)
    assert (manager.root / "4" / STATE_FILE).stat().st_mtime_ns == before
    assert sorted(p.name for p in manager.root.iterdir()) == ["4", LATEST]


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "garbled-state", "unsealed-state"])
def test_a_damaged_folder_of_the_step_is_set_aside_and_saved_anew(how, tiny_config, tmp_path):
    """A folder that holds a state file is not "saved already" unless its files match: a damaged one is renamed
    ``N.damaged`` (kept for a person) and the step is written again (before: trusted, and published)."""
    manager = _manager(tiny_config, tmp_path)
    _save(manager, 4)
    folder = manager.root / "4"
    weights, state = folder / "model" / "w.bin", folder / STATE_FILE
    if how == "flip":
        data = bytearray(weights.read_bytes())
        data[100:116] = bytes(16)
        data[100] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif how == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "missing":
        weights.unlink()
    elif how == "garbled-state":
        state.write_text(state.read_text()[:40])
    else:  # a state file without its seal and checksums
        state.write_text(json.dumps({"step": 4, "microbatches_per_step": 4}))
    _save(manager, 4)
    assert (manager.root / "4.damaged").is_dir()
    assert verify_share(folder, read_state(folder)) == [] and (folder / "model" / "w.bin").stat().st_size == 8192
    assert (manager.root / LATEST).read_text().strip() == "4"


def test_a_save_never_trusts_a_folder_past_the_pointer_that_is_not_its_own(tiny_config, tmp_path):
    """An unmarked folder newer than the pointer is what a person rolled back: a save of that step writes this
    run's state (the old folder set aside, ``N.rolled-back``) instead of publishing the dropped one."""
    manager = _manager(tiny_config, tmp_path)
    _save(manager, 2)
    _save(manager, 4)  # the line a person drops
    (manager.root / LATEST).write_text("2\n")
    manager.layout.fill = 7  # the state of step 4 on the line trained again
    _save(manager, 4)
    assert (manager.root / LATEST).read_text().strip() == "4"
    assert (manager.root / "4" / "model" / "w.bin").read_bytes() == bytes([7]) * 8192
    assert (manager.root / "4.rolled-back" / "model" / "w.bin").read_bytes() == bytes([1]) * 8192


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_with_no_interval_given_the_run_saves_on_the_auto_cadence(tiny_config, tmp_path):
    """``checkpoint_interval`` left out: the first save comes once the minimum interval of training has passed (it
    measures what a save stalls the step), every later one once Young/Daly's interval has; every rank saves the same
    steps (the decision is drawn from the steps' agreed sums), and the last step is on disk."""
    steps = 60
    config = tiny_config(dp=2, accumulation=2, steps=steps, checkpoint_interval=SAVE_AT,
                         fault_tolerance={"enabled": True})
    del config["checkpoints"]["checkpoint_interval"]
    config["checkpoints"].update(checkpoint_min_interval_s=0.4, all_snapshots_lost_h=0.0005)  # Young/Daly: ~1 s
    run = run_training(config, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    events = [r for r in read_metrics_jsonl(tmp_path / "run") if r.get("event") == "checkpoint_cadence"]
    assert len(events) >= 2, run.output[-3000:]
    assert events[0]["stall_s"] is None and events[0]["interval_s"] == 0.4
    assert all(e["stall_s"] is not None and e["stall_s"] > 0 for e in events[1:]), events
    mtbf_s = 0.0005 * 3600
    for before, e in zip([{"step": 0}, *events], events):
        assert (e["step"] - before["step"]) * e["step_s"] >= e["interval_s"] - 1e-3, e  # the training since the last
        if e["stall_s"] is not None:  # the rule, on the stall measured in this run
            assert e["interval_s"] == pytest.approx(max(math.sqrt(2 * e["stall_s"] * mtbf_s), 0.4), abs=2e-3), e
    root = tmp_path / "run" / "checkpoints"
    assert (root / LATEST).read_text().strip() == str(steps)
    print("\nauto cadence: saves after steps " + ", ".join(f"{e['step']} ({e['interval_s']} s, stall {e['stall_s']})"
                                                          for e in events))
