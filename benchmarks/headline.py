"""The headline comparison in one command: ReCoVer vs checkpoint-restart vs shrinking batch vs failure-free.

Default setup (sized for a 2-core CPU machine): 8 replicas (TP1 x PP1, 8 processes) of a tiny Llama (hidden 128,
4 layers, seq 128), M = 24 global microbatches per step (accumulation 3), 48 steps, checkpoint every 12 steps for
checkpoint-restart; the schedule loses half the replicas in two events: replicas 7 and 6 at step 19, replicas 5
and 4 at step 41 (backward phase, real SIGKILL; checkpoint-restart recomputes 6 + 4 steps). Two replicas per event because checkpoint-restart variant A relaunches on the
survivors with the same M: 24 divides by 8, 6 and 4 (one replica per event would need M divisible by 7 and 5).

Writes headline.json / headline.md / headline.png (loss curves of ReCoVer, the failure-free reference and both
baselines, plus committed tokens vs process-seconds) under --out, and prints LAST, on one line:

  recover_vs_ckpt_restart_effective_throughput=<x> tokens_ratio_at_equal_process_seconds=<y> overhead=<z>

x: ReCoVer's effective throughput (committed tokens / process-second) over checkpoint-restart's (the variant,
A or B, with the higher effective throughput); y: tokens committed by ReCoVer over those of that baseline once
both have spent the same process-seconds (the smaller of the two totals); z: ReCoVer's failure-free median step
time over the stock path's (torch gloo DDP), one run each (benchmarks/overhead.py repeats interleaved runs).

Minimal size (smoke test): --dp 2 --accumulation 1 --steps 4 --checkpoint-interval 2 --fail 3:1
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

from benchmarks.lib.config import add_size_args, size_from_args  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from benchmarks.ckpt_restart import FailureEvent  # noqa: E402
from benchmarks.compare import add_common_args, run_comparison, setup_line, write_report  # noqa: E402

DEFAULT_SIZE = dict(hidden=128, intermediate=512, layers=4, seq=128, micro_batch=2, vocab=128)


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, dp=8, accumulation=3, steps=48, interval=12, fail=["19:7,6", "41:5,4"],
                    out="runs/bench/headline")
    add_size_args(ap)
    ap.set_defaults(**DEFAULT_SIZE)
    args = ap.parse_args(argv)
    if args.no_overhead_run:
        ap.error("the headline line needs the overhead run")
    size = size_from_args(args)
    events = [FailureEvent.parse(f) for f in (args.fail or args.default_fail)]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    result = run_comparison(out=out, dp=args.dp, accumulation=args.accumulation, steps=args.steps,
                            checkpoint_interval=args.checkpoint_interval, events=events, size=size,
                            overhead_run=True, timeout_s=args.timeout_s)
    md = write_report(result, out, command=command_line(argv, "benchmarks/headline.py"), title="headline",
                      setup=setup_line(args, size))
    for name in ("compare.json", "compare.md", "compare.png"):
        (out / name).replace(out / name.replace("compare", "headline"))
    print(md)
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
