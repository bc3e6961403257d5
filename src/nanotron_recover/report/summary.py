"""The report's numbers, from a :class:`~nanotron_recover.report.timeline.RunTimeline`; pure, no plotting.

Where the wall time went (:func:`time_accounting`), from the first step's start of the first launch (the first
start-up is in no record) to the last record of the last launch, split into:

* useful step time: every step of the final trajectory, minus what a failure added to its step (the excess over
  the launch's median undisturbed step);
* that excess: detect + repair (the repair events' ``detect_ms + total_ms``), the hang timeout (a step with a
  ``hang_detected`` event), and the rest of the recovery (re-reduction, orphan microbatches, spare transfer);
* steps replayed: records a later launch logged again (their work was lost with their launch);
* between steps: checkpoint saves and anything else outside ``step_time_s``;
* the end of a launch: from its last commit to its last record (the hang wait, the stop and its checkpoint);
* relaunch: from one launch's last record to the next one's first step (its start-up, a requeue wait).

The effective training time ratio is useful step time / wall time.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from nanotron_recover.report.kill_costs import KillCost, kill_cost_lines, kill_costs
from nanotron_recover.report.timeline import Launch, RunTimeline, StepPoint, event_time

LOST_DETECT_REPAIR = "detect + repair"
LOST_HANG = "hang timeout (a frozen or stuck rank)"
LOST_RECOVERY = "rest of the recovery in failure steps"
LOST_REPLAYED = "steps replayed after a relaunch"
LOST_BETWEEN = "between steps (checkpoint saves, ...)"
LOST_LAUNCH_END = "end of a launch (step in flight, stop, checkpoint)"
LOST_RELAUNCH = "relaunch (next start-up, requeue wait)"
REGROW_LINES = 12  # regrow decisions printed one per line; the rest are counted


@dataclass
class Summary:
    run_dir: str
    launches: list[Launch]
    final_steps: list[int]
    step_records: int
    faults_by_kind: dict[str, int]
    faults_by_phase: dict[str, int]
    external_faults: list[str]
    hang_events_by_reason: dict[str, int]
    hang_killed_ranks: list[int]
    repairs: int
    repairs_without_failure: int
    detect_repair_ms: list[float]
    fault_to_repaired_s: list[float]
    spare_activations: int
    replica_formations: int
    replayed_steps: list[int]
    wall_s: float
    useful_s: float
    time_lost_s: dict[str, float]
    committed_microbatches: int
    microbatches_per_step: int | None
    failure_free_steps: int
    micro_batch_size: int | None
    train_steps: int | None
    short_steps: list[int]
    missing_steps: list[int]
    hang_stack_files: list[str] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)  # exit code -> ranks, of the last launch
    max_abs_dloss: float | None = None
    compared_steps: int = 0
    problems: list[str] = field(default_factory=list)
    regrow_decisions: list[dict[str, Any]] = field(default_factory=list)  # the ``regrow`` events, "not yet" too
    kill_costs: list[KillCost] = field(default_factory=list)  # what each kill cost, in parts

    @property
    def detect_repair_median_ms(self) -> float | None:
        return statistics.median(self.detect_repair_ms) if self.detect_repair_ms else None

    @property
    def detect_repair_max_ms(self) -> float | None:
        return max(self.detect_repair_ms) if self.detect_repair_ms else None

    @property
    def effective_ratio(self) -> float | None:
        return self.useful_s / self.wall_s if self.wall_s > 0 else None

    @property
    def failure_free_microbatches(self) -> int | None:
        m = self.microbatches_per_step
        return m * self.failure_free_steps if m is not None else None


# ------------------------------------------------------------------------------------------------ numbers
def summarize(tl: RunTimeline, compare: RunTimeline | None = None) -> Summary:
    """Every number of the text summary; ``compare``: a second run whose losses are set against this one's."""
    by_kind = Counter(str(k.get("signal", "kill")) for k in tl.kills)
    by_phase = Counter(str(k.get("at") if k.get("phase") == "startup" else k.get("phase")) for k in tl.kills)
    hangs = tl.events_of("hang_detected")
    wall, useful, lost = time_accounting(tl)
    m, short, missing = microbatch_check(tl)
    final_steps = [p.step for p in tl.final]
    summary = Summary(
        run_dir=str(tl.run_dir), launches=tl.launches, final_steps=final_steps, step_records=len(tl.records),
        faults_by_kind=dict(by_kind), faults_by_phase=dict(by_phase),
        external_faults=[str(e.get("name")) for e in tl.external],
        hang_events_by_reason=dict(Counter(str(h.get("reason", "?")) for h in hangs)),
        hang_killed_ranks=sorted({int(h["rank"]) for h in hangs if h.get("reason") in ("silent", "stuck")
                                  and isinstance(h.get("rank"), int)}),
        repairs=sum(r.kind == "repair" for r in tl.repairs),
        repairs_without_failure=sum(r.kind != "repair" for r in tl.repairs),
        detect_repair_ms=[r.detect_to_repaired_ms for r in tl.repairs],
        fault_to_repaired_s=fault_to_repaired_s(tl),
        spare_activations=len(tl.events_of("spare_activated")), replica_formations=len(tl.events_of("replica_formed")),
        replayed_steps=sorted(p.step for p in tl.replayed), wall_s=wall, useful_s=useful, time_lost_s=lost,
        committed_microbatches=sum(p.microbatches or 0 for p in tl.final), microbatches_per_step=m,
        failure_free_steps=_failure_free_steps(tl, final_steps), micro_batch_size=tl.size.micro_batch_size,
        train_steps=tl.size.train_steps, short_steps=short, missing_steps=missing,
        hang_stack_files=[p.name for p in tl.hang_stacks],
        exit_codes=dict(Counter(int(e.get("code", -1)) for e in tl.exits.values())), problems=list(tl.problems),
        regrow_decisions=tl.events_of("regrow"), kill_costs=kill_costs(tl))
    if compare is not None:
        deltas = loss_differences(tl.losses(), compare.losses())
        summary.max_abs_dloss = max(deltas.values()) if deltas else None
        summary.compared_steps = len(deltas)
        summary.problems += [f"--compare run: {p}" for p in compare.problems]
    return summary


