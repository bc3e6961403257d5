"""Verified checkpoints in real jobs (real ``mpirun``, real files): a damaged newest checkpoint, whichever file is
hit and however, is never loaded; the relaunch falls back to the previous intact one and its losses equal the
failure-free run's; with no intact one the job ends for a person (exit 2) naming the file; a checkpoint published
without its pointer is adopted, a pointer a person moved back is followed; an older checkpoint without checksums
still loads; ``resume_checkpoint_path`` does not stop a run that has checkpoints of its own; one "resumed from" line
per launch and no save progress bars."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import max_relative_param_diff, run_training
from nanotron_recover.run.exit_codes import EXIT_DONE, EXIT_NEEDS_PERSON
from nanotron_recover.run.run_folder import read_metrics_jsonl
from nanotron_recover.training.checkpoint_integrity import (
    FILES_KEY,
    PUBLISHING_MARKER,
    SEAL_KEY,
    read_state,
    verify_share,
)
from tests.conftest import make_tiny_config

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 2
TIMEOUT_S = 240
ARGS = ["--synthetic-data"]
KINDS = {  # one file of each kind a checkpoint holds
    "weights": lambda ckpt: sorted((ckpt / "model").rglob("*.safetensors"))[0],
    "optimizer": lambda ckpt: sorted((ckpt / "optimizer").glob("optimizer_*.pt"))[0],
    "lr_scheduler": lambda ckpt: ckpt / "lr_scheduler" / "lr_scheduler.pt",
    "trainer_state": lambda ckpt: ckpt / "trainer_state.json",
}


def _config(ft: bool = True) -> dict:
    # node-local snapshots off: the fallback under test is the disk checkpoint's
    return make_tiny_config(dp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=EVERY,
                            fault_tolerance={"enabled": True, "local_snapshot_interval": 0} if ft else None)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[float], str]:
    """The failure-free run: its folder, its losses and its output."""
    run = tmp_path_factory.mktemp("finished") / "run"
    result = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS)
    return run, result.losses, result.output


def _copy(finished: tuple[Path, list[float], str], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    return run


def damage(path: Path, how: str) -> None:
    """``flip``: 4 KB (or the middle half of a smaller file) overwritten with random bytes; ``truncate``: cut to
    half its length."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    n = min(4096, len(data) // 2)
    start = (len(data) - n) // 2
    data[start:start + n] = os.urandom(n)
    path.write_bytes(bytes(data))


def _logged_steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics_jsonl(run) if "event" not in r]


