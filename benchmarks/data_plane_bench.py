"""The two data planes side by side (``fault_tolerance.data_plane: mpi | torch``) on this machine.

Three parts, each printed as a table and written to data_plane.json / data_plane.md under --out:

* micro: the in-place SUM of one fp32 buffer over ``--ranks`` ranks (1-rank replicas), per size, on the MPI plane
  (``Allreduce(IN_PLACE)`` on the ULFM communicator) and on the torch plane (gloo, with the failure-notice polling
  the trainer uses), and the torch plane's group rebuild (close, then rendezvous + connect + a first reduction).
* step: failure-free training at the headline size, the planes interleaved (mpi, torch, torch, mpi, ...): median
  step time per plane and their ratio.
* recovery: one run per plane with a replica SIGKILLed inside the reduction: what the failure cost its step
  (failure step - median step before it; ``benchmarks/compare.py``'s accounting), and the repair's own time.

The last line is ``torch_over_mpi_step=<ratio>``. Example (smaller, ~3 min):
  .venv/bin/python benchmarks/data_plane_bench.py --repeats 1 --steps 12 --dp 4 --sizes-mb 1 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ckpt_restart import FailureEvent  # noqa: E402
from benchmarks.compare import recover_failures  # noqa: E402
from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, normal_step_times, summarize  # noqa: E402
from nanotron_recover.launcher.mpirun import mpirun_command  # noqa: E402

WORKER = Path(__file__).resolve().parent / "lib" / "data_plane_worker.py"
PLANES = ("mpi", "torch")


def micro(ranks: int, sizes_mb: Sequence[float], repeats: int, rebuilds: int, timeout_s: float) -> list[dict]:
    return run_worker(ranks, {"sizes_mb": list(sizes_mb), "repeats": repeats, "rebuilds": rebuilds}, timeout_s)


def run_worker(ranks: int, cfg: dict, timeout_s: float) -> list[dict]:
    """``lib/data_plane_worker.py`` under ``mpirun --with-ft ulfm``: the JSON lines it printed."""
    cmd = mpirun_command(ranks, [sys.executable, "-u", str(WORKER), json.dumps(cfg)],
                         env={"PYTHONPATH": str(WORKER.parents[2])})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not rows or ("victim" not in cfg and out.returncode != 0):
        raise RuntimeError(f"the micro-benchmark failed (rc {out.returncode}):\n"
                           f"{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return rows


def interleaved(repeats: int) -> list[str]:
    """mpi, torch, torch, mpi, ...: a slow drift of the machine hits both planes alike."""
    return [p for k in range(repeats) for p in (PLANES if k % 2 == 0 else PLANES[::-1])]


def step_runs(args, size, out: Path) -> dict[str, list[float]]:
    medians: dict[str, list[float]] = {p: [] for p in PLANES}
    for k, plane in enumerate(interleaved(args.repeats)):
        config = make_config(dp=args.dp, accumulation=args.accumulation, steps=args.steps, size=size,
                             fault_tolerance={"enabled": True, "data_plane": plane})
        a = launch(config, out / f"step_{k:02d}_{plane}", timeout_s=args.timeout_s)
        if not a.steps or a.steps[-1]["step"] < args.steps:
            log = (Path(a.run_dir) / "output.log").read_text()
            raise RuntimeError(f"{plane} run {k} stopped early:\n{log[-3000:]}")
        medians[plane].append(median(normal_step_times(a.steps)))
        print(f"[data plane] step run {k + 1}: {plane} median step {medians[plane][-1] * 1e3:.1f} ms", flush=True)
    return medians


def recovery_runs(args, size, out: Path) -> dict[str, dict]:
    fault_step = max(4, args.steps // 2)
    event = FailureEvent(step=fault_step, replicas=(1,), phase="reduce")
    found = {}
    for plane in PLANES:
        config = make_config(dp=args.dp, accumulation=args.accumulation, steps=args.steps, size=size,
                             fault_tolerance={"enabled": True, "data_plane": plane, "recycle": False,
                                              "inject": [{"step": fault_step, "replica": 1, "rank": 0,
                                                          "phase": "reduce"}]})
        a = launch(config, out / f"recovery_{plane}", timeout_s=args.timeout_s)
        run = summarize(plane, [a], args.steps, 1)
        (found[plane],) = recover_failures(run, [event], None)
        groups = [e for e in a.events if e.get("event") == "data_plane_group" and e.get("step") == fault_step]
        found[plane]["group_build_ms"] = sum(g["ms"] for g in groups)
        print(f"[data plane] recovery {plane}: the failure cost its step {found[plane]['total_s'] * 1e3:.0f} ms",
              flush=True)
    return found


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the micro-benchmark")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0, 64.0])
    ap.add_argument("--micro-repeats", type=int, default=10)
    ap.add_argument("--rebuilds", type=int, default=10)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2, help="failure-free runs per plane")
    add_headline_run_args(ap, out="runs/bench/data_plane")
    args = ap.parse_args(argv)
    size, out = size_from_args(args), fresh_out_dir(args)
    out.mkdir(parents=True)
    rows = micro(args.ranks, args.sizes_mb, args.micro_repeats, args.rebuilds, args.timeout_s)
    medians = step_runs(args, size, out)
    recovery = recovery_runs(args, size, out)
    step = {p: median(v) for p, v in medians.items()}
    ratio = step["torch"] / step["mpi"]
    command = command_line(argv, "benchmarks/data_plane_bench.py")
    data = {"command": command, "machine": machine_line(), "micro": rows, "step_medians_s": medians,
            "step_median_s": step, "torch_over_mpi_step": ratio, "recovery": recovery,
            "setup": f"{args.dp} replicas x 1 rank, M = {args.dp * args.accumulation}, {args.steps} steps, "
                     f"{size.describe()}, synthetic data"}
    write_json(out / "data_plane.json", data)
    write_record("data_plane", argv=argv, command=command, args=args, samples=data, figures=figures(data))
    md = report(data)
    (out / "data_plane.md").write_text(md)
    print(md)
    print(f"torch_over_mpi_step={ratio:.3f}")
    return data


def figures(data: dict) -> dict[str, float]:
    """The record's figures of a ``data_plane.json``: the step ratio and each plane's median step; the in-place SUM
    per plane and size; the torch group's rebuild; per plane what a kill inside the reduction cost."""
    step = data["step_median_s"]
    out = {"torch_over_mpi_step": data["torch_over_mpi_step"], "mpi_step_ms": step["mpi"] * 1e3,
           "torch_step_ms": step["torch"] * 1e3}
    for r in data["micro"]:
        if r["what"] == "allreduce":
            out[f"{r['plane']}_sum_ms_{r['mb']:g}MB"] = r["median_ms"]
        elif r["what"] == "rebuild":
            out["torch_rebuild_ms"] = r["median_ms"]
    for plane, rec in data["recovery"].items():
        out.update({f"{plane}_detect_ms": rec["detect_s"] * 1e3, f"{plane}_repair_ms": rec["repair_s"] * 1e3,
                    f"{plane}_group_build_ms": rec["group_build_ms"],
                    f"{plane}_failure_step_extra_ms": rec["total_s"] * 1e3})
    return out


