"""A relaunch continues from the node-local snapshot of the last committed step, bit-identically.

The whole job is SIGKILLed (every rank and mpirun: what a lost node does to an ``mpirun`` here) after step 5; the
relaunch in the same run dir resumes from the snapshots in ``/dev/shm`` (there is no disk checkpoint) at the last
committed step and trains on with exactly the losses of the uninterrupted run; at the end the snapshots are gone.
A relaunch with another config is refused the snapshots (and says so). 3D and HSDP replicas.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.launcher.runs import kill_run_processes, run_training, write_config
from nanotron_recover.run.run_folder import read_metrics, run_id
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import snapshot_folder
from tests.conftest import make_tiny_config

STEPS = 10
KILL_AFTER = 5
TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * TIMEOUT_S)]
RESUMED = re.compile(r"resumed from the local snapshot of step (\d+)")


def config(kind: str, tmp_path: Path, seed: int = 7) -> dict:
    ft = {"enabled": True, "reduce_bucket_mb": 0.01, "local_snapshot_dir": str(tmp_path / "shm"),
          "local_snapshot_interval": 1}  # every step: the relaunch resumes from the last committed one
    if kind == "fsdp":
        ft.update(replica="fsdp", fsdp_shard_size=2)
        raw = make_tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance=ft)
    else:
        raw = make_tiny_config(dp=2, tp=2, accumulation=2, steps=STEPS, layers=2, fault_tolerance=ft)
    raw["general"]["seed"] = seed
    return raw


def launch_and_kill_the_job(config_path: Path, run_dir: Path, after_step: int) -> int:
    """Launch; once ``after_step`` is logged SIGKILL the whole job (mpirun and every rank). -> last logged step."""
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps, _ = read_metrics(run_dir)
            if steps and steps[-1]["step"] >= after_step:
                break
            time.sleep(0.02)
    finally:
        kill_run_processes(run_dir, proc)
    steps, _ = read_metrics(run_dir)
    assert steps and steps[-1]["step"] >= after_step, "the job ended before it could be killed"
    return steps[-1]["step"]


@pytest.mark.parametrize("kind", ["3d", "fsdp"])
def test_a_killed_job_continues_from_its_last_committed_step(kind, tmp_path):
    reference = run_training(config(kind, tmp_path), tmp_path / "reference", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    run_dir = tmp_path / "run"
    config_path = write_config(config(kind, tmp_path), run_dir / "config.yaml")
    last = launch_and_kill_the_job(config_path, run_dir, KILL_AFTER)
    folder = snapshot_folder(SnapshotSettings.of(config_from_dict(config(kind, tmp_path))), run_id(run_dir))
    assert sorted(p.name for p in folder.glob("*.snap")), "every rank left its snapshots on the node"

    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    resumed = [int(m) for m in RESUMED.findall(result.output)]
    assert len(resumed) == 1, result.output[-3000:]  # one line for the launch, not one per rank
    (step,) = resumed
    # the last logged step; one committed but not yet logged; or, if the kill hit the background write of the last
    # logged step's snapshot, the one before (the other slot)
    assert step in (last - 1, last, last + 1), (step, last)
    after = [s for s in result.steps if s["time"] >= relaunched]
    assert [s["step"] for s in after] == list(range(step + 1, STEPS + 1))
    assert [s["loss"] for s in after] == reference.losses[step:]  # identical: the state is the committed one
    assert not folder.exists(), "the finished run deleted its snapshots"
    print(f"\n{kind}: killed after step {last} was logged, resumed at step {step} "
          f"({max(0, last - step)} logged step(s) recomputed)")


def test_snapshots_of_another_config_are_refused_with_a_message(tmp_path):
    run_dir = tmp_path / "run"
    launch_and_kill_the_job(write_config(config("3d", tmp_path), run_dir / "config.yaml"), run_dir, 3)
    changed = write_config(config("3d", tmp_path, seed=8), run_dir / "changed.yaml")  # same run dir, another seed
    relaunched = time.time()
    result = run_training(changed, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert "belongs to another run or config" in result.output and "refused" in result.output
    assert not RESUMED.search(result.output)
    assert [s["step"] for s in result.steps if s["time"] >= relaunched][0] == 1  # from scratch: no disk checkpoint


def test_a_new_run_in_a_remade_run_dir_does_not_take_the_old_runs_snapshots(tmp_path):
    """The old run's snapshots stay in the snapshot folder (it was killed); the run dir is deleted and a new run
    started at the same path, with the same config: it starts from step 1."""
    run_dir = tmp_path / "run"
    raw = config("3d", tmp_path)
    launch_and_kill_the_job(write_config(raw, run_dir / "config.yaml"), run_dir, 3)
    old = snapshot_folder(SnapshotSettings.of(config_from_dict(raw)), run_id(run_dir))
    assert list(old.glob("*.snap"))
    shutil.rmtree(run_dir)
    result = run_training(write_config(raw, run_dir / "config.yaml"), run_dir, timeout_s=TIMEOUT_S,
                          extra_args=["--synthetic-data", "--train-steps", "2"])
    assert not RESUMED.search(result.output), result.output[-3000:]
    assert [s["step"] for s in result.steps] == [1, 2]
    assert list(old.glob("*.snap")), "another run's snapshots are left alone"


AUTO_STEPS, AUTO_CAP = 20, 3  # killed after step 8: 12 steps of margin before the run could finish


def test_with_auto_the_interval_grows_to_its_cap_and_a_relaunch_loses_at_most_the_cap(tmp_path):
    """``local_snapshot_interval: auto`` with faults that end the job rare (Young's rule says far more than the
    cap): every step is snapshotted until a write was measured, then every ``local_snapshot_max_interval`` steps;
    the killed job's relaunch resumes from the newest of them, at most that many steps back, on the same
    trajectory."""
    def auto_config() -> dict:
        raw = config("3d", tmp_path)
        raw["tokens"]["train_steps"] = AUTO_STEPS
        raw["fault_tolerance"].update(local_snapshot_interval="auto", local_snapshot_max_interval=AUTO_CAP,
                                      relaunch_mtbf_h=1000.0)
        return raw

    reference = run_training(auto_config(), tmp_path / "reference", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    chosen = [e for e in read_metrics(tmp_path / "reference")[1] if e.get("event") == "snapshot_interval"]
    assert chosen and chosen[-1]["interval"] == AUTO_CAP and chosen[-1]["write_cost_s"] > 0, chosen

    run_dir = tmp_path / "run"
    config_path = write_config(auto_config(), run_dir / "config.yaml")
    last = launch_and_kill_the_job(config_path, run_dir, 8)
    folder = snapshot_folder(SnapshotSettings.of(config_from_dict(auto_config())), run_id(run_dir))
    held = sorted({int(re.search(r"\.s(\d+)\.snap$", p.name).group(1)) for p in folder.glob("*.snap")})
    assert len(held) >= 2 and held[-1] - held[-2] == AUTO_CAP, held  # the two newest: one interval apart

    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    (step,) = [int(m) for m in RESUMED.findall(result.output)]  # one line for the launch
    assert step in held and last - step <= AUTO_CAP, (step, last, held)
    after = [s for s in result.steps if s["time"] >= relaunched]
    assert [s["step"] for s in after] == list(range(step + 1, AUTO_STEPS + 1))
    assert [s["loss"] for s in after] == reference.losses[step:]
    print(f"\nauto: interval {chosen[-1]['interval']} (write {chosen[-1]['write_cost_s'] * 1e3:.1f} ms, step "
          f"{chosen[-1]['step_s'] * 1e3:.0f} ms); killed after step {last}, snapshots of steps {held} on the node, "
          f"resumed at step {step}")
