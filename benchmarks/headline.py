"""The headline comparison in one command: ReCoVer vs checkpoint-restart vs shrinking batch vs failure-free.

Default setup (sized for a 2-core CPU machine): 8 replicas (TP1 x PP1, 8 processes) of a tiny Llama (hidden 128,
4 layers, seq 128), M = 24 global microbatches per step (accumulation 3), 48 steps, checkpoint every 12 steps for
checkpoint-restart; the schedule loses half the replicas in two events: replicas 7 and 6 at step 19, replicas 5
and 4 at step 41 (backward phase, real SIGKILL; checkpoint-restart recomputes 6 + 4 steps). Two replicas per event
because checkpoint-restart variant A relaunches on the survivors with the same M: 24 divides by 8, 6 and 4 (one replica
per event would need M divisible by 7 and 5).

Writes headline.json / headline.md / headline.png (loss curves of ReCoVer, the failure-free reference and both
baselines, plus committed tokens vs process-seconds) under --out, and prints LAST, on one line:

  recover_vs_ckpt_restart_effective_throughput=<x> tokens_ratio_at_equal_process_seconds=<y> overhead=<z>

x: ReCoVer's effective throughput (committed tokens / process-second) over checkpoint-restart's (the variant,
A or B, with the higher effective throughput); y: tokens committed by ReCoVer over those of that baseline once
both have spent the same process-seconds (the smaller of the two totals); z: ReCoVer's failure-free median step
time over the stock path's (torch gloo DDP), one run each (benchmarks/overhead.py repeats interleaved runs).

Minimal size (smoke test): --dp 2 --accumulation 1 --steps 4 --checkpoint-interval 2 --fail 3:1

Before the last line it also prints the failure simulator's prediction of x for the same schedule, from this run's
own costs (``nanotron_recover.sim``, issue #17).

``--schedule paper`` runs the shape of the ReCoVer paper's successive-failure experiment instead: 8 replicas, one
replica SIGKILLed every 5 steps until half of them are lost (steps 5, 10, 15, 20), 30 steps, checkpoint-restart
relaunched at full size (variant B: M = 24 does not divide by 7 or 5 survivors) with a checkpoint every K steps,
K = Young/Daly sqrt(2 x save x MTBF) from the costs of the committed benchmarks/results/headline.json; only the
ReCoVer and the checkpoint-restart runs (~2-4 min on 2 cores). It prints the measured ratio next to the
simulator's predictions (from the committed headline's costs, and from this run's own), last:

  paper_schedule recover_vs_ckpt_restart_effective_throughput=<x> predicted=<y> predicted_own_costs=<z> K=<k>
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

from benchmarks.ckpt_restart import FailureEvent  # noqa: E402
from benchmarks.compare import add_common_args, record, run_comparison, setup_line, write_report  # noqa: E402
from benchmarks.lib.config import add_size_args, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402

DEFAULT_SIZE = dict(hidden=128, intermediate=512, layers=4, seq=128, micro_batch=2, vocab=128)
COMMITTED = Path(__file__).resolve().parent / "results" / "headline.json"


def _simulated_ratio(json_path: Path, schedule=None) -> float | None:
    """The failure simulator's ReCoVer / checkpoint-restart ratio for ``schedule`` (default: the file's own),
    with the costs calibrated from ``json_path``; None where the file cannot be calibrated from."""
    from nanotron_recover.sim.calibrate import from_benchmark_json
    from nanotron_recover.sim.validate import predict_benchmark

    try:
        stock, rec, own = from_benchmark_json(json_path)
        return predict_benchmark(stock, rec, schedule or own).predicted_ratio
    except Exception as e:  # a diagnostic beside the measurement: it never fails the benchmark
        print(f"simulator: no prediction from {json_path} ({type(e).__name__}: {e})", flush=True)
        return None


def paper_interval(steps_between_failures: int) -> tuple[int, str]:
    """Young/Daly's checkpoint interval (steps) for the paper schedule, from the committed headline's costs."""
    from nanotron_recover.sim.calibrate import from_benchmark_json
    from nanotron_recover.sim.optimal import young_daly_s

    stock, _, sched = from_benchmark_json(COMMITTED)
    save = stock.values["ckpt_fixed_s"]
    step = stock.values["mb_s"] * sched.accumulation * sched.dp / sched.devices
    tau = young_daly_s(save, steps_between_failures * step)
    k = max(1, round(tau / step))
    return k, (f"Young/Daly: sqrt(2 x save {save:.3g} s x MTBF {steps_between_failures} steps x {step:.3g} s) = "
               f"{tau:.3g} s = {tau / step:.2f} steps -> K = {k} (costs of {COMMITTED.name})")


def paper_figures(data: dict) -> dict[str, float | None]:
    """The record's figures of a ``headline_paper.json``: the measured ratio, the per-run figures it comes from,
    the checkpoint interval, and the simulator's predictions as the run computed them."""
    h, runs = data["headline"], data["runs"]
    return {"effective_throughput_ratio": h["recover_vs_ckpt_restart_effective_throughput"],
            "recover_tokens_per_process_s": runs["recover"]["effective_throughput_tokens_per_process_s"],
            "ckpt_restart_tokens_per_process_s": runs[h["baseline"]]["effective_throughput_tokens_per_process_s"],
            "checkpoint_interval": h["checkpoint_interval"],
            "predicted_from_committed_headline": h.get("predicted_from_committed_headline"),
            "predicted_from_own_costs": h.get("predicted_from_own_costs")}


