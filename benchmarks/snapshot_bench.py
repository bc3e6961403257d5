"""Node-local snapshots (issue #18): what they cost failure-free, and what they save when a job is lost.

1. **Overhead**: failure-free ReCoVer runs with a snapshot every step vs none, interleaved (``--pairs`` of each, in
   turn); the median step time of each (first two steps left out) and the bytes one rank writes per snapshot
   (its ``local_snapshot`` event).
2. **Restart from a local snapshot vs from the disk checkpoint**: the same run, its whole job SIGKILLed after step
   ``--kill-after`` (what a lost node does to an ``mpirun`` on this Open MPI: every rank is torn down), relaunched
   in the same run dir; once with snapshots (it resumes from the last committed step), once without (it resumes
   from the checkpoint every ``--checkpoint-interval`` steps). Reported: the step resumed at, the committed steps
   recomputed, and kill -> training again (the first resumed step's start) in seconds.

Writes snapshot.json / .md under --out. Last line:
``snapshot_step_overhead=X bytes_per_rank_per_step=N steps_recomputed_snapshot=A steps_recomputed_disk=B``.
Minimal size: --steps 6 --kill-after 3 --checkpoint-interval 2 --pairs 1 --hidden 32 --intermediate 64 --seq 16
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, normal_step_times  # noqa: E402
from nanotron_recover.launcher.runs import kill_run_processes, run_training, write_config
from nanotron_recover.run.run_folder import read_metrics  # noqa: E402


def kill_and_relaunch(config: dict, run_dir: Path, kill_after: int, timeout_s: float) -> dict:
    config_path = write_config(config, run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", "0"]  # the harness relaunches
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        steps, _ = read_metrics(run_dir)
        if steps and steps[-1]["step"] >= kill_after:
            break
        time.sleep(0.02)
    kill_run_processes(run_dir, proc)
    killed_at = time.time()
    last = read_metrics(run_dir)[0][-1]["step"]
    result = run_training(config_path, run_dir, timeout_s=timeout_s, extra_args=["--synthetic-data"])
    after = [s for s in result.steps if s["time"] >= killed_at]
    resumed_at = after[0]["step"] - 1
    return {"last_logged_step": last, "resumed_at": resumed_at, "steps_recomputed": max(0, last - resumed_at),
            "kill_to_training_s": after[0]["time"] - after[0]["step_time_s"] - killed_at,
            "relaunch_wall_s": result.wall_s}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=4, help="interleaved failure-free runs of each variant")
    ap.add_argument("--kill-after", type=int, default=14)
    ap.add_argument("--checkpoint-interval", type=int, default=10)
    add_headline_run_args(ap, out="runs/bench/snapshot")
    args = ap.parse_args(argv)
    size = size_from_args(args)
    out = fresh_out_dir(args)

    def config(interval: int, checkpoint_interval: int = 100000) -> dict:
        ft = {"enabled": True, "local_snapshot_interval": interval}  # the default folder: /dev/shm (memory)
        c = make_config(dp=args.dp, tp=args.tp, accumulation=args.accumulation, steps=args.steps, size=size,
                        fault_tolerance=ft, checkpoint_interval=checkpoint_interval)
        # the relaunch from disk is checkpoint-restart's: each checkpoint on disk when its step ends (a background
        # save is on disk one write later, and a kill inside that write costs one interval more)
        c["checkpoints"]["async_save"] = False
        return c

    step_times, per_rank_bytes, loads = _interleaved_runs(config, args, out)
    medians = {name: median(times) for name, times in step_times.items()}
    overhead = medians["every step"] / medians["none"]
    restart = {
        "local snapshot": kill_and_relaunch(config(1, args.checkpoint_interval), out / "restart_snapshot",
                                            args.kill_after, args.timeout_s),
        "disk checkpoint": kill_and_relaunch(config(0, args.checkpoint_interval), out / "restart_disk",
                                             args.kill_after, args.timeout_s),
    }
    return _write(medians, overhead, per_rank_bytes, restart, loads, args, size, argv, out)


def _interleaved_runs(config, args: argparse.Namespace, out: Path) -> tuple[dict[str, list[float]], int, list]:
    """Failure-free runs without and with a snapshot every step, ABBA-interleaved (no variant always goes first):
    their step times, the bytes one rank writes per snapshot, the load at each launch."""
    step_times: dict[str, list[float]] = {"none": [], "every step": []}
    per_rank_bytes = 0
    loads = []
    variants = [("none", 0), ("every step", 1)]
    for k in range(args.pairs):
        for name, interval in variants if k % 2 == 0 else variants[::-1]:  # ABBA: no variant always goes first
            attempt = launch(config(interval), out / f"{name.replace(' ', '_')}-{k}", timeout_s=args.timeout_s)
            if attempt.returncode != 0 or attempt.steps[-1]["step"] != args.steps:
                raise RuntimeError(f"{name} run {k} stopped early (exit {attempt.returncode})")
            step_times[name] += normal_step_times(attempt.steps)
            loads.append(attempt.load_avg_1min)
            events = [e for e in attempt.events if e.get("event") == "local_snapshot"]
            if interval:
                per_rank_bytes = events[0]["bytes_per_rank"]
            print(f"[snapshot] {name} run {k}: median step {median(normal_step_times(attempt.steps)) * 1000:.1f} ms",
                  flush=True)
    return step_times, per_rank_bytes, loads


def figures(data: dict) -> dict[str, float]:
    """The record's figures of a ``snapshot.json``: the step-time ratio, the median steps, the bytes per snapshot,
    and per relaunch source the steps recomputed and kill -> training again."""
    med = data["median_step_s"]
    out = {"snapshot_step_overhead": data["snapshot_step_overhead"],
           "median_step_ms_none": med["none"] * 1e3, "median_step_ms_every_step": med["every step"] * 1e3,
           "bytes_per_rank_per_snapshot": data["bytes_per_rank_per_snapshot"]}
    for source, key in (("local snapshot", "snapshot"), ("disk checkpoint", "disk")):
        out[f"steps_recomputed_{key}"] = data["restart"][source]["steps_recomputed"]
        out[f"kill_to_training_s_{key}"] = data["restart"][source]["kill_to_training_s"]
    return out


def _write(medians: dict, overhead: float, per_rank_bytes: int, restart: dict, loads: list,
           args: argparse.Namespace, size, argv: Sequence[str] | None, out: Path) -> dict:
    command = command_line(argv, "benchmarks/snapshot_bench.py")
    setup = (f"{args.dp} replicas x TP{args.tp}, M = {args.dp * args.accumulation}, {args.steps} steps, "
             f"{size.describe()}, synthetic data; restart runs: job SIGKILLed after step {args.kill_after}, disk "
             f"checkpoint every {args.checkpoint_interval} steps; snapshots in /dev/shm")
    data = {"command": command, "machine": machine_line(), "setup": setup, "median_step_s": medians,
            "snapshot_step_overhead": overhead, "bytes_per_rank_per_snapshot": per_rank_bytes, "restart": restart,
            "load_avg_1min": loads}
    write_json(out / "snapshot.json", data)
    write_record("snapshot", argv=argv, command=command, args=args, samples=data, figures=figures(data))
    rows = [[name, r["last_logged_step"], r["resumed_at"], r["steps_recomputed"], r["kill_to_training_s"]]
            for name, r in restart.items()]
    md = "\n".join([
        f"command: `{command}`", "", f"machine: {data['machine']}; 1-min load at launches {min(loads):.1f}-"
        f"{max(loads):.1f}", "", f"setup: {setup}", "",
        md_table(["snapshots", "median step (ms)"], [[n, m * 1000] for n, m in medians.items()]), "",
        f"step time with a snapshot every step / none = {overhead:.3f}; one rank writes {per_rank_bytes} bytes per "
        "snapshot", "",
        md_table(["relaunch from", "last logged step", "resumed at", "committed steps recomputed",
                  "kill -> training again (s)"], rows),
    ]) + "\n"
    (out / "snapshot.md").write_text(md)
    print(md)
    print(f"snapshot_step_overhead={overhead:.3f} bytes_per_rank_per_step={per_rank_bytes} "
          f"steps_recomputed_snapshot={restart['local snapshot']['steps_recomputed']} "
          f"steps_recomputed_disk={restart['disk checkpoint']['steps_recomputed']}")
    return data


if __name__ == "__main__":
    main()
