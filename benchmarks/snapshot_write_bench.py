"""One rank's snapshot write, alone: milliseconds per write of a host state of ``--mb`` MiB to ``--dir`` (tmpfs by
default), through :class:`~nanotron_recover.snapshots.local_snapshot.SnapshotWriter` as the step path uses it
(queue the write, then wait for it). The median over ``--writes`` writes, the first two left out (the first
allocates the files). To compare with another version of the writer, run the same script with that version's
``src`` first on ``PYTHONPATH``.

  .venv/bin/python benchmarks/snapshot_write_bench.py [--mb 64] [--writes 12]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402


def main(argv: Sequence[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--writes", type=int, default=12)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args(argv)
    import torch

    from nanotron_recover.snapshots.writer import SnapshotWriter

    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="snapshot-write-bench-"))
    try:
        state = [torch.randn(args.mb * 2**20 // 4)]
        writer = SnapshotWriter(folder, "r0-c0", run_id="bench", config_hash="bench", coord=0,
                                history="0000000000aa0000", log=lambda _: None)
        times = []
        for step in range(1, args.writes + 1):
            t0 = time.perf_counter()
            writer.write(step, state, {})
            writer.wait()
            times.append(time.perf_counter() - t0)
        writer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ms = 1000 * statistics.median(times[2:])
    write_record("snapshot_write", argv=argv, command=command_line(argv, "benchmarks/snapshot_write_bench.py"),
                 args=args, samples={"write_s": times},
                 figures={"snapshot_write_ms": ms, "gib_per_s": args.mb / 1024 / (ms / 1000)})
    print(f"snapshot write of {args.mb} MiB to {args.dir}: median {ms:.1f} ms over {len(times) - 2} writes "
          f"({args.mb / 1024 / (ms / 1000):.2f} GiB/s)")
    print(f"snapshot_write_ms={ms:.1f}")
    return ms


if __name__ == "__main__":
    main()
