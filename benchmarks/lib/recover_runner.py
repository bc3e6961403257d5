"""Run ReCoVer (and the project's stock DDP path) through the project's real launcher, with faults sent from
outside, for ``benchmarks/vs_torchft.py``.

Each launch is ``nanotron-recover train --config-file C --run-dir D`` (the console script a user runs; it starts
``mpirun --with-ft ulfm``). While it runs, :class:`FaultDriver` SIGKILLs (or SIGSTOPs) rank processes by pid (found with
``nanotron_recover.launcher.runs.rank_pids``). When the launcher exits 3 (the restart outcome: no replica left) and
``relaunch`` is set, the same command runs again in the same run dir, as a user's restart loop would; the job
resumes from its node-local snapshot of the last committed step. Steps are read from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.outside_faults import Fault, FaultDriver, pid_alive
from benchmarks.lib.side_by_side import SystemRun
from nanotron_recover.launcher.runs import final_checkpoint, kill_run_processes, rank_pids, write_config
from nanotron_recover.run.run_folder import record_external_fault

EXIT_RESTART = 3  # the launcher's documented exit code for "relaunch me" (README, Slurm)


def launcher_command(config_path: Path, run_dir: Path, max_restarts: int = 0) -> list[str]:
    """The user's command: the ``nanotron-recover`` console script next to this Python; ``max_restarts`` 0: the
    harness relaunches (as a scheduler's requeue would), each launch judged on its own."""
    script = Path(sys.executable).parent / "nanotron-recover"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "nanotron_recover.launcher.launch"]
    return [*head, "train", "--config-file", str(config_path), "--run-dir", str(run_dir), "--max-restarts",
            str(max_restarts)]


class Metrics:
    """Incremental reader of a run dir's ``metrics.jsonl`` (step records; a torn last line waits)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.offset = 0
        self.steps: dict[int, dict[str, Any]] = {}

    def poll(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "event" not in rec and "step" in rec:
                    self.steps[int(rec["step"])] = rec  # a replayed step: the last record wins
        return max(self.steps, default=0)


class _Targets:
    """Live replica -> pid of its rank 0 (TP1: the replica's only rank), rescanned every ``every_s`` in the wait
    loop: a scan of /proc takes tens of ms on a loaded machine, so the kill itself uses the cached pid and lands
    within one poll of its moment."""

    def __init__(self, run_dir: Path, ranks_per_replica: int, every_s: float = 0.25) -> None:
        self.run_dir, self.rpr, self.every_s = run_dir, ranks_per_replica, every_s
        self.cache: dict[int, int] = {}
        self.scanned = 0.0

    def refresh(self) -> None:
        if time.time() - self.scanned >= self.every_s:
            self.cache = {rank // self.rpr: pid for rank, pid in rank_pids(self.run_dir).items()
                          if rank % self.rpr == 0}
            self.scanned = time.time()

    def live(self) -> dict[int, int]:
        if not self.cache:
            self.scanned = 0.0
            self.refresh()
        return {r: pid for r, pid in self.cache.items() if pid_alive(pid)}


def _one_launch(cmd: list[str], run_dir: Path, metrics: Metrics, driver: FaultDriver, deadline: float,
                rpr: int) -> int:
    targets = _Targets(run_dir, rpr)
    with open(run_dir / "launcher.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            if time.time() > deadline:
                kill_run_processes(run_dir, proc)
                raise TimeoutError(f"ReCoVer run in {run_dir} ran past its deadline")
            if len(driver.sent) < len(driver.faults):
                targets.refresh()
            driver.poll(metrics.poll, targets.live)
            time.sleep(0.02)
    except BaseException:
        if proc.poll() is None:
            kill_run_processes(run_dir, proc)
        raise
    return proc.returncode


def run_recover(name: str, config: dict[str, Any], run_dir: Path, faults: list[Fault], timeout_s: float,
                relaunch: bool = False, max_launches: int = 20, in_place: bool = False) -> SystemRun:
    """One ReCoVer (or stock) run of ``config``; relaunched on exit 3 when ``relaunch`` (up to ``max_launches``);
    ``in_place``: the launcher relaunches by itself (its warm standby, regrow), the harness only if it gives up."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = launcher_command(write_config(config, run_dir / "config.yaml"), run_dir, 1000 if in_place else 0)
    ft = config.get("fault_tolerance") or {}
    dp, rpr = config["parallelism"]["dp"], config["parallelism"]["tp"] * config["parallelism"]["pp"]
    spares = ft.get("spare_replicas", 0) if ft.get("enabled") else 0
    metrics, t0 = Metrics(run_dir), time.time()
    # each fault leaves its marker first: whoever reads the run knows its hang events were provoked from outside
    driver = FaultDriver(faults, before_signal=lambda n, fault: record_external_fault(run_dir, f"{fault.kind}-{n}"))
    launches, rc = 0, EXIT_RESTART
    try:
        while rc == EXIT_RESTART and launches < (max_launches if relaunch else 1):
            launches += 1
            rc = _one_launch(cmd, run_dir, metrics, driver, t0 + timeout_s, rpr)
    finally:
        driver.release()
    metrics.poll()
    steps = config["tokens"]["train_steps"]
    if metrics.steps and max(metrics.steps) >= steps and rc in (0, EXIT_RESTART):
        rc = 0
    if rc != 0:
        tail = (run_dir / "launcher.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{name}: launcher exited {rc} after {launches} launches:\n{tail}")
    recs = {s: {"loss": r["loss"], "microbatches": r["microbatches"], "participants": r.get("live_replicas", dp),
                "time": r["time"], "t_start": r["time"] - r["step_time_s"], "step_time_s": r["step_time_s"]}
            for s, r in metrics.steps.items()}
    try:
        final: Path | None = final_checkpoint(run_dir)
    except FileNotFoundError:
        final = None
    return SystemRun(name=name, t0=t0, end_t=time.time(), replicas=dp, processes=(dp + spares) * rpr, steps=recs,
                     kills=list(driver.sent), launches=launches, final_weights=final, extra={"clock_t0": driver.t0})
