"""Costs from our own measured runs: run folders (``metrics.jsonl``) or a benchmark's JSON (``compare.json`` /
``headline.json``, written by ``benchmarks/compare.py``).

What is read, and from where (every value comes back with its source in :attr:`Calibration.sources`):

* step time vs quota: undisturbed step records (``step_time_s``, ``microbatches``, ``live_replicas``; processes =
  ``tokens_per_s / tokens_per_s_per_process``), fitted to ``base_s + quota * mb_s * share`` (least squares when
  at least two quotas were seen, else ``base_s = 0``); ``share = processes / devices`` when the run shared
  ``devices`` CPU cores;
* detect + repair: ``repair`` events (``total_ms``; detect = the injected kill's marker time -> repair start,
  else the logged ``detect_ms``);
* state transfer: ``spare_activated`` event time - its repair event's log time, per MB of the newest checkpoint
  folder / ranks per replica;
* checkpoint save: the gap between a checkpoint step's record and the next step's start;
* startup / restart: a run folder's ``config.yaml`` modification time (written by ``runs.run_training`` right
  before the launch) -> the first step's start; a folder whose first step is > 1 resumed: a restart;
* exit: the last record -> the folder's ``output.log`` modification time (written when the job is gone); not
  from a folder whose last step saved a checkpoint (the save would count as exit).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from nanotron_recover.sim.engine import ScheduledFailure
from nanotron_recover.sim.params import Params

__all__ = ["Calibration", "from_run_dirs", "from_benchmark_json", "BenchmarkSchedule", "fit_step_model"]


@dataclass
class Calibration:
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, source: str) -> None:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return
        self.values[name] = value
        self.sources[name] = f"measured: {source}"

    def apply(self, p: Params) -> Params:
        from dataclasses import replace

        return replace(p, sources={**p.sources, **self.sources}, **self.values)


def _median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def fit_step_model(points: Sequence[tuple[int, int, float]], devices: int | None) -> tuple[float, float]:
    """(base_s, mb_s) from (quota, processes, step_s) points: least squares on x = quota * share."""
    xs = [q * (max(1.0, n / devices) if devices else 1.0) for q, n, _ in points]
    ys = [t for _, _, t in points]
    if not xs:
        raise ValueError("no step records to fit")
    if len(set(xs)) < 2:
        return 0.0, statistics.median(ys) / xs[0]
    return _least_squares(xs, ys, proportional_fallback=True)


def fit_affine(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per_x) of y = fixed + per_x * x by least squares; one distinct x: (median y, 0)."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if not xs:
        return float("nan"), float("nan")
    if len(set(xs)) < 2:
        return statistics.median(ys), 0.0
    a, b = _least_squares(xs, ys, proportional_fallback=False)
    if b < 0:  # more processes cannot be cheaper: noise
        return statistics.median(ys), 0.0
    return a, b


def _least_squares(xs: list[float], ys: list[float], proportional_fallback: bool) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if proportional_fallback and (a < 0 or b <= 0):  # noise: fall back to proportional
        return 0.0, statistics.median(y / x for x, y in zip(xs, ys))
    return a, b


# ------------------------------------------------------------------------------------------------ run folders
def _processes(record: dict) -> int | None:
    a, b = record.get("tokens_per_s"), record.get("tokens_per_s_per_process")
    return round(a / b) if a and b else None


def _dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


@dataclass
class _RunSamples:
    """What the run folders measured, before the medians."""

    points: list[tuple[int, int, float]] = field(default_factory=list)  # (microbatches per replica, procs, step s)
    detect: list[float] = field(default_factory=list)
    repair: list[float] = field(default_factory=list)
    repair_ranks: list[int | None] = field(default_factory=list)
    transfer_ms_mb: list[float] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    exits: list[float] = field(default_factory=list)


def from_run_dirs(dirs: Sequence[str | Path], devices: int | None = None) -> Calibration:
    """Calibrate from run folders of ``nanotron-recover train`` (read through :mod:`nanotron_recover.run_folder`)."""
    cal, samples, names = Calibration(), _RunSamples(), []
    for d in map(Path, dirs):
        if _sample_run(d, samples, cal):
            names.append(d.name)
    _set_from_samples(cal, samples, ", ".join(names) or "no run", devices)
    return cal


def _sample_run(d: Path, out: _RunSamples, cal: Calibration) -> bool:
    """Add one run folder's measurements to ``out`` (False: it logged no step)."""
    import yaml

    from nanotron_recover.run.job_shape import ranks_per_replica
    from nanotron_recover.run.run_folder import read_kills, read_metrics

    steps, events = read_metrics(d)
    if not steps:
        return False
    cfg = yaml.safe_load((d / "config.yaml").read_text()) or {} if (d / "config.yaml").is_file() else {}
    rpr = ranks_per_replica(cfg)  # HSDP: the shard group
    for i, s in enumerate(steps):
        n = _processes(s)
        if i < 2 or s.get("recoveries") or not n or not s.get("live_replicas"):
            continue
        out.points.append((math.ceil(s["microbatches"] / s["live_replicas"]), n, float(s["step_time_s"])))
    reps = [e for e in events if e.get("event") == "repair"]
    _sample_repairs(reps, [k for k in read_kills(d) if k["time"] is not None], rpr, out)
    ckpt_dir = d / ((cfg.get("checkpoints") or {}).get("checkpoints_path") or "checkpoints")
    folders = sorted((p for p in ckpt_dir.glob("[0-9]*") if p.is_dir()), key=lambda p: int(p.name)) \
        if ckpt_dir.is_dir() else []
    state_mb = _dir_size_mb(folders[-1]) / max(1, rpr) if folders else None
    for e in events:
        if e.get("event") == "spare_activated" and state_mb:
            rep = [r for r in reps if r["time"] <= e["time"]]
            if rep:
                out.transfer_ms_mb.append((e["time"] - rep[-1]["time"]) * 1000 / state_mb)
    by_step = {s["step"]: s for s in steps}
    for f in folders:
        k = int(f.name)
        if k in by_step and k + 1 in by_step:
            nxt = by_step[k + 1]
            out.saves.append(nxt["time"] - nxt["step_time_s"] - by_step[k]["time"])
    _sample_launches(d, steps, events, {int(f.name) for f in folders}, out)
    if state_mb:
        cal.set("state_gb_per_rank", state_mb / 1024, f"newest checkpoint of {d.name} / {rpr} ranks")
    return True


