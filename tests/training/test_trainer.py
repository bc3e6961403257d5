"""Foundation equivalence: TP/PP/DP layouts (ReCoVer and stock paths) train exactly like one process.

Each run is a real ``nanotron-recover train`` job (mpirun, gloo replicas, ULFM for the ReCoVer path) on the
synthetic token stream, bounded by a hard timeout.
"""

from __future__ import annotations

import numpy as np
import pytest

from nanotron_recover.launcher.runs import run_training
from tests.conftest import make_tiny_config

STEPS = 10
TOL = 1e-5
TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S + 60)]  # the reference run + one run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no parallelism: M = 4 microbatches accumulated."""
    config = make_tiny_config(dp=1, accumulation=4, steps=STEPS)
    result = run_training(config, tmp_path_factory.mktemp("ref"), timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), result.output[-3000:]
    return np.array(result.losses)


LAYOUTS = {
    # name: (config kwargs, fault tolerance section)
    "tp2_pp2_afab_recover": (dict(tp=2, pp=2, engine="afab"), {"enabled": True}),
    "tp2_pp2_1f1b_recover": (dict(tp=2, pp=2, engine="1f1b"), {"enabled": True}),
    "dp2_tp2_recover": (dict(dp=2, tp=2, accumulation=2), {"enabled": True, "reduce_bucket_mb": 0.01}),
    "dp2_tp2_stock": (dict(dp=2, tp=2, accumulation=2), None),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_losses_equal_single_process(name, reference, tmp_path, tiny_config):
    kwargs, ft = LAYOUTS[name]
    config = tiny_config(steps=STEPS, fault_tolerance=ft, **kwargs)
    result = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    losses = np.array(result.losses)
    assert len(losses) == STEPS, result.output[-3000:]
    assert all(s["microbatches"] == 4 for s in result.steps)
    diff = np.abs(losses - reference).max()
    assert diff <= TOL, f"{name}: max |loss - single process| = {diff:.3e}\n{losses}\n{reference}"
    assert losses[-1] < losses[0]  # it learns
