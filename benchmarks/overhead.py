"""Failure-free step time: ReCoVer (ULFM path, fault tolerance on) vs the plain path (stock nanotron data path:
one torch world, DDP over gloo, fault tolerance off), the same config, interleaved runs.

Per run the median step time over the undisturbed steps (the first 2 steps of a job are warm-up and left out;
no checkpoints are taken). Runs alternate (stock, ReCoVer, ReCoVer, stock, ...) so slow drifts of the machine's
load hit both sides; the result is the median over runs of the per-run medians, and their ratio
(ReCoVer / stock; below 1 = ReCoVer faster). The same with per-run means (``overhead_mean=``) counts every step,
the ones slowed by a node-local snapshot too, which a median can miss when snapshots come every few steps;
``overhead_pairwise=`` is the median over rounds of each round's own ratio (its runs ran next to each other).
Writes overhead.json / overhead.md / overhead.png under --out.

Defaults: the headline's model and layout (8 replicas, M = 24, hidden 128, 4 layers, seq 128), 30 steps, 3 runs
per path. Example at a smaller size:
  .venv/bin/python benchmarks/overhead.py --dp 4 --accumulation 2 --steps 20 --repeats 2 --hidden 64 --layers 2

``--breakdown`` adds ReCoVer runs with one protection switched off each (node-local snapshots, the hang monitor),
with both off, and with the collectives waiting inside MPI (``mpi_wait: block``) instead of asleep, in the same
interleaving: a mechanism's share of the step is (all on - without it) / all on.
What stays in every ReCoVer run is the data path itself (per-bucket snapshots for in-step recovery, the ULFM
reduction and the per-step agreements). The last line is ``overhead=<ratio>`` (everything on vs stock) either way.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, normal_step_times  # noqa: E402


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="runs per path")
    ap.add_argument("--breakdown", action="store_true", help="also ReCoVer with each protection switched off")
    add_headline_run_args(ap, out="runs/bench/overhead")
    args = ap.parse_args(argv)
    size = size_from_args(args)
    out = fresh_out_dir(args)

    def config(ft: dict | None) -> dict:
        return make_config(dp=args.dp, tp=args.tp, pp=args.pp, accumulation=args.accumulation, steps=args.steps,
                              size=size, fault_tolerance=ft)

    paths = dict(PATHS) if args.breakdown else {n: PATHS[n] for n in ("stock", "recover")}
    order = interleaved(list(paths), args.repeats)
    per_run: dict[str, list[dict]] = {name: [] for name in paths}
    for k, name in enumerate(order):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        a = launch(config(paths[name]), out / f"{k:02d}_{name}", timeout_s=args.timeout_s)
        usage = job_usage(before, resource.getrusage(resource.RUSAGE_CHILDREN))
        times = normal_step_times(a.steps)
        if not a.steps or a.steps[-1]["step"] < args.steps:
            raise RuntimeError(f"{name} run {k} stopped early:\n{(Path(a.run_dir) / 'output.log').read_text()[-3000:]}")
        per_run[name].append({"median_step_s": median(times), "mean_step_s": sum(times) / len(times),
                              "n_steps": len(times), "load_avg_1min": a.load_avg_1min,
                              "wall_s": a.end_t - a.launch_t, "step_times": [s["step_time_s"] for s in a.steps],
                              # the launcher's warm standby (at the defaults), ready after this long (None: never)
                              "standby_ready_after_s": next((e["time"] - a.launch_t for e in a.events
                                                             if e.get("event") == "standby_ready"), None),
                              **usage})
        print(f"[overhead] run {k + 1}/{len(order)} {name}: median step {median(times) * 1000:.2f} ms "
              f"(load {a.load_avg_1min:.1f})", flush=True)
    med, mean, rounds = summarise(per_run)
    ratio, mean_ratio, pairwise = med["recover"] / med["stock"], mean["recover"] / mean["stock"], median(rounds)
    command = command_line(argv, "benchmarks/overhead.py")
    M = args.dp * args.accumulation
    setup = (f"{args.dp} replicas x TP{args.tp} x PP{args.pp}, M = {M} microbatches/step, {args.steps} steps, "
             f"{size.describe()}, synthetic data, no failures, no checkpoints")
    data = {"command": command, "machine": machine_line(), "setup": setup, "median_step_s": med, "ratio": ratio,
            "mean_step_s": mean, "mean_ratio": mean_ratio,
            "round_ratios": rounds, "pairwise_ratio": pairwise, "order": order, "runs": per_run}
    write_json(out / "overhead.json", data)
    write_record("overhead_breakdown" if args.breakdown else "overhead", argv=argv, command=command, args=args,
                 samples=data, figures=figures(data))
    data["shares"] = shares(med)
    md = report_md(data, per_run)
    (out / "overhead.md").write_text(md)
    _plot(per_run, out / "overhead.png", setup)
    print(md)
    print(f"overhead_mean={mean_ratio:.3f} overhead_pairwise={pairwise:.3f}")
    print(f"overhead={ratio:.3f}")
    return data


# The variants: stock, ReCoVer with everything on (its defaults), and ReCoVer with a protection switched off.
PATHS: dict[str, dict | None] = {
    "stock": None,
    "recover": {"enabled": True},
    "recover-no-snapshots": {"enabled": True, "local_snapshot_interval": 0},
    "recover-no-hang-monitor": {"enabled": True, "hang_monitor": False},
    "recover-bare": {"enabled": True, "local_snapshot_interval": 0, "hang_monitor": False},
    "recover-waiting-in-mpi": {"enabled": True, "mpi_wait": "block"},
}
# a mechanism's cost: (the variant with it - the variant without it), as a share of the everything-on step
MECHANISMS = {"node-local snapshots": ("recover", "recover-no-snapshots"),
              "hang monitor": ("recover", "recover-no-hang-monitor"),
              "both": ("recover", "recover-bare"),
              "the data path (bare ReCoVer vs stock)": ("recover-bare", "stock"),
              # negative: what waiting asleep (mpi_wait: poll, auto's choice on this oversubscribed node) saves
              "waiting asleep instead of inside MPI": ("recover", "recover-waiting-in-mpi")}


# the record's names of the mechanisms' shares
SHARE_KEYS = {"node-local snapshots": "share_snapshots", "hang monitor": "share_hang_monitor", "both": "share_both",
              "the data path (bare ReCoVer vs stock)": "share_data_path",
              "waiting asleep instead of inside MPI": "share_waiting_asleep"}


def figures(data: dict) -> dict[str, float | None]:
    """The record's figures of an ``overhead.json``: the three ratios; per variant its median step, its ratio to
    stock and its involuntary context switches per job (where counted); each mechanism's share of the step."""
    med = data["median_step_s"]
    out: dict[str, float | None] = {"overhead": data["ratio"], "overhead_mean": data.get("mean_ratio"),
                                    "overhead_pairwise": data.get("pairwise_ratio")}
    for name, runs in data["runs"].items():
        key = name.replace("-", "_")
        out[f"{key}_median_step_ms"] = med[name] * 1e3
        out[f"{key}_over_stock"] = med[name] / med["stock"]
        switches = [r["involuntary_switches"] for r in runs if "involuntary_switches" in r]
        if switches:
            out[f"{key}_involuntary_switches"] = median(switches)
    out.update({SHARE_KEYS[name]: share for name, share in shares(med).items()})
    ready = [r["standby_ready_after_s"] for r in data["runs"].get("recover", []) if r.get("standby_ready_after_s")]
    out["recover_runs_with_a_ready_standby"] = len(ready)  # a relaunch from these would have been warm
    out["recover_standby_ready_after_s"] = median(ready) if ready else None
    return out


