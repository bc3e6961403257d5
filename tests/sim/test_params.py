import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.sim.params import LLAMA3_MTBF_HOURS, MTTF_ANCHORS, Params, describe, mttf_hours_at


def test_mttf_passes_through_every_anchor():
    for gpus, hours in MTTF_ANCHORS:
        assert mttf_hours_at(gpus) == pytest.approx(hours, rel=1e-12)


def test_mttf_at_100k_is_between_the_16k_and_131k_anchors():
    h = mttf_hours_at(100_000)
    assert 14 / 60 < h < 1.8
    assert 15 < h * 60 < 22  # ~18 min, FT-HSDP's failure-every-~18-min regime


@given(st.integers(min_value=64, max_value=400_000), st.integers(min_value=1, max_value=400_000))
def test_mttf_decreases_with_size(a, b):
    lo, hi = sorted((a, b))
    assert mttf_hours_at(hi) <= mttf_hours_at(lo) + 1e-12


def test_llama3_anchor():
    assert LLAMA3_MTBF_HOURS == pytest.approx(3.09, abs=0.01)


def test_step_model_quota_bubble_and_sharing():
    p = Params(mb_s=1.0, base_s=0.5)
    assert p.step_s(4, 100) == 4.5
    assert p.step_s(4, 100, pp=4) == 7.5  # 3 bubble slots
    cpu = p.with_(devices=2)
    assert cpu.step_s(3, 8) == pytest.approx(0.5 + 3 * 4)  # 8 processes share 2 cores
    assert cpu.step_s(6, 4) == cpu.step_s(3, 8)  # the headline's 8 -> 4 replicas: same total work per core
    assert p.with_(recover_step_factor=1.1).step_s(4, 1, recover=True) == pytest.approx(4.95)


def test_repair_grows_with_log_ranks_and_restart_with_nodes():
    p = Params(repair_s=0.01, repair_ranks=8)
    assert p.repair_at(8) == pytest.approx(0.01)
    assert p.repair_at(64) == pytest.approx(0.02)
    assert p.restart_s(100) - p.restart_s(0) == pytest.approx(100 * p.restart_per_node_s)
    assert p.restart_s(10, load=False) == pytest.approx(p.restart_s(10) - p.ckpt_load_s())


def test_describe_names_every_source():
    p = Params().with_("measured: x", mb_s=0.1)
    rows = {n: (v, s) for n, v, s in describe(p, gpus=1024)}
    assert rows["mb_s"] == ("0.1", "measured: x")
    assert "2410.21680" in rows["job_mttf_hours"][1] and rows["job_mttf_hours"][0].startswith("7.9")
    assert all(s for _, _, s in describe(p, gpus=1024))
    assert math.isfinite(float(rows["= restart_s"][0]))
