"""Checkpoint-restart baseline driver (stock nanotron behaviour).

The stock path (``fault_tolerance.enabled: false``: one torch world, DDP over gloo, no MPI in the step) saves a
checkpoint every K steps. The failure schedule SIGKILLs a rank; plain ``mpirun`` then kills the whole job. The
driver relaunches the same command on a fresh run dir that shares the checkpoint folder, so the job resumes from
``latest.txt`` and recomputes the steps since that checkpoint, until the target step:

* variant A (``--variant A``): relaunch on the surviving replicas only (fewer processes); the global batch stays
  M microbatches by raising ``batch_accumulation_per_replica`` (M must divide by every surviving replica count);
* variant B (``--variant B``): relaunch at the original size (the failed hardware was replaced).

Per failure it measures: detect/teardown (kill -> mpirun exit), restart (launch -> first step start: imports,
rendezvous, model build, checkpoint load; from the first step record's ``time - step_time_s``), the recomputed
steps and their time, and the total time until the relaunched job is back at the step it lost.

Example:
  .venv/bin/python benchmarks/ckpt_restart.py --dp 4 --accumulation 2 --steps 12 --checkpoint-interval 4 \
      --fail 6:3 --variant both --out runs/bench/ckpt_restart
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import ModelSize, add_size_args, make_config, n_processes, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import (  # noqa: E402
    command_line,
    machine_line,
    md_table,
    median,
    plot_loss_and_progress,
    write_json,
)
from benchmarks.lib.timeline import Attempt, RunSummary, checkpoint_save_times, launch, summarize  # noqa: E402


@dataclass(frozen=True)
class FailureEvent:
    """At ``step`` (phase ``phase``) rank ``rank`` of each replica in ``replicas`` (original ids) is SIGKILLed."""

    step: int
    replicas: tuple[int, ...]
    phase: str = "backward"
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "FailureEvent":
        """``STEP:R[,R...]`` e.g. ``13:7,6``."""
        step, _, reps = text.partition(":")
        return cls(int(step), tuple(int(r) for r in reps.split(",") if r != ""))

    def describe(self) -> str:
        return f"step {self.step}: replicas {','.join(map(str, self.replicas))} ({self.phase})"


def inject_entries(events: Sequence[FailureEvent], index_of: dict[int, int]) -> list[dict]:
    """The YAML ``fault_tolerance.inject`` list, with original replica ids mapped to this job's indices."""
    return [
        {"step": e.step, "replica": index_of[r], "rank": e.rank, "phase": e.phase}
        for e in events
        for r in e.replicas
        if r in index_of
    ]


def run_ckpt_restart(*, name: str, out_dir: Path, dp: int, accumulation: int, steps: int, checkpoint_interval: int,
                     events: Sequence[FailureEvent], variant: str, size: ModelSize, tp: int = 1, pp: int = 1,
                     max_launches: int = 10, timeout_s: float = 900) -> RunSummary:
    """The stock path under checkpoint-restart: launch, lose replicas, relaunch from the last checkpoint (variant A:
    on the survivors, M kept; B: at full size) until ``steps`` are done."""
    if variant not in ("A", "B"):
        raise ValueError(f"variant must be A or B, got {variant!r}")
    out_dir = Path(out_dir).resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    ckpt_dir = out_dir / "checkpoints"
    M = dp * accumulation
    alive = list(range(dp))  # original replica ids still in the job (variant A)
    pending = sorted(events, key=lambda e: e.step)
    attempts: list[Attempt] = []
    failures: list[dict] = []
    while True:
        if len(attempts) >= max_launches:
            raise RuntimeError(f"{name}: no progress after {max_launches} launches")
        cur = alive if variant == "A" else list(range(dp))
        if M % len(cur):
            raise ValueError(f"variant A: M={M} is not divisible by {len(cur)} surviving replicas")
        config = make_config(
            dp=len(cur), accumulation=M // len(cur), steps=steps, size=size, tp=tp, pp=pp,
            fault_tolerance={"enabled": False, "inject": inject_entries(pending, {r: i for i, r in enumerate(cur)})},
            checkpoint_interval=checkpoint_interval, checkpoints_path=str(ckpt_dir),
        )
        attempt = _launch(name, config, out_dir, len(attempts) + 1, pending, timeout_s)
        attempts.append(attempt)
        last = attempt.steps[-1]["step"] if attempt.steps else attempt.resumed_from
        if last >= steps and not attempt.kills:
            break
        fired = [e for e in pending if any(k.step == e.step for k in attempt.kills)]
        if not fired:
            out = (Path(attempt.run_dir) / "output.log").read_text()[-4000:]
            raise RuntimeError(f"{name}: job ended at step {last} without an injected failure:\n{out}")
        for e in fired:
            pending.remove(e)
            if variant == "A":
                alive = [r for r in alive if r not in e.replicas]
        failures.append({"step": min(e.step for e in fired), "replicas": [r for e in fired for r in e.replicas],
                         "kill_t": attempt.kills[0].t})
    summary = summarize(name, attempts, steps, tp * pp)
    summary.extra.update(
        variant=variant,
        checkpoint_interval=checkpoint_interval,
        failures=_failure_breakdown(attempts, failures),
        checkpoint_save_s=[t for a in attempts for t in checkpoint_save_times(a, checkpoint_interval)],
        steps_executed=sum(len(a.steps) for a in attempts),
    )
    summary.extra["recomputed_steps"] = summary.extra["steps_executed"] - len(summary.trajectory)
    return summary


