import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.sim.calibrate import fit_affine, fit_step_model, from_run_dirs

T0 = 1_800_000_000.0


def _write_run(d, *, first_step, n_steps, quota_by_step, mb_s, base_s, procs, launch_t, kill=None, repair=None,
               ckpt_every=None, save_s=0.0, startup_s=5.0, exit_s=2.0):
    """A run folder as nanotron-recover train writes it (metrics.jsonl, config.yaml, injected/, checkpoints/)."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("parallelism: {dp: 4, tp: 1, pp: 1}\ncheckpoints: {checkpoints_path: checkpoints}\n")
    os.utime(d / "config.yaml", (launch_t, launch_t))
    t = launch_t + startup_s
    lines = []
    for step in range(first_step, first_step + n_steps):
        q = quota_by_step(step)
        live = 4
        dur = base_s + q * mb_s
        t += dur
        rec = {"step": step, "time": t, "loss": 1.0, "microbatches": q * live, "tokens": 256 * q * live,
               "step_time_s": dur, "tokens_per_s": 1000.0 * procs, "tokens_per_s_per_process": 1000.0,
               "live_replicas": live, "epoch": 0, "recoveries": 0}
        lines.append(json.dumps(rec))
        if ckpt_every and step % ckpt_every == 0:
            (d / "checkpoints" / str(step)).mkdir(parents=True)
            (d / "checkpoints" / str(step) / "model.bin").write_bytes(b"\0" * 2**20)  # 1 MB of state
            t += save_s
    if repair:
        lines.append(json.dumps({"event": "repair", **repair}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if kill:
        (d / "injected").mkdir()
        (d / "injected" / "step3-replica1-rank0-backward").write_text(json.dumps(
            {"step": 3, "replica": 1, "rank": 0, "phase": "backward", "at": None, "signal": "kill", "time": kill}))
    (d / "output.log").write_text("done\n")
    os.utime(d / "output.log", (t + exit_s, t + exit_s))


def test_costs_are_read_back_from_run_folders(tmp_path):
    # two quotas (2 and 4 microbatches per replica) so that base and per-microbatch time separate
    _write_run(tmp_path / "a", first_step=1, n_steps=12, quota_by_step=lambda s: 2 if s % 2 else 4, mb_s=0.25,
               base_s=0.1, procs=4, launch_t=T0, ckpt_every=4, save_s=0.5,
               kill=T0 + 7.0, repair={"step": 3, "total_ms": 20.0, "wall_time": T0 + 7.32, "time": T0 + 7.4,
                                      "detect_ms": 5.0, "live_replicas": [0, 2, 3]})
    _write_run(tmp_path / "b", first_step=9, n_steps=4, quota_by_step=lambda s: 2, mb_s=0.25, base_s=0.1, procs=4,
               launch_t=T0 + 100, startup_s=8.0)
    cal = from_run_dirs([tmp_path / "a", tmp_path / "b"])
    v = cal.values
    assert v["mb_s"] == pytest.approx(0.25, rel=1e-6) and v["base_s"] == pytest.approx(0.1, abs=1e-6)
    assert v["detect_s"] == pytest.approx(0.3, abs=1e-6)  # kill -> repair start (wall_time - total)
    assert v["repair_s"] == pytest.approx(0.02)
    assert v["startup_s"] == pytest.approx(5.0, abs=1e-6)
    assert v["restart_fixed_s"] == pytest.approx(8.0, abs=1e-6)  # folder b resumed at step 9
    assert v["exit_s"] == pytest.approx(2.0, abs=1e-3)
    assert v["state_gb_per_rank"] == pytest.approx(1 / 1024)
    assert v["state_gb_per_rank"] / v["storage_gb_per_s"] == pytest.approx(0.5, rel=1e-6)  # save time
    assert all(s.startswith("measured:") for s in cal.sources.values())


def test_an_empty_folder_calibrates_nothing(tmp_path):
    assert from_run_dirs([tmp_path]).values == {}


@given(st.floats(0.0, 2.0), st.floats(0.01, 3.0), st.lists(st.integers(1, 32), min_size=2, unique=True))
def test_step_fit_recovers_a_noiseless_model(base, mb, quotas):
    pts = [(q, 8, base + q * mb) for q in quotas]
    b, m = fit_step_model(pts, None)
    assert b == pytest.approx(base, abs=1e-6) and m == pytest.approx(mb, rel=1e-6)


def test_affine_fit_refuses_a_negative_slope():
    assert fit_affine([(4, 10.0), (8, 6.0)]) == (8.0, 0.0)
    assert fit_affine([(4, 7.0), (8, 11.0)]) == pytest.approx((3.0, 1.0))
