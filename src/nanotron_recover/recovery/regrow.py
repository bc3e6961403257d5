"""Back to full width (issue #40): after replicas are lost, stop at a step boundary when a relaunch pays.

ReCoVer keeps the global batch, so after a loss the survivors compute every microbatch and a step takes longer
until the job has its replicas back. The launcher can relaunch the job in place at full width
(:mod:`nanotron_recover.launcher.relauncher`), and a stop at a step boundary loses nothing (the step is committed
and snapshotted, the relaunch resumes at the next one). The launcher tells every rank how many relaunches in place
it has left (``NANOTRON_RECOVER_IN_PLACE_RESTARTS``) and, once it has measured one in this run folder, what a
relaunch costs (``NANOTRON_RECOVER_RELAUNCH_S``); before that, the ranks' own start-up of this launch stands for
it (their agreed mean, :mod:`nanotron_recover.process.startup_clock`). Each committed step while degraded asks
the simulator's rule (:func:`nanotron_recover.sim.regrow.decide`): does the relaunch cost less than the
full-width training that staying degraded gives away until the next failure (``relaunch_mtbf_h``)? Its inputs
are the same on every rank (the agreed mean step time now and at full width before the loss, the start-up sums,
the launcher's numbers), so every rank reaches the same decision in the same step, with no extra message.
Decisions are logged as ``regrow`` events (each change of verdict, and every :data:`SAY_EVERY_STEPS` steps while
degraded).

Where the launcher starts the standby only after a loss (``fault_tolerance.standby: after_loss``: its start-up then
runs on what the lost replica freed, not beside a full-width job), a regrow waits until a rank sees it ready (the
step's sums carry that, so every rank stops in the same step), then weighs the warm relaunch; after
:data:`STANDBY_WAIT_S` of degraded steps without it, it weighs a cold one (the ranks' own start-up).

A launch that the launcher ran narrower than the job (a node of the allocation did not answer: ``--replicas R``)
knows the job's full width (``NANOTRON_RECOVER_FULL_REPLICAS``); once a rank sees the launcher say that a missing
node answers again (agreed through the step's sums), the job counts as degraded against that width, with the
full-width step estimated from this launch's (the replicas' work scales with M / replicas), and regrows when that
pays.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from nanotron_recover.run.in_place import IN_PLACE_ENV, RELAUNCH_S_ENV, full_replicas, standby_follows_loss
from nanotron_recover.sim.regrow import decide
from nanotron_recover.training.seam import StepStop

SETTLE_STEPS = 2  # steps after a loss before its step time counts (the loss's own step includes the repair)
SAY_EVERY_STEPS = 100
STANDBY_WAIT_S = 60.0  # degraded steps' seconds a regrow waits for the standby started after the loss


class Regrow:
    """One rank's view of the regrow decision (identical on every rank: agreed inputs only)."""

    def __init__(self, setting: str, full_width: int, mtbf_h: float) -> None:
        restarts, relaunch_s = os.environ.get(IN_PLACE_ENV, ""), os.environ.get(RELAUNCH_S_ENV, "")
        self.enabled = setting == "auto" and restarts.isdigit() and int(restarts) > 0
        self.measured_relaunch_s = float(relaunch_s) if relaunch_s else None  # the launcher's, once it has one
        self.full_width, self.horizon_s = full_width, mtbf_h * 3600.0
        self.job_width = max(full_width, full_replicas() or 0)  # wider than this launch's: a node was left out
        self.standby_follows = standby_follows_loss()  # a standby starts after a loss: wait until it is ready
        self.step_full_s: float | None = None
        self.degraded_since: int | None = None
        self._verdict: bool | None = None
        self.news: dict | None = None  # the event to log after this step, if any

    @classmethod
    def of(cls, config: Any) -> Regrow:
        ft = config.fault_tolerance
        return cls(ft.regrow, config.parallelism.dp, ft.relaunch_mtbf_h)

    def after_commit(self, step: int, computing: int, step_s: float | None, startup_s: float | None = None,
                     standby_ready: bool = False, nodes_back: bool = False) -> StepStop | None:
        """A committed step with ``computing`` replicas, the agreed mean step time, the ranks' agreed mean
        start-up of this launch, whether a rank saw the standby after the loss ready, and whether one saw a node
        this launch left out answer again: stop here to regrow?"""
        self.news = None
        if not self.enabled or step_s is None:
            return None
        target = self.job_width if nodes_back else self.full_width  # the width a relaunch would have
        if computing >= self.full_width and (computing >= target or self.degraded_since is None):
            self.step_full_s = step_s  # at this launch's full width
        if computing >= target:
            self.degraded_since, self._verdict = None, None
            return None
        if self.degraded_since is None:
            self.degraded_since = step
        relaunch_s = self.measured_relaunch_s if self.measured_relaunch_s is not None else startup_s
        if self.step_full_s is None or step - self.degraded_since < SETTLE_STEPS or relaunch_s is None:
            return None
        waiting = self.standby_follows and not standby_ready and target == self.full_width
        if waiting and (step - self.degraded_since) * step_s >= STANDBY_WAIT_S:
            waiting, relaunch_s = False, startup_s if startup_s is not None else relaunch_s  # a cold relaunch
        step_full_s = self.step_full_s * self.full_width / target  # estimated when wider than this launch
        decision = decide(step_s, step_full_s, relaunch_s, self.horizon_s)
        regrow = decision.regrow and not waiting
        if regrow != self._verdict or (step - self.degraded_since) % SAY_EVERY_STEPS == 0:
            self.news = {"event": "regrow", "step": step, "decision": "regrow" if regrow else "not yet",
                         "computing_replicas": computing, "full_width": target,
                         "step_now_s": step_s, "step_full_s": step_full_s, "relaunch_s": relaunch_s,
                         "horizon_s": self.horizon_s, "degraded_cost_s": decision.degraded_cost_s,
                         **({"waiting_for_standby": True} if waiting else {}),
                         **({"nodes_back": True} if target > self.full_width else {})}
        self._verdict = regrow
        if not regrow:
            return None
        return StepStop("regrow_stop", f"regrow: back to {target} replicas after step {step} "
                                       f"({decision.describe()}); a relaunch resumes at step {step + 1}")


def log_news(regrow: Regrow, log_event: Callable[[dict], None]) -> None:
    """Log the decision of the step just committed, if it is news."""
    if regrow.news is not None:
        log_event(regrow.news)