def _launch(name: str, config: dict, out_dir: Path, n: int, pending: Sequence[FailureEvent],
            timeout_s: float) -> Attempt:
    """The n-th launch of the job, said before and after."""
    par = config["parallelism"]
    print(f"[{name}] launch {n}: dp={par['dp']} x accumulation={config['tokens']['batch_accumulation_per_replica']} "
          f"({n_processes(config)} processes), pending failures: {[e.describe() for e in pending] or 'none'}",
          flush=True)
    attempt = launch(config, out_dir / f"launch{n}", timeout_s=timeout_s)
    last = attempt.steps[-1]["step"] if attempt.steps else attempt.resumed_from
    print(f"[{name}]   exit {attempt.returncode} after {attempt.end_t - attempt.launch_t:.1f} s, "
          f"steps {attempt.resumed_from + 1}..{last}, kills at steps {sorted({k.step for k in attempt.kills})}",
          flush=True)
    return attempt


def _failure_breakdown(attempts: list[Attempt], failures: list[dict]) -> list[dict]:
    out = []
    for i, f in enumerate(failures):
        dead, nxt = attempts[i], attempts[i + 1]
        kill_t, s = f["kill_t"], f["step"]
        by_step = {r["step"]: r for r in nxt.steps}
        back = by_step.get(s - 1)
        redo = [by_step[k] for k in range(nxt.resumed_from + 1, s) if k in by_step]
        first = nxt.first_step_start
        lost_before_kill = kill_t - (
            max((r["time"] for r in dead.steps if r["step"] == nxt.resumed_from), default=dead.launch_t)
        )
        out.append({
            "step": s,
            "replicas": f["replicas"],
            "resumed_from": nxt.resumed_from,
            "recomputed_steps": max(0, s - 1 - nxt.resumed_from),
            "lost_work_before_kill_s": lost_before_kill,  # steps since the checkpoint + the partial failure step
            "detect_teardown_s": dead.end_t - kill_t,  # kill -> mpirun exit (the whole job is torn down)
            "relaunch_gap_s": nxt.launch_t - dead.end_t,  # driver bookkeeping between the jobs
            "restart_s": (first - nxt.launch_t) if first else None,  # imports, rendezvous, build, ckpt load
            "recompute_s": (back["time"] - first) if (back and first) else 0.0,  # redo of the lost steps
            "recompute_step_time_sum_s": sum(r["step_time_s"] for r in redo),
            "total_s": ((back["time"] if back else first or nxt.launch_t) - kill_t),  # kill -> back at step s-1
        })
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2, help="batch_accumulation_per_replica of the full job")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--checkpoint-interval", type=int, default=4)
    ap.add_argument("--fail", action="append", default=None, help="STEP:R[,R...] (original replica ids); repeat")
    ap.add_argument("--variant", choices=["A", "B", "both"], default="both")
    ap.add_argument("--out", default="runs/bench/ckpt_restart")
    ap.add_argument("--timeout-s", type=float, default=900)
    add_size_args(ap)
    args = ap.parse_args(argv)
    events = [FailureEvent.parse(f) for f in (args.fail or ["6:3"])]
    out = Path(args.out)
    size = size_from_args(args)
    results = {}
    for v in (["A", "B"] if args.variant == "both" else [args.variant]):
        s = run_ckpt_restart(name=f"ckpt_restart_{v}", out_dir=out / f"variant_{v}", dp=args.dp,
                             accumulation=args.accumulation, steps=args.steps,
                             checkpoint_interval=args.checkpoint_interval, events=events, variant=v, size=size,
                             timeout_s=args.timeout_s)
        results[v] = s
    data = {"command": command_line(argv, "benchmarks/ckpt_restart.py"), "machine": machine_line(),
            "model": size.describe(), "runs": {v: s.as_dict() for v, s in results.items()}}
    write_json(out / "ckpt_restart.json", data)
    write_record("ckpt_restart", argv=argv, command=data["command"], args=args, samples=data, figures=figures(data))
    md = [f"command: `{data['command']}`", f"machine: {data['machine']}", "",
          summary_table(list(results.values())), "", failure_table(list(results.values()))]
    (out / "ckpt_restart.md").write_text("\n".join(md) + "\n")
    plot_runs(list(results.values()), out / "ckpt_restart.png")
    print("\n".join(md))
    return data


