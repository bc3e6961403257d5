"""A non-finite step is never committed (real jobs, a real NaN): one microbatch of step k is poisoned
(``signal: nan``: a layer's output on that rank becomes NaN, so are the loss and the gradients); every rank learns
it in that step, the job ends for a person (exit 2) naming the step and the microbatch, no step >= k is logged,
checkpointed or snapshotted, and a relaunch with the fault removed continues on the failure-free trajectory."""

from __future__ import annotations

import copy

import pytest

from nanotron_recover.config import config_from_dict
from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.exit_codes import EXIT_DONE, EXIT_NEEDS_PERSON
from nanotron_recover.run.run_folder import latest_checkpoint_step, read_exits, read_metrics_jsonl, run_id
from nanotron_recover.snapshots.catalog import _FILE, SUFFIX
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import snapshot_folder
from tests.conftest import make_tiny_config

pytestmark = pytest.mark.slow

STEPS, EVERY, POISONED = 8, 2, 5
TIMEOUT_S = 240
ARGS = ["--synthetic-data"]


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("ft", [True, False], ids=["recover", "stock"])
def test_a_nan_microbatch_ends_the_run_with_the_last_finite_state_kept(ft, tmp_path, failure_free_run):
    nan = [{"step": POISONED, "replica": 1, "rank": 0, "phase": "forward", "signal": "nan"}]
    section = {"enabled": True, "local_snapshot_interval": 1} if ft else {"enabled": False}
    clean = make_tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=EVERY,
                             fault_tolerance=section)
    poisoned = copy.deepcopy(clean)
    poisoned["fault_tolerance"]["inject"] = nan
    # [recover]'s is the same job as tests/test_disk_full.py's reference: one launch per session
    reference = failure_free_run(clean, extra_args=ARGS, timeout_s=TIMEOUT_S)

    run = tmp_path / "run"
    first = run_training(poisoned, run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = first.output[-5000:]
    assert first.returncode == EXIT_NEEDS_PERSON, tail
    assert f"step {POISONED} was not committed" in first.output, tail
    assert [s["step"] for s in first.steps] == list(range(1, POISONED)), tail
    assert latest_checkpoint_step(run) == POISONED - 1
    assert not (run / "checkpoints" / str(POISONED)).exists()
    named = [e["nonfinite_microbatch"] for e in read_exits(run).values() if e.get("nonfinite_microbatch")]
    assert named and all(n["replica"] == 1 for n in named), read_exits(run)
    assert all(e["code"] == EXIT_NEEDS_PERSON for e in read_exits(run).values())
    if ft:  # the newest node-local snapshot is of the last finite step
        folder = snapshot_folder(SnapshotSettings.of(config_from_dict(poisoned)), run_id(run))
        snapped = {int(m.group(4)) for p in folder.glob(f"*{SUFFIX}") if (m := _FILE.fullmatch(p.name))}
        assert max(snapped) == POISONED - 1, snapped

    clean_run = copy.deepcopy(clean)  # the fault removed
    again = run_training(clean_run, run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert again.returncode == EXIT_DONE, again.output[-5000:]
    assert f"at step {POISONED - 1}" in again.output, again.output[-5000:]  # its checkpoint, or the equal snapshot
    logged = [int(r["step"]) for r in read_metrics_jsonl(run) if "event" not in r]
    assert logged == list(range(1, STEPS + 1))  # no step computed twice, none lost
    assert max(abs(a - b) for a, b in zip(again.losses, reference.losses)) <= 1e-6
