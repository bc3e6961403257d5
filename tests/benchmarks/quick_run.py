"""A benchmark script run at its smoke-test size (``--quick``) as a user runs it, and its last line read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, out: Path, timeout_s: float, last_line: re.Pattern) -> tuple[float, ...]:
    """``benchmarks/<script> --quick --out <out>``: it exits 0 and its last line matches ``last_line``; its groups
    as numbers."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    m = last_line.match(line)
    assert m, f"unexpected last line: {line!r}"
    return tuple(float(v) for v in m.groups())
