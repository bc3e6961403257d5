"""HSDP replicas vs 3D replicas: effective throughput on the same model and machine, with the same failure.

Three layouts of R replicas train the same model on the same data with the same failure schedule (one replica
SIGKILLed mid-run in ``backward``; ReCoVer keeps the global batch, so all three commit the same tokens):

* ``3d``      R replicas x TP1 PP1        (R processes)
* ``3d-tp2``  R replicas x TP2            (2R processes: as many as HSDP with the default F = 2)
* ``hsdp``    R replicas x FSDP2 shards F (F R processes; ``fault_tolerance.replica: fsdp``)

Reported per layout: effective throughput (committed tokens per process-second from launch to exit, the headline's
definition: startup, the failure and the smaller world after it included); step throughput (committed tokens per
process-second spent inside steps, the first 2 steps left out: no process startup, but the failure's step and the
smaller world after it count as in the effective throughput); committed
tokens per wall second; the median failure-free step time (steps before the kill, warm-up left out); and the largest
per-step loss difference from ``3d`` (the three must train the same model). Writes hsdp_vs_3d.json / .md under --out.

Last line: ``hsdp_vs_3d_effective_throughput=X hsdp_vs_3d_tp2_effective_throughput=Y hsdp_vs_3d_step_throughput=Z``
(HSDP / 3D ratios; the last one inside steps only).
Minimal size: --dp 2 --accumulation 1 --steps 4 --fail-step 3 --hidden 32 --intermediate 64 --seq 16
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_size_args, make_config, ranks_per_replica, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, normal_step_times, summarize  # noqa: E402


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=3, help="replicas R")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--shards", type=int, default=2, help="FSDP shard size F of an HSDP replica")
    ap.add_argument("--fail-step", type=int, default=None, help="step at which replica 1 dies (default: steps/2)")
    ap.add_argument("--out", default="runs/bench/hsdp_vs_3d")
    ap.add_argument("--timeout-s", type=float, default=900)
    add_size_args(ap)
    ap.set_defaults(hidden=128, intermediate=512, layers=4, seq=128, micro_batch=2)  # the headline model
    args = ap.parse_args(argv)
    args.size = size_from_args(args)
    if args.size.micro_batch % args.shards:
        ap.error(f"--micro-batch {args.size.micro_batch} must be divisible by --shards {args.shards}")
    args.fail_step = args.fail_step or max(1, args.steps // 2)
    return args


def _layouts(args: argparse.Namespace) -> dict[str, dict]:
    def config(tp: int, **replica) -> dict:
        inject = [{"step": args.fail_step, "replica": 1, "rank": 0, "phase": "backward"}] if args.dp > 1 else []
        # recycling off: one fault leaves one healthy rank per replica, never a full replica to form
        ft = {"enabled": True, "inject": inject, "recycle": False, **replica}
        return make_config(dp=args.dp, tp=tp, accumulation=args.accumulation, steps=args.steps, size=args.size,
                           fault_tolerance=ft)

    return {"3d": config(tp=1), "3d-tp2": config(tp=2),
            "hsdp": config(tp=1, replica="fsdp", fsdp_shard_size=args.shards)}


def _run_layout(name: str, cfg: dict, out: Path, args: argparse.Namespace) -> tuple[dict, list[float]]:
    """One layout's run: its throughputs and its loss per step."""
    attempt = launch(cfg, out / name, timeout_s=args.timeout_s)
    if attempt.returncode != 0 or not attempt.steps or attempt.steps[-1]["step"] != args.steps:
        log = (Path(attempt.run_dir) / "output.log").read_text()[-3000:]
        raise RuntimeError(f"{name} stopped early (exit {attempt.returncode}):\n{log}")
    summary = summarize(name, [attempt], args.steps, ranks_per_replica(cfg))
    before_kill = [s for s in attempt.steps if s["step"] < args.fail_step]
    steady = attempt.steps[2:]
    step_process_s = sum(s["step_time_s"] * s["live_replicas"] * ranks_per_replica(cfg) for s in steady)
    result = {
        "processes": attempt.n_procs,
        "effective_throughput": summary.effective_throughput,
        "step_throughput": sum(s["tokens"] for s in steady) / step_process_s,
        "tokens_per_wall_s": summary.committed_tokens / summary.wall_s,
        "median_step_s": median(normal_step_times(before_kill)),
        "committed_tokens": summary.committed_tokens,
        "wall_s": summary.wall_s,
        "process_seconds": summary.process_seconds,
        "final_loss": summary.final_loss,
        "load_avg_1min": attempt.load_avg_1min,
    }
    print(f"[hsdp_vs_3d] {name}: {result['effective_throughput']:.1f} tokens/process-s "
          f"({result['step_throughput']:.1f} in steps), median step {result['median_step_s'] * 1000:.1f} ms",
          flush=True)
    return result, [summary.trajectory[s]["loss"] for s in sorted(summary.trajectory)]


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    results: dict[str, dict] = {}
    losses: dict[str, list[float]] = {}
    for name, cfg in _layouts(args).items():
        results[name], losses[name] = _run_layout(name, cfg, out, args)
    for name in results:
        results[name]["max_loss_diff_vs_3d"] = max(abs(a - b) for a, b in zip(losses[name], losses["3d"]))
    return _write(results, args, out, argv)


