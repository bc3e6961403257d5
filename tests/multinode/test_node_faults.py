"""Faults across isolated nodes (``nanotron_recover.testbed.isolated_nodes``: each node its own namespaces, /tmp,
/dev/shm, hostname and address; ``tmp_path`` the shared file system), real SIGKILLs.

1. 2 nodes x 4 ranks, 2 replicas x TP2 x PP2: ranks fill the nodes with whole replicas (checked from the nodes'
   pid namespaces); one rank on node 2 is SIGKILLed in backward -> in-step recovery exactly as on one node.
2. 3 nodes, 3 replicas x TP2: node 3 is lost whole (its init SIGKILLed: every process and its memory). On this Open
   MPI that ends the whole job; the launcher judges the run and exits 3 (restart). The relaunch on the 2 nodes left
   (``--replicas 2``: M kept by raising the accumulation) resumes from latest.txt; it then loses node 2 too, and a
   relaunch at full size (nodes 2 and 3 replaced: started again, empty) resumes again and finishes. Every step's
   loss equals the failure-free run's; each loss costs at most a checkpoint interval of steps.

Each launch has a hard timeout; the whole process group is SIGKILLed when it runs over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from nanotron_recover.launcher.runs import run_training, write_config
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.outcome import OUTCOMES_FILE, run_outcome
from nanotron_recover.run.run_folder import latest_checkpoint_step, read_exits, read_metrics, read_metrics_jsonl
from nanotron_recover.testbed import isolated_nodes as iso
from tests.multinode.conftest import placement as placement_now
from tests.multinode.conftest import ranks_in_nodes

pytestmark = pytest.mark.slow

TOL = 1e-5
TIMEOUT_S = 240


class PlacementWatch:
    """Poll the nodes' pid namespaces in a thread until every rank was seen in some node: ``seen`` = {node: ranks}."""

    def __init__(self, bed: iso.Bed, world_size: int) -> None:
        self.seen: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._args = (bed, world_size)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        bed, world_size = self._args
        while not self._stop.is_set():
            now = placement_now(bed)
            if sum(len(r) for r in now.values()) == world_size:
                self.seen = now
                return
            time.sleep(0.2)

    def stop(self) -> dict[str, list[int]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.seen


# ------------------------------------------------------------------------------ 1. a rank lost on another node
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_rank_lost_on_node_2_is_recovered_in_step(tiny_config, tmp_path, monkeypatch, isolated_bed):
    steps, fail_step = 6, 3

    def config(inject: list[dict]) -> dict:
        return tiny_config(dp=2, tp=2, pp=2, accumulation=2, steps=steps, layers=2, fault_tolerance={
            "enabled": True, "reduce_bucket_mb": 0.01, "collective_timeout_s": 120, "inject": inject})

    reference = run_training(config([]), tmp_path / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    bed = isolated_bed([4, 4])
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    watch = PlacementWatch(bed, 8)
    # replica 1 = world ranks 4..7 on node 2; its local rank 3 (pp 1, tp 1) dies
    inject = [{"step": fail_step, "replica": 1, "rank": 3, "phase": "backward"}]
    try:
        result = run_training(config(inject), tmp_path / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    finally:
        placement = watch.stop()
    tail = result.output[-4000:]
    assert placement == {"n1": [0, 1, 2, 3], "n2": [4, 5, 6, 7]}, placement  # whole replicas per node
    assert [s["step"] for s in result.steps] == list(range(1, steps + 1)), tail
    assert all(s["microbatches"] == 4 for s in result.steps), tail
    assert {r for e in result.events_of("repair") for r in e["failed_replicas"]} == {1}, tail
    diff = np.abs(np.array(result.losses) - np.array(reference.losses)).max()
    assert diff <= TOL, f"losses differ from the failure-free run by {diff:.2e}\n{tail}"
    assert 7 not in read_exits(result.run_dir)
    repair = result.events_of("repair")[0]
    print(f"\n2 nodes x 4: rank 7 (node 2) SIGKILLed at step {fail_step}: repaired in step, "
          f"max |dloss| {diff:.1e}, detect + repair {repair['detect_to_repaired_ms']:.0f} ms; "
          f"run {result.wall_s:.1f} s, failure-free {reference.wall_s:.1f} s")


# ------------------------------------------------------------------------------------------- 2. a lost node
# the survivors of a node loss stop gracefully on the teardown's SIGTERM, a few steps later (3 were seen on this
# machine and on CI): the run must be long enough that they never reach its end before the relaunch
NODE_STEPS = 18
INTERVAL = 3


def _node_config(tiny_config) -> dict:
    raw = tiny_config(dp=3, tp=2, accumulation=2, steps=NODE_STEPS, layers=2, checkpoint_interval=INTERVAL,
                      fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "collective_timeout_s": 120,
                                       "local_snapshot_interval": 0})  # the disk-checkpoint fallback itself
    # each checkpoint on disk when its step ends (a background save lands one write later): at most an interval lost
    raw["checkpoints"]["async_save"] = False
    return raw


SPAWN_FAILED = "A daemon failed to report back after being spawned"


def _launch_and_lose(config_path: Path, run_dir: Path, bed: iso.Bed, nodes: list[str], node: str,
                     after_steps: int, extra: list[str], lose: Callable[[iso.Bed, str], object] = iso.kill_node
                     ) -> tuple[subprocess.Popen, str, float, dict]:
    """Launch on ``nodes`` of the bed; once this launch logged ``after_steps`` steps, lose ``node`` (whole, or as
    ``lose`` says). -> (proc, output, kill time, placement).

    A launch whose node daemon never came up (PRRTE's "failed to report back", seen once in a full suite run on the
    shared-host bed, exit status 213, before any rank started) is the bed's problem, not the run's: retried once."""
    hangs_before = len(_hangs(run_dir))
    try:
        launched = _launch_and_lose_once(config_path, run_dir, bed, nodes, node, after_steps, extra, lose)
    except AssertionError as error:
        if SPAWN_FAILED not in str(error) or read_metrics(run_dir)[0]:
            raise
        print("[test bed] a node daemon did not come up; launching again", flush=True)
        launched = _launch_and_lose_once(config_path, run_dir, bed, nodes, node, after_steps, extra, lose)
    hangs = _hangs(run_dir)[hangs_before:]
    if hangs:
        raise UnplannedHang(f"hang events in a launch: {hangs}")
    return launched


def _hangs(run_dir: Path) -> list[dict]:
    return [e for e in read_metrics(run_dir)[1] if e.get("event") == "hang_detected"] if run_dir.exists() else []


def _launch_and_lose_once(config_path: Path, run_dir: Path, bed: iso.Bed, nodes: list[str], node: str,
                          after_steps: int, extra: list[str], lose: Callable[[iso.Bed, str], object]
                          ) -> tuple[subprocess.Popen, str, float, dict]:
    started = time.time()
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **iso.launch_env(Path(bed.folder), nodes)}, start_new_session=True,
                            cwd=bed.shared)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    deadline, killed_at, placement = time.monotonic() + TIMEOUT_S, None, {}
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            steps = [s for s in read_metrics(run_dir)[0] if s["time"] >= started]
            if killed_at is None and len(steps) >= after_steps:
                placement = placement_now(bed)
                lose(bed, node)
                killed_at = time.time()
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            reader.join(timeout=10)
            raise AssertionError(f"the job did not end within {TIMEOUT_S} s:\n{''.join(output)[-4000:]}")
    reader.join(timeout=30)
    text = "".join(output)
    assert killed_at is not None, f"the job ended before {after_steps} steps:\n{text[-4000:]}"
    _assert_nothing_outlived_the_launcher(run_dir, text, bed)
    return proc, text, killed_at, placement


