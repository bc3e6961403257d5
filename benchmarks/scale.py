"""ETTR and effective throughput vs cluster size for every policy, by simulation (issue #17).

For each size (default 1k, 4k, 16k, 64k, 100k, 131k GPUs; replicas of TP8 x PP8): the job MTTF from arXiv
2410.21680's anchors, ReCoVer's spare_replicas / min_replicas searched and the checkpoint intervals at
Young/Daly (``nanotron_recover.sim.optimal.recommend``), then every policy over the same failure draws. Pure
Python (no MPI, no torch): ~1 min on the 2-core CPU machine.

Writes scale.json / scale.md / scale.png under --out (default benchmarks/results) and prints LAST, on one line:

  ettr_100k_recover=<x> ettr_100k_ckpt_restart=<y> ettr_100k_best=<z> best_policy=<name>

x: ReCoVer as coded (no spares, its best min_replicas); y: stock checkpoint-restart; z, name: the best policy
the code can run (hypothetical policies left out), at 100,000 GPUs. ``recover_recycle`` is ``recover_spares`` with
the same settings plus ``fault_tolerance.recycle``, so those two columns differ by recycling alone.
``recover_regrow_warm`` / ``_cold`` (issue #40, not in the code yet): ReCoVer as coded with ``min_replicas: 1`` plus
regrow, back to full width at a step boundary whenever the relaunch (warm onto a standby / cold) costs less than
running degraded until the next failure (``nanotron_recover.sim.regrow``); the decision at the first lost replica
is printed beside them with the relaunch costs that feed it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from nanotron_recover.sim import policies as P  # noqa: E402
from nanotron_recover.sim.cluster import Cluster  # noqa: E402
from nanotron_recover.sim.optimal import recommend, run_policies  # noqa: E402
from nanotron_recover.sim.params import Params, describe  # noqa: E402
from nanotron_recover.sim.plan import _coerce  # noqa: E402
from nanotron_recover.sim.regrow import at_first_loss  # noqa: E402

SIZES = (1024, 4096, 16384, 65536, 100_000, 131_072)
ORDER = ("ckpt_restart", "shrinking", "recover", "recover_regrow_warm", "recover_regrow_cold", "recover_spares",
         "recover_recycle", "recover_node_tolerant")
HYPOTHETICAL = ("recover_node_tolerant", "recover_regrow_warm", "recover_regrow_cold")


def sweep(sizes: Sequence[int], tp: int, pp: int, p: Params, days: float, seeds: int) -> list[dict]:
    rows = []
    horizon = days * 86400.0
    for gpus in sizes:
        c = Cluster(gpus, tp=tp, pp=pp)
        t0 = time.perf_counter()
        best = recommend(c, p, horizon, range(min(2, seeds)))
        plain = recommend(c, p, horizon, range(min(2, seeds)), spares=(0,))
        policies = [P.ckpt_restart(best.ckpt_restart_interval), P.shrinking(best.shrinking_interval, 1),
                    P.recover(best.checkpoint_interval, plain.min_replicas),
                    P.recover_regrow(best.checkpoint_interval, 1, warm=True),
                    P.recover_regrow(best.checkpoint_interval, 1, warm=False),
                    P.recover_spares(best.checkpoint_interval, best.spare_replicas, best.min_replicas),
                    P.recover_recycle(best.checkpoint_interval, best.spare_replicas, best.min_replicas),
                    P.recover_node_tolerant(best.checkpoint_interval, best.spare_replicas, best.min_replicas)]
        res = run_policies(c, p, policies, horizon, range(seeds))
        rows.append({"gpus": gpus, "replicas": c.slots, "mttf_min": p.mttf_hours(c.job_gpus) * 60,
                     "spare_replicas": best.spare_replicas, "min_replicas": best.min_replicas,
                     "min_replicas_no_spares": plain.min_replicas, "recover_interval": best.checkpoint_interval,
                     "ckpt_restart_interval": best.ckpt_restart_interval, "results": res,
                     "regrow_first_loss": {mode: dataclasses.asdict(at_first_loss(c, p, warm=mode == "warm"))
                                           for mode in ("warm", "cold")},
                     "seconds": time.perf_counter() - t0})
        print(f"[scale] {gpus} GPUs: " + ", ".join(f"{n} {res[n]['ettr']:.3f}" for n in ORDER)
              + f" ({rows[-1]['seconds']:.1f} s)", flush=True)
    return rows


def markdown(rows: list[dict], command: str, setup: str) -> str:
    head = "| GPUs | MTTF min | " + " | ".join(f"{n} ETTR" for n in ORDER) + \
        " | spares / min_replicas (no spares) | ckpt interval steps (stock / ReCoVer) |"
    lines = [f"command: `{command}`", "", setup, "", head, "|" + "---|" * (len(ORDER) + 4)]
    for r in rows:
        res = r["results"]
        lines.append(f"| {r['gpus']} | {r['mttf_min']:.3g} | " + " | ".join(f"{res[n]['ettr']:.3f}" for n in ORDER)
                     + f" | {r['spare_replicas']} / {r['min_replicas']} ({r['min_replicas_no_spares']}) of "
                       f"{r['replicas']} | {r['ckpt_restart_interval']} / {r['recover_interval']} |")
    lines += ["", "Regrow's decision at the first lost replica (M kept; `relaunch < T x (1 - step_full / step_now)`, "
              "T: job MTTF; relaunch: warm / cold, parameters below):", "",
              "| GPUs | step now / full s | T s | degraded costs s | warm relaunch s | cold relaunch s | warm / cold |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        w, c = r["regrow_first_loss"]["warm"], r["regrow_first_loss"]["cold"]
        verdict = "/".join("regrow" if d["regrow"] else "not yet" for d in (w, c))
        lines.append(f"| {r['gpus']} | {w['step_now_s']:.4g} / {w['step_full_s']:.4g} | {w['horizon_s']:.4g} | "
                     f"{w['degraded_cost_s']:.4g} | {w['relaunch_s']:.4g} | {c['relaunch_s']:.4g} | {verdict} |")
    lines += ["", "Effective throughput (useful tokens per allocated GPU-hour, millions):", "",
              "| GPUs | " + " | ".join(ORDER) + " |", "|" + "---|" * (len(ORDER) + 1)]
    for r in rows:
        res = r["results"]
        lines.append(f"| {r['gpus']} | " + " | ".join(f"{res[n]['tokens_per_gpu_hour'] / 1e6:.3f}" for n in ORDER)
                     + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["gpus"] for r in rows]
    for n in ORDER:
        style = "--" if n in HYPOTHETICAL else "-"
        label = n + (" (hypothetical)" if n in HYPOTHETICAL else "")
        axes[0].plot(xs, [r["results"][n]["ettr"] for r in rows], style, marker="o", label=label)
        axes[1].plot(xs, [r["results"][n]["tokens_per_gpu_hour"] / 1e6 for r in rows], style, marker="o", label=label)
    for ax, title in zip(axes, ("ETTR", "useful tokens per GPU-hour (M)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)
    fig.suptitle("simulated, costs: defaults of nanotron_recover.sim.params (see scale.md)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figures(rows: list[dict]) -> dict[str, float]:
    """The record's figures (simulated): each policy's ETTR at each size, ``ettr_<policy>_<GPUs>``."""
    return {f"ettr_{name}_{r['gpus']}": res["ettr"] for r in rows for name, res in r["results"].items()}


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a parameter")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    p = Params()
    for item in args.set:
        name, _, value = item.partition("=")
        p = p.with_("user (--set)", **{name: _coerce(p, name, value)})
    if 100_000 not in args.sizes:
        args.sizes = sorted(set(args.sizes) | {100_000})
    rows = sweep(args.sizes, args.tp, args.pp, p, args.days, args.seeds)
    import shlex

    command = shlex.join([".venv/bin/python", "benchmarks/scale.py", *(sys.argv[1:] if argv is None else argv)])
    setup = (f"replicas of TP{args.tp} x PP{args.pp}; {args.days:g} simulated days x {args.seeds} failure draws per "
             f"policy and size; simulated on 2 CPU cores ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
             "parameters: " + "; ".join(f"{n}={v}" for n, v, _ in describe(p)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, command, setup)
    (out / "scale.md").write_text(md)
    (out / "scale.json").write_text(json.dumps({"command": command, "setup": setup, "rows": rows,
                                                "parameters": describe(p)}, indent=1))
    plotted = plot(rows, out / "scale.png")
    write_record("scale", argv=argv, command=command, args=args,
                 samples={"setup": setup, "rows": rows, "parameters": describe(p)}, figures=figures(rows))
    print(md)
    if not plotted:
        print("(matplotlib not installed: no plot)")
    r100 = next(r for r in rows if r["gpus"] == 100_000)["results"]
    real = {n: r100[n]["ettr"] for n in ORDER if n not in HYPOTHETICAL}
    best = max(real, key=real.get)
    line = (f"ettr_100k_recover={r100['recover']['ettr']:.3f} ettr_100k_ckpt_restart={r100['ckpt_restart']['ettr']:.3f}"
            f" ettr_100k_best={real[best]:.3f} best_policy={best}")
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