def _loss_diff(relaunch, reference: list[float], resumed_at: int) -> float:
    """Max |Δloss| of the steps the relaunch trained again against the same steps of ``reference`` (a step's last
    record wins: the relaunch's)."""
    trained = relaunch.losses[resumed_at:]
    assert len(trained) == len(reference) - resumed_at == STEPS - resumed_at, trained
    return max(abs(a - b) for a, b in zip(trained, reference[resumed_at:]))


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_intact_one(kind, how, finished, tmp_path):
    run = _copy(finished, tmp_path)
    root = run / "checkpoints"
    target = KINDS[kind](root / str(STEPS))
    damage(target, how)
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = relaunch.output[-5000:]
    assert relaunch.returncode == EXIT_DONE, tail
    assert "damaged checkpoint" in relaunch.output and str(target) in relaunch.output, tail
    assert f"resumed from {root / str(STEPS - EVERY)} at step {STEPS - EVERY}" in relaunch.output, tail
    assert _logged_steps(run) == [*range(1, STEPS + 1), *range(STEPS - EVERY + 1, STEPS + 1)]
    assert all(math.isfinite(loss) for loss in relaunch.losses)
    assert max(abs(a - b) for a, b in zip(relaunch.losses, finished[1])) <= 1e-6
    assert (root / "latest.txt").read_text().strip() == str(STEPS)
    assert (root / f"{STEPS}.damaged").is_dir()  # kept for a person
    assert verify_share(root / str(STEPS), read_state(root / str(STEPS))) == []  # the new one is intact
    assert max_relative_param_diff(root / str(STEPS), finished[0] / "checkpoints" / str(STEPS)) <= 1e-6


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_with_no_intact_checkpoint_the_job_ends_for_a_person_naming_the_file(finished, tmp_path):
    run = _copy(finished, tmp_path)
    root = run / "checkpoints"
    for step in range(EVERY, STEPS, EVERY):
        shutil.rmtree(root / str(step))
    target = KINDS["optimizer"](root / str(STEPS))
    damage(target, "flip")
    before = _logged_steps(run)
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert relaunch.returncode == EXIT_NEEDS_PERSON, relaunch.output[-5000:]
    assert str(target) in relaunch.output and "not requeued" in relaunch.output
    assert _logged_steps(run) == before  # not one step trained on it
    assert (root / str(STEPS)).is_dir() and not (root / f"{STEPS}.damaged").exists()  # left in place
    again = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert again.returncode == EXIT_NEEDS_PERSON  # every later launch meets it too, none starts over


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_checkpoint_published_without_its_pointer_is_adopted(finished, tmp_path):
    """The writer died between renaming ``.tmp-step-N`` to ``N/`` and writing ``latest.txt``: the relaunch verifies
    ``N/``, adopts it, trains nothing again and exits 0 (before, it replayed the steps and exited 3 for ever)."""
    run = _copy(finished, tmp_path)
    (run / "checkpoints" / "latest.txt").write_text(f"{STEPS - EVERY}\n")
    (run / "checkpoints" / str(STEPS) / PUBLISHING_MARKER).write_text("")  # what the writer's death left
    before = _logged_steps(run)
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert relaunch.returncode == EXIT_DONE, relaunch.output[-5000:]
    assert "adopted" in relaunch.output and _logged_steps(run) == before
    assert (run / "checkpoints" / "latest.txt").read_text().strip() == str(STEPS)
    assert not (run / "checkpoints" / str(STEPS) / PUBLISHING_MARKER).exists()


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_pointer_set_back_by_hand_resumes_from_the_step_it_names(finished, tmp_path):
    """A person sets ``latest.txt`` from 8 back to 4 (after a loss spike) and relaunches: the run resumes from step 4
    and trains 5-8 again; 6/ and 8/ are kept as ``N.rolled-back`` (before: 8/ was adopted and nothing trained)."""
    run = _copy(finished, tmp_path)
    root, back = run / "checkpoints", STEPS - 2 * EVERY
    (root / "latest.txt").write_text(f"{back}\n")
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = relaunch.output[-5000:]
    assert relaunch.returncode == EXIT_DONE, tail
    assert f"resumed from {root / str(back)} at step {back}" in relaunch.output, tail
    assert _logged_steps(run) == [*range(1, STEPS + 1), *range(back + 1, STEPS + 1)]
    assert _loss_diff(relaunch, finished[1], back) <= 1e-6  # the same config trained again
    assert (root / f"{STEPS - EVERY}.rolled-back").is_dir() and (root / f"{STEPS}.rolled-back").is_dir()
    assert (root / "latest.txt").read_text().strip() == str(STEPS)  # the new line's own save
    assert verify_share(root / str(STEPS), read_state(root / str(STEPS))) == []


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_rollback_is_not_undone_by_newer_node_local_snapshots(finished, tmp_path):
    """Node-local snapshots on (every step): the job stops after step 7 (below ``min_replicas``: a replica killed
    in step 8), its snapshot of step 7 and checkpoints up to 7 kept. A person sets ``latest.txt`` back to 4: the
    relaunch resumes from the checkpoint of step 4, not from the newer snapshot, and trains 5-8 again with the
    failure-free losses (before: it resumed from the snapshot of step 7)."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    config = _config()
    config["fault_tolerance"].update(local_snapshot_interval=1, local_snapshot_dir=str(shm), min_replicas=2,
                                     inject=[{"step": STEPS, "replica": 1, "rank": 0, "phase": "forward"}])
    stopped = run_training(config, run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    root, back = run / "checkpoints", STEPS - 2 * EVERY
    assert stopped.returncode == 3 and (root / "latest.txt").read_text().strip() == str(STEPS - 1), \
        stopped.output[-3000:]
    assert list(shm.rglob(f"*.s{STEPS - 1:010d}.snap")), "the snapshot of step 7 is kept"
    (root / "latest.txt").write_text(f"{back}\n")
    relaunch = run_training(config, run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = relaunch.output[-5000:]
    assert relaunch.returncode == EXIT_DONE, tail
    assert f"resumed from {root / str(back)} at step {back}" in relaunch.output, tail
    assert "resumed from the local snapshot" not in relaunch.output, tail
    assert _loss_diff(relaunch, finished[1], back) <= 1e-6


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("source", ["moved-away", "own-root-damaged"])
def test_resume_checkpoint_path_does_not_stop_a_run_with_checkpoints_of_its_own(source, finished, tmp_path):
    """The path is checked before launch only where the runtime reads it (a run with no checkpoint of its own):
    its source folder moved away, or nanotron's requeue idiom (the run's own checkpoint root) with a damaged newest
    state file, the relaunch resumes from the run's own step 6 and exits 0 (before: exit 2 before any rank ran)."""
    run = _copy(finished, tmp_path)
    root, config = run / "checkpoints", _config()
    if source == "moved-away":
        config["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "moved-away" / "4")
        shutil.rmtree(root / str(STEPS))  # lost with its writer: the run still has step 6
        (root / "latest.txt").write_text(f"{STEPS - EVERY}\n")
    else:
        config["checkpoints"]["resume_checkpoint_path"] = str(root)
        (root / str(STEPS) / "trainer_state.json").write_text("{garbled")
    relaunch = run_training(config, run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    tail = relaunch.output[-5000:]
    assert relaunch.returncode == EXIT_DONE, tail
    assert "checkpoints of its own" in relaunch.output, tail
    assert f"resumed from {root / str(STEPS - EVERY)} at step {STEPS - EVERY}" in relaunch.output, tail
    assert _loss_diff(relaunch, finished[1], STEPS - EVERY) <= 1e-6


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_one_resumed_from_line_per_launch_and_no_save_progress_bars(finished, tmp_path):
    """Every rank loads, one says so; nanotron's "Saving weights" bar (one per writing rank and save) is not shown."""
    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / str(STEPS))
    (run / "checkpoints" / "latest.txt").write_text(f"{STEPS - EVERY}\n")
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert relaunch.returncode == EXIT_DONE, relaunch.output[-5000:]
    resumed = [line for line in relaunch.output.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, resumed
    assert "resumed from" not in finished[2]  # the first launch started from scratch
    for output in (finished[2], relaunch.output):
        assert "Saving weights" not in output, output[-3000:]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_an_older_checkpoint_without_checksums_still_loads(finished, tmp_path):
    run = _copy(finished, tmp_path)
    root = run / "checkpoints"
    for step in range(EVERY, STEPS + 1, EVERY):
        state = json.loads((root / str(step) / "trainer_state.json").read_text())
        state.pop(FILES_KEY), state.pop(SEAL_KEY)
        (root / str(step) / "trainer_state.json").write_text(json.dumps(state))
    (root / "latest.txt").write_text(f"{STEPS - EVERY}\n")
    shutil.rmtree(root / str(STEPS))
    relaunch = run_training(_config(), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert relaunch.returncode == EXIT_DONE, relaunch.output[-5000:]
    assert relaunch.output.count("no checksums") == 1  # said once
    assert max(abs(a - b) for a, b in zip(relaunch.losses, finished[1])) <= 1e-6


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_the_stock_path_falls_back_too(tmp_path):
    """The stock data path (one torch world) agrees on the verdict over torch instead of MPI."""
    run = tmp_path / "run"
    full = run_training(_config(ft=False), run, timeout_s=TIMEOUT_S, extra_args=ARGS)
    target = KINDS["weights"](run / "checkpoints" / str(STEPS))
    damage(target, "flip")
    relaunch = run_training(_config(ft=False), run, timeout_s=TIMEOUT_S, extra_args=ARGS, check=False)
    assert relaunch.returncode == EXIT_DONE, relaunch.output[-5000:]
    assert str(target) in relaunch.output and f"at step {STEPS - EVERY}" in relaunch.output
    assert max(abs(a - b) for a, b in zip(relaunch.losses, full.losses)) <= 1e-6
