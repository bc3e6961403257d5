"""A node loss costs one step, not a checkpoint interval: the relaunch resumes from node-local snapshots.

3 isolated nodes (each its own /dev/shm, where the snapshots are), 3 replicas x TP2, a disk checkpoint every 10
steps. Node 3 is lost whole after step 11 (its init SIGKILLed: its processes and its memory): the job ends (exit 3).
Node 2 is replaced too (killed and started again, empty), so only node 1 holds a replica's worth of snapshots.
The relaunch on 2 nodes (``--replicas 2``, M kept) agrees on the newest step node 1 holds, node 2's ranks receive
their coordinates' state over MPI, and training continues there, never at the disk checkpoint; every loss after
the resume equals the failure-free run's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.launcher.runs import run_training, write_config
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import latest_checkpoint_step, read_metrics, run_id
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import snapshot_folder
from nanotron_recover.testbed import isolated_nodes as iso
from tests.multinode.test_node_faults import TIMEOUT_S, _launch_and_lose

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S + 60)]
# the survivors of the loss stop gracefully on the teardown's SIGTERM some steps later (up to 6 seen in a loaded
# suite run): the run must be long enough that they never reach its end before the relaunch, and the next disk
# checkpoint far enough that they rarely stop on it (CI once saw them stop on step 8 with checkpoints every 4: the
# relaunch then rightly resumed from that checkpoint, as new as any snapshot, and the snapshot path went untried)
STEPS = 24
INTERVAL = 10
LOSE_AFTER = 11
TOL = 1e-5
SHM = "/dev/shm/nr-test-snapshots"  # each node's own memory


def node_config(tiny_config) -> dict:
    return tiny_config(dp=3, tp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=INTERVAL,
                       fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "collective_timeout_s": 120,
                                        "local_snapshot_dir": SHM, "local_snapshot_interval": 1})


def test_a_lost_node_costs_one_step_not_a_checkpoint_interval(tiny_config, tmp_path, monkeypatch, isolated_bed):
    reference = run_training(node_config(tiny_config), tmp_path / "ref", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    want = {s["step"]: s["loss"] for s in reference.steps}
    run_dir = tmp_path / "run"
    raw = node_config(tiny_config)
    config_path = write_config(raw, run_dir / "config.yaml")

    bed = isolated_bed([2, 2, 2])
    proc, out, lost_at, placement = _launch_and_lose(config_path, run_dir, bed, ["n1", "n2", "n3"], "n3",
                                                     LOSE_AFTER, [])
    assert placement == {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}, placement
    assert proc.returncode == EXIT_RESTART, out[-4000:]
    last = read_metrics(run_dir)[0][-1]["step"]
    # the checkpoint of step 10 is written in the background: on disk unless the loss came inside its write
    disk = latest_checkpoint_step(run_dir) or 0
    assert disk % INTERVAL == 0 and disk <= last, (disk, last)

    held = snapshot_folder(SnapshotSettings.of(config_from_dict(raw), node="n1"), run_id(run_dir))
    assert any(iso.node_path(bed, "n1", held).iterdir()), "node 1 holds snapshots"
    iso.kill_node(bed, "n2")  # node 2 replaced too (node 3's memory went with it): its ranks must receive
    iso.start_node(bed, "n2")
    for key, value in iso.launch_env(Path(bed.folder), ["n1", "n2"]).items():
        monkeypatch.setenv(key, value)
    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data", "--replicas", "2"])
    if disk == last:  # the survivors stopped on a checkpoint step: no snapshot is newer, the checkpoint is the choice
        assert f"checkpoints/{disk} at step {disk}" in result.output, result.output[-4000:]
        assert "resumed from the local snapshot" not in result.output, result.output[-4000:]
        after = [s for s in result.steps if s["time"] >= relaunched]
        assert [s["step"] for s in after] == list(range(disk + 1, STEPS + 1))
        assert max(abs(s["loss"] - want[s["step"]]) for s in after) <= TOL
        return
    steps = {int(s) for s in re.findall(r"resumed from the local snapshot of step (\d+)", result.output)}
    assert len(steps) == 1, result.output[-4000:]
    (step,) = steps
    # the last committed step (or the one before, if the loss hit its snapshot's background write), not the checkpoint
    assert step >= max(last - 1, disk), (step, last, disk)
    assert "received from rank 0" in result.output or "received from rank 1" in result.output  # node 2's ranks
    after = [s for s in result.steps if s["time"] >= relaunched]
    assert [s["step"] for s in after] == list(range(step + 1, STEPS + 1))
    assert all(s["microbatches"] == 6 and s["live_replicas"] == 2 for s in after)
    diff = max(abs(s["loss"] - want[s["step"]]) for s in after)
    assert diff <= TOL, [(s["step"], s["loss"], want[s["step"]]) for s in after]
    again = after[0]["time"] - after[0]["step_time_s"] - lost_at
    print(f"\nnode 3 lost after step {last} (disk checkpoint at {disk}): resumed from the local snapshot of step "
          f"{step}, {max(0, last - step)} logged step(s) recomputed (a relaunch from disk: {last - disk}); "
          f"training again {again:.1f} s after the loss; max |dloss| vs failure-free {diff:.1e}")


def test_a_replica_lost_on_a_node_of_its_own_leaves_no_snapshot_there(tiny_config, tmp_path, monkeypatch,
                                                                      isolated_bed):
    """2 isolated nodes x 2 slots, a replica (PP2) per node; one rank of replica 1 is killed: its mate is evicted and
    leaves, and no rank of node 2 reaches the end of the run, which deletes the snapshots of the finishing ranks'
    nodes only. The leaving mate deletes its replica's files on its node (before: they stayed after the run)."""
    config = tiny_config(dp=2, pp=2, accumulation=2, steps=8, layers=2, checkpoint_interval=8,
                         fault_tolerance={"enabled": True, "local_snapshot_dir": SHM, "local_snapshot_interval": 1,
                                          "inject": [{"step": 4, "replica": 1, "rank": 0, "phase": "backward"}]})
    bed = isolated_bed([2, 2])
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    result = run_training(config, tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert [s["step"] for s in result.steps] == list(range(1, 9)) and result.steps[-1]["live_replicas"] == 1
    assert "evicted" in result.output, result.output[-3000:]
    held = {name: [p for p in iso.node_path(bed, name, SHM).rglob("*") if p.is_file()] for name in ("n1", "n2")}
    assert held == {"n1": [], "n2": []}, held
    assert not Path(SHM, run_id(tmp_path / "run")).exists()  # the ranks wrote in their nodes' memory, not the host's
