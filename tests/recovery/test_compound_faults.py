"""Two faults in one repair window never publish a wrong state, and a fault the design covers never ends the job.

Real ``nanotron-recover train`` jobs under ``mpirun --with-ft ulfm``, real SIGKILLs, a hard timeout on each run.
2 replicas x TP2 + 1 spare = 6 ranks, 6 steps, M = 4.

* The donor of a spare's state transfer dies inside the transfer, after the replica the spare replaces died in the
  same step: no replica holding the committed state is left. The job must stop with the restart outcome *without*
  writing a checkpoint (the spare holds initial weights), and the relaunch must resume from the last committed
  checkpoint and follow the failure-free trajectory.
* A rank dies inside a checkpoint save while the spare waits: the spare takes the slot only after its state
  transfer, the next step still commits M microbatches, and the run finishes on the failure-free trajectory.
"""

from __future__ import annotations

import numpy as np
import pytest

from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.run_folder import latest_checkpoint_step, read_metrics

pytestmark = pytest.mark.slow

STEPS = 6
M = 4  # dp 2 x accumulation 2
TIMEOUT_S = 300
TOL = 1e-5


def spare_config(tiny_config, inject: list[dict], checkpoint_interval: int) -> dict:
    return tiny_config(
        dp=2, tp=2, pp=1, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=checkpoint_interval,
        fault_tolerance={"enabled": True, "spare_replicas": 1, "reduce_bucket_mb": 0.01, "hang_timeout_s": 20,
                         "collective_timeout_s": 20, "local_snapshot_interval": 0, "inject": inject},
    )


_REFERENCE: list = []


@pytest.fixture
def reference(tiny_config, tmp_path_factory) -> np.ndarray:
    """Failure-free losses of steps 1..STEPS (once per module)."""
    if not _REFERENCE:
        result = run_training(spare_config(tiny_config, [], STEPS), tmp_path_factory.mktemp("ref"),
                              timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
        assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), result.output[-3000:]
        _REFERENCE.append(np.array(result.losses))
    return _REFERENCE[0]


@pytest.mark.timeout(4 * TIMEOUT_S)
def test_donor_lost_in_the_transfer_writes_no_checkpoint_and_the_relaunch_keeps_the_trajectory(
        tiny_config, reference, tmp_path):
    # step 3: replica 1 dies in backward (the spare takes its slot); at the step's end the donor, replica 0, dies
    # inside the state transfer. The spare never received the committed state of step 3.
    inject = [{"step": 3, "replica": 1, "rank": 0, "phase": "backward"},
              {"step": 3, "replica": 0, "rank": 1, "phase": "transfer"}]
    config = spare_config(tiny_config, inject, checkpoint_interval=2)
    first = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    tail = first.output[-6000:]
    assert first.returncode == EXIT_RESTART, tail
    assert latest_checkpoint_step(tmp_path) == 2, "only a committed step may be published as a checkpoint"
    assert not (tmp_path / "checkpoints" / "3").exists(), tail
    assert "no live replica holds the committed state of step 3" in first.output, tail
    assert [s["step"] for s in first.steps] == [1, 2], tail

    again = run_training(config, tmp_path, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    assert again.returncode == 0, again.output[-6000:]
    assert "resumed from" in again.output and "at step 2" in again.output, again.output[-3000:]
    steps, _ = read_metrics(tmp_path)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), again.output[-3000:]
    assert all(s["microbatches"] == M for s in steps)
    diff = float(np.abs(np.array([s["loss"] for s in steps]) - reference).max())
    assert diff <= TOL, f"max |dloss| {diff:.2e} against the failure-free run"
    print(f"\ndonor lost in the transfer: no checkpoint of step 3; relaunch from step 2, max |dloss| {diff:.2e}")


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_death_inside_a_checkpoint_save_with_a_spare_waiting_is_survived(tiny_config, reference, tmp_path):
    inject = [{"step": 3, "replica": 1, "rank": 0, "phase": "checkpoint"}]
    result = run_training(spare_config(tiny_config, inject, checkpoint_interval=3), tmp_path,
                          timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"], check=False)
    tail = result.output[-6000:]
    assert result.returncode == 0, tail
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == M for s in result.steps), tail
    repairs = [e for e in result.events_of("repair") if e["phase"] == "checkpoint"]
    assert repairs and repairs[0]["failed_replicas"] == [1], tail
    (activated,) = result.events_of("spare_activated")
    assert activated["replicas"] == [2] and activated["donor"] == 0, activated
    assert latest_checkpoint_step(tmp_path) == STEPS
    diff = float(np.abs(np.array(result.losses) - reference).max())
    assert diff <= TOL, f"max |dloss| {diff:.2e} against the failure-free run"
    print(f"\ndeath inside a checkpoint save, spare waiting: every step committed M; max |dloss| {diff:.2e}")
