"""A randomized fault campaign: N real jobs, each with a fault drawn from a seed, and invariants checked after each.

Every trial runs a real job through the user's launcher (``nanotron-recover train``) under ``mpirun --with-ft
ulfm``, sends its faults for real (SIGKILL / SIGSTOP of ranks or of mpirun by pid, from outside; or a schedule
the ranks fire themselves at a named phase, ``fault_tolerance.inject``; or a fake node lost whole, its daemon
and ranks SIGKILLed and its node-local snapshots removed, on the fake-node bed with one replica per node),
relaunches while the launcher says "restart" (exit 3; a lost node's trial on a fresh bed of the same size), and
then checks:

* the job ended by itself: every launch within ``--launch-bound-s`` (no stall), at most ``--relaunches``;
* the outcome is done, directly or after relaunches that each followed exit 3; a ``checkpoint-damage`` trial damages
  one file of the finished run's final checkpoint and relaunches (it must fall back to the previous intact
  checkpoint: ``done->damaged->done``); a ``non-finite`` trial must end with exit 2 with no step from the poisoned
  one logged or saved, and is relaunched with the fault removed (``person->done``);
* every committed step has exactly M microbatches, and every logged loss (replays after a relaunch included)
  equals the failure-free run of the same shape within the tolerance (1e-5 in fp32, whose summation-order floor
  is ~1e-7; in bf16 3x the floor measured here, a failure-free run with another split of the same M);
* the final weights equal the failure-free run's within the same tolerance;
* no rank process and no node-local snapshot file of the run is left afterwards;
* no rank outside a frozen or hung replica was killed by the hang monitor (false kills are counted apart, with
  the load average at the time: they lose a replica, never data).

Prints one line per trial (its seed first), a tally of kind x outcome, and the campaign's seed; a failing trial
reruns alone with ``--seed <its seed> --trials 1``. The last line is ``campaign_trials=N failures=F stalls=S
false_kills=K seed=S``. Minimal: ``python benchmarks/fault_campaign.py --trials 3``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.campaign import KINDS, SHAPES, SHAPES_BY_NAME, STEPS, ExternalFault, Shape, Trial, draw_trial  # noqa: E402
from benchmarks.lib.checkpoint_damage import damage_final_checkpoint  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from nanotron_recover.launcher.runs import (  # noqa: E402
    final_checkpoint,
    max_relative_param_diff,
    mpirun_pid,
    rank_pids,
    rank_processes,
    standby_ready,
    write_config,
)
from nanotron_recover.run.exit_codes import EXIT_DONE, EXIT_NEEDS_PERSON, EXIT_RESTART  # noqa: E402
from nanotron_recover.run.procfs import proc_stat  # noqa: E402
from nanotron_recover.run.run_folder import (  # noqa: E402
    latest_checkpoint_step,
    read_launches,
    read_metrics_jsonl,
    record_external_fault,
    run_id,
)
from nanotron_recover.testbed.fake_nodes import kill_node, write_bed  # noqa: E402

FP32_TOL = 1e-5


# ------------------------------------------------------------------------------------------------ processes
def _signal(pid: int | None, sig: str) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL if sig == "kill" else signal.SIGSTOP)
    except ProcessLookupError:
        pass


def _last_step(run_dir: Path) -> int:
    return max((int(r["step"]) for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r), default=0)


# ------------------------------------------------------------------------------------------------ one launch
@dataclass
class Launch:
    rc: int | None  # None: stalled (killed at the bound)
    wall_s: float
    sent: list[str] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)  # faults whose moment never came (the job ended first)


def run_launch(config_path: Path, run_dir: Path, faults: Sequence[ExternalFault], bound_s: float,
               bed: Path | None = None, in_place: int = 0, after_standby: int | None = None) -> Launch:
    """One launch through the user's launcher; ``faults`` are sent from outside at their moments. With ``bed``
    (a fake-node bed already written there) the job runs on its nodes. ``in_place``: the launcher's
    ``--max-restarts`` (0: the harness relaunches after exit 3; more: the launcher first relaunches in place, from
    its warm standby when one is ready). ``after_standby``: the job's world size, when the faults must also wait
    until the launcher's warm standby is ready (the warm relaunch exercised)."""
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", str(in_place)]
    env = {**os.environ, **bed_env(bed)} if bed is not None else None
    t0 = time.monotonic()
    with open(run_dir / "launcher.log", "ab") as log:
        launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    pending = sorted(faults, key=lambda f: (f.after_step, f.delay_s))
    sent: list[str] = []
    due: float | None = None
    while launcher.poll() is None:
        now = time.monotonic()
        if now - t0 > bound_s:
            _kill_all(launcher, run_dir)
            return Launch(None, now - t0, sent)
        if pending:
            fault = pending[0]
            ready = bool(rank_pids(run_dir)) if fault.after_step == 0 else _last_step(run_dir) >= fault.after_step
            ready = ready and (after_standby is None or standby_ready(launcher.pid, after_standby))
            if ready and due is None:
                due = now + fault.delay_s
            if due is not None and now >= due:
                pending.pop(0)
                due = None
                record_external_fault(run_dir, f"{fault.signal}-" + ("-".join(map(str, fault.ranks)) or
                                                                    fault.node or "mpirun"))
                if fault.node is not None and bed is not None:
                    lose_node(bed, fault.node, run_dir, config_path)
                elif fault.ranks:
                    pids = rank_pids(run_dir)
                    for rank in fault.ranks:
                        _signal(pids.get(rank), fault.signal)
                else:
                    _signal(mpirun_pid(launcher.pid), fault.signal)  # a frozen one: the launcher must end it
                sent.append(f"{fault.describe()} at {now - t0:.1f} s")
        time.sleep(0.05)
    return Launch(launcher.returncode, time.monotonic() - t0, sent, [f.describe() for f in pending])


