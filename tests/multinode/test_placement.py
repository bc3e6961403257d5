"""Launching on many nodes, without MPI: where replicas land, the launcher's flags and verdict, ``--replicas``."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from nanotron_recover.launcher import launch
from nanotron_recover.launcher.mpirun import hostfile_slots, replica_nodes, replica_placement, slurm_tasks_per_node
from nanotron_recover.launcher.runs import write_config
from nanotron_recover.run.exit_codes import EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART


# ------------------------------------------------------------------------------------------------ placement
def test_whole_replicas_per_node_when_the_ranks_per_replica_divide_the_slots():
    assert replica_nodes([4, 4], 8, 4) == [[0], [1]]
    assert replica_nodes([4, 4, 4], 12, 2) == [[0], [0], [1], [1], [2], [2]]
    assert replica_placement([4, 4], 8, 4) == []
    assert replica_placement([8], 6, 3) == []  # one node: nothing can span


def test_a_replica_that_spans_two_nodes_is_named():
    assert replica_nodes([3, 3], 6, 2) == [[0], [0, 1], [1]]
    (warning,) = replica_placement([3, 3], 6, 2, names=["a", "b"])
    assert "replica 1 on a+b" in warning and "a, b" in warning and "multiple of 2" in warning


def test_more_ranks_than_slots_is_a_warning():
    assert replica_nodes([2, 2], 8, 2) is None
    (warning,) = replica_placement([2, 2], 8, 2)
    assert "oversubscribed" in warning


def test_hostfile_and_slurm_slot_counts(tmp_path: Path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\nn1 slots=4\nn2 slots=4 max_slots=8\n\nn1 slots=2  # again\n")
    assert hostfile_slots(hostfile) == (["n1", "n2"], [6, 4])
    hostfile.write_text("n1 slots=4\nn2\n")
    assert hostfile_slots(hostfile) is None  # Open MPI would count n2's cores: unknown here
    assert slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert slurm_tasks_per_node("8") == [8]


# ------------------------------------------------------------------------------------------------ launcher
def _config(tmp_path: Path, tiny_config, **kwargs) -> Path:
    return write_config(tiny_config(**kwargs, fault_tolerance={"enabled": True}), tmp_path / "config.yaml")


def test_dry_run_maps_by_slot_with_ulfm_safe_collectives_and_warns_on_split_replicas(
        tmp_path, tiny_config, monkeypatch, capsys):
    config = _config(tmp_path, tiny_config, dp=3, tp=2)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n1 slots=3\nn2 slots=3\n")
    monkeypatch.setenv(launch.HOSTFILE_ENV, str(hostfile))
    assert launch.main(["train", "--config-file", str(config), "--run-dir", str(tmp_path / "r"), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    words = " ".join(shlex.split(out))
    assert "--map-by slot" in words and "--mca coll ^han,cuda" in words and f"--hostfile {hostfile}" in words
    assert "replica 1 on n1+n2" in err
    hostfile.write_text("n1 slots=2\nn2 slots=2\nn3 slots=2\n")
    assert launch.main(["train", "--config-file", str(config), "--run-dir", str(tmp_path / "r"), "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err


def _args(config: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_override_args(parser)
    return parser.parse_args(["--config-file", str(config), *extra])


def test_replicas_override_keeps_the_global_batch(tmp_path, tiny_config):
    config = _config(tmp_path, tiny_config, dp=3, accumulation=2)
    effective = launch.load_effective_config(_args(config, "--replicas", "2"))
    assert (effective.parallelism.dp, effective.tokens.batch_accumulation_per_replica) == (2, 3)
    assert effective.microbatches_per_step == 6 and effective.world_size == 2
    assert "--replicas" in launch.forwarded_args(_args(config, "--replicas", "2"), tmp_path)  # the ranks get it too


def test_replicas_override_that_cannot_keep_the_global_batch_is_bad_input(tmp_path, tiny_config, capsys):
    config = _config(tmp_path, tiny_config, dp=3, accumulation=2)
    assert launch.main(["train", "--config-file", str(config), "--replicas", "4", "--dry-run"]) == EXIT_BAD_INPUT
    assert "M = 6" in capsys.readouterr().err


def test_replicas_override_caps_min_replicas(tmp_path, tiny_config):
    config = write_config(tiny_config(dp=4, accumulation=1, fault_tolerance={"enabled": True, "min_replicas": 4}),
                          tmp_path / "config.yaml")
    effective = launch.load_effective_config(_args(config, "--replicas", "2"))
    assert effective.fault_tolerance.min_replicas == 2 and effective.tokens.batch_accumulation_per_replica == 2


@pytest.mark.parametrize("logged, saved, rc, code", [
    (4, 4, 0, EXIT_DONE),        # finished: the last step is on disk
    (4, 2, 0, EXIT_RESTART),     # every step logged, torn down in the final save: the relaunch writes it
    (2, 2, 0, EXIT_RESTART),     # mpirun returned 0 but the job was torn down before its last step (a lost node)
    (2, None, 3, EXIT_RESTART),  # the trainer stopped below min_replicas
    (0, None, 2, EXIT_BAD_INPUT),
])
def test_the_launcher_exit_code_is_judged_from_the_run_dir(tmp_path, tiny_config, logged, saved, rc, code):
    config = launch.load_effective_config(_args(_config(tmp_path, tiny_config, steps=4)))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                    for s in range(1, logged + 1)))
    if saved is not None:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "latest.txt").write_text(f"{saved}\n")
    assert launch._judge(tmp_path, config, rc) == code


def test_the_sbatch_helper_warns_when_slurm_tasks_per_node_split_a_replica(tmp_path, tiny_config):
    import os
    import sys

    config = _config(tmp_path, tiny_config, dp=3, tp=2)
    helper = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "recover_job.py"
    for tasks, split in (("3(x2)", True), ("2(x3)", False)):
        out = subprocess.run([sys.executable, str(helper), "info", "--config-file", str(config)], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "SLURM_TASKS_PER_NODE": tasks})
        assert out.returncode == 0 and "RECOVER_WORLD_SIZE=6" in out.stdout, out.stderr
        assert ("replica 1 on node 0+node 1" in out.stderr) == split, out.stderr
