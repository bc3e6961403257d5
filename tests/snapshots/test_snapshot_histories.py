"""Two launches' different files for one (coordinate, step), on two nodes: every rank loads the same bytes.

Real processes: 4 ranks under ``mpirun --with-ft ulfm`` (2 replicas x 2 coordinates), on two fake nodes (the node
name the snapshot store uses). Node n1 holds history A's step 5 of both coordinates, node n2 history B's (a later
launch, another summation order: other bytes); step 6 is held only as coordinate 0 of A and coordinate 1 of B (two
trajectories: not a snapshot). Every rank must resume B's step 5 (the later launch), the ranks of n1 receiving it,
so that both replicas of each coordinate hold identical state; the step-6 files and A's step 5 are deleted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_recover.launcher.mpirun import mpirun_command
from nanotron_recover.run.run_folder import ensure_run_id
from nanotron_recover.snapshots.catalog import scan
from nanotron_recover.snapshots.format import payload_checksum
from nanotron_recover.snapshots.store import config_hash
from tests.snapshots.snapshot_world import config, node_folder, state_digest, training_state, write_line

TIMEOUT_S = 120
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S)]
ROOT = Path(__file__).resolve().parents[2]
A, B = "0000000000a1", "0000000000b2"  # B sorts after A: the later launch

PROGRAM = r"""
import os, sys
from pathlib import Path
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
from nanotron_recover.ft import FTWorld, WorldOptions
from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.snapshots.local_snapshot import LocalSnapshots
from tests.snapshots.snapshot_world import config, state_digest, training_state
base = Path(sys.argv[1])
ft = FTWorld(MPI.COMM_WORLD, ranks_per_replica=2, options=WorldOptions(watch=False))
state = training_state(0.0)
snapshots = LocalSnapshots.for_config(config(base / "store", 2), base / "run", ft, replica=rank // 2, coord=rank % 2,
                                      launch=LaunchContract(node_name="n1" if rank < 2 else "n2"))
step = snapshots.resume(state, None)
print(f"RESULT rank={rank} coord={rank % 2} step={step} digest={state_digest(state)}", flush=True)
"""


def test_every_rank_loads_the_same_history_when_two_hold_one_step(tmp_path, monkeypatch):
    cfg = config(tmp_path / "store", 2)
    run, chash = ensure_run_id(tmp_path / "run"), config_hash(cfg)
    n1, n2 = node_folder(cfg, run, "n1", monkeypatch), node_folder(cfg, run, "n2", monkeypatch)
    for folder, history, value in ((n1, A, 5.0), (n2, B, 5.5)):
        for coord in (0, 1):
            write_line(folder, run, chash, coord, history, [5], value=value + coord)
    write_line(n1, run, chash, 0, A, [6])
    write_line(n2, run, chash, 1, B, [6])

    b_step5 = {s.coord: s for s in scan(n2, run, chash) if (s.history, s.step) == (B, 5)}
    cmd = mpirun_command(4, [sys.executable, "-c", PROGRAM, str(tmp_path)])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    results = re.findall(r"RESULT rank=(\d) coord=(\d) step=(\w+) digest=(\w+)", out.stdout)
    assert len(results) == 4, out.stdout[-3000:] + out.stderr[-3000:]
    want = {coord: state_digest(training_state(5.5 + coord)) for coord in (0, 1)}
    for rank, coord, step, digest in results:
        assert step == "5" and digest == want[int(coord)], (rank, coord, step, digest)
    said = re.findall(r"resumed from the local snapshot of step .*", out.stdout)
    assert len(said) == 1, said  # one line for the launch, not one per rank
    assert said[0].startswith(f"resumed from the local snapshot of step 5 (history {B}, 4 rank(s)"), said
    sums = ", ".join(f"coordinate {c} {payload_checksum(s.header)}" for c, s in sorted(b_step5.items()))
    assert f"payload checksum of {sums};" in said[0], said  # every rank's checksum, one per coordinate
    assert len(re.findall(r"rank [01] received from rank [23]", said[0])) == 2, said  # n1's hold only A
    # the line not followed is gone (step 6 of both, A's step 5); B's step 5 stays until the launch has its own
    assert scan(n1, run, chash) == [] and {(s.history, s.step) for s in scan(n2, run, chash)} == {(B, 5)}
