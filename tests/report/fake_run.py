"""A run folder written by the real writers (``MetricsLogger``, ``run_folder``) on a synthetic clock, so that the
report's numbers can be checked against records whose times are known exactly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from nanotron_recover.run import run_folder
from nanotron_recover.training.metrics import MetricsLogger


class FakeRun:
    """Steps, events, faults and relaunches of one run dir; ``t`` is the synthetic wall clock (seconds)."""

    def __init__(self, run_dir: Path, t0: float = 1_000_000.0, m: int = 4, live: int = 2) -> None:
        self.run_dir = Path(run_dir)
        self.t = t0
        self.m = m
        self.live = live
        self.logger = MetricsLogger(self.run_dir, enabled=True, wandb_config=None)

    def step(self, step: int, loss: float, step_time: float = 0.1, gap: float = 0.01, first: bool = False,
             **extra: Any) -> dict[str, Any]:
        """One committed step: ``gap`` s after the last record it starts, ``step_time`` s later it commits."""
        self.t += gap + step_time
        record = {"step": step, "time": self.t, "loss": loss, "microbatches": self.m, "tokens": self.m * 64,
                  "step_time_s": step_time, "live_replicas": self.live, "epoch": 0, "recoveries": 0, **extra}
        self.logger.log_step(record)
        if first:  # what the trainer logs right after a launch's first step
            self.logger.log_event({"event": "training_state", "step": step, "time": self.t + 1e-4})
        return record

    def event(self, kind: str, after: float = 0.0, **fields: Any) -> dict[str, Any]:
        self.t += after
        record = {"event": kind, "time": self.t, **fields}
        self.logger.log_event(record)
        return record

    def repair(self, step: int, failed_replicas: list[int], detect_ms: float, total_ms: float, after: float = 0.0,
               **fields: Any) -> dict[str, Any]:
        self.t += after
        return self.event("repair", step=step, phase=fields.pop("phase", "in-step"), failed_ranks=failed_replicas,
                          failed_replicas=failed_replicas, detect_ms=detect_ms, revoke_ms=total_ms / 2,
                          shrink_ms=total_ms / 4, agree_ms=0.0, rebuild_ms=total_ms / 4, total_ms=total_ms,
                          wall_time=self.t,
                          extra={"cause": {"op": "allreduce(coord)", "detail": "MPI_ERR_PROC_FAILED"}},
                          detect_to_repaired_ms=detect_ms + total_ms, **fields)

    def hang(self, after: float, **fields: Any) -> dict[str, Any]:
        """A ``hang_detected`` line as a non-logging rank appends it (``wall_time``, no ``time``)."""
        self.t += after
        record = {"event": "hang_detected", "by_rank": 0, "wall_time": self.t, **fields}
        run_folder.append_metrics_record(self.run_dir, record)
        return record

    def fault(self, name: str, after: float = 0.0, **fault: Any) -> float:
        """The injector's record of a fired fault, stamped with the synthetic clock."""
        self.t += after
        with mock.patch.object(time, "time", return_value=self.t):
            run_folder.record_fired_fault(self.run_dir, name, {"at": None, "signal": "kill", **fault})
        return self.t

    def relaunch(self, gap: float) -> None:
        """The job ended; ``gap`` s later the next launch logs (a new logging process appends)."""
        self.logger.close()
        self.t += gap
        self.logger = MetricsLogger(self.run_dir, enabled=True, wandb_config=None)

    def exits(self, ranks: int, code: int = 0, reason: str = "finished") -> None:
        for rank in range(ranks):
            run_folder.record_exit(self.run_dir, rank, code, reason)

    def config(self, dp: int, accumulation: int, train_steps: int, micro_batch_size: int = 2) -> None:
        text = {"parallelism": {"dp": dp}, "tokens": {"batch_accumulation_per_replica": accumulation,
                                                      "train_steps": train_steps, "micro_batch_size": micro_batch_size}}
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(text))

    def close(self) -> None:
        self.logger.close()
