"""Smoke tests of benchmarks/precision_bench.py and benchmarks/snapshot_bench.py at their minimal sizes.

Short mpirun jobs (about 20-60 s each on the 2-core CI machine). At this size the step times mostly reflect noise;
the tests check the plumbing and the numbers that do not depend on machine speed: bytes per parameter, bytes per
snapshot, and which step a killed job resumes at.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
SMALL = ["--hidden", "32", "--intermediate", "64", "--seq", "16"]


def run(script: str, args: list[str], out: Path) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args, *SMALL, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_precision_bench_minimal(tmp_path):
    last = run("precision_bench.py", ["--steps", "4"], tmp_path)
    m = re.fullmatch(r"bf16_bytes_per_param=(\S+) fp32_bytes_per_param=(\S+) bf16_vs_fp32_step_time=(\S+)", last)
    assert m, last
    bf16, fp32, ratio = map(float, m.groups())
    # measured from the tensors: fp32 = 4 param + 4 grad + 4 snapshot + 8 Adam; bf16 adds a 4-byte master, halves
    # the parameter (a few bytes of Adam's step scalars on top)
    assert 20.0 <= fp32 < 20.1 and 22.0 <= bf16 < 22.1 and ratio > 0, last
    data = json.loads((tmp_path / "precision.json").read_text())
    assert data["results"]["bfloat16"]["bytes_per_param"]["masters"] == pytest.approx(4.0)
    assert data["results"]["float32"]["bytes_per_param"]["masters"] == 0.0


def test_snapshot_bench_minimal(tmp_path):
    last = run("snapshot_bench.py", ["--steps", "6", "--kill-after", "3", "--checkpoint-interval", "2", "--tp", "1",
                                     "--pairs", "1"], tmp_path)
    m = re.fullmatch(r"snapshot_step_overhead=(\S+) bytes_per_rank_per_step=(\d+) steps_recomputed_snapshot=(\d+) "
                     r"steps_recomputed_disk=(\d+)", last)
    assert m, last
    data = json.loads((tmp_path / "snapshot.json").read_text())
    restart = data["restart"]
    assert float(m[1]) > 0 and int(m[2]) > 0
    # snapshots: back at the last committed step (or the one before, if the kill hit its snapshot's write); disk:
    # back at a checkpoint (every 2 steps), at most one interval behind
    snap, disk = restart["local snapshot"], restart["disk checkpoint"]
    assert snap["resumed_at"] >= snap["last_logged_step"] - 1, snap
    assert disk["resumed_at"] % 2 == 0 and 0 <= disk["last_logged_step"] - disk["resumed_at"] <= 2, disk