def _sample_repairs(reps: list[dict], kills: list[dict], rpr: int, out: _RunSamples) -> None:
    """Detection (the injector's kill -> the repair's start) and repair times."""
    for e in reps:
        out.repair.append(e["total_ms"] / 1000)
        out.repair_ranks.append(len(e.get("live_replicas") or []) * rpr or None)
        start = float(e.get("wall_time", e["time"])) - e["total_ms"] / 1000
        before = [k["time"] for k in kills if k["time"] <= start]
        out.detect.append(start - max(before) if before else e.get("detect_ms", 0) / 1000)


def _sample_launches(d: Path, steps: list[dict], events: list[dict], checkpointed: set[int], out: _RunSamples) -> None:
    """Start-up (config written -> first step), relaunches appended to the same folder (requeue), job ends."""
    first = steps[0]
    if (d / "config.yaml").is_file():
        up = first["time"] - first["step_time_s"] - (d / "config.yaml").stat().st_mtime
        (out.restarts if first["step"] > 1 else out.startups).append(up)
    for prev, cur in zip(steps, steps[1:]):
        if cur["time"] - cur["step_time_s"] > prev["time"] + 1.0 and cur["step"] <= prev["step"] + 1 \
                and any(e.get("event") == "stopped" and prev["time"] <= e["time"] <= cur["time"] for e in events):
            out.restarts.append(cur["time"] - cur["step_time_s"] - prev["time"])
    if (d / "output.log").is_file() and steps[-1]["step"] not in checkpointed:
        out.exits.append((d / "output.log").stat().st_mtime - max(r["time"] for r in steps + events))


