"""bf16 vs fp32 under fault tolerance: bytes of training state per parameter and step time.

Two failure-free ReCoVer runs of the same model, layout and data, one per ``model.dtype``. The bytes come from the
process itself: each run's logging rank logs a ``training_state`` event after its first optimizer step, counting
every storage once under its role (``nanotron_recover.training.memory``): parameters, fp32 masters (bf16 only), the flat
fp32 gradient buckets, their snapshots (in-step recovery) and Adam's state. Step time: the median over the steps
after the first two. Writes precision.json / .md under --out.

Last line: ``bf16_bytes_per_param=X fp32_bytes_per_param=Y bf16_vs_fp32_step_time=Z``.
Minimal size: --steps 4 --hidden 32 --intermediate 64 --seq 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, normal_step_times  # noqa: E402
from nanotron_recover.training.memory import ROLES  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2, help="replicas")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    add_headline_run_args(ap, out="runs/bench/precision")
    args = ap.parse_args(argv)
    size = size_from_args(args)
    out = fresh_out_dir(args)

    results: dict[str, dict] = {}
    for dtype in DTYPES:
        config = make_config(dp=args.dp, tp=args.tp, accumulation=args.accumulation, steps=args.steps, size=size,
                             fault_tolerance={"enabled": True})
        config["model"]["dtype"] = dtype
        attempt = launch(config, out / dtype, timeout_s=args.timeout_s)
        if attempt.returncode != 0 or not attempt.steps or attempt.steps[-1]["step"] != args.steps:
            log = (Path(attempt.run_dir) / "output.log").read_text()[-3000:]
            raise RuntimeError(f"{dtype} stopped early (exit {attempt.returncode}):\n{log}")
        (state,) = [e for e in attempt.events if e.get("event") == "training_state"]
        results[dtype] = {
            "params_on_logging_rank": state["params"],
            "bytes_per_param": state["bytes_per_param"],
            "median_step_s": median(normal_step_times(attempt.steps)),
            "final_loss": attempt.steps[-1]["loss"],
            "load_avg_1min": attempt.load_avg_1min,
        }
        print(f"[precision] {dtype}: {state['bytes_per_param']['total']:.2f} bytes/param, "
              f"median step {results[dtype]['median_step_s'] * 1000:.1f} ms", flush=True)
    bf16, fp32 = results["bfloat16"], results["float32"]
    step_ratio = bf16["median_step_s"] / fp32["median_step_s"]
    command = command_line(argv, "benchmarks/precision_bench.py")
    setup = (f"{args.dp} replicas x TP{args.tp}, M = {args.dp * args.accumulation} microbatches/step, {args.steps} "
             f"steps, {size.describe()}, synthetic data, failure-free, fault tolerance on")
    data = {"command": command, "machine": machine_line(), "setup": setup, "results": results,
            "bf16_vs_fp32_step_time": step_ratio}
    write_json(out / "precision.json", data)
    write_record("precision", argv=argv, command=command, args=args, samples=data, figures=figures(data))
    rows = [[dtype, *(r["bytes_per_param"].get(role, 0.0) for role in ROLES), r["bytes_per_param"]["total"],
             r["median_step_s"] * 1000, r["final_loss"]] for dtype, r in results.items()]
    md = "\n".join([
        f"command: `{command}`", "", f"machine: {data['machine']}", "", f"setup: {setup}", "",
        md_table(["dtype", *(f"{role} (B/param)" for role in ROLES), "total (B/param)", "median step (ms)",
                  "final loss"], rows), "",
        f"bf16 / fp32 median step time = {step_ratio:.3f} (same machine, same run of this script)",
    ]) + "\n"
    (out / "precision.md").write_text(md)
    print(md)
    print(f"bf16_bytes_per_param={bf16['bytes_per_param']['total']:.2f} "
          f"fp32_bytes_per_param={fp32['bytes_per_param']['total']:.2f} bf16_vs_fp32_step_time={step_ratio:.3f}")
    return data


def figures(data: dict) -> dict[str, float]:
    """The record's figures of a ``precision.json``: bytes of training state per parameter and median step per
    dtype, and bf16 / fp32 step time."""
    out = {"bf16_vs_fp32_step_time": data["bf16_vs_fp32_step_time"]}
    for dtype, r in data["results"].items():
        out[f"bytes_per_param_{dtype}"] = r["bytes_per_param"]["total"]
        out[f"median_step_ms_{dtype}"] = r["median_step_s"] * 1e3
    return out


if __name__ == "__main__":
    main()