def figures(data: dict) -> dict[str, float]:
    """The record's figures of an ``hsdp_vs_3d.json``: the three ratios, and per layout its effective throughput,
    median step and loss difference from 3D."""
    out = {k: data[k] for k in ("hsdp_vs_3d", "hsdp_vs_3d_tp2", "hsdp_vs_3d_step_throughput")}
    for name, r in data["results"].items():
        key = name.replace("-", "_")
        out.update({f"{key}_tokens_per_process_s": r["effective_throughput"],
                    f"{key}_median_step_ms": r["median_step_s"] * 1e3,
                    f"{key}_max_dloss_vs_3d": r["max_loss_diff_vs_3d"]})
    return out


def _write(results: dict[str, dict], args: argparse.Namespace, out: Path, argv: Sequence[str] | None) -> dict:
    ratio = results["hsdp"]["effective_throughput"] / results["3d"]["effective_throughput"]
    ratio_tp2 = results["hsdp"]["effective_throughput"] / results["3d-tp2"]["effective_throughput"]
    ratio_steps = results["hsdp"]["step_throughput"] / results["3d"]["step_throughput"]
    command = command_line(argv, "benchmarks/hsdp_vs_3d.py")
    setup = (f"{args.dp} replicas, M = {args.dp * args.accumulation} microbatches/step, {args.steps} steps, "
             f"{args.size.describe()}, synthetic data, replica 1 killed at step {args.fail_step} (backward)")
    data = {"command": command, "machine": machine_line(), "setup": setup, "results": results,
            "hsdp_vs_3d": ratio, "hsdp_vs_3d_tp2": ratio_tp2, "hsdp_vs_3d_step_throughput": ratio_steps}
    write_json(out / "hsdp_vs_3d.json", data)
    write_record("hsdp_vs_3d", argv=argv, command=command, args=args, samples=data, figures=figures(data))
    rows = [[name, r["processes"], r["effective_throughput"], r["step_throughput"], r["tokens_per_wall_s"],
             r["median_step_s"] * 1000, r["final_loss"], r["max_loss_diff_vs_3d"]] for name, r in results.items()]
    md = "\n".join([
        f"command: `{command}`", "", f"machine: {data['machine']}", "", f"setup: {setup}", "",
        md_table(["layout", "processes", "effective throughput (tokens/process-s)",
                  "step throughput (tokens/process-s in steps)", "tokens/wall-s",
                  "median step before the kill (ms)", "final loss", "max abs loss diff vs 3d"], rows), "",
        f"HSDP / 3D effective throughput = {ratio:.3f}; HSDP / 3D-TP2 = {ratio_tp2:.3f}; "
        f"HSDP / 3D step throughput = {ratio_steps:.3f}",
    ]) + "\n"
    (out / "hsdp_vs_3d.md").write_text(md)
    print(md)
    print(f"hsdp_vs_3d_effective_throughput={ratio:.3f} hsdp_vs_3d_tp2_effective_throughput={ratio_tp2:.3f} "
          f"hsdp_vs_3d_step_throughput={ratio_steps:.3f}")
    return data


if __name__ == "__main__":
    main()
