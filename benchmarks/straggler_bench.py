"""Benchmark: a straggler replica, the static split vs quotas that follow measured speed (issue #26).

    python benchmarks/straggler_bench.py [--factors 2 4] [--steps 30] [--slow-from 10] [--out DIR]

4 replicas x 1 rank, a tiny Llama, synthetic data, M = 28 (7 microbatches per replica failure-free). Per factor F:
one run with the static split (``rebalance: false``) and one with ``rebalance: true``, replica 3's rank F times
slower from step ``--slow-from`` on (``signal: slow``: a real sleep of F - 1 times its own time per microbatch).
Each run's ratio is the median step time of its slowed steps over the median step time of its own failure-free steps
(3 .. slow_from - 1) on the same machine at the same time; the rebalanced run's slowed steps start ``--settle``
steps after the slowdown (the EWMA needs a few steps; the whole window is printed too). A failure-free run with the
static split is the loss reference: every run must commit M microbatches per step and match its losses within the
summation-order floor (``--tol``). Prints, per factor, ``straggler_rebalanced_ratio=<x> straggler_static_ratio=<y>
factor=<F>``; writes ``straggler.{json,md}`` to ``--out``.

**Device time.** 4 CPU-bound ranks on a 2-core machine share the cores, so a sleeping straggler would hand its CPU
to the others and speed them up (measured: the static split then got *faster* than failure-free). As on GPUs,
where a replica's time is its device's and not the host's, every rank therefore computes ``--device-factor`` times
slower from step 1 (a sleep: 4/5 of a microbatch's time by default uses no CPU), and the straggler
``device_factor x F``: its microbatches take F times as long as the others'.

The best any split can do is bounded by the integer quotas: ``ideal`` is the shortest step over all splits of M
(each replica's quota x its time per microbatch) over the failure-free step, printed beside the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import ModelSize, add_size_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from nanotron_recover.launcher.runs import RunResult, run_training  # noqa: E402
from nanotron_recover.workload.planner import replan_orphans  # noqa: E402

REPLICAS = 4
SLOWED = 3  # the replica whose rank is slowed


def config(args, size: ModelSize, *, rebalance: bool, factor: float | None) -> dict:
    """``factor`` None: the failure-free loss reference (nothing slowed: sleeping changes no number)."""
    base = args.device_factor
    inject = [] if factor is None else [
        *({"step": 1, "replica": r, "rank": 0, "signal": "slow", "factor": base} for r in range(REPLICAS)),
        {"step": args.slow_from, "replica": SLOWED, "rank": 0, "signal": "slow", "factor": base * factor}]
    return make_config(dp=REPLICAS, accumulation=args.accumulation, steps=args.steps, size=size, fault_tolerance={
        "enabled": True, "rebalance": rebalance, "local_snapshot_interval": 0, "hang_timeout_s": 120,
        "collective_timeout_s": 120, "inject": inject})


def ideal_ratio(M: int, factor: float) -> float:
    """Shortest step over every integer split (greedy by finish time: optimal for unit work) / the equal split's."""
    speeds = {r: 1.0 / factor if r == SLOWED else 1.0 for r in range(REPLICAS)}
    split = replan_orphans(list(range(M)), list(range(REPLICAS)), {}, speeds)
    return max(len(ix) / speeds[r] for r, ix in split.items()) / (M / REPLICAS)


def step_ratio(run: RunResult, first_slowed: int, slow_from: int) -> tuple[float, float, float]:
    """(ratio, median slowed step s, median failure-free step s) from a run's step records."""
    times = {s["step"]: s["step_time_s"] for s in run.steps}
    free = statistics.median(times[s] for s in range(3, slow_from))
    slowed = statistics.median(t for s, t in times.items() if s >= first_slowed)
    return slowed / free, slowed, free


def launch(args, name: str, cfg: dict) -> tuple[RunResult, float]:
    load = os.getloadavg()[0]
    run = run_training(cfg, Path(args.out) / name, timeout_s=args.timeout_s, extra_args=["--synthetic-data"])
    print(f"  {name}: {len(run.steps)} steps in {run.wall_s:.1f} s (1-min load at launch {load:.1f})", flush=True)
    return run, load


def check(run: RunResult, reference: RunResult, M: int, tol: float) -> float:
    """max |dloss| against the failure-free run; raises if a step did not commit M or the losses differ."""
    if any(s["microbatches"] != M for s in run.steps) or len(run.steps) != len(reference.steps):
        raise SystemExit(f"{run.run_dir}: a step did not commit M = {M} microbatches")
    diff = max(abs(a - b) for a, b in zip(run.losses, reference.losses))
    if diff > tol:
        raise SystemExit(f"{run.run_dir}: max |dloss| {diff:.2e} > {tol:.0e} against the failure-free run")
    return diff


