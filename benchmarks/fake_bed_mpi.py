"""MPI latency on the fake-node test bed, with ranks busy-polling and yielding (``mpi_yield_when_idle``).

The bed (``nanotron_recover.testbed.fake_nodes``) runs several Open MPI nodes on one machine. PRRTE sees each node's
slots filled, not exceeded, so by default a rank waiting in MPI busy-polls as on a real node; with more ranks than cores
the waiting ranks then take the CPU from the ones that would answer. Measured: the mean time of an ``Allreduce``
of 10 KB and of an ULFM ``Agree`` over all ranks, on one node (shared memory, and TCP) and on the bed (TCP between
nodes) without and with yielding. The bed's own launch arguments yield.

Last line: ``bed_allreduce_ms_busy=A bed_allreduce_ms_yield=B bed_agree_ms_busy=C bed_agree_ms_yield=D``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line  # noqa: E402
from nanotron_recover.launcher.launch import MPIRUN_ARGS_ENV  # noqa: E402
from nanotron_recover.launcher.mpirun import mpirun_command  # noqa: E402
from nanotron_recover.testbed.fake_nodes import write_bed  # noqa: E402

PROGRAM = """
import sys, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
buf = np.ones(2500, np.float32)  # 10 KB
n = int(sys.argv[1])
comm.Barrier()
t0 = time.perf_counter()
for _ in range(n):
    comm.Allreduce(MPI.IN_PLACE, buf)
t1 = time.perf_counter()
for _ in range(n):
    comm.Agree(1)
t2 = time.perf_counter()
if comm.Get_rank() == 0:
    print(f"RESULT allreduce_ms={1e3 * (t1 - t0) / n:.3f} agree_ms={1e3 * (t2 - t1) / n:.3f}", flush=True)
"""


def measure(ranks: int, repeats: int, extra: list[str], timeout_s: float = 300.0) -> tuple[float, float]:
    cmd = mpirun_command(ranks, [sys.executable, "-c", PROGRAM, str(repeats)], extra_args=extra)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    found = re.search(r"RESULT allreduce_ms=([\d.]+) agree_ms=([\d.]+)", out.stdout)
    if found is None:
        raise RuntimeError(f"no result (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(found.group(1)), float(found.group(2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2, help="ranks per fake node")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    ranks = args.nodes * args.slots
    print(machine_line())
    print(command_line(argv, "benchmarks/fake_bed_mpi.py"))
    with tempfile.TemporaryDirectory() as tmp:
        bed_args = write_bed(Path(tmp) / "bed", [args.slots] * args.nodes)
        bed = ["--hostfile", bed_args["NANOTRON_RECOVER_HOSTFILE"], *bed_args[MPIRUN_ARGS_ENV].split()]
        busy = list(bed)
        i = busy.index("mpi_yield_when_idle")
        busy[i + 1] = "0"
        rows = {
            "one node, shared memory": measure(ranks, args.repeats, []),
            "one node, TCP": measure(ranks, args.repeats, ["--mca", "btl", "tcp,self"]),
            f"{args.nodes} fake nodes, busy-polling": measure(ranks, args.repeats, busy),
            f"{args.nodes} fake nodes, yielding (the bed)": measure(ranks, args.repeats, bed),
        }
    print(f"{ranks} ranks, {args.repeats} operations each")
    print("| where | Allreduce 10 KB (ms) | Agree (ms) |\n|---|---|---|")
    for name, (allreduce, agree) in rows.items():
        print(f"| {name} | {allreduce:.2f} | {agree:.2f} |")
    (b_ar, b_ag), (y_ar, y_ag) = list(rows.values())[2:]
    write_record("fake_bed_mpi", argv=argv, command=command_line(argv, "benchmarks/fake_bed_mpi.py"), args=args,
                 samples={name: {"allreduce_ms": a, "agree_ms": g} for name, (a, g) in rows.items()},
                 figures={"bed_allreduce_ms_busy": b_ar, "bed_allreduce_ms_yield": y_ar, "bed_agree_ms_busy": b_ag,
                          "bed_agree_ms_yield": y_ag})
    print(f"bed_allreduce_ms_busy={b_ar:.3f} bed_allreduce_ms_yield={y_ar:.3f} "
          f"bed_agree_ms_busy={b_ag:.3f} bed_agree_ms_yield={y_ag:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
