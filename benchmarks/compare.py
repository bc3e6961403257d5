"""ReCoVer vs the baselines on one failure schedule: every run of the comparison, one after the other.

Runs (all the same model, M = dp x accumulation global microbatches per step, same target step):

* ``reference``      stock path (torch gloo DDP, fault tolerance off), no failures: the failure-free trajectory;
* ``recover_ff``     ReCoVer, no failures (for the failure-free overhead; ``--no-overhead-run`` skips it);
* ``recover``        ReCoVer (ULFM), the failure schedule: survivors take over the orphaned microbatches;
* ``shrinking``      ReCoVer's world with ``keep_global_batch: false`` (torchft-style shrinking batch);
* ``ckpt_restart_A`` stock path + checkpoints every K steps; each failure kills the job; relaunch from the latest
  checkpoint on the survivors (same M via a larger batch_accumulation_per_replica);
* ``ckpt_restart_B`` the same, relaunched at full size (replaced hardware).

Writes ``compare.json``, ``compare.md`` and ``compare.png`` (loss curves + tokens vs process-seconds) to --out.

Example:
  .venv/bin/python benchmarks/compare.py --dp 4 --accumulation 2 --steps 12 --checkpoint-interval 4 --fail 6:3
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ckpt_restart import FailureEvent, failure_table, inject_entries, plot_runs, run_ckpt_restart  # noqa: E402
from benchmarks.lib.config import (  # noqa: E402
    ModelSize,
    add_size_args,
    make_config,
    n_processes,
    ranks_per_replica,
    size_from_args,
)
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import RunSummary, launch, normal_step_times, summarize  # noqa: E402


def run_single(name: str, out_dir: Path, config: dict, steps: int, timeout_s: float) -> RunSummary:
    out_dir = Path(out_dir).resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    print(f"[{name}] launch: {n_processes(config)} processes", flush=True)
    attempt = launch(config, out_dir, timeout_s=timeout_s)
    last = attempt.steps[-1]["step"] if attempt.steps else 0
    print(f"[{name}]   exit {attempt.returncode} after {attempt.end_t - attempt.launch_t:.1f} s, last step {last}, "
          f"{len([e for e in attempt.events if e.get('event') == 'repair'])} repair event(s)", flush=True)
    if last < steps:
        raise RuntimeError(f"{name}: stopped at step {last} < {steps}:\n"
                           f"{(out_dir / 'output.log').read_text()[-4000:]}")
    s = summarize(name, [attempt], steps, ranks_per_replica(config))
    s.extra["startup_s"] = (attempt.first_step_start - attempt.launch_t) if attempt.first_step_start else None
    return s


def recover_failures(run: RunSummary, events: Sequence[FailureEvent], checkpoint_interval: int | None) -> list[dict]:
    """Recovery time per failure of an in-place run (ReCoVer or shrinking batch).

    detect: kill (the time in the victim's injector marker) -> start of the first repair of that step (repair start =
    the event's ``wall_time - total_ms``); it holds ULFM's failure notice latency plus the rank's own ``detect_ms``.
    repair: the repair events' ``total_ms`` (revoke + shrink + agree + rebuild). restore + orphan recompute: the
    failure step's ``step_time_s`` minus the median step time of up to 3 undisturbed steps before it, minus
    detect and repair (not clipped: a negative value means the step-time noise is larger than this part): bucket
    restore, the failed replicas' microbatches recomputed by the survivors, and the repeated reduction. Nothing finer is
    logged per step, so this is a difference of measured step times and carries their noise.
    """
    a = run.attempts[0]
    steps = a.steps
    by_step = {s["step"]: s for s in steps}
    out = []
    for ev in events:
        kills = [k for k in a.kills if k.step == ev.step]
        repairs = [e for e in a.events if e.get("event") == "repair" and e.get("step") == ev.step]
        if not kills or ev.step not in by_step:
            out.append({"step": ev.step, "replicas": list(ev.replicas), "note": "no kill / step record found"})
            continue
        kill_t = min(k.t for k in kills)
        starts = [float(e["wall_time"]) - e["total_ms"] / 1000 for e in repairs]
        repair_s = sum(e["total_ms"] for e in repairs) / 1000
        detect_s = (min(starts) - kill_t) if starts else float("nan")
        before = [s for s in steps if ev.step - 4 < s["step"] < ev.step]
        normal = median(normal_step_times(before, skip_first=0, checkpoint_interval=checkpoint_interval)
                           or [s["step_time_s"] for s in before])
        fail_step = by_step[ev.step]["step_time_s"]
        overrun = fail_step - normal
        out.append({
            "step": ev.step,
            "replicas": list(ev.replicas),
            "repair_events": len(repairs),
            "detect_s": detect_s,
            "detect_ms_logged": sum(e.get("detect_ms", 0) for e in repairs),
            "repair_s": repair_s,
            "revoke_ms": sum(e.get("revoke_ms", 0) for e in repairs),
            "shrink_ms": sum(e.get("shrink_ms", 0) for e in repairs),
            "agree_ms": sum(e.get("agree_ms", 0) for e in repairs),
            "rebuild_ms": sum(e.get("rebuild_ms", 0) for e in repairs),
            "failure_step_time_s": fail_step,
            "normal_step_time_s": normal,
            "restore_recompute_s": overrun - (detect_s if math.isfinite(detect_s) else 0)
                                   - repair_s,  # may be < 0: noise
            "total_s": overrun,  # what the failure cost this step, end to end
        })
    return out


def recover_failure_table(runs: Sequence[RunSummary]) -> str:
    rows = []
    for r in runs:
        for f in r.extra.get("failures", []):
            if "detect_s" in f:
                rows.append([r.name, f["step"], ",".join(map(str, f["replicas"])), f["detect_s"], f["repair_s"],
                             f["restore_recompute_s"], f["failure_step_time_s"], f["normal_step_time_s"],
                             f["total_s"]])
    return md_table(["run", "fail step", "replicas", "detect s", "repair s (revoke+shrink+agree+rebuild)",
                        "restore + orphan recompute s", "failure step s", "normal step s",
                        "total s (failure step - normal)"], rows)


def overhead_of(ref: RunSummary, ff: RunSummary, checkpoint_interval: int | None) -> dict:
    a = normal_step_times(ref.attempts[0].steps, checkpoint_interval=checkpoint_interval)
    b = normal_step_times(ff.attempts[0].steps, checkpoint_interval=checkpoint_interval)
    return {"stock_median_step_s": median(a), "recover_median_step_s": median(b),
            "ratio": median(b) / median(a), "n_steps": [len(a), len(b)]}


def run_comparison(
    *,
    out: Path,
    dp: int,
    accumulation: int,
    steps: int,
    checkpoint_interval: int,
    events: Sequence[FailureEvent],
    size: ModelSize,
    overhead_run: bool = True,
    timeout_s: float = 900,
) -> dict:
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    K = checkpoint_interval
    inject = inject_entries(events, {r: r for r in range(dp)})
    cfg = lambda ft: make_config(dp=dp, accumulation=accumulation, steps=steps, size=size, fault_tolerance=ft,  # noqa: E731
                                    checkpoint_interval=100000)
    runs: dict[str, RunSummary] = {}
    runs["reference"] = run_single("reference", out / "reference", cfg(None), steps, timeout_s)
    if overhead_run:
        runs["recover_ff"] = run_single("recover_ff", out / "recover_ff", cfg({"enabled": True}), steps, timeout_s)
    runs["recover"] = run_single("recover", out / "recover", cfg({"enabled": True, "inject": inject}), steps, timeout_s)
    runs["shrinking"] = run_single("shrinking", out / "shrinking",
                                   cfg({"enabled": True, "keep_global_batch": False, "inject": inject}),
                                   steps, timeout_s)
    for name in ("recover", "shrinking"):
        runs[name].extra["failures"] = recover_failures(runs[name], events, None)
    for v in ("A", "B"):
        runs[f"ckpt_restart_{v}"] = run_ckpt_restart(
            name=f"ckpt_restart_{v}", out_dir=out / f"ckpt_restart_{v}", dp=dp, accumulation=accumulation,
            steps=steps, checkpoint_interval=K, events=events, variant=v, size=size, timeout_s=timeout_s)

    ref_losses = {k: v["loss"] for k, v in runs["reference"].trajectory.items()}
    for r in runs.values():
        diffs = [abs(v["loss"] - ref_losses[k]) for k, v in r.trajectory.items() if k in ref_losses]
        r.extra["max_abs_loss_diff_vs_reference"] = max(diffs) if diffs else None

    # headline ratios against the stronger checkpoint-restart variant (higher effective throughput)
    ckpt = max((runs["ckpt_restart_A"], runs["ckpt_restart_B"]), key=lambda r: r.effective_throughput)
    rec = runs["recover"]
    budget = min(rec.process_seconds, ckpt.process_seconds)
    tok_rec, tok_ckpt = rec.tokens_at_process_seconds(budget), ckpt.tokens_at_process_seconds(budget)
    headline = {
        "baseline": ckpt.name,
        "recover_vs_ckpt_restart_effective_throughput": rec.effective_throughput / ckpt.effective_throughput,
        "equal_process_seconds_budget": budget,
        "tokens_recover_at_budget": tok_rec,
        "tokens_ckpt_restart_at_budget": tok_ckpt,
        "tokens_ratio_at_equal_process_seconds": (tok_rec / tok_ckpt) if tok_ckpt else float("inf"),
        "effective_throughput_ratio_after_first_startup":
            (rec.committed_tokens / rec.process_seconds_after_first_startup)
            / (ckpt.committed_tokens / ckpt.process_seconds_after_first_startup),
    }
    if overhead_run:
        headline["overhead"] = overhead_of(runs["reference"], runs["recover_ff"], None)
    return {"runs": runs, "headline": headline, "events": events}


def write_report(result: dict, out: Path, *, command: str, title: str, setup: str) -> str:
    runs: dict[str, RunSummary] = result["runs"]
    order = [n for n in ("reference", "recover_ff", "recover", "shrinking", "ckpt_restart_A", "ckpt_restart_B")
             if n in runs]
    h = result["headline"]
    data = {
        "command": command, "machine": machine_line(), "setup": setup, "headline": h,
        "failures": [e.describe() for e in result["events"]],
        "runs": {n: runs[n].as_dict() for n in order},
    }
    write_json(out / "compare.json", data)
    rows = []
    for n in order:
        r = runs[n]
        first = r.attempts[0]
        startup = (first.first_step_start - first.launch_t) if first.first_step_start else None
        rows.append([n, len(r.attempts), r.final_step, round(r.wall_s, 1), startup, round(r.process_seconds, 1),
                     r.committed_tokens, round(r.effective_throughput, 2),
                     median(normal_step_times(r.attempts[0].steps)), r.final_loss,
                     r.extra.get("max_abs_loss_diff_vs_reference"), r.extra.get("recomputed_steps", 0),
                     round(r.process_seconds_after_first_startup, 1),
                     round(r.committed_tokens / r.process_seconds_after_first_startup, 2)
                     if r.process_seconds_after_first_startup else None])
    table = md_table(["run", "launches", "final step", "wall s", "startup s (launch->1st step)", "process-s",
                         "committed tokens",
                         "eff. throughput tok/s/process", "median step s (1st job)", "final loss",
                         "max |loss - reference|", "recomputed steps", "process-s after 1st startup",
                         "eff. throughput after 1st startup"], rows)
    lines = [
        f"command: `{command}`", "", f"machine: {data['machine']}", "", f"setup: {setup}", "",
        f"failures: {'; '.join(data['failures'])}", "",
        "machine load (1-min load average at each launch; other users' jobs share the 2 cores): "
        + ", ".join(f"{n} " + "/".join(f"{a.load_avg_1min:.1f}" for a in runs[n].attempts) for n in order), "",
        table, "",
        "Recovery per failure, in place (ReCoVer / shrinking batch):", "",
        recover_failure_table([runs[n] for n in ("recover", "shrinking") if n in runs]), "",
        "Recovery per failure, checkpoint-restart:", "",
        failure_table([runs[n] for n in ("ckpt_restart_A", "ckpt_restart_B")]), "",
        "Checkpoint save time per checkpoint (s, median): "
        + ", ".join(f"{n} {median(runs[n].extra.get('checkpoint_save_s', [])):.3f}"
                    for n in ("ckpt_restart_A", "ckpt_restart_B")), "",
        f"Headline vs {h['baseline']} (the checkpoint-restart variant with the higher effective throughput): "
        f"effective throughput ratio {h['recover_vs_ckpt_restart_effective_throughput']:.3f}; at "
        f"{h['equal_process_seconds_budget']:.1f} process-seconds ReCoVer committed "
        f"{h['tokens_recover_at_budget']:.0f} tokens, checkpoint-restart {h['tokens_ckpt_restart_at_budget']:.0f} "
        f"(ratio {h['tokens_ratio_at_equal_process_seconds']:.3f}). Not counting each run's first startup "
        f"(launch -> first step of the first job, the part most exposed to other users' load): effective throughput "
        f"ratio {h['effective_throughput_ratio_after_first_startup']:.3f}.",
    ]
    if "overhead" in h:
        o = h["overhead"]
        lines += ["", f"Failure-free overhead (one run each): ReCoVer median step {o['recover_median_step_s']:.4f} "
                      f"s vs stock {o['stock_median_step_s']:.4f} s, ratio {o['ratio']:.3f}."]
    md = "\n".join(lines) + "\n"
    (out / "compare.md").write_text(md)
    plot_runs([runs[n] for n in order if n != "recover_ff"], out / "compare.png", title=setup)
    return md


def figures(data: dict) -> dict[str, float | str | None]:
    """The record's figures of a comparison's JSON (``compare.json``, ``headline.json``): ReCoVer against the
    stronger checkpoint-restart variant, and the per-run figures the ratios come from (machine-speed dependent)."""
    h, runs = data["headline"], data["runs"]
    rec, base = runs["recover"], runs[h["baseline"]]
    shrinking = runs.get("shrinking", {})
    out: dict[str, float | str | None] = {
        "baseline": h["baseline"],
        "effective_throughput_ratio": h["recover_vs_ckpt_restart_effective_throughput"],
        "tokens_ratio_at_equal_process_seconds": h["tokens_ratio_at_equal_process_seconds"],
        "effective_throughput_ratio_after_first_startup": h["effective_throughput_ratio_after_first_startup"],
        "recover_tokens_per_process_s": rec["effective_throughput_tokens_per_process_s"],
        "ckpt_restart_tokens_per_process_s": base["effective_throughput_tokens_per_process_s"],
        "recover_failure_s": median(f["detect_s"] + f["repair_s"] for f in rec.get("failures", []) if "detect_s" in f),
        "ckpt_restart_failure_s": median(f["total_s"] for f in base.get("failures", []) if "total_s" in f),
        "recover_max_dloss": rec.get("max_abs_loss_diff_vs_reference"),
        "shrinking_max_dloss": shrinking.get("max_abs_loss_diff_vs_reference"),
    }
    if shrinking:
        out["shrinking_tokens_share"] = shrinking["committed_tokens"] / rec["committed_tokens"]
    if "overhead" in h:
        o = h["overhead"]
        out.update(overhead=o["ratio"], recover_median_step_ms=o["recover_median_step_s"] * 1e3,
                   stock_median_step_ms=o["stock_median_step_s"] * 1e3)
    return out


def record(name: str, out: Path, json_name: str, argv: Sequence[str] | None, command: str, args) -> None:
    """The run's record (``benchmarks/lib/record.py``): the comparison's JSON as its samples, and its figures."""
    import json

    data = json.loads((out / json_name).read_text())
    write_record(name, argv=argv, command=command, args=args, samples=data, figures=figures(data))


def add_common_args(ap: argparse.ArgumentParser, *, dp: int, accumulation: int, steps: int, interval: int,
                    fail: list[str], out: str) -> None:
    ap.add_argument("--dp", type=int, default=dp)
    ap.add_argument("--accumulation", type=int, default=accumulation)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--checkpoint-interval", type=int, default=interval)
    ap.add_argument("--fail", action="append", default=None,
                    help=f"STEP:R[,R...] original replica ids killed at STEP (backward); repeat. Default {fail}")
    ap.add_argument("--out", default=out)
    ap.add_argument("--no-overhead-run", action="store_true", help="skip the failure-free ReCoVer run")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.set_defaults(default_fail=fail)


def setup_line(args, size: ModelSize) -> str:
    M = args.dp * args.accumulation
    return (f"{args.dp} replicas x TP1 x PP1 ({args.dp} processes), M = {M} microbatches/step "
            f"({M * size.micro_batch * size.seq} tokens), {args.steps} steps, checkpoint every "
            f"{args.checkpoint_interval} steps (checkpoint-restart runs only), {size.describe()}, synthetic data")


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, dp=4, accumulation=2, steps=12, interval=4, fail=["6:3"], out="runs/bench/compare")
    add_size_args(ap)
    args = ap.parse_args(argv)
    size = size_from_args(args)
    events = [FailureEvent.parse(f) for f in (args.fail or args.default_fail)]
    result = run_comparison(out=Path(args.out), dp=args.dp, accumulation=args.accumulation, steps=args.steps,
                            checkpoint_interval=args.checkpoint_interval, events=events, size=size,
                            overhead_run=not args.no_overhead_run, timeout_s=args.timeout_s)
    command = command_line(argv, "benchmarks/compare.py")
    md = write_report(result, Path(args.out), command=command, title="compare", setup=setup_line(args, size))
    record("compare", Path(args.out), "compare.json", argv, command, args)
    print(md)
    return result


if __name__ == "__main__":
    main()