def _set_from_samples(cal: Calibration, samples: _RunSamples, src: str, devices: int | None) -> None:
    if samples.points:
        base, mb = fit_step_model(samples.points, devices)
        cal.set("base_s", base, f"{len(samples.points)} step records of {src}")
        cal.set("mb_s", mb, f"{len(samples.points)} step records of {src}")
        cal.set("devices", devices, "the machine the runs shared (cores)")
    cal.set("detect_s", _median(samples.detect), f"{len(samples.detect)} repair events")
    cal.set("repair_s", _median(samples.repair), f"{len(samples.repair)} repair events")
    ranks = _median([r for r in samples.repair_ranks if r])
    cal.set("repair_ranks", ranks and int(ranks), "ranks in those repairs")
    tm = _median(samples.transfer_ms_mb)
    if tm:
        cal.set("transfer_gb_per_s", 1000 / tm / 1.024,
                f"{len(samples.transfer_ms_mb)} spare activations ({tm:.3g} ms/MB)")
    s = _median(samples.saves)
    if s is not None and "state_gb_per_rank" in cal.values:
        cal.set("ckpt_fixed_s", 0.0, "save time taken as size / bandwidth")
        cal.set("storage_gb_per_s", cal.values["state_gb_per_rank"] / max(s, 1e-6),
                f"{len(samples.saves)} checkpoint saves")
    cal.set("startup_s", _median(samples.startups),
            f"{len(samples.startups)} launches (config.yaml mtime -> first step)")
    r = _median(samples.restarts)
    if r is not None:
        # one node: restart_per_node_s cannot be measured here and keeps its anchor
        cal.set("restart_fixed_s", r, f"{len(samples.restarts)} relaunches (checkpoint load not separated)")
    cal.set("exit_s", _median(samples.exits), f"{len(samples.exits)} job ends (last record -> output.log)")


# ---------------------------------------------------------------------------------------------- benchmark JSON
@dataclass(frozen=True)
class BenchmarkSchedule:
    """What a comparison ran: enough to simulate it again."""

    dp: int
    accumulation: int
    steps: int
    checkpoint_interval: int
    failures: tuple[ScheduledFailure, ...]
    tokens_per_microbatch: int
    devices: int | None
    measured_ratio: float  # recover / checkpoint-restart effective throughput, as the benchmark measured it
    baseline: str  # ckpt_restart_A (survivors) or ckpt_restart_B (full size)


def _time_of(segments: Sequence[Sequence[float]], ps: float) -> float:
    """Invert process-seconds -> wall time along the run's (t0, t1, processes) segments."""
    acc = 0.0
    for t0, t1, n in segments:
        span = (t1 - t0) * n
        if n > 0 and acc + span >= ps - 1e-9:
            return t0 + (ps - acc) / n
        acc += span
    return segments[-1][1]


def _attempt_steps(run: dict) -> list[list[float]]:
    """Wall time of every step record, grouped by attempt, from the run's progress curve and segments as the JSON
    keeps them: after the origin, each attempt has one entry for its launch, then one per step record."""
    prog = run["progress"]
    out, i = [], 1
    for a in run["attempts"]:
        i += 1  # the launch entry
        n = int(a["n_steps_logged"])
        out.append([_time_of(run["segments"], ps) for ps, _ in prog[i:i + n]])
        i += n
    return out


def _first_startup(run: dict, step_s: float) -> float:
    a = run["attempts"][0]
    first = _attempt_steps(run)[0]
    return (first[0] - step_s - a["launch_t"]) if first else float("nan")


def from_benchmark_json(path: str | Path) -> tuple[Calibration, Calibration, BenchmarkSchedule]:
    """(stock-path costs, ReCoVer-path costs, schedule) from a comparison's JSON (``headline.json``).

    Each cost is the median over every run of that path in the file, not the value of the run it will be
    compared with: the stock path's startup from ``reference`` and both checkpoint-restart variants' first
    launches, its restart from every relaunch of both variants, and so on."""
    data = json.loads(Path(path).read_text())
    runs, name = data["runs"], Path(path).name
    stock = [r for n, r in runs.items() if n == "reference" or n.startswith("ckpt_restart")]
    rec = [r for n, r in runs.items() if n in ("recover", "recover_ff", "shrinking")]
    ref = runs.get("reference") or stock[0]
    a0 = ref["attempts"][0]
    dp, acc = int(a0["dp"]), int(a0["accumulation"])
    cores = os.cpu_count()
    machine = str(data.get("machine", ""))
    if machine.split(" ")[0].isdigit() and "CPU only" in machine:
        cores = int(machine.split(" ")[0])
    ends = _job_ends(runs)
    stock_cal = _path_calibration(stock, "the stock path", name, dp, acc, cores, ends)
    fails = [f for r in stock if r["name"].startswith("ckpt_restart") for f in r.get("failures", [])]
    stock_cal.set("teardown_s", _median(f.get("detect_teardown_s") for f in fails), f"kill -> mpirun exit, {name}")
    saves = [s for r in stock for s in r.get("checkpoint_save_s", [])]
    rec_cal = _path_calibration(rec, "the ReCoVer path", name, dp, acc, cores, ends)
    for cal in (stock_cal, rec_cal):  # the same checkpoint code on both paths
        cal.set("ckpt_fixed_s", _median(saves), f"{len(saves)} checkpoint saves in {name}")
        cal.set("state_gb_per_rank", 0.0, "save time measured whole (ckpt_fixed_s)")
    rfails = [f for r in rec for f in r.get("failures", []) if "detect_s" in f]
    rec_cal.set("detect_s", _median(f["detect_s"] for f in rfails), f"{len(rfails)} failures in {name}")
    rec_cal.set("repair_s", _median(f["repair_s"] for f in rfails), f"{len(rfails)} failures in {name}")
    rec_cal.set("repair_ranks", dp, "processes of the job")
    return stock_cal, rec_cal, _schedule(data, stock, ref, dp, acc, cores)