def report(data: dict) -> str:
    sums = [r for r in data["micro"] if r["what"] == "allreduce"]
    by = {(r["plane"], r["mb"]): r for r in sums}
    sizes = sorted({r["mb"] for r in sums})
    micro_rows = [[mb, by[("mpi", mb)]["median_ms"], by[("torch", mb)]["median_ms"],
                   f"{by[('torch', mb)]['median_ms'] / by[('mpi', mb)]['median_ms']:.2f}"] for mb in sizes]
    (rebuild,) = [r for r in data["micro"] if r["what"] == "rebuild"]
    rec = data["recovery"]
    rec_rows = [[p, rec[p]["detect_s"] * 1e3, rec[p]["repair_s"] * 1e3, rec[p]["group_build_ms"],
                 rec[p]["total_s"] * 1e3] for p in PLANES]
    step = data["step_median_s"]
    return "\n".join([
        f"command: `{data['command']}`", "", f"machine: {data['machine']}", "",
        f"micro: in-place SUM over {sums[0]['ranks']} ranks (median of the repeats)", "",
        md_table(["MB", "mpi ms", "torch (gloo) ms", "torch / mpi"], micro_rows), "",
        f"torch plane group rebuild (close, rendezvous, connect, first reduction): median "
        f"{rebuild['median_ms']:.1f} ms, max {rebuild['max_ms']:.1f} ms over {rebuild['n']}", "",
        f"step: {data['setup']}; median step mpi {step['mpi'] * 1e3:.1f} ms, torch {step['torch'] * 1e3:.1f} ms, "
        f"torch / mpi = {data['torch_over_mpi_step']:.3f}", "",
        "recovery: one replica SIGKILLed inside the reduction", "",
        md_table(["plane", "detect ms", "repair ms", "group build ms", "failure step - normal step ms"], rec_rows),
    ]) + "\n"


if __name__ == "__main__":
    main()
