"""What each kill cost the run, in parts: the failure step, the degraded steps after it, and, where the launch
ended because of it (a regrow, too few replicas, the last replica lost), the stop, the start-up of the next launch,
its first step and the steps it computed again.

Every part is read from the records of any run (:class:`~nanotron_recover.report.timeline.RunTimeline`) against
the run's full-width step (the median step time of the steps that ran at the launches' widest, undisturbed):

* failure step: the step with the repair, over a full-width step (detection, the repair, the orphaned
  microbatches computed again on top);
* degraded: the steps after it at fewer replicas, each over a full-width step (the survivors compute every
  microbatch), until the width comes back or the launch ends (a later kill's steps are the later kill's);
* stop: from the launch's last committed step to its last record (the step in flight, the snapshot, a checkpoint);
* start-up: from that record to the next launch's first step (the relaunch: warm or cold);
* first step: the next launch's first step over a full-width step;
* replayed: the steps the next launch computed again (those after the snapshot it resumed from).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from nanotron_recover.report.timeline import Launch, RunTimeline, StepPoint

PARTS = ("failure step", "degraded", "stop", "start-up", "first step", "replayed")


@dataclass(frozen=True)
class KillCost:
    """One kill (a repair that lost replicas) and the seconds each part of it cost (:data:`PARTS`)."""

    step: int
    launch: int
    degraded_steps: int
    seconds: dict[str, float]

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def full_width_step_s(tl: RunTimeline) -> float | None:
    """The median step at the widest width any launch ran, of the steps no recovery touched (their first left out)."""
    widths = [p.live_replicas for p in tl.records if p.live_replicas is not None]
    if not widths:
        return None
    widest = max(widths)
    firsts = {(la.index, la.first_step) for la in tl.launches}
    clean = [p.step_time_s for p in tl.records if p.live_replicas == widest and not p.recoveries
             and (p.launch, p.step) not in firsts]
    return statistics.median(clean) if clean else None


def kill_costs(tl: RunTimeline) -> list[KillCost]:
    """Each kill of the run, oldest first, with what it cost (see the module docstring)."""
    full = full_width_step_s(tl)
    kills = [r for r in tl.repairs if r.kind == "repair" and r.failed_replicas]
    if full is None or not kills:
        return []
    widest = max(p.live_replicas for p in tl.records if p.live_replicas is not None)
    out = []
    for i, kill in enumerate(kills):
        mine = [p for p in tl.records if p.launch == kill.launch]
        later_kill = next((k.step for k in kills[i + 1:] if k.launch == kill.launch), None)
        failure = [p for p in mine if p.step == kill.step]
        degraded = _degraded_after(mine, kill.step, later_kill, widest)
        seconds = dict.fromkeys(PARTS, 0.0)
        seconds["failure step"] = sum(max(0.0, p.step_time_s - full) for p in failure[-1:])
        seconds["degraded"] = sum(max(0.0, p.step_time_s - full) for p in degraded)
        if later_kill is None:  # the launch's end is this kill's (it ended degraded, or stopped to regrow)
            _add_launch_end(tl, kill.launch, mine, full, seconds)
        out.append(KillCost(kill.step, kill.launch, len(degraded), seconds))
    return out


def _degraded_after(mine: Sequence[StepPoint], step: int, until: int | None, widest: int) -> list[StepPoint]:
    """The steps after ``step`` (before ``until``) that ran narrower than ``widest``, up to the first at full
    width (a spare or a formed replica took the slot)."""
    out = []
    for p in (p for p in mine if p.step > step and (until is None or p.step < until)):
        if p.live_replicas is None or p.live_replicas >= widest:
            break
        out.append(p)
    return out


def _add_launch_end(tl: RunTimeline, launch_index: int, mine: Sequence[StepPoint], full: float,
                    seconds: dict[str, float]) -> None:
    """The stop, the next launch's start-up, its first step and the steps it computed again."""
    launch = next(la for la in tl.launches if la.index == launch_index)
    following: Launch | None = next((la for la in tl.launches if la.index == launch_index + 1), None)
    if following is None or not mine:
        return
    seconds["stop"] = max(0.0, launch.end - mine[-1].time)
    seconds["start-up"] = max(0.0, following.start - launch.end)
    theirs = [p for p in tl.records if p.launch == following.index]
    seconds["first step"] = max(0.0, theirs[0].step_time_s - full) if theirs else 0.0
    seconds["replayed"] = sum(p.step_time_s for p in theirs if p.step <= launch.last_step)


def kill_cost_lines(costs: Sequence[KillCost], limit: int = 12) -> list[str]:
    """The report's lines: the mean cost of a kill in parts, then one line per kill (at most ``limit``)."""
    if not costs:
        return []
    mean = {part: statistics.fmean(c.seconds[part] for c in costs) for part in PARTS}
    lines = [f"cost of a kill (mean of {len(costs)}): {sum(mean.values()):.2f} s = "
             + ", ".join(f"{part} {mean[part]:.2f}" for part in PARTS)]
    for c in costs[:limit]:
        lines.append(f"  kill at step {c.step} (launch {c.launch}): {c.total_s:.2f} s = "
                     + ", ".join(f"{part} {c.seconds[part]:.2f}" for part in PARTS)
                     + f" ({c.degraded_steps} degraded step(s))")
    if len(costs) > limit:
        lines.append(f"  ... and {len(costs) - limit} more kills")
    return lines
