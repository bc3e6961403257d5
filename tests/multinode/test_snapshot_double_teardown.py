"""Two quick tear-downs leave two different files for one (coordinate, step); the next launch loads one of them on
every rank (issue #23, item 3).

Two isolated nodes x 2 slots (each its own /dev/shm, where the snapshots are), 2 replicas x TP2 (one replica a
node). A "lost" node here loses its processes, not its memory (a crashed daemon, an OOM kill: every process of the
node but its init SIGKILLed), so that its files outlive the job:

1. launch 1 (history H1) loses node 2 after step 2: the job ends; both nodes hold H1's newest snapshots. (Steps
   take ~0.1 s; node 1's replica repairs and trains on until PRRTE's teardown, once seen in CI past the last of 8
   steps, which deletes a finished run's snapshots: hence 16 steps, the loss early, and one more try.)
2. Node 1 is replaced (killed and started again: its memory empty); launch 2 runs on node 1 alone (``--replicas 1``, M
   kept: another summation order, so other bytes), from scratch, and its node is lost as soon as it holds, whole,
   a step k that node 2 holds whole from launch 1. Both nodes' files newer than k are dropped (as if the losses
   hit those writes).
3. Launch 3 on both nodes finds step k whole twice: H1 on node 2, H2 on node 1. Every rank must load the same
   one (the later launch's), so both replicas of each coordinate hold the same state: the payload CRC each rank
   prints at its resume is the same for the two replicas of a coordinate.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.launcher.runs import run_training, write_config
from nanotron_recover.run.run_folder import read_metrics, run_id
from nanotron_recover.snapshots.catalog import scan
from nanotron_recover.snapshots.format import payload_checksum
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import config_hash, snapshot_folder
from nanotron_recover.testbed import isolated_nodes as iso
from tests.multinode.test_node_faults import TIMEOUT_S, _launch_and_lose

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S + 60)]
STEPS = 16
RESUMED = re.compile(r"resumed from the local snapshot of step (\d+) \(history (\w+), (\d+) rank\(s\); payload "
                     r"checksum of ([^;]+);")


SHM = "/dev/shm/nr-test-snapshots"  # each node's own memory


def folder_of(config, run: str, bed: iso.Bed, node: str) -> Path:
    """Node ``node``'s snapshot folder of ``run``, as the host reads it (through the node's root)."""
    return iso.node_path(bed, node, snapshot_folder(SnapshotSettings.of(config, node=node), run))


def whole_steps(snaps, history: str | None = None) -> dict[tuple[str, int], dict[int, int]]:
    """{(history, step): {coordinate: payload checksum}} of the (history, step)s held for both coordinates."""
    held: dict[tuple[str, int], dict[int, int]] = {}
    for s in snaps:
        held.setdefault((s.history, s.step), {})[s.coord] = payload_checksum(s.header)
    return {k: v for k, v in held.items() if len(v) == 2 and (history is None or k[0] == history)}


def launch_and_lose_when(config_path: Path, run_dir: Path, bed: iso.Bed, node: str, ready: Callable[[], bool],
                         extra: list[str]) -> str:
    """Launch on ``node`` alone; once ``ready()``, lose its processes. -> the output."""
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", *extra]
    env = {**os.environ, **iso.launch_env(Path(bed.folder), [node])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=bed.shared)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    deadline, lost = time.monotonic() + TIMEOUT_S, False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not lost and ready():
                iso.kill_processes(bed, node)
                lost = True
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    reader.join(timeout=30)
    assert lost, f"launch 2 ended before it was ready to be lost:\n{''.join(output)[-4000:]}"
    return "".join(output)


def test_two_quick_teardowns_end_with_one_state_per_coordinate(tiny_config, tmp_path, monkeypatch, isolated_bed):
    raw = tiny_config(dp=2, tp=2, accumulation=2, steps=STEPS, layers=2,
                      fault_tolerance={"enabled": True, "reduce_bucket_mb": 0.01, "collective_timeout_s": 120,
                                       "local_snapshot_dir": SHM,
                                       "local_snapshot_interval": 1})  # every step: the scenario needs ties
    config = config_from_dict(raw)
    chash = config_hash(config)
    bed = isolated_bed([2, 2])
    for attempt in (1, 2):
        run_dir = tmp_path / f"run{attempt}"
        config_path = write_config(raw, run_dir / "config.yaml")
        _launch_and_lose(config_path, run_dir, bed, ["n1", "n2"], "n2", 2, [], lose=iso.kill_processes)
        run = run_id(run_dir)
        n1, n2 = folder_of(config, run, bed, "n1"), folder_of(config, run, bed, "n2")
        if n1.is_dir():
            break
        print(f"\n[test bed] launch 1 finished on node 1 before the teardown (steps logged: "
              f"{[s['step'] for s in read_metrics(run_dir)[0]][-3:]}); trying once more", flush=True)
    assert n1.is_dir(), "launch 1 finished on node 1 twice before PRRTE tore it down"
    on_n2 = whole_steps(scan(n2, run, chash))
    assert on_n2, "node 2 holds a whole snapshot of launch 1"
    (h1,) = {history for history, _ in on_n2}
    iso.kill_node(bed, "n1")  # node 1 replaced: launch 2 starts from scratch
    iso.start_node(bed, "n1")
    n1 = folder_of(config, run, bed, "n1")  # through its new init

    def both() -> set[int]:
        """Steps held whole by launch 2 on node 1 and by launch 1 on node 2."""
        quiet = lambda message: None  # noqa: E731 - files come and go while launch 2 writes
        return ({step for _, step in whole_steps(scan(n1, run, chash, quiet))}
                & {step for _, step in on_n2})

    launch_and_lose_when(config_path, run_dir, bed, "n1", lambda: bool(both()), ["--replicas", "1"])
    tie = both()
    assert tie, "the loss of launch 2 came after its writes had moved past launch 1's steps"
    k = max(tie)
    for folder in (n1, n2):
        for snap in scan(folder, run, chash):
            if snap.step > k:
                snap.path.unlink()
    on_n1, on_n2 = whole_steps(scan(n1, run, chash)), whole_steps(scan(n2, run, chash))
    (h2,) = {history for history, step in on_n1 if step == k}
    assert h2 > h1 and (h1, k) in on_n2, (on_n1, on_n2)  # step k twice, in two histories; H2 the later launch

    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    resumed = RESUMED.findall(result.output)
    assert len(resumed) == 1, result.output[-4000:]  # one line for the launch, from one rank
    ((step, history, ranks, sums),) = resumed
    assert (int(step), history, int(ranks)) == (k, h2, 4)
    # every rank's payload checksum by coordinate; both replicas of a coordinate with other bytes would show two
    assert {int(c): s for c, s in re.findall(r"coordinate (\d+) ([\w:/]+)", sums)} == on_n1[(h2, k)]
    after = [s["step"] for s in result.steps if s["time"] >= relaunched]
    assert after == list(range(k + 1, STEPS + 1))
    differ = on_n1[(h2, k)] != on_n2[(h1, k)]
    print(f"\nstep {k} held by H1 on n2 and H2 on n1 ({'different' if differ else 'equal'} bytes): every rank "
          f"loaded H2's")
