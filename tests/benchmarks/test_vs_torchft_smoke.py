"""Smoke test of benchmarks/vs_torchft.py at its shortest size (``--quick``): ReCoVer beside torchft 0.2.0 and
plain torch DDP, the same tiny Llama on the same KJV samples.

Real processes only: ``torchrun`` jobs, a ``torchft_lighthouse``, ``nanotron-recover train`` jobs under mpirun, real
SIGKILLs from outside. About 70 s on the 2-core CI machine (8 short jobs, start-up dominated). It checks what must
hold whatever the machine's load: every system committed every step; the three systems trained the same model on
the same samples (failure-free losses equal up to summation order); ReCoVer kept its failure-free trajectory
through the kill (max |dloss| within the fp32 floor, every step M microbatches, no committed step lost); torchft
healed the killed replica and committed at least one shrunken step. Skipped where torchft is not installed
(``pip install -e .[peers]``).
"""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.benchmarks.quick_run import run_quick

TIMEOUT_S = 300
FP32_TOL = 1e-5  # the project's fp32 trajectory tolerance (README: the summation-order floor is ~1e-7)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]
LINE = re.compile(r"^recover_vs_torchft_time_to_N=(\S+) recover_vs_torchft_overhead=(\S+) "
                  r"recover_max_dloss=(\S+) torchft_max_dloss=(\S+)$")


def test_vs_torchft_quick(tmp_path):
    pytest.importorskip("torchft", reason="torchft is an optional extra: pip install -e .[peers]")
    out = tmp_path / "out"
    time_ratio, overhead_ratio, recover_dloss, torchft_dloss = run_quick("vs_torchft.py", out, TIMEOUT_S, LINE)
    assert math.isfinite(time_ratio) and time_ratio > 0 and math.isfinite(overhead_ratio) and overhead_ratio > 0
    assert recover_dloss <= FP32_TOL, f"ReCoVer left its failure-free trajectory: max |dloss| {recover_dloss}"
    assert math.isfinite(torchft_dloss)

    s = json.loads((out / "vs_torchft.json").read_text())["summary"]
    same = s["same_training_max_dloss_vs_recover"]
    assert set(same) >= {"ddp", "recover", "torchft", "torchft-mar"}
    assert all(v <= FP32_TOL for v in same.values()), f"not the same training: {same}"
    rec, ft = s["fault"]["recover"], s["fault"]["torchft-mar"]
    assert rec["steps_not_full"] == [] and rec["committed_steps_lost"] == 0, rec
    assert set(rec["microbatches_around_fault"].values()) == {4}, rec  # M = 4 on every step, the fault's too
    assert ft["restarts"] >= 1 and ft["full_replicas_again_s"] is not None, ft  # the killed replica came back
    assert ft["steps_not_full"], ft  # and torchft committed a step without the dead replica's samples
    for system, c in s["clockwork"]["0.5"].items():
        assert c["reached"] and c["kills_sent"] == 1, (system, c)
    assert s["clockwork"]["0.5"]["recover"]["useful_fraction"] == 1.0
    # every report names the peer that ran (here the project's own environment: torchft 0.2.0 on torch 2.13)
    peer = json.loads((out / "vs_torchft.json").read_text())["args"]["peer"]
    import torch

    assert peer["torchft_version"].startswith("torchft ") and peer["torch_version"] == torch.__version__, peer
    assert f"peer: {peer['torchft_version']} on torch {torch.__version__}" in (out / "vs_torchft.md").read_text()
