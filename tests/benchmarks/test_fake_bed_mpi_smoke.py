"""Smoke test of benchmarks/fake_bed_mpi.py at a small size: 2 fake nodes x 2 ranks, 10 operations per kind.

Four short mpirun jobs (about 15 s on the 2-core CI machine). It checks the plumbing (the bed's launch arguments,
the busy-polling variant, the result line); the speeds themselves are the benchmark's to report.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
LINE = re.compile(r"^bed_allreduce_ms_busy=(\S+) bed_allreduce_ms_yield=(\S+) bed_agree_ms_busy=(\S+) "
                  r"bed_agree_ms_yield=(\S+)$")


def test_fake_bed_mpi_minimal():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fake_bed_mpi.py"), "--nodes", "2", "--slots", "2",
           "--repeats", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = LINE.match(lines[-1])
    assert m, f"unexpected last line: {lines[-1]!r}"
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in m.groups()), lines[-1]
    rows = [line for line in lines if line.startswith("| ") and "fake nodes" in line]
    assert len(rows) == 2 and "busy-polling" in rows[0] and "yielding" in rows[1], lines
