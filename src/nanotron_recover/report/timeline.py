"""A run folder as one timeline: the step series of every launch and every event placed on the step axis.

Pure: no plotting, no printing. Built from :class:`~nanotron_recover.report.records.RunRecords`.

How launches are told apart: ``metrics.jsonl`` is appended to by every launch in the run dir, and no record says
"a launch began". A step record starts a new launch when it is the first, when its step is not above the one
before (a relaunch replays steps from its checkpoint), when a ``stopped`` event came in between, or when the
trainer's ``training_state`` event (logged once per launch, right after its first step) follows it with the same
step (a relaunch that resumed exactly where the last one stopped). A record logged twice (the new logging rank
re-logs the last committed step after a repair: the same record, the same ``time``) counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from nanotron_recover.report.records import RunRecords, RunSize

REPAIR_KINDS = ("repair", "repair_without_failure")
# a launch that ended itself: below min_replicas, on a stop signal, or to come back at full width (regrow)
STOP_EVENTS = ("stopped", "stop_signal", "regrow_stop")  # a launch's stop events, the most telling last
MARKED_EVENTS = ("repair", "repair_without_failure", "hang_detected", "spare_activated", "replica_formed",
                 "pool_changed", "stopped")


@dataclass(frozen=True)
class StepPoint:
    """One step record of one launch."""

    step: int
    launch: int
    time: float  # when the step was committed (wall clock)
    step_time_s: float
    loss: float | None = None
    microbatches: int | None = None
    tokens: int | None = None
    live_replicas: int | None = None
    pool_size: int | None = None
    quotas: dict[str, int] | None = None
    recoveries: int = 0

    @property
    def start(self) -> float:
        return self.time - self.step_time_s


@dataclass(frozen=True)
class Launch:
    """One job (one ``mpirun``) in the run dir, as its records show it; its start-up is not in the records, so
    ``start`` is its first step's start."""

    index: int  # 1-based
    first_step: int
    last_step: int
    start: float
    end: float  # its last record, step or event
    stopped: str | None = None  # the reason of its stop event (STOP_EVENTS), if it logged one

    @property
    def resumed_from(self) -> int:
        return self.first_step - 1


@dataclass(frozen=True)
class Repair:
    """One repair event (``repair`` or ``repair_without_failure``), phase times in ms."""

    step: int
    launch: int
    time: float
    kind: str
    phase: str
    failed_ranks: tuple[int, ...]
    failed_replicas: tuple[int, ...]
    detect_ms: float
    revoke_ms: float
    shrink_ms: float
    agree_ms: float
    rebuild_ms: float
    total_ms: float
    cause: str = ""

    @property
    def detect_to_repaired_ms(self) -> float:
        return self.detect_ms + self.total_ms


@dataclass(frozen=True)
class Marker:
    """Something to mark on the step axis: ``kind`` is ``fault``, ``hang``, ``resume``, or an event's name."""

    kind: str
    x: float
    time: float | None
    launch: int
    label: str


@dataclass
class RunTimeline:
    run_dir: Path
    size: RunSize
    records: list[StepPoint]  # every step record in file order, replays included
    final: list[StepPoint]  # the final trajectory: each step's last record, by step
    launches: list[Launch]
    repairs: list[Repair]
    events: list[dict[str, Any]]  # every event record, with "launch" and "x" added
    markers: list[Marker]
    kills: list[dict[str, Any]] = field(default_factory=list)
    external: list[dict[str, Any]] = field(default_factory=list)
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    hang_stacks: list[Path] = field(default_factory=list)
    latest_checkpoint: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def replayed(self) -> list[StepPoint]:
        """Records a later launch logged again (their work was lost with the launch)."""
        final = {id(p) for p in self.final}
        return [p for p in self.records if id(p) not in final]

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]

    def losses(self) -> dict[int, float]:
        """The final trajectory's loss per step."""
        return {p.step: p.loss for p in self.final if p.loss is not None}


# ------------------------------------------------------------------------------------------------ building
def build_timeline(raw: RunRecords) -> RunTimeline:
    """The timeline of a run folder's records, over all its launches."""
    problems = list(raw.problems)
    records = _without_relogs(_well_formed(raw.records, problems))
    launch_of = _launch_numbers_from_records(records, raw.launches) if raw.launches else _launch_numbers(records)
    points = [_step_point(r, launch_of[i]) for i, r in enumerate(records) if _is_step(r)]
    launches = _launches(points, records, launch_of)
    events = _placed_events(records, launch_of, points, launches)
    kills = [_placed_fault(k, points, launches) for k in raw.kills]
    final = sorted({p.step: p for p in points}.values(), key=lambda p: p.step)
    repairs = [_repair(e) for e in events if e.get("event") in REPAIR_KINDS]
    markers = _markers(events, kills, launches)
    problems += [f"a hang event of rank {e.get('rank')} names {e['stacks_file']}, which is not there"
                 for e in events if e.get("stacks_file") and not Path(str(e["stacks_file"])).is_file()]
    return RunTimeline(run_dir=raw.run_dir, size=raw.size, records=points, final=final, launches=launches,
                       repairs=repairs, events=events, markers=markers, kills=kills, external=raw.external,
                       exits=raw.exits, hang_stacks=raw.hang_stacks, latest_checkpoint=raw.latest_checkpoint,
                       problems=problems)


