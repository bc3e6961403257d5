"""Smoke test of benchmarks/fault_mix.py at its shortest size (``--quick``): ReCoVer with regrow and torchft 0.2.0,
each failure-free and then under a kill -9 and a SIGSTOP sent from outside at seeded random times.

Real processes only (``nanotron-recover train`` under mpirun, a ``torchft_lighthouse`` and ``torchrun`` agents, real
signals). It checks what must hold whatever the machine's load: both faults were sent to both systems, each system
committed every step, ReCoVer kept its failure-free trajectory (max |dloss| within the fp32 floor, all M
microbatches every step), its frozen rank was found by its hang detector, and kept throughput is a positive ratio for
both. Skipped where torchft is not installed (``pip install -e .[peers]``).
"""

from __future__ import annotations

import json
import math
import re

import pytest

from nanotron_recover.run.run_folder import read_metrics
from tests.benchmarks.quick_run import run_quick

TIMEOUT_S = 420
FP32_TOL = 1e-5  # the project's fp32 trajectory tolerance (README: the summation-order floor is ~1e-7)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
LINE = re.compile(r"^recover_kept_throughput=(\S+) torchft_kept_throughput=(\S+) recover_max_dloss=(\S+) "
                  r"torchft_max_dloss=(\S+)$")


def test_fault_mix_quick(tmp_path):
    pytest.importorskip("torchft", reason="torchft is an optional extra: pip install -e .[peers]")
    out = tmp_path / "out"
    recover_kept, torchft_kept, recover_dloss, torchft_dloss = run_quick("fault_mix.py", out, TIMEOUT_S, LINE)
    assert 0 < recover_kept and 0 < torchft_kept and math.isfinite(torchft_dloss)
    assert recover_dloss <= FP32_TOL, f"ReCoVer left its failure-free trajectory: max |dloss| {recover_dloss}"

    systems = json.loads((out / "fault_mix.json").read_text())["systems"]
    for name, c in systems.items():
        assert (c["kills_sent"], c["stops_sent"]) == (1, 1), (name, c)  # the seeded mix: one of each, both systems
        assert 0 < c["kept_throughput_drift_free"] and c["pace_mix_s"] > 0 and c["pace_ff_s"] > 0, (name, c)
    assert systems["recover+regrow"]["useful_fraction"] == 1.0, systems["recover+regrow"]  # M every step
    run = out / "mix_recover+regrow"
    events = read_metrics(run)[1]
    assert any(e["event"] == "hang_detected" for e in events), [e["event"] for e in events]  # the frozen rank
