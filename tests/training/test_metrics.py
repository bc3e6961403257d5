"""Metrics: JSONL per line, wandb offline runs and logging-rank handover, the JSONL -> wandb replay after a lost
logging rank (in-process, against a fake wandb), no crash on wandb errors."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nanotron_recover.run.run_folder import read_logged_step, read_metrics_jsonl
from nanotron_recover.training.metrics import MetricsLogger, find_wandb_run_files, wandb_replay


def test_jsonl_lines_are_flushed_and_only_on_the_logging_rank(tmp_path: Path) -> None:
    quiet = MetricsLogger(tmp_path / "run", enabled=False, wandb_config=None)
    quiet.log_step({"step": 0, "loss": 1.0})
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    log = MetricsLogger(tmp_path / "run", enabled=True, wandb_config=None)
    log.log_step({"step": 0, "loss": 2.5, "tokens_per_s": 10})
    log.log_event({"event": "repair", "step": 0, "world_epoch": 1, "failed_replicas": (1,), "t_shrink_s": 0.02})
    rows = read_metrics_jsonl(tmp_path / "run")  # read while still open: every line is flushed
    assert [r.get("event") for r in rows] == [None, "repair"]
    assert rows[0]["loss"] == 2.5 and rows[1]["failed_replicas"] == [1] and "time" in rows[0]
    log.close()
    log.log_step({"step": 1, "loss": 1.0})  # closed loggers drop records
    assert len(read_metrics_jsonl(tmp_path / "run")) == 2


def test_tensor_and_numpy_values_serialize(tmp_path: Path) -> None:
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, True, None) as log:
        log.log_step({"step": 3, "loss": torch.tensor(1.5), "lr": np.float32(0.25), "hist": np.arange(2)})
    (row,) = read_metrics_jsonl(tmp_path)
    assert (row["loss"], row["lr"], row["hist"]) == (1.5, 0.25, [0, 1])


def test_wandb_import_is_lazy(tmp_path: Path) -> None:
    code = (
        "import sys; from nanotron_recover.training.metrics import MetricsLogger;"
        f"m = MetricsLogger({str(tmp_path)!r}, True, None); m.log_step({{'step': 0, 'loss': 1.0}}); m.close();"
        "assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_wandb_offline_runs_share_one_id_across_a_handover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)  # default must be offline: no network, no login
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    losses = [5.0, 4.25, 3.5, 3.0, 2.75]
    first = MetricsLogger(run, enabled=True, wandb_config={"project": "test", "config": {"lr": 1e-3}})
    for step in range(3):
        first.log_step({"step": step, "loss": losses[step]})
    first.log_event({"event": "repair", "step": 2, "world_epoch": 1, "recovery_s": 0.4})
    assert first.wandb_active
    first.close()
    assert read_logged_step(run) == 2  # wandb finished: rows up to step 2 are on disk

    # the logging rank moves to another process: it starts logging into the same run folder and run id
    second = MetricsLogger(run, enabled=False, wandb_config={"project": "test"})
    second.log_step({"step": 99, "loss": 0.0})  # not the logging rank yet: dropped
    second.set_logging(True)
    for step in range(3, 5):
        second.log_step({"step": step, "loss": losses[step]})
    second.close()

    files = find_wandb_run_files(run / "wandb")
    assert len(files) == 2 and all(f.parent.name.startswith("offline-run-") for f in files)
    assert len({f.name for f in files}) == 1  # one run id shared by both halves
    assert read_logged_step(run) == 4
    assert [r["loss"] for r in read_metrics_jsonl(run) if "loss" in r] == losses


class _FakeRun:
    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs, self.rows, self.finished = kwargs, [], False

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


class _FakeWandb:
    """A recording stand-in for ``wandb.init``, handed to :class:`MetricsLogger` (its ``wandb_init`` seam)."""

    def __init__(self) -> None:
        self.runs: list[_FakeRun] = []

    def init(self, **kwargs: Any) -> _FakeRun:
        self.runs.append(_FakeRun(kwargs))
        return self.runs[-1]

    def logger(self, run_dir: Path, enabled: bool = True) -> MetricsLogger:
        return MetricsLogger(run_dir, enabled, {"project": "test"}, wandb_init=self.init)


@pytest.fixture
def fake_wandb() -> _FakeWandb:
    return _FakeWandb()


def _die(logger: MetricsLogger) -> None:
    """What a SIGKILL leaves: the JSONL lines written so far, no wandb finish, no sidecar update."""
    assert logger._file is not None
    logger._file.close()


def test_replay_plan_takes_the_records_after_the_sidecar_and_before_the_next_step() -> None:
    records = [
        {"step": 1, "loss": 4.0, "time": 1.0},
        {"step": 2, "loss": 3.0, "time": 2.0},
        {"event": "repair", "step": 2, "world_epoch": 1, "failed_replicas": [1]},
        {"step": 3, "loss": 2.0, "tokens": 64},
        {"step": 2, "loss": 3.0},  # an older copy of a replayed step: wandb steps only increase
        {"event": "stopped", "reason": "no step"},
        {"step": 4, "loss": 1.0},
    ]
    assert wandb_replay(records, logged_step=1, before_step=4) == [
        (2, {"loss": 3.0}), (2, {"repair/world_epoch": 1}), (3, {"loss": 2.0, "tokens": 64})]
    assert [s for s, _ in wandb_replay(records, logged_step=None)] == [1, 2, 2, 3, 4]
    assert wandb_replay(records, logged_step=4) == [] and wandb_replay(records, None, before_step=1) == []


def test_a_logging_rank_lost_without_finishing_wandb_is_replayed_in_full(tmp_path: Path,
                                                                          fake_wandb: _FakeWandb) -> None:
    first = fake_wandb.logger(tmp_path)
    for step in range(4):
        first.log_step({"step": step, "loss": 10.0 - step})
    _die(first)  # its wandb rows may never have reached the disk
    heir = fake_wandb.logger(tmp_path, enabled=False)
    heir.set_logging(True)
    heir.log_step({"step": 3, "loss": 7.0})  # the heir re-logs the last committed step first (resilient.py)
    heir.log_step({"step": 4, "loss": 6.0})
    heir.close()
    dead, new = fake_wandb.runs
    assert new.kwargs["id"] == dead.kwargs["id"] and new.kwargs["resume"] == "allow"
    assert [(step, row["loss"]) for step, row in new.rows] == [(s, 10.0 - s) for s in range(5)]
    assert new.finished and read_logged_step(tmp_path) == 4


def test_after_a_clean_finish_only_the_later_records_are_replayed(tmp_path: Path, fake_wandb: _FakeWandb) -> None:
    with fake_wandb.logger(tmp_path) as first:  # finishes wandb: sidecar = 1
        first.log_step({"step": 0, "loss": 5.0})
        first.log_step({"step": 1, "loss": 4.0})
    assert read_logged_step(tmp_path) == 1
    second = fake_wandb.logger(tmp_path)
    second.log_step({"step": 2, "loss": 3.0})
    second.log_event({"event": "repair", "step": 2, "world_epoch": 1})
    second.log_step({"step": 3, "loss": 2.0})
    _die(second)
    with fake_wandb.logger(tmp_path) as third:
        third.log_step({"step": 4, "loss": 1.0})
    assert [(step, sorted(row)) for step, row in fake_wandb.runs[1].rows] == [
        (2, ["loss"]), (2, ["repair/world_epoch"]), (3, ["loss"])]
    assert [(step, sorted(row)) for step, row in fake_wandb.runs[2].rows] == [
        (2, ["loss"]), (2, ["repair/world_epoch"]), (3, ["loss"]), (4, ["loss"])]
    assert read_logged_step(tmp_path) == 4


def test_a_relaunch_logs_the_steps_it_computes_again_instead_of_replaying_them(tmp_path: Path,
                                                                               fake_wandb: _FakeWandb) -> None:
    """A job killed after step 5 and resumed from the snapshot of step 3. The relaunch starts wandb during set-up
    (the trainer does) and logs its resume event at step 4, then steps 4-7. The replay must stop before step 4: had
    it run at start-up it would reach step 5, and wandb, whose steps only increase, would drop the event and step 4
    with a warning each."""
    first = fake_wandb.logger(tmp_path)
    for step in range(1, 6):
        first.log_step({"step": step, "loss": 10.0 - step})
    _die(first)
    with fake_wandb.logger(tmp_path) as relaunch:
        assert relaunch.start_wandb() and fake_wandb.runs[1].rows == []  # started, nothing replayed yet
        relaunch.log_event({"event": "local_snapshot", "step": 4, "bytes": 100})
        for step in range(4, 8):
            relaunch.log_step({"step": step, "loss": 10.0 - step})
    rows = fake_wandb.runs[1].rows
    assert [step for step, _ in rows] == [1, 2, 3, 4, 4, 5, 6, 7]  # the replay to 3, then every new row
    assert rows[3] == (4, {"local_snapshot/bytes": 100})
    assert [r["step"] for r in read_metrics_jsonl(tmp_path)] == [1, 2, 3, 4, 5, 4, 4, 5, 6, 7]  # the JSONL keeps all
    assert read_logged_step(tmp_path) == 7


def test_a_step_below_the_last_one_sent_is_not_sent(tmp_path: Path, fake_wandb: _FakeWandb) -> None:
    log = fake_wandb.logger(tmp_path)
    log.log_step({"step": 5, "loss": 1.0})
    log.log_step({"step": 4, "loss": 2.0})  # wandb would drop it, with a warning
    log.log_step({"step": 5, "loss": 1.0})  # the same step again is a row wandb takes
    log.close()
    assert [step for step, _ in fake_wandb.runs[0].rows] == [5, 5]


def test_wandb_failure_does_not_stop_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    import wandb

    def broken_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", broken_init)
    log = MetricsLogger(tmp_path, True, {"project": "x"})
    with caplog.at_level(logging.WARNING, logger="nanotron_recover.training.metrics"):
        for step in range(3):
            log.log_step({"step": step, "loss": 1.0 / (step + 1)})
    log.close()
    assert "wandb disabled" in caplog.text and caplog.text.count("wandb disabled") == 1
    assert [r["step"] for r in read_metrics_jsonl(tmp_path)] == [0, 1, 2]


def test_wandb_can_be_switched_off_in_config(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, True, {"enabled": False, "project": "x"})
    log.log_step({"step": 0, "loss": 1.0})
    assert not log.wandb_active and not (tmp_path / "wandb").exists()
    log.close()


def test_a_new_logging_rank_starts_wandb_inside_its_slow_io_guard(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting wandb takes seconds (a service process, then the replay); a rank that becomes the logging rank
    mid-run does it inside a step, so the trainer tells the hang monitor through ``slow_io``. Real wandb, offline."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen: list[str] = []

    @contextmanager
    def guard():
        seen.append("enter")
        yield
        seen.append(f"exit active={heir.wandb_active}")

    heir = MetricsLogger(tmp_path / "run", enabled=False, wandb_config={"project": "test"})
    heir.slow_io = guard
    heir.log_step({"step": 1, "loss": 1.0})  # not the logging rank: no wandb, no guard
    assert seen == []
    heir.set_logging(True)
    heir.log_step({"step": 2, "loss": 0.5})
    heir.log_step({"step": 3, "loss": 0.25})
    heir.close()
    assert seen == ["enter", "exit active=True"]  # once: around the start only


def test_wandb_started_in_the_background_gets_every_row_the_steps_logged_meanwhile(tmp_path: Path) -> None:
    """A relaunch's logging rank starts wandb in a thread (its start is off the path to the first step). Steps
    logged while it starts are in the JSONL only; the first record after it started replays them, in order."""
    started = threading.Event()

    class SlowWandb(_FakeWandb):
        def init(self, **kwargs: Any) -> _FakeRun:
            started.wait(10)  # wandb's start takes its time
            return super().init(**kwargs)

    wandb = SlowWandb()
    log = wandb.logger(tmp_path)
    t0 = time.monotonic()
    assert log.start_wandb(background=True)
    log.log_step({"step": 1, "loss": 3.0})
    log.log_step({"step": 2, "loss": 2.0})
    assert time.monotonic() - t0 < 1.0 and wandb.runs == []  # nothing waited for wandb
    started.set()
    log._starting.join(10)
    log.log_step({"step": 3, "loss": 1.0})
    log.close()
    assert [(step, row["loss"]) for step, row in wandb.runs[0].rows] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert read_logged_step(tmp_path) == 3


def test_wandb_started_in_the_background_and_closed_before_any_later_record_replays_on_close(tmp_path: Path) -> None:
    wandb = _FakeWandb()
    log = wandb.logger(tmp_path)
    log.start_wandb(background=True)
    log.log_step({"step": 1, "loss": 3.0})  # perhaps before wandb started
    log.close()
    assert [step for step, _ in wandb.runs[0].rows] == [1] and wandb.runs[0].finished