def run_paper(args, size, argv: Sequence[str] | None = None) -> str:
    """ReCoVer vs checkpoint-restart (variant B) on the paper's schedule; the simulator's predictions beside."""
    from benchmarks.ckpt_restart import inject_entries, run_ckpt_restart
    from benchmarks.compare import recover_failures, run_single
    from benchmarks.lib.config import make_config
    from benchmarks.lib.report import machine_line, write_json
    from nanotron_recover.sim.calibrate import BenchmarkSchedule, from_benchmark_json
    from nanotron_recover.sim.engine import ScheduledFailure

    every, dp = 5, args.dp
    events = [FailureEvent(every * (i + 1), (dp - 1 - i,)) for i in range(dp // 2)]
    k, why = (args.paper_interval, "given") if args.paper_interval else paper_interval(every)
    print(f"[paper] failures: {[e.describe() for e in events]}; checkpoint every {k} steps ({why})", flush=True)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = make_config(dp=dp, accumulation=args.accumulation, steps=args.steps, size=size,
                      fault_tolerance={"enabled": True, "inject": inject_entries(events, {r: r for r in range(dp)})},
                      checkpoint_interval=100000)
    rec = run_single("recover", out / "recover", cfg, args.steps, args.timeout_s)
    rec.extra["failures"] = recover_failures(rec, events, None)
    ckpt = run_ckpt_restart(name="ckpt_restart_B", out_dir=out / "ckpt_restart_B", dp=dp,
                            accumulation=args.accumulation, steps=args.steps, checkpoint_interval=k, events=events,
                            variant="B", size=size, timeout_s=args.timeout_s)
    measured = rec.effective_throughput / ckpt.effective_throughput
    data = {"command": command_line(argv, "benchmarks/headline.py"), "machine": machine_line(),
            "setup": setup_line(args, size).replace(f"every {args.checkpoint_interval}", f"every {k}"),
            "headline": {"baseline": ckpt.name, "recover_vs_ckpt_restart_effective_throughput": measured,
                         "checkpoint_interval": k, "checkpoint_interval_why": why},
            "failures": [e.describe() for e in events],
            "runs": {"recover": rec.as_dict(), "ckpt_restart_B": ckpt.as_dict()}}
    write_json(out / "headline_paper.json", data)
    sched = BenchmarkSchedule(dp, args.accumulation, args.steps, k,
                              tuple(ScheduledFailure(e.step - 0.5, e.replicas) for e in events),
                              size.micro_batch * size.seq, from_benchmark_json(COMMITTED)[2].devices, measured,
                              ckpt.name)
    pred = _simulated_ratio(COMMITTED, sched)
    own = _simulated_ratio(out / "headline_paper.json")
    data["headline"].update(predicted_from_committed_headline=pred, predicted_from_own_costs=own)
    write_json(out / "headline_paper.json", data)
    write_record("headline_paper", argv=argv, command=data["command"], args=args, samples=data,
                 figures=paper_figures(data))
    md = _paper_md(data, (rec, ckpt), why, measured, pred, own)
    (out / "headline_paper.md").write_text(md)
    print(md)
    fmt = lambda v: "nan" if v is None else f"{v:.3f}"  # noqa: E731
    line = (f"paper_schedule recover_vs_ckpt_restart_effective_throughput={measured:.3f} predicted={fmt(pred)} "
            f"predicted_own_costs={fmt(own)} K={k}")
    print(line, flush=True)
    return line


def _paper_md(data: dict, runs, why: str, measured: float, pred: float | None, own: float | None) -> str:
    """The paper schedule's printed report: its setup, a row per run, the measured and the predicted ratios."""
    from benchmarks.lib.report import md_table

    rows = [[r.name, len(r.attempts), r.final_step, round(r.wall_s, 1), round(r.process_seconds, 1),
             r.committed_tokens, round(r.effective_throughput, 1), r.extra.get("recomputed_steps", 0)] for r in runs]
    return "\n".join([f"command: `{data['command']}`", "", f"machine: {data['machine']}", "",
                      f"setup: {data['setup']}", "", f"failures: {'; '.join(data['failures'])}; checkpoint-restart: "
                      f"{why}", "", md_table(["run", "launches", "final step", "wall s", "process-s",
                                              "committed tokens", "eff. throughput tok/s/process",
                                              "recomputed steps"], rows), "",
                      f"measured ReCoVer / checkpoint-restart effective throughput: {measured:.3f}; simulator: "
                      f"{pred if pred is None else f'{pred:.3f}'} (costs of the committed headline.json), "
                      f"{own if own is None else f'{own:.3f}'} (this run's own costs)"]) + "\n"


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, dp=8, accumulation=3, steps=48, interval=12, fail=["19:7,6", "41:5,4"],
                    out="runs/bench/headline")
    add_size_args(ap)
    ap.add_argument("--schedule", choices=["default", "paper"], default="default",
                    help="paper: one failure every 5 steps until half the replicas are lost (see above)")
    ap.add_argument("--paper-interval", type=int, default=None, help="paper: checkpoint interval (default Young/Daly)")
    ap.set_defaults(**DEFAULT_SIZE)
    args = ap.parse_args(argv)
    if args.schedule == "paper":
        if args.steps == 48:
            args.steps = 30
        if args.out == "runs/bench/headline":
            args.out = "runs/bench/headline_paper"
        return run_paper(args, size_from_args(args), argv)
    if args.no_overhead_run:
        ap.error("the headline line needs the overhead run")
    size = size_from_args(args)
    events = [FailureEvent.parse(f) for f in (args.fail or args.default_fail)]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    result = run_comparison(out=out, dp=args.dp, accumulation=args.accumulation, steps=args.steps,
                            checkpoint_interval=args.checkpoint_interval, events=events, size=size,
                            overhead_run=True, timeout_s=args.timeout_s)
    command = command_line(argv, "benchmarks/headline.py")
    md = write_report(result, out, command=command, title="headline", setup=setup_line(args, size))
    for name in ("compare.json", "compare.md", "compare.png"):
        (out / name).replace(out / name.replace("compare", "headline"))
    record("headline", out, "headline.json", argv, command, args)
    print(md)
    pred = _simulated_ratio(out / "headline.json")
    if pred is not None:
        print(f"simulator (nanotron_recover.sim, this run's own costs): predicted ratio {pred:.3f}, measured "
              f"{result['headline']['recover_vs_ckpt_restart_effective_throughput']:.3f}", flush=True)
    h = result["headline"]
    x = h["recover_vs_ckpt_restart_effective_throughput"]
    y = h["tokens_ratio_at_equal_process_seconds"]
    z = h["overhead"]["ratio"]
    line = (f"recover_vs_ckpt_restart_effective_throughput={x:.3f} tokens_ratio_at_equal_process_seconds={y:.3f} "
            f"overhead={z:.3f}")
    if not all(math.isfinite(v) for v in (x, y, z)):
        print("warning: a ratio is not finite (see headline.md)", flush=True)
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