def measure(args, size: ModelSize, factor: float, reference: RunResult, M: int) -> dict:
    """The static and the rebalanced run at one slowdown factor."""
    out: dict = {"factor": factor, "ideal_ratio": ideal_ratio(M, factor)}
    for name, rebalance in (("static", False), ("rebalanced", True)):
        run, load = launch(args, f"{name}_x{factor:g}", config(args, size, rebalance=rebalance, factor=factor))
        first = args.slow_from + (args.settle if rebalance else 0)
        ratio, slowed, free = step_ratio(run, first, args.slow_from)
        out[name] = {"ratio": ratio, "slowed_step_s": slowed, "free_step_s": free, "load": load,
                     "window_ratio": step_ratio(run, args.slow_from, args.slow_from)[0],
                     "max_dloss": check(run, reference, M, args.tol),
                     "last_quotas": run.steps[-1].get("quotas"), "last_speeds": run.steps[-1].get("speeds"),
                     "quotas": [s.get("quotas") for s in run.steps],
                     "step_time_s": [s["step_time_s"] for s in run.steps]}
    return out


def table(results: list[dict], args, M: int) -> str:
    lines = ["| slowdown | split | failure-free step (ms) | slowed step (ms) | ratio | ratio, whole window | ideal | "
             "quotas at the end | max \\|Δloss\\| | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("static", "rebalanced"):
            m = r[name]
            window = f"{m['window_ratio']:.2f}" if name == "rebalanced" else "–"
            quotas = ", ".join(f"{v}" for _, v in sorted((m["last_quotas"] or {}).items()))
            lines.append(f"| {r['factor']:g}x | {name} | {m['free_step_s'] * 1e3:.0f} | {m['slowed_step_s'] * 1e3:.0f} "
                         f"| **{m['ratio']:.2f}** | {window} | {r['ideal_ratio']:.2f} | {quotas} | "
                         f"{m['max_dloss']:.1e} | {m['load']:.1f} |")
    return "\n".join(lines) + (f"\n\nM = {M}, {REPLICAS} replicas x 1 rank, replica {SLOWED} slowed from step "
                               f"{args.slow_from}, {args.steps} steps; rebalanced ratio from step "
                               f"{args.slow_from + args.settle}.\n")


def figures(results: list[dict]) -> dict[str, float]:
    """The record's figures, per slowdown factor F (``_x<F>``): each split's ratio, its slowed and failure-free
    median steps, the integer bound; and the largest |dloss| against the failure-free run over every run."""
    out: dict[str, float] = {}
    for r in results:
        x = f"x{r['factor']:g}"
        out[f"ideal_ratio_{x}"] = r["ideal_ratio"]
        for name in ("static", "rebalanced"):
            m = r[name]
            out.update({f"{name}_ratio_{x}": m["ratio"], f"{name}_slowed_step_ms_{x}": m["slowed_step_s"] * 1e3,
                        f"{name}_free_step_ms_{x}": m["free_step_s"] * 1e3})
    out["max_dloss"] = max(r[name]["max_dloss"] for r in results for name in ("static", "rebalanced"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--slow-from", type=int, default=10)
    ap.add_argument("--settle", type=int, default=5, help="steps after the slowdown before the rebalanced ratio")
    ap.add_argument("--accumulation", type=int, default=7, help="microbatches per replica failure-free (M / 4)")
    ap.add_argument("--tol", type=float, default=1e-5, help="the summation-order floor for |dloss|")
    ap.add_argument("--device-factor", type=float, default=5.0,
                    help="every rank sleeps (this - 1) x its CPU time per microbatch: device time (see the doc)")
    ap.add_argument("--out", default="runs/bench/straggler")
    ap.add_argument("--timeout-s", type=float, default=600)
    add_size_args(ap)
    ap.set_defaults(hidden=128, intermediate=512, layers=2, seq=64, micro_batch=2)
    args = ap.parse_args(argv)
    args.out = str(fresh_out_dir(args))
    size, M = size_from_args(args), REPLICAS * args.accumulation
    print(f"{size.describe()}; M = {M}; {os.cpu_count()} CPUs", flush=True)
    reference, _ = launch(args, "failure_free", config(args, size, rebalance=False, factor=None))
    results = [measure(args, size, factor, reference, M) for factor in args.factors]
    text = table(results, args, M)
    print(text)
    Path(args.out, "straggler.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    Path(args.out, "straggler.md").write_text(text)
    write_record("straggler", argv=argv, command=command_line(argv, "benchmarks/straggler_bench.py"), args=args,
                 samples={"results": results}, figures=figures(results))
    for r in results:
        print(f"straggler_rebalanced_ratio={r['rebalanced']['ratio']:.3f} "
              f"straggler_static_ratio={r['static']['ratio']:.3f} factor={r['factor']:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
