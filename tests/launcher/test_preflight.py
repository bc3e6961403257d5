"""The preflight of ``checkpoints.resume_checkpoint_path`` checks the path only where the runtime will read it: a run
with no checkpoint of its own. Once it has some, a moved-away source, or nanotron's requeue idiom (the path is the
run's own checkpoint root) with a damaged newest folder, is the runtime's to handle (own checkpoints, verified
fallback), not a refusal with exit 2. Real folders in tmp_path; the real launch is in
tests/training/test_verified_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_recover.config import ConfigError, RecoverConfig, config_from_dict
from nanotron_recover.launcher.preflight import check_runtime_inputs
from nanotron_recover.run.run_folder import write_atomically
from nanotron_recover.training.checkpoint_integrity import FILES_KEY, STATE_FILE, manifest, sealed_state_text

KEY = "checkpoints.resume_checkpoint_path"


def _config(tiny_config, resume: Path, checkpoints_path: str = "checkpoints") -> RecoverConfig:
    raw = tiny_config(dp=2, accumulation=2, fault_tolerance={"enabled": True})
    raw["checkpoints"].update(resume_checkpoint_path=str(resume), checkpoints_path=checkpoints_path)
    return config_from_dict(raw)


def _checkpoint(root: Path, step: int) -> Path:
    """A sealed checkpoint this config resumes (M = 4, float32, nanotron's layout)."""
    folder = root / str(step)
    folder.mkdir(parents=True)
    (folder / "weights.safetensors").write_bytes(b"w" * 4096)
    state = {"step": step, "microbatches_per_step": 4, "dtype": "float32", "layout": "nanotron",
             FILES_KEY: manifest(folder)}
    (folder / STATE_FILE).write_text(sealed_state_text(state))
    write_atomically(root / "latest.txt", f"{step}\n")
    return folder


def test_a_missing_source_is_refused_while_the_run_has_no_checkpoint_of_its_own(tiny_config, tmp_path):
    config = _config(tiny_config, tmp_path / "moved-away")
    with pytest.raises(ConfigError, match=KEY):
        check_runtime_inputs(config, tmp_path / "run")


def test_once_the_run_has_checkpoints_of_its_own_the_source_is_not_read(tiny_config, tmp_path):
    """The runtime (``CheckpointManager.choose``) resumes from the run's own checkpoints then: so does the check."""
    _checkpoint(tmp_path / "run" / "checkpoints", 4)
    check_runtime_inputs(_config(tiny_config, tmp_path / "moved-away"), tmp_path / "run")


def test_the_requeue_idiom_with_a_damaged_newest_state_file_is_left_to_the_verified_fallback(tiny_config, tmp_path):
    """``resume_checkpoint_path`` = the run's own (absolute) root, its newest state file garbled: the runtime sets it
    aside and loads step 2; the preflight must not refuse the launch."""
    root = tmp_path / "ckpts"
    _checkpoint(root, 2)
    newest = _checkpoint(root, 4)
    (newest / STATE_FILE).write_text("{garbled")
    check_runtime_inputs(_config(tiny_config, root, checkpoints_path=str(root)), tmp_path / "run")
    check_runtime_inputs(_config(tiny_config, root, checkpoints_path=str(root)))  # an absolute root needs no run dir


def test_without_a_run_dir_a_relative_root_cannot_be_looked_at_and_the_source_is_checked(tiny_config, tmp_path):
    _checkpoint(tmp_path / "run" / "checkpoints", 4)
    with pytest.raises(ConfigError, match=KEY):
        check_runtime_inputs(_config(tiny_config, tmp_path / "moved-away"))


def test_a_source_of_another_global_batch_is_still_refused_before_launch(tiny_config, tmp_path):
    source = _checkpoint(tmp_path / "elsewhere", 4)
    raw = tiny_config(dp=2, accumulation=4, fault_tolerance={"enabled": True})
    raw["checkpoints"]["resume_checkpoint_path"] = str(source)
    with pytest.raises(ConfigError, match="microbatches per step"):
        check_runtime_inputs(config_from_dict(raw), tmp_path / "run")


def test_the_snapshot_budget_is_checked_for_one_nodes_ranks_not_the_whole_job(tmp_path, monkeypatch):
    """8 ranks on 2 nodes of 4 slots (a Slurm allocation): each node holds the snapshots of its 4 ranks. A budget
    that fits 4 ranks' and not 8's is accepted there, and refused where the job runs on one node."""
    from nanotron_recover.launcher.launch import build_parser, train_command
    from nanotron_recover.launcher.runs import write_config
    from nanotron_recover.training.memory import snapshot_bytes_per_rank
    from tests.conftest import make_tiny_config

    raw = make_tiny_config(dp=8, accumulation=1, fault_tolerance={"enabled": True,
                                                                  "local_snapshot_dir": str(tmp_path / "shm")})
    per_rank = snapshot_bytes_per_rank(config_from_dict(raw))
    raw["fault_tolerance"]["local_snapshot_max_gb"] = 3 * 6 * per_rank / 2**30  # 3 snapshots of 6 ranks
    path = write_config(raw, tmp_path / "config.yaml")
    args = build_parser().parse_args(["train", "--config-file", str(path), "--run-dir", str(tmp_path / "run")])
    for variable in ("SLURM_JOB_ID", "SLURM_TASKS_PER_NODE", "NANOTRON_RECOVER_HOSTFILE"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ConfigError, match="each of 8 rank"):
        train_command(args)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    cmd, config, _ = train_command(args)
    assert config.world_size == 8