def report_md(data: dict, per_run: dict[str, list[dict]]) -> str:
    """The printed report: one row per variant, the three ratios, each mechanism's share."""
    med, mean = data["median_step_s"], data["mean_step_s"]
    rows = [[n, len(runs), ", ".join(f"{r['median_step_s'] * 1000:.2f}" for r in runs), med[n] * 1000,
             f"{med[n] / med['stock']:.3f}", mean[n] * 1000, f"{mean[n] / mean['stock']:.3f}",
             f"{median(r['involuntary_switches'] for r in runs) / 1e3:.0f}",
             f"{median(r['cpu_sys_s'] for r in runs):.1f}"] for n, runs in per_run.items()]
    return "\n".join([
        f"command: `{data['command']}`", "", f"machine: {data['machine']}", "", f"setup: {data['setup']}", "",
        md_table(["path", "runs", "per-run median step (ms)", "median (ms)", "/ stock", "mean step (ms)",
                  "mean / stock", "involuntary context switches (thousands, whole job)", "system CPU (s)"], rows),
        "",
        f"ratio ReCoVer / stock = {data['ratio']:.3f} (medians), {data['mean_ratio']:.3f} (means: every step "
        f"counted), {data['pairwise_ratio']:.3f} (median of the rounds' own ratios: "
        f"{', '.join(f'{x:.3f}' for x in data['round_ratios'])})",
        *[f"share of the ReCoVer step: {name} {share * 100:+.1f}%" for name, share in data["shares"].items()],
    ]) + "\n"


def job_usage(before: resource.struct_rusage, after: resource.struct_rusage) -> dict[str, float]:
    """What one job (the launcher, mpirun and every rank: waited-for descendants) cost the machine: involuntary
    context switches (a rank taken off a core it wanted) and CPU seconds."""
    return {"involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
            "cpu_user_s": after.ru_utime - before.ru_utime, "cpu_sys_s": after.ru_stime - before.ru_stime}


def summarise(per_run: dict[str, list[dict]]) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """Per variant the median of its per-run medians and of its per-run means (a mean counts every step as a user
    pays it: with a snapshot every few steps a median can miss them); and ReCoVer / stock within each round (the
    round's runs ran next to each other: robust to slow drifts of the machine)."""
    med = {n: median(r["median_step_s"] for r in runs) for n, runs in per_run.items()}
    mean = {n: median(r["mean_step_s"] for r in runs) for n, runs in per_run.items()}
    rounds = [r["median_step_s"] / s["median_step_s"] for r, s in zip(per_run["recover"], per_run["stock"])]
    return med, mean, rounds


def interleaved(names: list[str], repeats: int) -> list[str]:
    """Each round runs every variant once, the order reversed every other round, so drifts hit all alike."""
    order: list[str] = []
    for i in range(repeats):
        order += names if i % 2 == 0 else names[::-1]
    return order


def shares(med: dict[str, float]) -> dict[str, float]:
    """Each mechanism's share of the everything-on step (:data:`MECHANISMS`), where both its variants ran."""
    return {name: (med[with_] - med[without]) / med["recover"]
            for name, (with_, without) in MECHANISMS.items() if with_ in med and without in med}


def _plot(per_run: dict, path: Path, title: str) -> None:
    """Step time per step of every run, stock vs ReCoVer (drawn with the run report's figure code)."""
    import textwrap

    from nanotron_recover.report.figure import new_figure, save_figure

    fig, (ax,) = new_figure(1, 1, width=7, row_height=4)
    for name, runs in per_run.items():
        for i, r in enumerate(runs):
            ax.plot(range(1, len(r["step_times"]) + 1), [t * 1000 for t in r["step_times"]],
                    color=f"C{list(per_run).index(name)}", alpha=0.7, label=name if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=7)
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
