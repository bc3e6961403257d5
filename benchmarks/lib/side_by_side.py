"""What ``benchmarks/vs_torchft.py`` measures, the same way for every system: one run's committed steps, the
faults sent to it, and the numbers derived from them.

Every number is computed from what the runs wrote (per-step records with wall-clock times) and from the times the
benchmark itself sent its SIGKILLs; nothing is modelled. A *committed step* is a step whose optimizer update was
applied; its *samples* are the microbatches whose gradients it used (ReCoVer: always M; torchft: the shares of
the replicas that took part; a step torchft could not commit is not a step).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.lib.outside_faults import SentKill


@dataclass
class SystemRun:
    """One system's run (possibly several launches): committed steps by number, the kills it received."""

    name: str
    t0: float
    end_t: float
    replicas: int
    processes: int
    # loss, microbatches, participants, time, step_time_s
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    kills: list[SentKill] = field(default_factory=list)
    launches: int = 1
    final_weights: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)

    def time_to(self, step: int) -> float | None:
        """Seconds from the first launch until ``step`` was committed."""
        rec = self.steps.get(step)
        return rec["time"] - self.t0 if rec else None

    def samples(self, micro_batch: int) -> int:
        """Sequences whose gradients the committed trajectory used."""
        return int(sum(r["microbatches"] for r in self.steps.values()) * micro_batch)


def median_step_s(run: SystemRun, skip: int = 5) -> float:
    """Median step time over the steps after the first ``skip`` (warm-up)."""
    times = [r["step_time_s"] for s, r in sorted(run.steps.items()) if s > skip]
    return statistics.median(times) if times else float("nan")


def max_dloss(run: SystemRun, ref: SystemRun, only: Callable[[int], bool] = lambda s: True) -> float:
    """Largest |loss difference| over the steps both committed (and ``only`` admits); a step whose loss is
    known for only some of its microbatches (a participant killed before it could log) is left out."""
    common = [s for s in run.steps if s in ref.steps and only(s) and not run.steps[s].get("loss_partial")]
    if not common:
        return float("nan")
    return max(abs(run.steps[s]["loss"] - ref.steps[s]["loss"]) for s in common)


def full_steps(run: SystemRun, M: int) -> Callable[[int], bool]:
    """Steps that used all M microbatches: their loss is over the same samples as the reference's."""
    return lambda s: run.steps[s]["microbatches"] == M


def _longest_gap(run: SystemRun, since: float, until: float) -> float | None:
    """Longest time between consecutive commits from the last commit before ``since`` to ``until``."""
    times = sorted(r["time"] for r in run.steps.values())
    before = [t for t in times if t <= since]
    window = ([before[-1]] if before else []) + [t for t in times if since < t <= until]
    gaps = [b - a for a, b in zip(window, window[1:])]
    return max(gaps) if gaps else None


def fault_numbers(run: SystemRun, ref: SystemRun, M: int, window: tuple[int, int] = (2, 4)) -> dict[str, Any]:
    """The one-fault numbers of ``run`` (one kill sent) against its own failure-free ``ref``. "All replicas
    again": the first commit of a step that *started* after the kill with every replica computing."""
    if not run.kills or run.kills[0].pid is None:
        raise RuntimeError(f"{run.name}: the kill was not sent (no live target)")
    kill = run.kills[0]
    after = sorted((r["time"], s) for s, r in run.steps.items() if r["time"] > kill.time)
    full = sorted(r["time"] for r in run.steps.values()
                  if r["t_start"] > kill.time and r["participants"] >= run.replicas)
    k = kill.committed + 1
    around = {s: run.steps[s]["microbatches"] if s in run.steps else 0
              for s in range(max(1, k - window[0]), min(run.last_step, k + window[1]) + 1)}
    first_after = after[0][1] if after else None
    return {
        "kill_after_step": kill.committed,
        "first_step_after_fault": first_after,
        "committed_steps_lost": max(0, kill.committed - first_after + 1) if first_after else None,
        "fault_to_next_commit_s": after[0][0] - kill.time if after else None,
        "longest_commit_gap_s": _longest_gap(run, kill.time, full[0] if full else run.end_t),
        "full_replicas_again_s": (full[0] - kill.time) if full else None,
        "microbatches_around_fault": around,
        "microbatches_dropped": sum(M - r["microbatches"] for r in run.steps.values()),
        "steps_not_full": sorted(s for s, r in run.steps.items() if r["microbatches"] != M),
        "max_dloss": max_dloss(run, ref),
        "max_dloss_full_steps": max_dloss(run, ref, full_steps(run, M)),
    }


def clockwork_numbers(run: SystemRun, n_steps: int, micro_batch: int, M: int) -> dict[str, Any]:
    """Time to ``n_steps`` (from the first launch, and from the first committed step, where the kill clock
    starts) and the useful samples of a Clockwork run."""
    clock = run.extra.get("clock_t0")
    done = run.steps.get(n_steps)
    useful = int(sum(r["microbatches"] for s, r in run.steps.items() if s <= n_steps) * micro_batch)  # N steps
    return {
        "time_to_n_s": run.time_to(n_steps),
        "time_to_n_from_first_step_s": (done["time"] - clock) if (done and clock) else None,
        "time_to_n_full_batch_s": time_to_full_batch_steps(run, n_steps, M, clock),
        "reached": run.last_step >= n_steps,
        "useful_samples": useful,
        "useful_fraction": useful / (n_steps * M * micro_batch),
        "kills_sent": sum(1 for k in run.kills if k.pid is not None),
        "kills_without_target": sum(1 for k in run.kills if k.pid is None),
        "launches": run.launches,
    }


def time_to_full_batch_steps(run: SystemRun, n_steps: int, M: int, clock: float | None) -> float | None:
    """From the first committed step until the ``n_steps``-th step that used all M microbatches was committed
    (a step that dropped a killed replica's share does not count); None if the run had fewer."""
    full = [r["time"] for s, r in sorted(run.steps.items()) if r["microbatches"] == M]
    return full[n_steps - 1] - clock if clock is not None and len(full) >= n_steps else None


def relative_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """max over tensors of max|a - b| / max|a| (two state dicts with the same keys)."""
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())[:4]}")
    worst = 0.0
    for key, x in a.items():
        x, y = x.double(), b[key].double()
        worst = max(worst, (x - y).abs().max().item() / (x.abs().max().item() or 1.0))
    return worst


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return float("nan")
    return a / b
