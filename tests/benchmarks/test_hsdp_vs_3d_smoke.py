"""Smoke test of benchmarks/hsdp_vs_3d.py at its minimal size: 2 replicas, 4 steps, one kill, three layouts.

Three short mpirun jobs (about 20-40 s on the 2-core CI machine). At this size the numbers mostly reflect process
startup; the test checks the plumbing and that the three layouts train the same model.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
LINE = re.compile(
    r"^hsdp_vs_3d_effective_throughput=(\S+) hsdp_vs_3d_tp2_effective_throughput=(\S+) "
    r"hsdp_vs_3d_step_throughput=(\S+)$"
)


def test_hsdp_vs_3d_minimal(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "hsdp_vs_3d.py"), "--dp", "2", "--accumulation", "1",
           "--steps", "4", "--fail-step", "3", "--hidden", "32", "--intermediate", "64", "--seq", "16",
           "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m, f"unexpected last line: {last!r}"
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in m.groups()), last
    data = json.loads((tmp_path / "out" / "hsdp_vs_3d.json").read_text())
    assert set(data["results"]) == {"3d", "3d-tp2", "hsdp"}
    assert data["results"]["hsdp"]["processes"] == 4 and data["results"]["3d"]["processes"] == 2
    for name, r in data["results"].items():
        assert r["max_loss_diff_vs_3d"] <= 1e-5, (name, r)
        assert r["committed_tokens"] == data["results"]["3d"]["committed_tokens"], name
    assert (tmp_path / "out" / "hsdp_vs_3d.md").is_file()
