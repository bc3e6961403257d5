"""Checkpoints written in the background (``checkpoints.async_save``, the default), real jobs and real faults.

* The same files as a save in the step: a run with ``async_save: false`` and one with the default write the same
  checkpoint folders, file for file: identical tensors and metadata in every weight file, byte-identical optimizer
  and scheduler files, the same state file (but the checksums of the weight files' bytes).
* A writer SIGKILLed while its thread writes (after its part is written, before it says it is done): the world
  repairs in-step, the save of that step is never published (no folder, nothing partial), the next one is, and the
  losses are the failure-free run's.
* The launcher's node lost (the launcher and its ``mpirun`` SIGKILLed) while a background save cannot finish (its
  publisher's thread blocked): the orphaned ranks end, ``latest.txt`` still names the previous checkpoint, nothing
  partial is published, and the relaunch (from the node-local snapshots) reaches the failure-free losses. (A
  launcher lost alone leaves the job running on purpose: it holds the run folder, and its save completes.)

A full disk during a background write is tests/test_disk_full.py (its checkpoints are written in the background).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from nanotron_recover.launcher.runs import max_loss_diff, mpirun_pid, rank_processes, run_training, write_config
from nanotron_recover.run.run_folder import last_logged_step, latest_checkpoint_step, read_metrics_jsonl
from nanotron_recover.training.checkpoint_integrity import FILES_KEY, SEAL_KEY, STATE_FILE
from tests.conftest import make_tiny_config

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 2
TIMEOUT_S = 240
ARGS = ["--synthetic-data"]


def config(inject: list[dict] | None = None, async_save: bool = True) -> dict:
    raw = make_tiny_config(dp=2, tp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=EVERY,
                           fault_tolerance={"enabled": True, "inject": inject or []})
    if not async_save:
        raw["checkpoints"]["async_save"] = False
    return raw


def _files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def _content(path: Path) -> object:
    """What a file holds. A safetensors file's bytes differ between any two saves (its metadata mapping is written
    in a random order), so it is compared by tensors and metadata; the state file by everything but the checksums
    of those bytes; every other file by its bytes."""
    if path.suffix == ".safetensors":
        with safe_open(path, "pt") as f:
            return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in sorted(f.keys())}
    if path.name == STATE_FILE:
        state = json.loads(path.read_text())
        return {k: v for k, v in state.items() if k not in (FILES_KEY, SEAL_KEY)}, sorted(state[FILES_KEY])
    return path.read_bytes()


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_background_save_writes_the_same_files_as_a_save_in_the_step(failure_free_run, tmp_path):
    background = failure_free_run(config(), extra_args=ARGS, timeout_s=TIMEOUT_S)
    in_step = run_training(config(async_save=False), tmp_path, timeout_s=TIMEOUT_S, extra_args=ARGS)
    for step in range(EVERY, STEPS + 1, EVERY):
        a, b = (_files(r.run_dir / "checkpoints" / str(step)) for r in (background, in_step))
        assert sorted(a) == sorted(b) and len(a) > 4, (sorted(a), sorted(b))
        different = [name for name in a if _content(a[name]) != _content(b[name])]
        assert not different, (step, different)
    assert sorted(p.name for p in (background.run_dir / "checkpoints").iterdir()) == ["2", "4", "6", "latest.txt"]


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_writer_killed_in_the_background_write_costs_that_save_and_nothing_else(failure_free_run, tmp_path):
    reference = failure_free_run(config(), extra_args=ARGS, timeout_s=TIMEOUT_S)
    # replica 0 writes (the lowest holder); its rank 1 dies after its part is written: its publisher waits for it
    inject = [{"step": 4, "replica": 0, "rank": 1, "phase": "checkpoint-background"}]
    result = run_training(config(inject), tmp_path, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = result.output[-5000:]
    assert result.returncode == 0, tail
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), tail
    assert all(s["microbatches"] == 4 for s in result.steps), tail
    assert result.events_of("repair"), tail
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "6", "latest.txt"], tail
    assert not [e for e in result.events if e.get("event") == "checkpoint_damaged"], tail
    assert max_loss_diff(result, reference) <= 1e-6


def _launch(run_dir: Path, raw: dict) -> subprocess.Popen:
    path = write_config(raw, run_dir / "config.yaml")
    log = open(run_dir / "launcher.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file",
                             str(path), "--run-dir", str(run_dir), *ARGS], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_the_launchers_node_lost_during_a_background_save_publishes_nothing_partial(failure_free_run, tmp_path):
    reference = failure_free_run(config(), extra_args=ARGS, timeout_s=TIMEOUT_S)
    # the publisher's thread blocks before it is done with step 4's save; its main thread trains on
    inject = [{"step": 4, "replica": 0, "rank": 0, "phase": "checkpoint-background", "signal": "hang"}]
    raw = config(inject)
    launcher = _launch(tmp_path, raw)
    try:
        _wait_until(lambda: last_logged_step(tmp_path) >= 5, 120, "step 5, after the save of step 4 began")
        mpirun = mpirun_pid(launcher.pid)
        assert mpirun is not None
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher's node lost: the launcher and its mpirun
        os.kill(mpirun, signal.SIGKILL)
        launcher.wait(timeout=30)
        _wait_until(lambda: not rank_processes(tmp_path), 60, "the orphaned ranks end by themselves")
    finally:
        for pid in rank_processes(tmp_path):
            os.kill(pid, signal.SIGKILL)
    assert latest_checkpoint_step(tmp_path) == 2, (tmp_path / "launcher.log").read_text()[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".tmp-step-")) == [
        "2", "latest.txt"]  # step 4's writers' folder is a leftover, never published
    again = run_training(raw, tmp_path, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert again.returncode == 0, again.output[-5000:]
    assert not list((tmp_path / "checkpoints").glob(".tmp-step-*"))  # the next save removed the leftover
    assert latest_checkpoint_step(tmp_path) == STEPS
    want = {s["step"]: s["loss"] for s in reference.steps}
    records = [r for r in read_metrics_jsonl(tmp_path) if "event" not in r and "step" in r]  # both launches
    assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))
    assert max(abs(r["loss"] - want[r["step"]]) for r in records) <= 1e-6
