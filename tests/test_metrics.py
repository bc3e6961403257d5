"""Metrics: JSONL per line, wandb offline run holding the loss history, logging-rank handover, no crash on wandb errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_recover.metrics import MetricsLogger, find_wandb_run_files, read_metrics_jsonl, read_wandb_history


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
        "import sys; from nanotron_recover.metrics import MetricsLogger;"
        f"m = MetricsLogger({str(tmp_path)!r}, True, None); m.log_step({{'step': 0, 'loss': 1.0}}); m.close();"
        "assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_wandb_offline_run_holds_loss_history_and_survives_handover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
    history = [row for f in files for row in read_wandb_history(f)]
    assert [(row["_step"], row["loss"]) for row in history] == list(enumerate(losses))
    assert history[2]["repair/world_epoch"] == 1 and history[2]["repair/recovery_s"] == 0.4
    jsonl = read_metrics_jsonl(run)
    assert [r["loss"] for r in jsonl if "loss" in r] == losses


def test_wandb_failure_does_not_stop_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import wandb

    def broken_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", broken_init)
    log = MetricsLogger(tmp_path, True, {"project": "x"})
    with caplog.at_level(logging.WARNING, logger="nanotron_recover.metrics"):
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


_KILLED_LOGGER = """
import os, signal, sys
from nanotron_recover.metrics import MetricsLogger
log = MetricsLogger(sys.argv[1], True, {"project": "test"})
for step in range(4):
    log.log_step({"step": step, "loss": 10.0 - step})
os.kill(os.getpid(), signal.SIGKILL)  # the logging rank dies without closing anything
"""


def test_takeover_after_sigkill_replays_lost_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = tmp_path / "run"
    # a separate rank, not a child sharing this process's wandb-core service (WANDB_SERVICE)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_LOGGER, str(run)], timeout=60, capture_output=True, env=env)
    assert proc.returncode == -9
    assert [r["step"] for r in read_metrics_jsonl(run)] == [0, 1, 2, 3]
    heir = MetricsLogger(run, enabled=False, wandb_config={"project": "test"})
    heir.set_logging(True)
    heir.log_step({"step": 4, "loss": 6.0})
    heir.log_step({"step": 5, "loss": 5.0})
    heir.close()
    rows = [row for f in find_wandb_run_files(run / "wandb") for row in read_wandb_history(f)]
    assert sorted((row["_step"], row["loss"]) for row in rows) == [(s, 10.0 - s) for s in range(6)]