def _assert_nothing_outlived_the_launcher(run_dir: Path, output: str, bed: iso.Bed) -> None:
    """The launcher judged the run only once its ranks had ended: no rank is left, and nothing was written into the
    run folder after its verdict (seen before the launcher waited for them: survivors of the teardown committed
    steps and a checkpoint after the verdict, and a next launch resumed from it)."""
    assert not ranks_in_nodes(bed, run_dir), (ranks_in_nodes(bed, run_dir), output[-4000:])
    verdict_at = max(r["time"] for r in read_metrics_jsonl(run_dir / OUTCOMES_FILE))
    written_at = max(r.get("time", 0.0) for r in read_metrics_jsonl(run_dir))
    assert written_at <= verdict_at, (written_at - verdict_at, output[-4000:])


@pytest.mark.timeout(7 * TIMEOUT_S + 60)
def test_a_lost_node_ends_the_job_and_the_relaunch_resumes_the_same_trajectory(tiny_config, tmp_path, monkeypatch,
                                                                                isolated_bed):
    reference = run_training(_node_config(tiny_config), tmp_path / "ref", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    try:
        _lose_nodes(tiny_config, tmp_path / "try1", monkeypatch, reference, isolated_bed([2, 2, 2]))
    except UnplannedHang as hang:
        # seen once in a full suite run: two healthy ranks stuck 30 s in one launch, so the scenario (which
        # replicas each node loss takes) was not the planned one; their stacks are kept, the scenario runs again
        print(f"\n[test bed] {hang}; running the scenario again", flush=True)
        _lose_nodes(tiny_config, tmp_path / "try2", monkeypatch, reference, isolated_bed([2, 2, 2]))


class UnplannedHang(AssertionError):
    """A launch of the node-loss scenario had a hang that the scenario did not plan (the hang monitor acted)."""


def _lose_nodes(tiny_config, tmp_path: Path, monkeypatch, reference, bed: iso.Bed) -> None:
    want = {s["step"]: s["loss"] for s in reference.steps}
    run_dir = tmp_path / "run"
    config_path = write_config(_node_config(tiny_config), run_dir / "config.yaml")
    report = []

    # --- 3 nodes; node 3 (replica 2) is lost after step 4
    proc, out, lost_at, placement = _launch_and_lose(config_path, run_dir, bed, ["n1", "n2", "n3"], "n3", 4, [])
    assert placement == {"n1": [0, 1], "n2": [2, 3], "n3": [4, 5]}, placement
    assert proc.returncode == EXIT_RESTART, (proc.returncode, out[-4000:])  # mpirun itself returned 0
    assert "ended before its last step" in out, out[-4000:]
    verdict, detail = run_outcome(run_dir, NODE_STEPS, 0)
    assert verdict == "restart", detail
    # torn down with the lost daemon, or stopped by that teardown's SIGTERM (graceful stop): never another outcome
    assert {r["code"] for r in read_exits(run_dir).values()} <= {EXIT_RESTART}, read_exits(run_dir)
    first_steps, _ = read_metrics(run_dir)
    ckpt1 = latest_checkpoint_step(run_dir)
    lost1 = first_steps[-1]["step"] - ckpt1
    assert ckpt1 is not None and 0 <= lost1 <= INTERVAL, (ckpt1, first_steps[-1])

    # --- relaunch on the 2 nodes left: 2 replicas, accumulation 3 (M = 6 kept); it loses node 2 after 3 steps
    relaunched = time.time()
    proc, out, lost2_at, placement = _launch_and_lose(config_path, run_dir, bed, ["n1", "n2"], "n2", 3,
                                                      ["--replicas", "2"])
    assert placement == {"n1": [0, 1], "n2": [2, 3]}, placement
    assert proc.returncode == EXIT_RESTART, (proc.returncode, out[-4000:])
    assert f"at step {ckpt1}" in out, out[-4000:]  # "resumed from .../checkpoints/<ckpt1> at step <ckpt1>"
    second = [s for s in read_metrics(run_dir)[0] if s["time"] >= relaunched]
    assert second[0]["step"] == ckpt1 + 1, second[:2]
    assert all(s["microbatches"] == 6 for s in second), second
    # 2 replicas until node 2 is lost; the survivor may still repair and commit a step alone before the teardown
    assert all(s["live_replicas"] == 2 for s in second if s["time"] <= lost2_at), second
    assert all(s["live_replicas"] in (1, 2) for s in second), second
    again1 = second[0]["time"] - lost_at
    ckpt2 = latest_checkpoint_step(run_dir)
    lost2 = second[-1]["step"] - ckpt2
    assert ckpt2 is not None and 0 <= lost2 <= INTERVAL, (ckpt2, second[-1])
    # steps the survivors still repaired and committed after a loss, before PRRTE's teardown reached them
    raced = ([s["step"] for s in first_steps if s["time"] > lost_at]
             + [s["step"] for s in second if s["time"] > lost2_at])
    before = lambda steps, t: max(s["step"] for s in steps if s["time"] <= t)  # noqa: E731 - last step before t
    report.append(f"node 3 lost after step {before(first_steps, lost_at)}: resumed from {ckpt1} on 2 nodes, "
                  f"{lost1} step(s) lost, training again {again1:.1f} s after the loss")

    # --- relaunch at full size (nodes 2 and 3 replaced: same names and addresses, empty memory): 3 replicas again
    for lost in ("n2", "n3"):
        iso.start_node(bed, lost)
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    relaunched, hangs_before = time.time(), len(_hangs(run_dir))
    final = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    if len(_hangs(run_dir)) > hangs_before:
        raise UnplannedHang(f"hang events in the last launch: {_hangs(run_dir)[hangs_before:]}")
    third = [s for s in final.steps if s["time"] >= relaunched]
    assert third and third[0]["step"] == ckpt2 + 1 and third[-1]["step"] == NODE_STEPS, final.output[-4000:]
    assert all(s["live_replicas"] == 3 and s["microbatches"] == 6 for s in third), third
    again2 = third[0]["time"] - lost2_at
    report.append(f"node 2 lost after step {before(second, lost2_at)}: resumed from {ckpt2} at full size, "
                  f"{lost2} step(s) lost, training again {again2:.1f} s after the loss")
    assert run_outcome(run_dir, NODE_STEPS, final.returncode)[0] == "done"

    # every step's loss, in every launch (replayed steps included), equals the failure-free run's
    records = _all_step_records(run_dir)
    diffs = [abs(r["loss"] - want[r["step"]]) for r in records]
    assert max(diffs) <= TOL, [(r["step"], r["loss"], want[r["step"]]) for r in records]
    assert sorted({r["step"] for r in records}) == list(range(1, NODE_STEPS + 1))
    print("\n" + "\n".join(report) + f"\nmax |dloss| vs failure-free over {len(records)} step records "
          f"{max(diffs):.1e}; steps the survivors committed in-step before the teardown: {raced}; "
          f"failure-free run {reference.wall_s:.1f} s")


def _all_step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