def _step_median(rs: list[dict]) -> float:
    diffs = []
    for r in rs:
        for ts in _attempt_steps(r):
            diffs += [b - a for a, b in zip(ts[2:], ts[3:])]  # the first steps of a job are slower
    return statistics.median(diffs)


_JobEnds = tuple[list[tuple[int, float]], list[tuple[int, float]], list[tuple[int, float]]]


def _job_ends(runs: dict[str, dict]) -> _JobEnds:
    """Launches (first and relaunches, both paths), clean job ends, and job ends after failures, against the
    processes of the job: ``(processes, seconds)``."""
    launches, clean_exits, exits_after_failure = [], [], []
    for r in runs.values():
        step = _step_median([r])
        had_failure = bool(r.get("failures"))
        for a, ts in zip(r["attempts"], _attempt_steps(r)):
            if ts:
                launches.append((a["n_procs"], ts[0] - step - a["launch_t"]))
                in_place = not r["name"].startswith("ckpt")  # an in-place run's kills do not end its job
                if a["returncode"] == 0 and (in_place or not a["kills"]):
                    (exits_after_failure if had_failure and in_place else clean_exits).append(
                        (a["n_procs"], a["end_t"] - ts[-1])
                    )
    return launches, clean_exits, exits_after_failure


def _path_calibration(
    rs: list[dict], what: str, name: str, dp: int, acc: int, cores: int | None, ends: _JobEnds
) -> Calibration:
    launches, clean_exits, exits_after_failure = ends
    cal = Calibration()
    step = _step_median(rs)
    cal.set("base_s", 0.0, "one quota x share value only")
    cal.set(
        "mb_s",
        step / (acc * dp / cores),
        f"median step {step:.3f} s of {what} in {name} at {dp} processes, quota {acc}, {cores} cores",
    )
    cal.set("devices", cores, f"{name}: machine line")
    fixed, per = fit_affine(launches)
    cal.set("restart_fixed_s", fixed, f"{len(launches)} launches (first + relaunches) in {name}, vs processes")
    cal.set("restart_per_process_s", per, f"{len(launches)} launches in {name}, vs processes")
    fixed, per = fit_affine(clean_exits)
    cal.set("exit_s", fixed, f"{len(clean_exits)} clean job ends (last record -> job gone) in {name}")
    cal.set("exit_per_process_s", per, f"{len(clean_exits)} clean job ends in {name}, vs processes")
    cal.set("exit_after_failure_s", _median(e for _, e in exits_after_failure),
            f"{len(exits_after_failure)} ReCoVer job ends after failures in {name}")
    return cal


def _schedule(data: dict, stock: list[dict], ref: dict, dp: int, acc: int, cores: int | None) -> BenchmarkSchedule:
    """What the headline's checkpoint-restart baseline ran, to simulate it again."""
    runs = data["runs"]
    tpm = int(round(ref["committed_tokens"] / ref["final_step"] / (dp * acc)))
    ck = runs.get(data.get("headline", {}).get("baseline", "ckpt_restart_A")) or stock[-1]
    interval = int(ck.get("checkpoint_interval") or 0)
    kill_fraction = 0.5  # a SIGKILL in the backward pass: about half-way through the step
    events = tuple(
        ScheduledFailure(f["step"] - 1 + kill_fraction, tuple(f["replicas"])) for f in ck.get("failures", [])
    )
    return BenchmarkSchedule(
        dp,
        acc,
        int(ck["target_steps"]),
        interval,
        events,
        tpm,
        cores,
        float(data["headline"]["recover_vs_ckpt_restart_effective_throughput"]),
        ck["name"],
    )
