"""Benchmark timelines: launching one job and reading back what it wrote, and the accounting every comparison
uses (wall time, process-seconds, committed tokens, the progress curve).

Everything here is measured from what a run wrote: ``metrics.jsonl`` (every record carries ``time``, the wall
clock when it was written), the failure injector's markers (``<run_dir>/injected/``, each holding the time a rank
wrote it just before its SIGKILL), and the driver's own launch / exit timestamps. Nothing is modelled or assumed.

Definitions (also in docs/benchmarks.md):

* process-seconds: the integral over the run of the number of live processes (our stand-in for GPU-hours).
  A process counts from its job's launch until it dies (the injected SIGKILL), its replica is evicted (ReCoVer:
  the repair's end), or its job ends. With ``fault_tolerance.recycle`` nobody is evicted: a survivor waiting in the
  pool still holds its hardware and counts as live. Gaps between a dead job and its relaunch count with the processes
  the relaunch will hold (the allocation is held while waiting).
* committed tokens: tokens of the steps in the final trajectory (a step recomputed after a restart counts once).
* effective throughput: committed tokens / process-seconds (= tokens / second / live process).
* progress curve: (process-seconds so far, committed tokens of the newest step whose state still exists). A
  checkpoint-restart job drops back to its checkpoint at each relaunch.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from benchmarks.lib.config import n_processes
from nanotron_recover.launcher.runs import run_training
from nanotron_recover.run.run_folder import read_kills, resumed_from


@dataclass
class Kill:
    t: float
    step: int
    replica: int
    rank: int
    phase: str


@dataclass
class Attempt:
    """One ``mpirun`` job: launched at ``launch_t`` with ``n_procs`` processes, exited at ``end_t``."""

    run_dir: str
    n_procs: int
    launch_t: float
    end_t: float
    returncode: int
    steps: list[dict]
    events: list[dict]
    kills: list[Kill]
    resumed_from: int
    dp: int = 0
    accumulation: int = 0
    load_avg_1min: float = 0.0  # machine load when the job was launched (other users' jobs show up here)

    @property
    def first_step_start(self) -> float | None:
        if not self.steps:
            return None
        s = self.steps[0]
        return s["time"] - s["step_time_s"]


def launch(config: dict, run_dir: Path, *, timeout_s: float = 900) -> Attempt:
    """One job through the real launcher (``nanotron_recover.launcher.runs.run_training`` -> ``nanotron-recover
    train``), on synthetic data; returns its timeline. ``TimeoutError`` (job group killed) after ``timeout_s``."""
    run_dir = Path(run_dir).resolve()
    load0 = os.getloadavg()[0]
    t0 = time.time()
    result = run_training(config, run_dir, timeout_s=timeout_s, extra_args=["--synthetic-data"], check=False)
    t1 = time.time()
    kills = [Kill(k["time"], k["step"], k["replica"], k["rank"], k["phase"]) for k in read_kills(run_dir)
             if k["signal"] == "kill" and k["time"] is not None and k["time"] >= t0]
    steps = [s for s in result.steps if s.get("time", 0) >= t0]  # every attempt has its own dir; be safe anyway
    return Attempt(str(run_dir), n_processes(config), t0, t1, result.returncode, steps,
                   [e for e in result.events if e.get("time", 0) >= t0], sorted(kills, key=lambda k: k.t),
                   resumed_from(steps), config["parallelism"]["dp"],
                   config["tokens"]["batch_accumulation_per_replica"], load0)


# ------------------------------------------------------------------------------------------------ accounting
@dataclass
class RunSummary:
    name: str
    attempts: list[Attempt]
    target_steps: int
    segments: list[tuple[float, float, int]] = field(default_factory=list)  # (t0, t1, live processes)
    trajectory: dict[int, dict] = field(default_factory=dict)  # step -> record of the final trajectory
    progress: list[tuple[float, float]] = field(default_factory=list)  # (process-seconds, committed tokens)
    extra: dict[str, Any] = field(default_factory=dict)

    # -- derived numbers
    @property
    def t0(self) -> float:
        return self.attempts[0].launch_t

    @property
    def wall_s(self) -> float:
        return self.attempts[-1].end_t - self.t0

    @property
    def process_seconds(self) -> float:
        return sum((b - a) * n for a, b, n in self.segments)

    @property
    def committed_tokens(self) -> int:
        return int(sum(r["tokens"] for r in self.trajectory.values()))

    @property
    def final_step(self) -> int:
        return max(self.trajectory) if self.trajectory else 0

    @property
    def effective_throughput(self) -> float:
        return self.committed_tokens / self.process_seconds if self.process_seconds else 0.0

    @property
    def final_loss(self) -> float | None:
        return self.trajectory[self.final_step]["loss"] if self.trajectory else None

    @property
    def process_seconds_after_first_startup(self) -> float:
        """Process-seconds from the first step's start of the first job (every run pays one initial startup; on
        a loaded shared machine it is the noisiest part, so this is reported next to the full count)."""
        t = self.attempts[0].first_step_start or self.t0
        return self.process_seconds - self.process_seconds_at(t)

    def process_seconds_at(self, t: float) -> float:
        return sum(max(0.0, min(b, t) - a) * n for a, b, n in self.segments if a < t)

    def tokens_at_process_seconds(self, budget: float) -> float:
        """Committed tokens (progress curve, a step function) once ``budget`` process-seconds were spent."""
        value = 0.0
        for ps, tok in self.progress:
            if ps > budget + 1e-9:
                break
            value = tok
        return value

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "target_steps": self.target_steps,
            "final_step": self.final_step,
            "wall_s": self.wall_s,
            "process_seconds": self.process_seconds,
            "committed_tokens": self.committed_tokens,
            "effective_throughput_tokens_per_process_s": self.effective_throughput,
            "process_seconds_after_first_startup": self.process_seconds_after_first_startup,
            "effective_throughput_after_first_startup": (
                self.committed_tokens / self.process_seconds_after_first_startup
                if self.process_seconds_after_first_startup else 0.0),
            "final_loss": self.final_loss,
            "launches": len(self.attempts),
            "losses": {str(k): v["loss"] for k, v in sorted(self.trajectory.items())},
            "microbatches": {str(k): v["microbatches"] for k, v in sorted(self.trajectory.items())},
            "progress": self.progress,
            "segments": self.segments,
            **self.extra,
            "attempts": [
                {**{k: v for k, v in asdict(a).items() if k not in ("steps", "events")},
                 "n_steps_logged": len(a.steps), "first_step": a.steps[0]["step"] if a.steps else None,
                 "last_step": a.steps[-1]["step"] if a.steps else None}
                for a in self.attempts
            ],
        }


def summarize(name: str, attempts: list[Attempt], target_steps: int, rpr: int,
              gap_procs: Sequence[int] | None = None) -> RunSummary:
    """Segments of live processes, the final trajectory and the progress curve of a run of 1+ attempts.

    ``gap_procs[i]``: processes held during the gap before attempt i+1 (default: attempt i+1's size).
    """
    summary = RunSummary(name, attempts, target_steps)
    segs: list[tuple[float, float, int]] = []
    for i, a in enumerate(attempts):
        # process deaths inside this job: injected kills; ReCoVer also evicts the rest of a failed replica
        drops: list[tuple[float, int]] = [(k.t, 1) for k in a.kills]
        for e in a.events:
            if e.get("event") == "repair":
                evicted = e.get("evicted_ranks") or []
                if evicted:
                    drops.append((float(e.get("wall_time") or e["time"]), len(evicted)))
        drops.sort()
        t, n = a.launch_t, a.n_procs
        for td, k in drops:
            td = min(max(td, t), a.end_t)
            segs.append((t, td, n))
            t, n = td, max(0, n - k)
        segs.append((t, a.end_t, n))
        if i + 1 < len(attempts):
            nxt = attempts[i + 1]
            held = gap_procs[i] if gap_procs is not None else nxt.n_procs
            segs.append((a.end_t, nxt.launch_t, held))
    summary.segments = [(a, b, n) for a, b, n in segs if b > a]

    # final trajectory (last execution of each step wins) and the progress curve
    cum: dict[int, float] = {0: 0.0}
    progress: list[tuple[float, float]] = [(0.0, 0.0)]
    traj: dict[int, dict] = {}
    for a in attempts:
        progress.append((summary.process_seconds_at(a.launch_t), cum.get(a.resumed_from, 0.0)))
        for s in a.steps:
            traj[s["step"]] = s
            cum[s["step"]] = cum.get(s["step"] - 1, 0.0) + s["tokens"]
            progress.append((summary.process_seconds_at(s["time"]), cum[s["step"]]))
        # a job that died: its steps after its last checkpoint are lost (the next attempt drops back)
    summary.trajectory = dict(sorted(traj.items()))
    summary.progress = progress
    return summary


def normal_step_times(steps: list[dict], *, skip_first: int = 2, checkpoint_interval: int | None = None,
                      exclude: Iterable[int] = ()) -> list[float]:
    """Step times of undisturbed steps: not the first ``skip_first`` of a job, not right after a checkpoint
    (the save lands between two records and is not in ``step_time_s``, but a cache-cold next step may be), not
    a failure step."""
    excl = set(exclude)
    out = []
    for i, s in enumerate(steps):
        if i < skip_first or s["step"] in excl or s.get("recoveries"):
            continue
        if checkpoint_interval and (s["step"] - 1) % checkpoint_interval == 0 and s["step"] > 1:
            continue
        out.append(s["step_time_s"])
    return out


def checkpoint_save_times(a: Attempt, interval: int) -> list[float]:
    """Seconds between a checkpoint step's record and the start of the next step (the save sits there)."""
    by_step = {s["step"]: s for s in a.steps}
    out = []
    for k, s in by_step.items():
        if k % interval == 0 and (k + 1) in by_step:
            nxt = by_step[k + 1]
            out.append((nxt["time"] - nxt["step_time_s"]) - s["time"])
    return out