def bed_env(bed: Path) -> dict[str, str]:
    return json.loads((bed / "env.json").read_text())


def make_bed(folder: Path, slots_per_node: Sequence[int]) -> Path:
    """A fresh fake-node bed (one real ``prted`` per node, started by the launch); its environment in env.json."""
    shutil.rmtree(folder, ignore_errors=True)
    env = write_bed(folder, slots_per_node)
    (folder / "env.json").write_text(json.dumps(env))
    return folder


def lose_node(bed: Path, node: str, run_dir: Path, config_path: Path) -> None:
    """The node's daemon and ranks SIGKILLed, and its memory gone: its node-local snapshot folder removed."""
    kill_node(bed, node)
    store = Path(yaml.safe_load(config_path.read_text())["fault_tolerance"]["local_snapshot_dir"])
    shutil.rmtree(store / run_id(run_dir) / node, ignore_errors=True)


def _kill_all(launcher: subprocess.Popen, run_dir: Path) -> None:
    for pid in rank_processes(run_dir):
        _signal(pid, "kill")
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()


# ------------------------------------------------------------------------------------------------ references
@dataclass
class Reference:
    losses: dict[int, float]
    checkpoint: Path
    tol: float


def code_hash() -> str:
    """A hash of the package's code: a cached reference counts only for the code that made it."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1] / "src" / "nanotron_recover"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cached(marker: Path) -> bool:
    """Whether ``marker`` (a reference's ``done`` file) was written by this code."""
    return marker.is_file() and marker.read_text().strip() == code_hash()


def reference_of(shape: Shape, out: Path, bound_s: float) -> Reference:
    """The failure-free run of ``shape`` (cached under ``out`` for the same code); bf16 also measures its floor."""
    run_dir = out / "references" / shape.name
    if not _cached(run_dir / "done"):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        path = write_config(shape.config([], str(out / "shm" / f"ref-{shape.name}")), run_dir / "config.yaml")
        launch = run_launch(path, run_dir, [], bound_s)
        if launch.rc != EXIT_DONE:
            raise RuntimeError(f"the failure-free {shape.name} run failed (exit {launch.rc}): {run_dir}")
        (run_dir / "done").write_text(code_hash() + "\n")
    losses = {int(r["step"]): float(r["loss"]) for r in read_metrics_jsonl(run_dir) if "event" not in r}
    tol = FP32_TOL
    if shape.dtype != "float32":
        tol = max(FP32_TOL, 3 * _bf16_floor(shape, out, losses, bound_s))
    return Reference(losses, final_checkpoint(run_dir), tol)


def _bf16_floor(shape: Shape, out: Path, losses: dict[int, float], bound_s: float) -> float:
    """Failure-free, the same M on half the replicas (twice the accumulation): the summation-order floor."""
    run_dir = out / "references" / f"{shape.name}-floor"
    if not (run_dir / "floor.json").exists() or not _cached(run_dir / "done"):
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        config = shape.config([], str(out / "shm" / f"floor-{shape.name}"))
        config["parallelism"]["dp"] = shape.dp // 2
        config["tokens"]["batch_accumulation_per_replica"] *= 2
        launch = run_launch(write_config(config, run_dir / "config.yaml"), run_dir, [], bound_s)
        if launch.rc != EXIT_DONE:
            raise RuntimeError(f"the {shape.name} floor run failed (exit {launch.rc}): {run_dir}")
        other = {int(r["step"]): float(r["loss"]) for r in read_metrics_jsonl(run_dir) if "event" not in r}
        (run_dir / "floor.json").write_text(json.dumps(max(abs(other[s] - losses[s]) for s in losses)))
        (run_dir / "done").write_text(code_hash() + "\n")
    return float(json.loads((run_dir / "floor.json").read_text()))


# ------------------------------------------------------------------------------------------------ one trial
@dataclass
class TrialResult:
    trial: Trial
    outcome: str  # "done" | "restart->done" | "done->damaged->done" | "person->done" | "FAIL" | "STALL"
    problems: list[str]
    launches: int
    wall_s: float
    false_kills: list[str]
    max_dloss: float
    in_place: int = 0  # relaunches the launcher made itself (--in-place)
    warm: int = 0  # of those, from its warm standby
    unsent: list[str] = field(default_factory=list)  # faults whose moment never came

    def line(self) -> str:
        verdict = "ok" if not self.problems else "FAILED: " + "; ".join(self.problems)
        fk = f" false kills: {self.false_kills}" if self.false_kills else ""
        ip = f" in place {self.in_place} (warm {self.warm})" if self.in_place else ""
        fk += f" never sent (the job ended first): {self.unsent}" if self.unsent else ""
        return (f"seed {self.trial.seed:>6} {self.trial.shape.name:<8} {self.trial.kind:<19} {self.outcome:<14} "
                f"launches {self.launches}{ip} {self.wall_s:5.1f} s max|dloss| {self.max_dloss:.1e} "
                f"[{self.trial.describe()}] {verdict}{fk}")


def run_trial(trial: Trial, out: Path, reference: Reference, *, bound_s: float, relaunches: int,
              in_place: int = 0, after_standby: bool = False) -> TrialResult:
    shape = trial.shape
    run_dir = out / "trials" / f"{trial.seed}-{shape.name}-{trial.kind}"
    shm = Path("/dev/shm") / f"nanotron-recover-campaign-{os.getuid()}" / f"{trial.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    run_dir.mkdir(parents=True)
    problems: list[str] = []
    outcome, launches = _launch_until_done(trial, out, run_dir, str(shm), problems, bound_s, relaunches, in_place,
                                           shape.world_size if after_standby else None)
    recorded = read_launches(run_dir)  # the launcher's own launches, in place ones included
    max_dloss = _check_records(run_dir, shape, reference, problems)
    if outcome.endswith("done"):
        try:
            rel = max_relative_param_diff(final_checkpoint(run_dir), reference.checkpoint)
            if rel > reference.tol:
                problems.append(f"final weights differ: rel. {rel:.2e} > {reference.tol:.1e}")
        except (FileNotFoundError, OSError, ValueError) as e:
            problems.append(f"final weights: {e}")
    _check_left_behind(run_dir, shm, problems)
    false_kills = _false_kills(run_dir, trial)
    if outcome != "STALL" and problems:
        outcome = "FAIL"
    return TrialResult(trial, outcome, problems, len(launches), sum(launch.wall_s for launch in launches), false_kills,
                       max_dloss, in_place=max(0, len(recorded) - len(launches)),
                       warm=sum(1 for launch in recorded if launch.get("warm")),
                       unsent=[f for launch in launches for f in launch.unsent])


def _launch_until_done(trial: Trial, out: Path, run_dir: Path, shm: str, problems: list[str], bound_s: float,
                       relaunches: int, in_place: int = 0, after_standby: int | None = None
                       ) -> tuple[str, list[Launch]]:
    """Launch, and relaunch as an operator would: after exit 3; after a finished run whose final checkpoint the
    trial then damages; after the non-finite trial's exit 2, with the fault removed. -> (outcome, launches):
    the outcomes in order (``restart->done``, ``done->damaged->done``, ``person->done``), or ``STALL``/``FAIL``."""
    path = write_config(trial.shape.config(trial.inject, shm, trial.settings), run_dir / "config.yaml")
    launches: list[Launch] = []
    said: list[str] = []
    for attempt in range(1 + relaunches + (trial.damage is not None)):
        # a lost node's trial relaunches on a fresh bed of the same size (the node replaced)
        bed = make_bed(out / "beds" / f"{trial.seed}-{attempt}", trial.shape.nodes) if trial.on_bed() else None
        launch = run_launch(path, run_dir, trial.external if attempt == 0 else [], bound_s, bed, in_place,
                            after_standby)
        launches.append(launch)
        if launch.rc is None:
            problems.append(f"launch {attempt + 1} did not end within {bound_s:g} s")
            return "STALL", launches
        if launch.rc == EXIT_DONE and trial.damage is not None and "damaged" not in said:
            problems.extend(damage_final_checkpoint(run_dir, trial.damage))
            said += ["done", "damaged"]
            continue
        if launch.rc == EXIT_DONE:
            return "->".join([*said, "done"]), launches
        if launch.rc == EXIT_NEEDS_PERSON and trial.kind == "non-finite" and "person" not in said:
            _check_nothing_committed_at(run_dir, trial.inject[0]["step"], problems)
            write_config(trial.shape.config([], shm, trial.settings), path)  # the fault removed
            said.append("person")
            continue
        if launch.rc != EXIT_RESTART:
            problems.append(f"launch {attempt + 1} exited {launch.rc} (neither done nor restart)")
            return "FAIL", launches
        said.append("restart")
    problems.append(f"still not done after {relaunches} relaunches")
    return "FAIL", launches


def _check_nothing_committed_at(run_dir: Path, step: int, problems: list[str]) -> None:
    """The non-finite trial's first launch: no step from the poisoned one on logged or checkpointed."""
    logged = [int(r["step"]) for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    if any(s >= step for s in logged):
        problems.append(f"step(s) >= the non-finite step {step} were logged: {sorted(set(logged))}")
    saved = latest_checkpoint_step(run_dir)
    if saved is not None and saved >= step:
        problems.append(f"latest.txt names step {saved} >= the non-finite step {step}")


def _check_records(run_dir: Path, shape: Shape, reference: Reference, problems: list[str]) -> float:
    """Every step record (replays included): M microbatches and the failure-free loss; every step present."""
    records = [r for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    worst = 0.0
    for r in records:
        step = int(r["step"])
        if r.get("microbatches") != shape.M:
            problems.append(f"step {step} committed {r.get('microbatches')} microbatches, not M={shape.M}")
        diff = abs(float(r["loss"]) - reference.losses[step])
        worst = max(worst, diff)
    if worst > reference.tol:
        problems.append(f"max |dloss| {worst:.2e} > {reference.tol:.1e}")
    missing = sorted(set(range(1, shape.steps + 1)) - {int(r["step"]) for r in records})
    if missing:
        problems.append(f"steps never logged: {missing}")
    return worst


def job_processes(run_dir: Path) -> dict[int, str]:
    """``{pid: name}`` of every live process of the run: the launcher, ``mpirun``, the ranks and their watchdogs
    (their command lines name the run folder), and any orphaned MPI daemon (``prted`` whose parent is gone)."""
    needle = str(run_dir).encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = proc_stat(int(entry))
        if stat is None or stat[2] == "Z":
            continue
        try:
            named = needle in Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if named or (stat[1] == "prted" and stat[0] == 1):
            found[int(entry)] = stat[1]
    return found


def _check_left_behind(run_dir: Path, shm: Path, problems: list[str]) -> None:
    """Nothing of the run is left: no process of any kind, no snapshot file on any node."""
    deadline = time.monotonic() + 30
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = job_processes(run_dir)
    if left:
        problems.append(f"processes left 30 s after the end: {sorted(set(left.values()))} ({len(left)})")
        for pid in left:
            _signal(pid, "kill")
    files = [p for p in shm.rglob("*") if p.is_file()] if shm.exists() else []
    if files:
        problems.append(f"{len(files)} snapshot file(s) left in {shm}")
    shutil.rmtree(shm, ignore_errors=True)


def _false_kills(run_dir: Path, trial: Trial) -> list[str]:
    """Hang kills of ranks outside the replicas this trial froze or hung (with the load average when the trial
    ended). A hung rank's replica-mate that waits on it may kill itself as stuck: the replica is the unit of
    failure, so that costs nothing the hang did not cost already."""
    frozen = trial.frozen_ranks()
    if frozen is None:
        return []
    replicas = {r // trial.shape.rpr for r in frozen}
    out = []
    for record in read_metrics_jsonl(run_dir):
        if record.get("event") == "hang_detected" and record.get("reason") in ("silent", "stuck") \
                and record.get("rank") is not None and record["rank"] // trial.shape.rpr not in replicas:
            out.append(f"rank {record.get('rank')} {record['reason']} at step "
                       f"{record.get('step', record.get('last_step'))} (load {os.getloadavg()[0]:.1f})")
    return out


# ------------------------------------------------------------------------------------------------ the campaign
def tally(results: Sequence[TrialResult]) -> str:
    counts = Counter((r.trial.kind, r.outcome) for r in results)
    outcomes = sorted({r.outcome for r in results})
    lines = ["| kind | " + " | ".join(outcomes) + " |", "|---|" + "---|" * len(outcomes)]
    for kind in KINDS:
        if any(k == kind for k, _ in counts):
            lines.append(f"| {kind} | " + " | ".join(str(counts.get((kind, o), 0)) for o in outcomes) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="the first trial's seed (default: from the clock)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", default="runs/bench/fault_campaign")
    ap.add_argument("--launch-bound-s", type=float, default=240.0, help="a launch running longer is a stall")
    ap.add_argument("--relaunches", type=int, default=2)
    ap.add_argument("--recycle", choices=("shape", "on", "off"), default="shape",
                    help="fault_tolerance.recycle in every trial: each shape's own (default), or on / off everywhere")
    ap.add_argument("--settings", choices=("short", "defaults"), default="short",
                    help="the campaign's short timeouts (default) or the settings a user gets (a frozen start-up then "
                         "costs startup_timeout_s, 600 s: give --launch-bound-s 900)")
    ap.add_argument("--in-place", type=int, default=0, metavar="N",
                    help="the launcher's --max-restarts: it relaunches in place up to N times (from its warm standby, "
                         "standby auto) before the harness relaunches after exit 3 (default 0: the harness only)")
    ap.add_argument("--faults-after-standby", action="store_true",
                    help="faults from outside also wait until the launcher's warm standby is ready (with --in-place: "
                         "the warm relaunch; give --steps long enough for a standby to get ready)")
    ap.add_argument("--steps", type=int, default=STEPS, help="each run's length in steps (faults in its first "
                                                              f"{STEPS}, or later with --faults-after-standby)")
    ap.add_argument("--data-plane", choices=("default", "mpi", "torch"), default="default",
                    help="fault_tolerance.data_plane in every trial and reference (default: the config's, auto)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    shapes = tuple(SHAPES_BY_NAME[name] for name in args.shapes.split(","))
    if args.recycle != "shape":
        shapes = tuple(s.with_recycle(args.recycle == "on") for s in shapes)
    if args.data_plane != "default":
        shapes = tuple(s.with_data_plane(args.data_plane) for s in shapes)
    if args.settings == "defaults":
        shapes = tuple(s.with_defaults() for s in shapes)
    shapes = tuple(s.with_steps(args.steps) for s in shapes)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"fault campaign: {args.trials} trials from seed {seed}; recycle {args.recycle}; data plane {args.data_plane};"
        f" settings {args.settings}; in place {args.in_place}; steps {args.steps};"
        f" launch bound {args.launch_bound_s:g} s; out {out}",
        flush=True,
    )
    results = []
    references: dict[str, Reference] = {}
    for i in range(args.trials):
        trial = draw_trial(seed + i, shapes, kinds)
        if trial.shape.name not in references:
            references[trial.shape.name] = reference_of(trial.shape, out, args.launch_bound_s)
        result = run_trial(trial, out, references[trial.shape.name], bound_s=args.launch_bound_s,
                           relaunches=args.relaunches, in_place=args.in_place,
                           after_standby=args.faults_after_standby)
        results.append(result)
        print(result.line(), flush=True)
    failures = sum(1 for r in results if r.outcome == "FAIL")
    stalls = sum(1 for r in results if r.outcome == "STALL")
    false_kills = sum(len(r.false_kills) for r in results)
    in_place, warm = sum(r.in_place for r in results), sum(r.warm for r in results)
    print(tally(results))
    figures = {"trials": len(results), "failures": failures, "stalls": stalls, "false_kills": false_kills, "seed": seed,
               "in_place_relaunches": in_place, "warm_relaunches": warm}
    write_record("fault_campaign", argv=argv, command=command_line(argv, "benchmarks/fault_campaign.py"), args=args,
                 samples={"trials": [r.line() for r in results]}, figures=figures)
    print(f"campaign_trials={len(results)} failures={failures} stalls={stalls} false_kills={false_kills} seed={seed} "
          f"in_place_relaunches={in_place} warm_relaunches={warm}")
    return 1 if failures or stalls else 0


if __name__ == "__main__":
    sys.exit(main())
