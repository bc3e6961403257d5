"""Peak memory of a relaunch from node-local snapshots when one node holds a coordinate and 3 ranks receive it.

Issue #23 item 6: the old transfer read the whole snapshot file once per receiver and kept every copy, so after the
loss of several nodes one process held (receivers + 1) copies at once. This benchmark writes one rank's snapshot
(``--mb`` MiB of parameters, plus AdamW's two moments: 3x that in the file), then relaunches on 4 ranks on 4 fake
nodes (``NANOTRON_RECOVER_NODE_NAME``): rank 0's node holds the file, ranks 1-3 receive it over MPI (real
``mpirun --with-ft ulfm``). Each rank reports its peak RSS during the resume above its RSS before it (the state
itself already allocated), in MiB.

``--module-file`` loads another copy of ``local_snapshot.py`` (e.g. the old one, from ``git show``) to measure it.
Last line: ``sender_peak_extra_mib=A receiver_peak_extra_mib=B file_mib=C``.
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
from nanotron_recover.launcher.mpirun import mpirun_command  # noqa: E402

PROGRAM = r"""
import importlib.util, os, resource, sys, types
from pathlib import Path
phase, base, mib, module_file = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
os.environ["NANOTRON_RECOVER_NODE_NAME"] = f"n{rank}"
import torch
from nanotron_recover.ft import FTWorld, WorldOptions
from nanotron_recover.training.training_state import ensure_adam_state
if module_file:
    spec = importlib.util.spec_from_file_location("local_snapshot_under_test", module_file)
    snap = importlib.util.module_from_spec(spec); sys.modules[spec.name] = snap; spec.loader.exec_module(snap)
else:
    from nanotron_recover.snapshots import local_snapshot as snap
ns = types.SimpleNamespace
ft_args = ns(local_snapshot_interval=1, local_snapshot_dir=str(base / "shm"), replica="3d", fsdp_shard_size=None)
config = ns(fault_tolerance=ft_args, ranks_per_replica=1, model=ns(model_config="bench", dtype="float32"),
            optimizer="adamw", general=ns(seed=1), data="synthetic", microbatches_per_step=4,
            tokens=ns(micro_batch_size=1, sequence_length=16), parallelism=ns(tp=1, pp=1))
param = torch.nn.Parameter(torch.full((mib * 2**18,), float(rank + 1)))
optimizer = torch.optim.AdamW([param], lr=1e-3)
state = ns(named_params=[("w", param)], optimizer=optimizer,
           lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
ensure_adam_state(optimizer)
for t in optimizer.state[param].values():
    t.fill_(0.5)
ft = FTWorld(MPI.COMM_WORLD, ranks_per_replica=1, options=WorldOptions(watch=False))
import inspect
from nanotron_recover.run.launch_contract import LaunchContract
# each rank its own node: the launch names it (an older module under test read the variable set above)
where = {"launch": LaunchContract(node_name=f"n{rank}")} \
    if "launch" in inspect.signature(snap.LocalSnapshots.for_config).parameters else {}
snapshots = snap.LocalSnapshots.for_config(config, base / "run", ft, replica=rank, coord=0, log=lambda m: None,
                                           **where)
if phase == "write":
    snapshots.resume(state, None)
    snapshots.after_commit(1, state)
    snapshots.finish()
else:
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    step = snapshots.resume(state, None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert step == 1 and float(param[0]) == 1.0, (step, float(param[0]))
    print(f"RESULT rank={rank} peak_extra_mib={(peak - before) / 2**20:.1f}", flush=True)
"""


def run_phase(phase: str, ranks: int, base: Path, mib: int, module_file: str, timeout_s: float) -> str:
    cmd = mpirun_command(ranks, [sys.executable, "-c", PROGRAM, phase, str(base), str(mib), module_file])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0 or (phase == "resume" and out.stdout.count("RESULT") != ranks):
        raise RuntimeError(f"{phase} failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="MiB of parameters (the file holds 3x: AdamW's moments)")
    parser.add_argument("--module-file", default="", help="another local_snapshot.py to measure (default: this one)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    print(machine_line())
    print(command_line(argv, "benchmarks/snapshot_resume_memory_bench.py"))
    with tempfile.TemporaryDirectory(prefix="snapshot-resume-mem-") as tmp:
        base = Path(tmp)
        run_phase("write", 1, base, args.mb, args.module_file, args.timeout_s)
        out = run_phase("resume", 4, base, args.mb, args.module_file, args.timeout_s)
    peaks = {int(r): float(p) for r, p in re.findall(r"RESULT rank=(\d+) peak_extra_mib=([\d.-]+)", out)}
    for rank in sorted(peaks):
        print(f"rank {rank} ({'sender' if rank == 0 else 'receiver'}): peak RSS during resume +{peaks[rank]:.1f} MiB")
    receiver = max(peaks[r] for r in peaks if r != 0)
    write_record("snapshot_resume_memory", argv=argv, args=args, samples={"peak_extra_mib": peaks},
                 command=command_line(argv, "benchmarks/snapshot_resume_memory_bench.py"),
                 figures={"sender_peak_extra_mib": peaks[0], "receiver_peak_extra_mib": receiver,
                          "file_mib": 3 * args.mb})
    print(f"sender_peak_extra_mib={peaks[0]:.1f} receiver_peak_extra_mib={receiver:.1f} file_mib={3 * args.mb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