def _is_step(record: dict[str, Any]) -> bool:
    return "event" not in record and "step" in record


def _well_formed(records: Iterable[dict[str, Any]], problems: list[str]) -> list[dict[str, Any]]:
    """Leave out (and name) a step record without a step number or a commit time: it cannot be placed."""
    out = []
    for record in records:
        if _is_step(record) and (_int(record.get("step")) is None or _float(record.get("time")) is None):
            problems.append(f"a step record without a step number or a time was skipped: {str(record)[:80]}")
            continue
        out.append(record)
    return out


def _without_relogs(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop a step record that repeats an earlier one (same step, same commit time): a new logging rank's re-log."""
    seen: set[tuple[Any, Any]] = set()
    out = []
    for record in records:
        if _is_step(record):
            key = (record.get("step"), record.get("time"))
            if key in seen:
                continue
            seen.add(key)
        out.append(record)
    return out


def _launch_numbers(records: Sequence[dict[str, Any]]) -> list[int]:
    """The launch (1-based) of every record, in file order (see the module docstring for the rule)."""
    steps = [i for i, r in enumerate(records) if _is_step(r)]
    if not steps:
        return [1] * len(records)
    starts = set()
    for n, i in enumerate(steps):
        before = records[steps[n - 1] + 1:i] if n else []
        after = records[i + 1:steps[n + 1] if n + 1 < len(steps) else len(records)]
        step = int(records[i]["step"])
        if (n == 0 or step <= int(records[steps[n - 1]]["step"])
                or any(r.get("event") == "stopped" for r in before)
                or any(r.get("event") == "training_state" and _int(r.get("step")) == step for r in after)):
            starts.add(i)
    out, current = [], 1
    for i in range(len(records)):
        if i in starts and i != steps[0]:
            current += 1
        out.append(current)
    return out


def _launch_numbers_from_records(records: Sequence[dict[str, Any]], launches: Sequence[dict[str, Any]]) -> list[int]:
    """The launch of every record from the run folder's launch records (``launches.jsonl``, written by the
    launcher before each launch): the last launch that began before the record was written. Launches that logged
    nothing (a start-up fault) are left out and the others numbered 1, 2, ... as with the inferred rule."""
    starts = sorted(float(r["time"]) for r in launches if isinstance(r.get("time"), (int, float)))
    raw = []
    for r in records:
        t = _float(r.get("time", r.get("wall_time")))
        raw.append(sum(1 for start in starts if t is not None and start <= t) or 1)
    used = {n: i + 1 for i, n in enumerate(sorted(set(raw)))}
    return [used[n] for n in raw]


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _step_point(record: dict[str, Any], launch: int) -> StepPoint:
    pool = record.get("pool_ranks")
    quotas = record.get("quotas")
    return StepPoint(step=int(record["step"]), launch=launch, time=float(record["time"]),
                     step_time_s=_float(record.get("step_time_s")) or 0.0, loss=_float(record.get("loss")),
                     microbatches=_int(record.get("microbatches")),
                     tokens=_int(record.get("tokens")), live_replicas=_int(record.get("live_replicas")),
                     pool_size=len(pool) if isinstance(pool, list) else None,
                     quotas={str(k): int(v) for k, v in quotas.items()} if isinstance(quotas, dict) else None,
                     recoveries=_int(record.get("recoveries")) or 0)


def _launches(points: Sequence[StepPoint], records: Sequence[dict[str, Any]], launch_of: Sequence[int]) -> list[Launch]:
    out = []
    for k in sorted({p.launch for p in points}):
        mine = [p for p in points if p.launch == k]
        own = [r for r, n in zip(records, launch_of) if n == k]
        times = [t for r in own if (t := event_time(r)) is not None]
        # the most telling stop: the launcher's regrow names why it sent the stop signal the ranks logged
        stopped = next((str(r.get("reason", "")) for kind in reversed(STOP_EVENTS) for r in own
                        if r.get("event") == kind), None)
        out.append(Launch(index=k, first_step=mine[0].step, last_step=mine[-1].step, start=mine[0].start,
                          end=max(times, default=mine[-1].time), stopped=stopped))
    return out


def event_time(record: dict[str, Any]) -> float | None:
    """When a record was written: ``time`` (the logging rank's), else ``wall_time`` (a hang event any rank
    appends carries only that)."""
    return _float(record.get("time")) if record.get("time") is not None else _float(record.get("wall_time"))


def step_in_flight(t: float, points: Sequence[StepPoint], launch: Launch) -> float:
    """The step a launch was working on at wall time ``t``: the first one committed at or after ``t``, else the
    one after its last (a step it never committed)."""
    mine = [p for p in points if p.launch == launch.index]
    return float(next((p.step for p in mine if p.time >= t), launch.last_step + 1))


def _launch_at(t: float | None, launches: Sequence[Launch]) -> Launch | None:
    """The launch running at wall time ``t``: the last one that started before it (the first for earlier)."""
    if not launches:
        return None
    if t is None:
        return launches[-1]
    return next((la for la in reversed(launches) if la.start <= t), launches[0])


def _placed_events(records: Sequence[dict[str, Any]], launch_of: Sequence[int], points: Sequence[StepPoint],
                   launches: Sequence[Launch]) -> list[dict[str, Any]]:
    """Every event with its launch and its position on the step axis (``x``)."""
    by_index = {la.index: la for la in launches}
    out = []
    for record, k in zip(records, launch_of):
        if "event" not in record:
            continue
        launch = by_index.get(k)
        out.append({**record, "launch": k, "x": _event_x(record, launch, points)})
    return out


def _event_x(event: dict[str, Any], launch: Launch | None, points: Sequence[StepPoint]) -> float:
    step = _int(event.get("step"))
    if event.get("event") == "stopped" and step is not None:
        return step + 0.5  # after the last committed step: the one in flight was lost
    if step is not None and step > 0:
        return float(step)
    t = event_time(event)
    if launch is None:
        return 0.0
    return step_in_flight(t, points, launch) if t is not None else float(launch.last_step)


def _placed_fault(fault: dict[str, Any], points: Sequence[StepPoint], launches: Sequence[Launch]) -> dict[str, Any]:
    """A fired fault with the launch it hit (by its time) and its position on the step axis."""
    t = _float(fault.get("time"))
    launch = _launch_at(t, launches)
    step = _int(fault.get("step"))
    if fault.get("phase") != "startup" and step:
        x = float(step)
    elif launch is not None and t is not None:
        x = step_in_flight(t, points, launch)
    else:
        x = float(step or 0)
    return {**fault, "launch": launch.index if launch is not None else 0, "x": x}


def _repair(event: dict[str, Any]) -> Repair:
    cause = (event.get("extra") or {}).get("cause") if isinstance(event.get("extra"), dict) else None
    ms = {k: _float(event.get(k)) or 0.0 for k in ("detect_ms", "revoke_ms", "shrink_ms", "agree_ms", "rebuild_ms",
                                                   "total_ms")}
    return Repair(step=_int(event.get("step")) or 0, launch=event["launch"],
                  time=_float(event.get("wall_time")) or event_time(event) or 0.0, kind=str(event["event"]),
                  phase=str(event.get("phase", "")), failed_ranks=tuple(event.get("failed_ranks") or ()),
                  failed_replicas=tuple(event.get("failed_replicas") or ()),
                  cause=_cause_text(cause), **ms)


def _cause_text(cause: Any) -> str:
    if isinstance(cause, dict):
        return " ".join(str(cause[k]) for k in ("op", "detail") if cause.get(k))
    return "" if cause is None else str(cause)


def _markers(events: Sequence[dict[str, Any]], kills: Sequence[dict[str, Any]],
             launches: Sequence[Launch]) -> list[Marker]:
    """What the figure marks: every fired fault, every marked event, and each relaunch's resume."""
    out = [Marker("fault", k["x"], _float(k.get("time")), k["launch"], fault_label(k)) for k in kills]
    out += [Marker(e["event"] if e["event"] != "hang_detected" else "hang", e["x"], event_time(e), e["launch"],
                   event_label(e)) for e in events if e.get("event") in MARKED_EVENTS]
    out += [Marker("resume", la.first_step - 0.5, la.start, la.index,
                   f"launch {la.index} resumed from step {la.resumed_from}") for la in launches[1:]]
    return sorted(out, key=lambda m: (m.x, m.time or 0.0))


def fault_label(fault: dict[str, Any]) -> str:
    where = fault.get("at") if fault.get("phase") == "startup" else fault.get("phase")
    return f"{fault.get('signal', 'kill')} replica {fault.get('replica')} rank {fault.get('rank')} in {where}"


def event_label(event: dict[str, Any]) -> str:
    """One line per event kind, with the numbers a reader looks for first."""
    kind = event.get("event")
    if kind in REPAIR_KINDS:
        ms = (_float(event.get("detect_ms")) or 0.0) + (_float(event.get("total_ms")) or 0.0)
        ranks = event.get("failed_ranks") or "none dead"
        return f"{kind} ({event.get('phase', '')}): ranks {ranks}, {ms:.1f} ms"
    if kind == "hang_detected":
        who = event.get("rank", "?")
        return f"hang: {event.get('reason', '?')} rank {who}, {event.get('action', 'no action')}"
    if kind == "spare_activated":
        return f"spare activated: replicas {event.get('replicas')} ({_float(event.get('transfer_ms')) or 0:.0f} ms)"
    if kind == "replica_formed":
        return f"replica {event.get('replica', '?')} formed (slot {event.get('slot')})"
    if kind == "pool_changed":
        return f"pool: joined {event.get('joined')}, died {event.get('died')}"
    if kind == "stopped":
        return f"stopped: {event.get('reason', '')}"
    return str(kind)