def _failure_free_steps(tl: RunTimeline, final_steps: Sequence[int]) -> int:
    """The steps the failure-free run commits: the config's ``train_steps``, else as many as this run reached."""
    return tl.size.train_steps if tl.size.train_steps is not None else max(final_steps, default=0)


def microbatch_check(tl: RunTimeline) -> tuple[int | None, list[int], list[int]]:
    """M (the config's, else the most common count), the final steps that committed fewer than M microbatches,
    and the steps up to the last one that have no record at all."""
    m = tl.size.microbatches_per_step
    if m is None:
        counts = Counter(p.microbatches for p in tl.final if p.microbatches is not None)
        m = counts.most_common(1)[0][0] if counts else None
    short = [p.step for p in tl.final if m is not None and (p.microbatches or 0) < m]
    have = {p.step for p in tl.final}
    missing = [s for s in range(1, max(have, default=0) + 1) if s not in have]
    return m, short, missing


def fault_to_repaired_s(tl: RunTimeline) -> list[float]:
    """Per fired fault, seconds from the injector's record (written just before the signal) to the end of the
    first later repair that took the fault's replica out; faults with no such repair are left out."""
    out = []
    for fault in tl.kills:
        t = fault.get("time")
        if not isinstance(t, (int, float)):
            continue
        repair = next((r for r in tl.repairs if r.launch == fault.get("launch") and r.time >= t
                       and fault.get("replica") in r.failed_replicas), None)
        if repair is not None:
            out.append(repair.time - t)
    return out