def figures(data: dict) -> dict[str, float]:
    """The record's figures of a ``ckpt_restart.json``, per variant: effective throughput, recomputed steps, and
    the median restart (launch -> first step) and total (kill -> back at the lost step) per failure."""
    out: dict[str, float] = {}
    for v, run in data["runs"].items():
        fails = run.get("failures", [])
        out.update({f"{v}_tokens_per_process_s": run["effective_throughput_tokens_per_process_s"],
                    f"{v}_recomputed_steps": run.get("recomputed_steps", 0),
                    f"{v}_restart_s": median(f["restart_s"] for f in fails if f.get("restart_s") is not None),
                    f"{v}_failure_s": median(f["total_s"] for f in fails if "total_s" in f)})
    return out


# --------------------------------------------------------------------------------------------- report pieces
def summary_table(runs: Sequence[RunSummary]) -> str:
    rows = []
    for r in runs:
        rows.append([r.name, r.final_step, len(r.attempts), round(r.wall_s, 1), round(r.process_seconds, 1),
                     r.committed_tokens, round(r.effective_throughput, 2), r.extra.get("recomputed_steps", 0),
                     r.final_loss])
    return md_table(["run", "final step", "launches", "wall s", "process-s", "committed tokens",
                        "eff. throughput (tok/s/process)", "recomputed steps", "final loss"], rows)


def failure_table(runs: Sequence[RunSummary]) -> str:
    rows = []
    for r in runs:
        for f in r.extra.get("failures", []):
            if "detect_teardown_s" in f:
                rows.append([r.name, f["step"], ",".join(map(str, f["replicas"])), f["detect_teardown_s"],
                             f["relaunch_gap_s"], f["restart_s"], f["recomputed_steps"], f["recompute_s"],
                             f["total_s"]])
    return md_table(["run", "fail step", "replicas", "detect+teardown s", "relaunch gap s",
                        "restart s (launch->1st step)", "recomputed steps", "recompute s",
                        "total s (kill->back at step-1)"], rows)


def plot_runs(runs: Sequence[RunSummary], path: Path, title: str = "") -> None:
    plot_curves({r.name: ({s: r.trajectory[s]["loss"] for s in r.trajectory}, r.progress) for r in runs}, path, title)


def plot_curves(curves: dict[str, tuple[dict[int, float], list]], path: Path, title: str = "") -> None:
    """``curves``: name -> ({step: loss}, [(process-seconds, committed tokens), ...]). Three panels: loss, |loss
    minus the ``reference`` run's| (when there is one), committed tokens vs process-seconds (the run report's
    plotting code: ``benchmarks.lib.report.plot_loss_and_progress``)."""
    plot_loss_and_progress(curves, path, title)


def replot(json_path: Path, png_path: Path) -> None:
    """Redraw the figure of a compare/headline/ckpt_restart JSON (no training run)."""
    import json

    data = json.loads(Path(json_path).read_text())
    runs = {n: r for n, r in data["runs"].items() if n != "recover_ff"}
    curves = {n: ({int(k): v for k, v in r["losses"].items()}, r["progress"]) for n, r in runs.items()}
    plot_curves(curves, png_path, data.get("setup", ""))


if __name__ == "__main__":
    main()
