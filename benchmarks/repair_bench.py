"""Benchmark: detect-to-repaired time of FTWorld under real SIGKILLs.

    python benchmarks/repair_bench.py --ranks 8 --ranks-per-replica 2 --runs 10

Each run kills one rank (rotating over phases and victims) and reports, per run, the median over survivors of
``detect_to_repaired_ms`` (this rank's first failure notice -> repaired) and the SIGKILL -> last survivor
repaired time; then the medians over runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from tests.ft.harness import run_worker  # noqa: E402  (the ft layer's toy trainer, launched under mpirun)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--ranks-per-replica", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--bucket-len", type=int, default=1 << 16)
    args = ap.parse_args(argv)
    rpr, n_rep = args.ranks_per_replica, args.ranks // args.ranks_per_replica
    phases = ["reduce", "forward", "optimizer"]
    d2r, k2r = [], []
    for i in range(args.runs):
        victim_replica, victim_local, phase = 1 + i % (n_rep - 1), i % rpr, phases[i % len(phases)]
        cfg = {"ranks_per_replica": rpr, "steps": 4, "bucket_len": args.bucket_len,
               "schedule": [{"step": 2, "replica": victim_replica, "rank": victim_local, "phase": phase}]}
        with tempfile.TemporaryDirectory() as tmp:
            run = run_worker(args.ranks, cfg, Path(tmp))
        done = run.by_status("done")
        if len(done) != args.ranks - rpr or any(d["errors"] or d["steps_completed"] != 4 for d in done.values()):
            print(f"run {i}: FAILED\n{run.output[-3000:]}")
            return 1
        med = statistics.median(d["events"][0]["detect_to_repaired_ms"] for d in done.values())
        d2r.append(med)
        k2r.append(run.kill_to_repaired_ms())
        print(f"run {i}: kill replica {victim_replica} local {victim_local} in {phase}: "
              f"detect-to-repaired median {med:.1f} ms, SIGKILL-to-all-repaired {k2r[-1]:.1f} ms")
    write_record("repair", argv=argv, command=command_line(argv, "benchmarks/repair_bench.py"), args=args,
                 samples={"detect_to_repaired_ms": d2r, "kill_to_all_repaired_ms": k2r},
                 figures={"detect_to_repaired_ms": statistics.median(d2r),
                          "kill_to_all_repaired_ms": statistics.median(k2r), "kill_to_all_repaired_max_ms": max(k2r)})
    print(f"{args.ranks} ranks ({n_rep} replicas x {rpr}), {args.runs} runs: "
          f"median detect-to-repaired {statistics.median(d2r):.1f} ms, "
          f"median SIGKILL-to-all-repaired {statistics.median(k2r):.1f} ms (max {max(k2r):.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
