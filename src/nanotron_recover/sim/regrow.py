"""Regrow (issue #40): when does a relaunch at full width pay for itself?

After replicas are lost, ReCoVer keeps the global batch: the survivors compute every microbatch, so a step takes
``step_now`` instead of ``step_full`` until the job comes back to full width. Coming back means ending at a step
boundary with a node-local snapshot of exactly that step (nothing is recomputed) and relaunching, which costs
``relaunch_s`` of wall time without training (warm onto a standby, or cold). Over the expected time to the next
failure ``horizon_s`` (after which the question is asked again):

* staying degraded trains ``horizon_s / step_now`` steps;
* regrowing trains ``(horizon_s - relaunch_s) / step_full`` steps;

so regrowing pays exactly when ``relaunch_s < horizon_s * (1 - step_full / step_now)``: the right-hand side,
``degraded_cost_s``, is the full-width training time that staying degraded gives away before the next failure.
Pure functions: the engine (:mod:`.engine`) and ``plan`` (:mod:`.plan`) call the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanotron_recover.sim.cluster import Cluster
    from nanotron_recover.sim.params import Params

__all__ = ["RegrowDecision", "decide", "at_first_loss"]


@dataclass(frozen=True)
class RegrowDecision:
    """One decision and the numbers behind it (an event of the simulated run, a line of ``plan``)."""

    regrow: bool
    step_now_s: float
    step_full_s: float
    relaunch_s: float
    horizon_s: float
    degraded_cost_s: float  # full-width seconds of training that staying degraded loses over the horizon

    def describe(self) -> str:
        verdict = "regrow" if self.regrow else "not yet"
        return (f"{verdict}: step {self.step_now_s:.4g} s now vs {self.step_full_s:.4g} s at full width; over "
                f"{self.horizon_s:.4g} s to the next failure, degraded costs {self.degraded_cost_s:.4g} s, a "
                f"relaunch {self.relaunch_s:.4g} s")


def decide(step_now_s: float, step_full_s: float, relaunch_s: float, horizon_s: float) -> RegrowDecision:
    """Regrow when the relaunch costs less than running degraded until the next failure (module docstring).

    A relaunch that gains nothing (``step_full_s >= step_now_s``) never pays, even when it is free."""
    if min(step_now_s, step_full_s) <= 0 or relaunch_s < 0 or horizon_s < 0:
        raise ValueError("step times must be positive; relaunch_s and horizon_s non-negative")
    gain = 1.0 - step_full_s / step_now_s
    cost = horizon_s * gain if gain > 0 else 0.0
    return RegrowDecision(relaunch_s < cost, step_now_s, step_full_s, relaunch_s, horizon_s, cost)


def at_first_loss(cluster: Cluster, p: Params, warm: bool, recover_path: bool = True) -> RegrowDecision:
    """The decision right after the first replica of a full-width job is lost (what ``plan`` and the scale
    benchmark print beside the simulated ETTR): M kept, one replica fewer, the relaunch of the whole job."""
    full = cluster.replicas
    m = full * p.accumulation
    procs = cluster.slots * cluster.ranks_per_replica
    now = p.step_s(math.ceil(m / max(1, full - 1)), procs - cluster.ranks_per_replica, cluster.pp, recover_path)
    step_full = p.step_s(p.accumulation, procs, cluster.pp, recover_path)
    return decide(now, step_full, p.relaunch_s(cluster.nodes, procs, warm), p.regrow_horizon_s(cluster.job_gpus))
