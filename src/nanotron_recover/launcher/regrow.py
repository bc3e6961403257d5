"""Back to full width: after replicas are lost, the launcher stops the job at a step boundary when a relaunch pays.

ReCoVer keeps the global batch, so after a loss the survivors compute every microbatch and a step takes longer
until the job has its replicas back. The launcher can relaunch the job in place at full width
(:mod:`nanotron_recover.launcher.relauncher`), and a stop at a step boundary loses nothing (the step is committed
and snapshotted, the relaunch resumes at the next one). Every input of the decision is the launcher's own: how many
relaunches in place it has left, what one costs (the last one measured in this run folder; before that, the
ranks' start-up of this launch, from its ``startup`` event), whether its standby is ready, whether a node it left
out answers again, the job's full width; and the step times and widths, which it reads from ``metrics.jsonl`` as the
ranks log them. Each step record while degraded asks the simulator's rule
(:func:`nanotron_recover.sim.regrow.decide`): does the relaunch cost less than the full-width training that
staying degraded gives away until the next failure (``relaunch_mtbf_h``)? When it does, the launcher asks the job
to stop through the graceful stop that exists (SIGUSR1 to ``mpirun``: every rank learns in the same step that it is
the last, snapshots it and exits 3) and relaunches it at full width. The decisions are logged as ``regrow`` events
(each change of verdict, and every :data:`SAY_EVERY_STEPS` steps while degraded), the stop as ``regrow_stop``.

The stop lands later than a decision inside the step would (the launcher reads a step's record after it was
committed, then the signal reaches every rank within the next step or two): measured in docs/operations.md.

Where the standby starts only after a loss (``fault_tolerance.standby: after_loss``: its start-up then runs on what
the lost replica freed), a regrow waits until it is ready, then weighs the warm relaunch; after
:data:`STANDBY_WAIT_S` of degraded steps without it, a cold one (the ranks' own start-up). A launch run narrower
than the job (a node did not answer) counts as degraded against the job's full width once a missing node answers
again, with the full-width step estimated from this launch's (the replicas' work scales with M / replicas).
Standard library only (the launcher stays light).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from nanotron_recover.sim.regrow import decide

SETTLE_STEPS = 2  # steps after a loss before its step time counts (the loss's own step includes the repair)
WINDOW = 5  # the step times weighed: the median of the last few (one step is noisy on a shared machine)
SAY_EVERY_STEPS = 100
STANDBY_WAIT_S = 60.0  # degraded steps' seconds a regrow waits for the standby started after the loss


class Regrow:
    """The regrow decision over one launch's step records (:meth:`begin` at each launch)."""

    def __init__(self, setting: str, job_width: int, mtbf_h: float) -> None:
        self.setting, self.job_width, self.horizon_s = setting, job_width, mtbf_h * 3600.0
        self.begin(job_width, restarts_left=0, relaunch_s=None, standby_follows=False)

    def begin(self, width: int, *, restarts_left: int, relaunch_s: float | None, standby_follows: bool) -> None:
        """A launch of ``width`` replicas (narrower than the job's when a node was left out) starts: the relaunches
        in place left after it, the measured cost of one (None: not measured yet), and whether its standby starts
        only after a loss (then a regrow waits until it is ready)."""
        self.enabled = self.setting == "auto" and restarts_left > 0
        self.full_width, self.measured_relaunch_s, self.standby_follows = width, relaunch_s, standby_follows
        self.startup_s: float | None = None  # this launch's start-up, from its startup event
        self.step_full_s: float | None = None
        self._full: deque[float] = deque(maxlen=WINDOW)  # the last full-width step times
        self._degraded: deque[float] = deque(maxlen=WINDOW)  # the last degraded ones, once settled
        self.degraded_since: int | None = None
        self._verdict: bool | None = None
        self.news: dict | None = None  # the event to log after this step, if any

    def observe(self, record: dict[str, Any], standby_ready: bool = False, nodes_back: bool = False) -> str | None:
        """A record this launch logged: its ``startup`` event (what a relaunch costs, until one is measured), or a
        step's. -> why to stop the job after that step to regrow, or None."""
        self.news = None
        if record.get("event") == "startup" and isinstance(record.get("seconds"), (int, float)):
            self.startup_s = float(record["seconds"])
        live, step_s = record.get("live_replicas"), record.get("step_time_s")
        if "event" in record or not isinstance(live, int) or not isinstance(step_s, (int, float)):
            return None
        return self.after_commit(int(record["step"]), live, float(step_s), standby_ready, nodes_back)

    def after_commit(self, step: int, computing: int, step_s: float, standby_ready: bool = False,
                     nodes_back: bool = False) -> str | None:
        """A committed step with ``computing`` replicas and its time; whether the standby after the loss is ready,
        and whether a node this launch left out answers again: stop after it to regrow? (the reason, or None)"""
        self.news = None
        if not self.enabled:
            return None
        target = self.job_width if nodes_back else self.full_width  # the width a relaunch would have
        if computing >= self.full_width and (computing >= target or self.degraded_since is None):
            self._full.append(step_s)  # at this launch's full width
            self.step_full_s = statistics.median(self._full)
        if computing >= target:
            self.degraded_since, self._verdict = None, None
            self._degraded.clear()
            return None
        if self.degraded_since is None:
            self.degraded_since = step
        relaunch_s = self.measured_relaunch_s if self.measured_relaunch_s is not None else self.startup_s
        if self.step_full_s is None or step - self.degraded_since < SETTLE_STEPS or relaunch_s is None:
            return None
        self._degraded.append(step_s)
        step_s = statistics.median(self._degraded)
        waiting = self.standby_follows and not standby_ready and target == self.full_width
        if waiting and (step - self.degraded_since) * step_s >= STANDBY_WAIT_S:
            waiting, relaunch_s = False, self.startup_s if self.startup_s is not None else relaunch_s  # cold
        # wider than this launch (a node back): the job's full-width step estimated from this launch's own recent
        # steps (the same window), not from its first ones (warm-up, a standby importing beside them: seen 3x slower,
        # and the regrow then never paid)
        step_full_s = step_s * self.full_width / target if target > self.full_width else self.step_full_s
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
        self.enabled = False  # asked once per launch
        return f"regrow: back to {target} replicas after step {step} ({decision.describe()})"
