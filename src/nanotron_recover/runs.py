"""Launch a training run through the real launcher and read its results back (tests, benchmarks).

A run is judged by what it wrote, not by mpirun's exit code: under ``--with-ft ulfm`` mpirun returns 0 even
when ranks were SIGKILLed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    output: str
    wall_s: float
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Per-step records (deduplicated by step, last wins) and events from ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    steps: dict[int, dict] = {}
    events: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if "event" in record:
                events.append(record)
            elif "step" in record:
                steps[int(record["step"])] = record
    return [steps[k] for k in sorted(steps)], events


def write_config(config: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_training(
    config: dict | Path,
    run_dir: Path,
    *,
    timeout_s: float = 600,
    extra_args: Sequence[str] = (),
    check: bool = True,
) -> RunResult:
    """``nanotron-recover train`` on ``config`` (a dict is written to ``run_dir/config.yaml``), killed at timeout."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_config(config, run_dir / "config.yaml") if isinstance(config, dict) else Path(config)
    cmd = [sys.executable, "-m", "nanotron_recover.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), *extra_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        raise TimeoutError(f"run did not finish in {timeout_s} s:\n{output[-6000:]}") from None
    wall = time.perf_counter() - t0
    (run_dir / "output.log").write_text(output)
    steps, events = read_metrics(run_dir)
    result = RunResult(run_dir, proc.returncode, output, wall, steps, events)
    if check and proc.returncode not in (0,):
        raise RuntimeError(f"run failed with exit code {proc.returncode}:\n{output[-6000:]}")
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
