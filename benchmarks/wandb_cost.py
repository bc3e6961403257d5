"""What wandb's offline run costs one job: the wall time of a tiny job with ``WANDB_MODE=offline`` (the users'
default) vs ``disabled`` (what the test suite uses), runs alternating so that load drifts hit both.

Prints ``wandb_offline_s=<median> wandb_disabled_s=<median> saved_per_job_s=<difference>``.
Example: ``python benchmarks/wandb_cost.py --repeats 3``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import make_config  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from nanotron_recover.launcher.runs import run_training  # noqa: E402

MODES = ("offline", "disabled")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="jobs per mode")
    ap.add_argument("--out", default=None, help="run folders (default: a temporary folder)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="wandb-cost-"))
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.repeats):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            os.environ["WANDB_MODE"] = mode
            config = make_config(dp=2, tp=2, accumulation=2, steps=6, fault_tolerance={"enabled": True})
            result = run_training(config, out / f"{mode}-{i}", timeout_s=300, extra_args=["--synthetic-data"])
            walls[mode].append(result.wall_s)
            print(f"[wandb_cost] {mode} job {i + 1}: {result.wall_s:.2f} s", flush=True)
    med = {mode: statistics.median(values) for mode, values in walls.items()}
    write_record("wandb_cost", argv=argv, command=command_line(argv, "benchmarks/wandb_cost.py"), args=args,
                 samples={"wall_s": walls}, figures={"offline_s": med["offline"], "disabled_s": med["disabled"],
                                                     "saved_per_job_s": med["offline"] - med["disabled"]})
    print(f"wandb_offline_s={med['offline']:.2f} wandb_disabled_s={med['disabled']:.2f} "
          f"saved_per_job_s={med['offline'] - med['disabled']:.2f}")
    return med


if __name__ == "__main__":
    main()
