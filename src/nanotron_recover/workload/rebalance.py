"""Quotas that follow each replica's measured speed: stragglers get fewer of the step's M microbatches.

Pure and deterministic, like the planner: every rank feeds :class:`Rebalancer` the same agreed numbers (the
step's world-wide stats, :mod:`nanotron_recover.recovery.rebalancing`) in the same order and gets the same
weights, so every rank plans the same quotas without a round of its own. Only *who* computes which microbatch
changes; step ``s`` still trains on samples ``s*M ... s*M+M-1``, so the trajectory is kept (summation order aside).

Decisions (callers and the docs rely on them):

* **What is measured**: seconds of compute per microbatch, per replica, of every committed step in which the
  replica computed at least one microbatch. A replica that computed nothing this step keeps its estimate. A
  replica's first such step is not used: it carries one-time costs (allocations, lazy initialisation, the first
  microbatch of a new replica's world), which made the slowest replica of a real run look the fastest.
* **Smoothing**: an EWMA per replica (``smoothing`` = the weight of the newest step), so one noisy step moves the
  estimate by a fraction only.
* **Hysteresis**: the weights in use change only when the quotas from the new estimates would shorten the
  predicted step (the slowest replica's ``quota x seconds per microbatch``, both from the estimates) by more than
  ``hysteresis`` (a fraction) against the quotas in use. Integer quotas then do not flap on noise: going back
  needs the estimates to move by about twice the threshold.
* **Replicas without a measurement** (a spare or recycled replica that just took a slot, one that has had quota
  0) are estimated from the others: the median of ``seconds x prior weight`` over the measured ones, divided by
  their own prior weight (1 without ``fixed`` weights).
* **Fixed weights** (``fixed``: known heterogeneous hardware, by replica id) are the plan with ``rebalance`` off,
  and the prior before anything was measured with it on. Ids past the list (replicas formed by recycling) get the
  smallest fixed weight: their ranks' hardware is not known, and assuming the slowest keeps them off the critical
  path.
* **Persistent stragglers** (``straggler_factor``, off by default): a replica whose estimate is above
  ``straggler_factor`` x the median of the computing replicas' estimates for ``straggler_steps`` consecutive steps
  in which it computed is *drained*: weight 0, quota 0, for the rest of the run (it still holds the committed state,
  takes part in every reduction with a zero gradient and in the optimizer step, and can replace nobody's work
  again until a relaunch). The fastest replica is never above the median, so at least one replica always computes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nanotron_recover.workload.planner import quotas


@dataclass(frozen=True)
class RebalanceSettings:
    """What ``fault_tolerance`` asks of the rebalancer (see :class:`nanotron_recover.config.FaultToleranceArgs`)."""

    rebalance: bool = False
    smoothing: float = 0.3
    hysteresis: float = 0.1
    straggler_factor: float | None = None
    straggler_steps: int = 10
    fixed: Mapping[int, float] | None = None

    @property
    def changes_the_plan(self) -> bool:
        """Whether anything here can move a quota (else the planner's equal split is used untouched)."""
        return self.rebalance or self.fixed is not None or self.straggler_factor is not None


def ewma(old: float | None, new: float, smoothing: float) -> float:
    """The smoothed value after observing ``new`` (the first observation is taken as is)."""
    return new if old is None else (1.0 - smoothing) * old + smoothing * new


def predicted_step_s(quota: Mapping[int, int], seconds_per_microbatch: Mapping[int, float]) -> float:
    """The step's compute time as the slowest replica's ``quota x seconds per microbatch``."""
    return max((n * seconds_per_microbatch[r] for r, n in quota.items()), default=0.0)


@dataclass
class Rebalancer:
    """Per-replica speed estimates and the weights the planner uses, identical on every rank fed the same stats."""

    M: int
    settings: RebalanceSettings = field(default_factory=RebalanceSettings)
    estimates: dict[int, float] = field(default_factory=dict)  # EWMA seconds per microbatch
    planned: dict[int, float] = field(default_factory=dict)  # the estimates the weights in use came from
    slow_steps: dict[int, int] = field(default_factory=dict)  # consecutive computing steps above the factor
    drained: set[int] = field(default_factory=set)
    warmed: set[int] = field(default_factory=set)  # replicas whose first measured step was left out

    def _prior(self, replica: int) -> float:
        fixed = self.settings.fixed
        if not fixed:
            return 1.0
        return float(fixed.get(replica, min(fixed.values())))

    def _seconds(self, table: Mapping[int, float], replicas: Sequence[int]) -> dict[int, float]:
        """Seconds per microbatch of ``replicas`` from ``table``; the unmeasured ones from the measured (module doc)."""
        known = [r for r in replicas if r in table] or sorted(table)
        scale = statistics.median(table[r] * self._prior(r) for r in known)
        return {r: table[r] if r in table else scale / self._prior(r) for r in replicas}

    def weights(self, replicas: Sequence[int]) -> dict[int, float] | None:
        """Relative weights for the planner (None: nothing to change, the planner's equal split). Drained replicas
        get 0; if every one of ``replicas`` is drained, all of them get their weight back (somebody must compute)."""
        ids = sorted(int(r) for r in replicas)
        live = [r for r in ids if r not in self.drained] or ids
        if self.settings.rebalance and self.planned:
            seconds = self._seconds(self.planned, live)
            speed = {r: 1.0 / seconds[r] for r in live}
        elif self.settings.fixed is not None or len(live) < len(ids):
            speed = {r: self._prior(r) for r in live}
        else:
            return None
        return {r: speed.get(r, 0.0) for r in ids}

    def speeds(self, replicas: Sequence[int]) -> dict[int, float]:
        """Smoothed microbatches per second of the measured ones among ``replicas`` (logged per step)."""
        return {r: 1.0 / self.estimates[r] for r in sorted(replicas) if r in self.estimates}

    def observe(self, seconds: Mapping[int, float], microbatches: Mapping[int, int], computing: Sequence[int]) -> None:
        """One committed step: ``seconds`` and ``microbatches`` each replica computed (0: it computed nothing);
        ``computing`` the replicas that will be planned next. Updates the estimates, the straggler counters and,
        with ``rebalance``, the weights in use (past the hysteresis)."""
        measured = []
        for r in sorted(seconds):
            n, s = int(microbatches.get(r, 0)), float(seconds[r])
            if n > 0 and s > 0 and math.isfinite(s):
                if r not in self.warmed:
                    self.warmed.add(r)
                    continue
                self.estimates[r] = ewma(self.estimates.get(r), s / n, self.settings.smoothing)
                measured.append(r)
        self._judge_stragglers(measured, computing)
        if self.settings.rebalance:
            self._maybe_replan(computing)

    def _judge_stragglers(self, measured: Sequence[int], computing: Sequence[int]) -> None:
        factor = self.settings.straggler_factor
        candidates = [r for r in sorted(computing) if r in self.estimates and r not in self.drained]
        if factor is None or len(candidates) < 2:
            return
        median = statistics.median(self.estimates[r] for r in candidates)
        for r in measured:
            if r not in candidates:
                continue
            self.slow_steps[r] = self.slow_steps.get(r, 0) + 1 if self.estimates[r] > factor * median else 0
            if self.slow_steps[r] >= self.settings.straggler_steps:
                self.drained.add(r)

    def _maybe_replan(self, computing: Sequence[int]) -> None:
        """Adopt the current estimates as the weights in use if their quotas beat the ones in use by the
        hysteresis, both judged with the current estimates."""
        live = [r for r in sorted(computing) if r not in self.drained]
        if not live or not self.estimates:
            return
        seconds = self._seconds(self.estimates, live)
        current = self.weights(live)
        now = quotas(self.M, live, current)
        new = quotas(self.M, live, {r: 1.0 / seconds[r] for r in live})
        if predicted_step_s(new, seconds) < (1.0 - self.settings.hysteresis) * predicted_step_s(now, seconds):
            self.planned = dict(self.estimates)
