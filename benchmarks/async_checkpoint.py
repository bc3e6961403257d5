"""What a checkpoint save costs the step: written in the step (``checkpoints.async_save: false``) vs in the
background (the default), the same job, interleaved runs.

Per run: the plain steps' median time (not the first 2, not a saving step nor the one after it); per save, the
stall (from the saving step's record to the start of the next step: the save sits there) and the saving step's
time with its stall, over the plain median (``*_save_step_ratio``). The step after a save is reported too
(``*_next_step_ratio``): a background writer shares the cores with it. The final save (the last step's, always in
the step) is left out. Writes async_checkpoint.json under --out and a raw record; the last line is
``async_save_step_ratio=<ratio>``.

Defaults: the headline's model and layout (8 replicas, M = 24, hidden 128, 4 layers, seq 128), 40 steps, a save
every 5 steps, 2 runs per mode. Example at a smaller size:
  .venv/bin/python benchmarks/async_checkpoint.py --dp 2 --accumulation 2 --steps 20 --every 4 --repeats 1 \\
      --hidden 64 --layers 2
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
from benchmarks.lib.report import command_line, machine_line, median, write_json  # noqa: E402
from benchmarks.lib.timeline import Attempt, launch  # noqa: E402

MODES = {"sync": False, "async": True}


def step_costs(a: Attempt, every: int, last: int) -> dict:
    """One run's plain median step, and per save (not the final one) its stall, its step with the stall and the
    step after it, in seconds."""
    by_step = {s["step"]: s for s in a.steps}
    saves = [k for k in sorted(by_step) if k % every == 0 and k < last and (k + 1) in by_step]
    plain = [s["step_time_s"] for k, s in sorted(by_step.items())
             if k > 2 and k % every not in (0, 1) and not s.get("recoveries")]
    # the save sits between the saving step's record and the start of the next step
    stalls = [(by_step[k + 1]["time"] - by_step[k + 1]["step_time_s"]) - by_step[k]["time"] for k in saves]
    return {"plain_step_s": median(plain), "n_plain": len(plain), "saves": saves, "stall_s": stalls,
            "save_step_s": [by_step[k]["step_time_s"] + stall for k, stall in zip(saves, stalls)],
            "next_step_s": [by_step[k + 1]["step_time_s"] for k in saves]}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint_interval")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode")
    add_headline_run_args(ap, out="runs/bench/async_checkpoint")
    args = ap.parse_args(argv)
    size, out = size_from_args(args), fresh_out_dir(args)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for k in range(args.repeats):
        for mode in (MODES if k % 2 == 0 else reversed(MODES)):  # sync, async, async, sync, ...
            config = make_config(dp=args.dp, accumulation=args.accumulation, steps=args.steps, size=size,
                                 fault_tolerance={"enabled": True}, checkpoint_interval=args.every)
            config["checkpoints"]["async_save"] = MODES[mode]
            a = launch(config, out / f"{k:02d}_{mode}", timeout_s=args.timeout_s)
            if a.returncode != 0 or not a.steps or a.steps[-1]["step"] < args.steps:
                raise RuntimeError(f"{mode} run {k} failed:\n{(Path(a.run_dir) / 'output.log').read_text()[-3000:]}")
            costs = step_costs(a, args.every, args.steps)
            runs[mode].append(costs)
            print(f"[async_checkpoint] run {k} {mode}: plain step {costs['plain_step_s'] * 1e3:.1f} ms, stall per "
                  f"save {median(costs['stall_s']) * 1e3:.1f} ms", flush=True)
    figures: dict[str, float] = {}
    for mode, per_run in runs.items():
        plain = median([r["plain_step_s"] for r in per_run])
        figures[f"{mode}_plain_step_ms"] = plain * 1e3
        figures[f"{mode}_stall_ms"] = median([s for r in per_run for s in r["stall_s"]]) * 1e3
        figures[f"{mode}_save_step_ratio"] = median([s / r["plain_step_s"] for r in per_run for s in r["save_step_s"]])
        figures[f"{mode}_next_step_ratio"] = median([s / r["plain_step_s"] for r in per_run for s in r["next_step_s"]])
    command = command_line(argv, "benchmarks/async_checkpoint.py")
    setup = (f"{args.dp} replicas, M = {args.dp * args.accumulation}, {args.steps} steps, a checkpoint every "
             f"{args.every} steps, {size.describe()}, synthetic data, no failures")
    data = {"command": command, "machine": machine_line(), "setup": setup, "figures": figures, "runs": runs}
    write_json(out / "async_checkpoint.json", data)
    write_record("async_checkpoint", argv=argv, command=command, args=args, samples=data, figures=figures)
    for name, value in figures.items():
        print(f"{name}={value:.3f}")
    print(f"async_save_step_ratio={figures['async_save_step_ratio']:.3f}")
    return data


if __name__ == "__main__":
    main()
