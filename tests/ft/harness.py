"""Launch ``worker.py`` under ``mpirun --with-ft ulfm`` with a hard timeout and collect its per-rank JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_recover.launcher.launch import LAUNCH_RETRIES, launch_failure
from nanotron_recover.launcher.mpirun import mpirun_command
from nanotron_recover.run.run_folder import read_kills

WORKER = Path(__file__).with_name("worker.py")
HARD_TIMEOUT_S = 90.0


@dataclass
class Run:
    output: str
    results: dict[int, dict[str, Any]]
    kills: list[tuple[int, int, float]]  # (replica, local rank, unix time)
    wall_s: float

    def by_status(self, *statuses: str) -> dict[int, dict[str, Any]]:
        return {r: d for r, d in self.results.items() if d["status"] in statuses}

    def kill_to_repaired_ms(self) -> float:
        """From the first injected kill to the last survivor's end of the (first) repair."""
        t_kill = min(t for _, _, t in self.kills)
        ends = [d["events"][0]["wall_time"] for d in self.by_status("done").values() if d["events"]]
        return (max(ends) - t_kill) * 1e3


def run_worker(n_procs: int, cfg: dict[str, Any], tmp: Path, timeout_s: float = HARD_TIMEOUT_S) -> Run:
    """Run the toy trainer; raise if it exceeds ``timeout_s`` (after killing the whole process group). A launch
    that PRRTE itself failed to start, before any rank ran, is made again (as the user's launcher does)."""
    for attempt in range(1 + LAUNCH_RETRIES):
        run, rc = _run_worker_once(n_procs, cfg, tmp, timeout_s)
        failure = None if run.results or run.kills else launch_failure(rc, run.output.encode())
        if failure is None or attempt == LAUNCH_RETRIES:
            return run
        print(f"[test bed] mpirun did not start ({failure!r}); launching again", flush=True)
    raise AssertionError("unreachable")


def _run_worker_once(n_procs: int, cfg: dict[str, Any], tmp: Path, timeout_s: float) -> tuple[Run, int]:
    import time

    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "outdir": str(tmp)}
    cmd = mpirun_command(n_procs, [sys.executable, "-u", str(WORKER), json.dumps(cfg)])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"mpirun exceeded the hard timeout of {timeout_s} s; output:\n{out[-6000:]}")
    wall = time.monotonic() - t0
    results = {}
    for f in tmp.glob("rank*.json"):
        d = json.loads(f.read_text())
        results[int(d["rank"])] = d
    kills = [(k["replica"], k["rank"], k["time"]) for k in read_kills(tmp)]  # the injector's own records
    return Run(out, results, kills, wall), proc.returncode
