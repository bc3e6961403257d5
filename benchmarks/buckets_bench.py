"""Micro-benchmark: cost of GradBuckets snapshot + restore (and host staging on CUDA) per MB.

Usage: python benchmarks/buckets_bench.py [--sizes-mb 16 64 256] [--bucket-cap-mb 25] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from nanotron_recover.training.buckets import GradBuckets  # noqa: E402


def _params(total_mb: float, param_mb: float, device: torch.device) -> list[tuple[str, torch.nn.Parameter]]:
    """Enough fp32 params of ``param_mb`` each to fill ``total_mb``."""
    per = max(1, int(param_mb * 2**20) // 4)
    n = max(1, int(total_mb * 2**20) // 4 // per)
    return [(f"p{k}", torch.nn.Parameter(torch.zeros(per, device=device))) for k in range(n)]


def _time(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[16.0, 64.0, 256.0])
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--param-mb", type=float, default=4.0, help="size of each synthetic parameter")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    ap.add_argument("--snapshot-device", default=None, help="default: same as --device")
    args = ap.parse_args(argv)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device={device} snapshot_device={args.snapshot_device or device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} bucket_cap_mb={args.bucket_cap_mb}")
    print(f"{'MB':>8} {'buckets':>7} {'snap ms':>9} {'rest ms':>9} {'snap+rest ms/MB':>16} {'GB/s':>7}"
          f" {'D2H+H2D ms/MB':>14}")
    rows = []
    for size in args.sizes_mb:
        b = GradBuckets(_params(size, args.param_mb, device), args.bucket_cap_mb, device,
                        snapshot_device=args.snapshot_device)
        b.flat.normal_()
        mb = b.numel * 4 / 2**20
        step = [0]

        def snap() -> None:
            step[0] += 1
            b.release(step[0] - 1)
            b.snapshot(step[0], epoch=0)

        t_snap = _time(snap, sync, args.repeats)

        def rest() -> None:
            b.restore(step[0])
            b.snapshot(step[0], epoch=0)  # re-arm the marks so the next restore copies again

        t_rest = _time(rest, sync, args.repeats) - t_snap
        t_stage = float("nan")
        if device.type == "cuda":
            def stage() -> None:
                for i in range(b.num_buckets):
                    b.to_host(i)
                    b.from_host(i)
            t_stage = _time(stage, sync, args.repeats) * 1e3 / mb
        row = {"mb": mb, "buckets": b.num_buckets, "snapshot_ms": t_snap * 1e3, "restore_ms": t_rest * 1e3,
               "snap_restore_ms_per_mb": (t_snap + t_rest) * 1e3 / mb,
               "gb_per_s": 2 * mb / 1024 / max(t_snap + t_rest, 1e-12), "staging_ms_per_mb": t_stage}
        rows.append(row)
        print(f"{mb:8.1f} {b.num_buckets:7d} {row['snapshot_ms']:9.3f} {row['restore_ms']:9.3f} "
              f"{row['snap_restore_ms_per_mb']:16.4f} {row['gb_per_s']:7.2f} {t_stage:14.4f}")
        b.close()
        b = None  # the next size's buckets do not stack on these
    write_record("buckets", argv=argv, command=command_line(argv, "benchmarks/buckets_bench.py"), args=args,
                 samples={"device": str(device), "rows": rows},
                 figures={f"snap_restore_ms_per_mb_{r['mb']:.0f}MB": r["snap_restore_ms_per_mb"] for r in rows})
    return rows


if __name__ == "__main__":
    main()
