"""Each replica's quota (microbatches it computed) per step of the final trajectory.

Step records carry ``quotas`` only with recycling. For every other run they are re-planned here with the
workload planner itself (pure, deterministic: the same calls every rank made): a launch starts on replicas
``0..n-1`` (``n``: its first record's ``live_replicas``), a step's plan is :func:`plan_step` over the active
replicas, an in-step repair hands the failed replicas' microbatches to the survivors (:func:`replan_orphans`),
and a ``spare_activated`` event adds its replicas from the next step on. A re-planned step whose replica count
or microbatch sum disagrees with its record is left out rather than shown wrong.
"""

from __future__ import annotations

from typing import Any, Sequence

from nanotron_recover.report.timeline import Launch, RunTimeline, StepPoint
from nanotron_recover.workload.planner import merge, orphans_of, plan_step, replan_orphans


def quota_series(tl: RunTimeline, m: int | None) -> tuple[dict[int, dict[str, int]], bool]:
    """({step: {replica: microbatches}}, whether they were logged rather than re-planned)."""
    logged = {p.step: p.quotas for p in tl.final if p.quotas}
    if logged or m is None:
        return logged, bool(logged)
    out: dict[int, dict[str, int]] = {}
    final = {id(p) for p in tl.final}
    for launch in tl.launches:
        mine = [p for p in tl.records if p.launch == launch.index]
        for point, planned in zip(mine, _replan_launch(tl, launch, mine, m)):
            if id(point) in final and planned is not None:
                out[point.step] = planned
    return out, False


def _replan_launch(tl: RunTimeline, launch: Launch, points: Sequence[StepPoint],
                   m: int) -> list[dict[str, int] | None]:
    """The planner's quotas for each of a launch's step records, in order (None where it disagrees)."""
    active = list(range(points[0].live_replicas or 0))
    events = [e for e in tl.events if e["launch"] == launch.index]
    out: list[dict[str, int] | None] = []
    for point in points:
        if not active:
            out.append(None)
            continue
        plan = plan_step(point.step, m, active)
        failed = sorted({r for e in _in_step_repairs(events, point.step) for r in e.get("failed_replicas", ())})
        survivors = [r for r in plan if r not in failed]
        if failed and survivors:
            plan = merge(plan, replan_orphans(orphans_of(plan, failed), survivors, plan), failed)
        quotas = {str(r): len(v) for r, v in sorted(plan.items())}
        agrees = len(quotas) == point.live_replicas and sum(quotas.values()) == point.microbatches
        out.append(quotas if agrees else None)
        active = _active_after(active, events, point.step)
    return out


def _in_step_repairs(events: Sequence[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "repair" and e.get("step") == step and e.get("phase") == "in-step"]


def _active_after(active: list[int], events: Sequence[dict[str, Any]], step: int) -> list[int]:
    """The replicas that compute the step after ``step``: minus every replica a repair of ``step`` took out, plus
    the spares activated at its end."""
    gone = {r for e in events if e.get("event") == "repair" and e.get("step") == step
            for r in e.get("failed_replicas", ())}
    added = {r for e in events if e.get("event") == "spare_activated" and int(e["x"]) == step
             for r in e.get("replicas", ())}
    return sorted((set(active) - gone) | added)