def loss_differences(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """|loss_a - loss_b| on the steps both final trajectories hold."""
    return {s: abs(a[s] - b[s]) for s in sorted(a.keys() & b.keys())}


# ------------------------------------------------------------------------------------------------ wall time
def time_accounting(tl: RunTimeline) -> tuple[float, float, dict[str, float]]:
    """(wall s, useful step s, {cause: s lost}); see the module docstring for what each cause holds."""
    if not tl.records:
        return 0.0, 0.0, {}
    wall = max(la.end for la in tl.launches) - min(p.start for p in tl.records)
    lost = dict.fromkeys((LOST_DETECT_REPAIR, LOST_HANG, LOST_RECOVERY, LOST_REPLAYED, LOST_BETWEEN,
                          LOST_LAUNCH_END, LOST_RELAUNCH), 0.0)
    final = {id(p) for p in tl.final}
    useful = 0.0
    for launch in tl.launches:
        mine = [p for p in tl.records if p.launch == launch.index]
        base = baseline_step_s(mine, _disturbed_steps(tl, launch.index))
        for point in mine:
            if id(point) not in final:
                lost[LOST_REPLAYED] += point.step_time_s
                continue
            useful += point.step_time_s - _split_excess(tl, point, base, lost)
        lost[LOST_BETWEEN] += sum(max(0.0, b.start - a.time) for a, b in zip(mine, mine[1:]))
        _split_launch_end(tl, launch, mine[-1], lost)
    for before, after in zip(tl.launches, tl.launches[1:]):
        lost[LOST_RELAUNCH] += max(0.0, after.start - before.end)
    return wall, useful, lost


def _disturbed_steps(tl: RunTimeline, launch: int) -> set[int]:
    """Steps of a launch that a failure, a hang or a spare activation touched."""
    marked = {int(m.x) for m in tl.markers if m.launch == launch and m.kind not in ("resume", "stopped")}
    return marked | {p.step for p in tl.records if p.launch == launch and p.recoveries}


def baseline_step_s(points: Sequence[StepPoint], disturbed: set[int]) -> float:
    """A launch's undisturbed step time: the median of its steps that no failure touched, its first (warm-up)
    step left out when there are others."""
    clean = [p.step_time_s for p in points if p.step not in disturbed and not p.recoveries]
    if len(clean) > 1 and points and points[0].step not in disturbed:
        clean = clean[1:]
    return statistics.median(clean) if clean else statistics.median([p.step_time_s for p in points] or [0.0])


def _split_excess(tl: RunTimeline, point: StepPoint, base: float, lost: dict[str, float]) -> float:
    """Book what a failure added to ``point``'s step time; -> the seconds booked."""
    if not point.recoveries and not _hang_in(tl, point.launch, point.step):
        return 0.0
    excess = max(0.0, point.step_time_s - base)
    repair_s = sum(r.detect_to_repaired_ms for r in tl.repairs
                   if r.launch == point.launch and r.step == point.step) / 1e3
    booked = min(excess, repair_s)
    lost[LOST_DETECT_REPAIR] += booked
    rest = excess - booked
    lost[LOST_HANG if _hang_in(tl, point.launch, point.step) else LOST_RECOVERY] += rest
    return excess


def _hang_in(tl: RunTimeline, launch: int, step: int) -> bool:
    return any(e["launch"] == launch and int(e["x"]) == step for e in tl.events_of("hang_detected"))


def _split_launch_end(tl: RunTimeline, launch: Launch, last: StepPoint, lost: dict[str, float]) -> None:
    """From a launch's last commit to its last record: up to its last hang event a hang timeout, the rest the
    stop (repair, fallback checkpoint)."""
    tail = max(0.0, launch.end - last.time)
    hang_times = [t for e in tl.events_of("hang_detected") if e["launch"] == launch.index
                  and (t := event_time(e)) is not None and t > last.time]
    hang = min(tail, max(hang_times) - last.time) if hang_times else 0.0
    lost[LOST_HANG] += hang
    lost[LOST_LAUNCH_END] += tail - hang


# ------------------------------------------------------------------------------------------------ text
def format_summary(s: Summary) -> str:
    """The summary as the report prints it: one fact a line, the numbers first."""
    lines = [f"run {s.run_dir}: {len(s.launches)} launch(es), {s.step_records} step records, final trajectory "
             f"steps {_range(s.final_steps)}"]
    lines += _fault_lines(s) + _repair_lines(s) + _relaunch_lines(s) + _time_lines(s) + kill_cost_lines(s.kill_costs)
    lines += _sample_lines(s)
    if s.max_abs_dloss is not None:
        lines.append(f"max |dloss| vs --compare run: {s.max_abs_dloss:.3g} over {s.compared_steps} common steps")
    elif s.compared_steps == 0 and any(p.startswith("--compare") for p in s.problems):
        lines.append("max |dloss| vs --compare run: no common step")
    if s.problems:
        lines.append("could not read:")
        lines += [f"  - {p}" for p in s.problems]
    return "\n".join(lines)


def _range(steps: Sequence[int]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _fault_lines(s: Summary) -> list[str]:
    n = sum(s.faults_by_kind.values())
    lines = [f"faults fired (injected/): {n}; by kind: {_counts(s.faults_by_kind)}; by phase: "
             f"{_counts(s.faults_by_phase)}"]
    if s.external_faults:
        lines.append(f"faults sent from outside: {len(s.external_faults)} ({', '.join(s.external_faults)})")
    if s.hang_events_by_reason:
        lines.append(f"hang events: {_counts(s.hang_events_by_reason)}; ranks killed as hung: "
                     f"{s.hang_killed_ranks or 'none'}")
    if s.hang_stack_files:
        lines.append(f"stacks of stuck ranks (hangs/): {', '.join(s.hang_stack_files)}")
    if s.exit_codes:
        codes = ", ".join(f"{n} x code {c}" for c, n in sorted(s.exit_codes.items()))
        lines.append(f"exit records (the last launch's: a relaunch overwrites them): {codes}")
    return lines


def _repair_lines(s: Summary) -> list[str]:
    lines = [f"repairs: {s.repairs} (+{s.repairs_without_failure} without a failure); detect + repair median "
             f"{_ms(s.detect_repair_median_ms)}, max {_ms(s.detect_repair_max_ms)}"]
    if s.fault_to_repaired_s:
        lines.append(f"fault to repaired (injector's record to the repair's end): median "
                     f"{statistics.median(s.fault_to_repaired_s):.3f} s, max {max(s.fault_to_repaired_s):.3f} s")
    if s.spare_activations or s.replica_formations:
        lines.append(f"spare activations: {s.spare_activations}; replicas formed from the pool: {s.replica_formations}")
    return lines


def _relaunch_lines(s: Summary) -> list[str]:
    lines = [f"steps replayed after relaunches: {len(s.replayed_steps)}"
             + (f" ({', '.join(map(str, s.replayed_steps))})" if s.replayed_steps else "")]
    for before, after in zip(s.launches, s.launches[1:]):
        why = f" after stopping: {before.stopped}" if before.stopped else ""
        lines.append(f"  launch {after.index} resumed from step {after.resumed_from} (launch {before.index} logged "
                     f"steps {before.first_step}..{before.last_step}{why}), {after.start - before.end:.1f} s later")
    if s.regrow_decisions:
        said = Counter(str(e.get("decision")) for e in s.regrow_decisions)
        lines.append(f"regrow decisions (fault_tolerance.regrow): {_counts(dict(said))}")
        shown = s.regrow_decisions[:REGROW_LINES]
        lines += [f"  {_regrow_line(e)}" for e in shown]
        if len(s.regrow_decisions) > len(shown):
            lines.append(f"  ... and {len(s.regrow_decisions) - len(shown)} more (metrics.jsonl, event regrow)")
    return lines


def _regrow_line(e: dict[str, Any]) -> str:
    """One decision with the numbers it weighed: a relaunch against running degraded until the next failure."""
    def num(key: str, scale: float = 1.0, digits: int = 2) -> str:
        value = e.get(key)
        return f"{value * scale:.{digits}f}" if isinstance(value, (int, float)) else "?"

    why = (", waiting for the standby" if e.get("waiting_for_standby") else "") \
        + (", a node left out answers again (full-width step estimated)" if e.get("nodes_back") else "")
    return (f"step {e.get('step')}: {e.get('decision')} ({e.get('computing_replicas')} of {e.get('full_width')} "
            f"replicas computing{why}; step {num('step_now_s', 1e3, 0)} ms against {num('step_full_s', 1e3, 0)} ms "
            f"at full width; degraded until the next failure ({num('horizon_s', 1, 0)} s) costs "
            f"{num('degraded_cost_s')} s, a relaunch {num('relaunch_s')} s)")


def _time_lines(s: Summary) -> list[str]:
    lines = ["time lost per cause:"]
    lines += [f"  {cause:<52} {seconds:8.2f} s" for cause, seconds in s.time_lost_s.items() if seconds > 0]
    if len(lines) == 1:
        lines[0] += " none"
    ratio = "n/a" if s.effective_ratio is None else f"{s.effective_ratio:.3f}"
    lines.append(f"effective training time ratio: {ratio} (useful step time {s.useful_s:.2f} s / wall "
                 f"{s.wall_s:.2f} s from the first step; the first start-up is in no record)")
    return lines


def _sample_lines(s: Summary) -> list[str]:
    m, mbs = s.microbatches_per_step, s.micro_batch_size
    expected = s.failure_free_microbatches
    unit = (lambda n: f"{n * mbs} samples ({n} microbatches)") if mbs else (lambda n: f"{n} microbatches")
    line = f"committed: {unit(s.committed_microbatches)}"
    line += f" of the failure-free {unit(expected)} (M = {m} x {s.failure_free_steps} steps)" if expected else ""
    lines = [line]
    if s.short_steps:
        lines.append(f"  steps that committed fewer than M = {m} microbatches: {s.short_steps}")
    if s.missing_steps:
        lines.append(f"  steps with no record: {s.missing_steps}")
    if s.train_steps is not None and max(s.final_steps, default=0) < s.train_steps:
        lines.append(f"  the run is not finished: step {max(s.final_steps, default=0)} of train_steps {s.train_steps}")
    return lines
