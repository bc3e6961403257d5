"""A relaunch, cold and warm, in one invocation: from the end of the old job to the next committed step.

The same job twice, differing only in ``fault_tolerance.standby`` (``off``: the launcher relaunches cold; ``auto``:
from the warm standby it keeps beside the job): a replica is SIGKILLed at step ``--kill-step`` with ``min_replicas``
= every replica, so the survivors checkpoint the last committed step and end with the restart outcome, and the
launcher relaunches in place (``--max-restarts 1``). From the run folder: when the old job's ``mpirun`` ended
(the second launch record's ``previous_job_ended``), when the launcher launched again, when the first step after it
started and was committed (logged). Also the standby's memory: the largest resident set of one standby rank
while it waited, summed over the ranks of this node.

Writes relaunch.json / .md under --out and the raw record ``benchmarks/results/relaunch.json``
(``cold_s``, ``warm_s``). Last line: ``cold_s=X warm_s=Y warm_over_cold=R``.
Default: the main job's shape (2 replicas x TP2 x PP2, 8 processes); ``--tp 1 --pp 1`` for 2 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, write_json  # noqa: E402
from nanotron_recover.launcher.runs import write_config  # noqa: E402
from nanotron_recover.run.launch_contract import STANDBY_ENV  # noqa: E402
from nanotron_recover.run.run_folder import read_launches, read_metrics_jsonl  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def standby_rss_gb() -> list[float]:
    """The resident set (GB) of every standby rank on this machine now."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if f"{STANDBY_ENV}=".encode() not in Path(f"/proc/{entry}/environ").read_bytes():
                continue
            status = Path(f"/proc/{entry}/status").read_text()
            if "python" not in Path(f"/proc/{entry}/comm").read_text():
                continue
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        out.append(kb / 2**20)
    return out


def run_variant(config: dict, run_dir: Path, timeout_s: float) -> dict:
    """One job, relaunched in place once; -> the relaunch's timings and the standby's memory."""
    config_path = write_config(config, run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", "1"]
    env = {k: v for k, v in os.environ.items() if k != "NANOTRON_RECOVER_MAX_RESTARTS"}
    peak: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            rss = standby_rss_gb()
            if rss and sum(rss) > sum(peak):
                peak[:] = rss

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with open(run_dir / "output.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    done.set()
    sampler.join()
    return {**timings(run_dir), "launcher_rc": rc, "standby_rank_rss_gb": max(peak, default=0.0),
            "standby_ranks_seen": len(peak), "standby_rss_gb_total": sum(peak)}


def timings(run_dir: Path) -> dict:
    """The second launch, from the run folder: old job ended -> relaunched -> first step started -> committed."""
    launches = read_launches(run_dir)
    if len(launches) != 2:
        raise RuntimeError(f"{run_dir}: expected one in-place relaunch, found {len(launches)} launch(es)")
    second = launches[1]
    records = read_metrics_jsonl(run_dir)
    stopped = next(r for r in records if r.get("event") == "stopped")
    first = next(r for r in records if "event" not in r and r.get("time", 0) >= second["time"])
    ended = second["previous_job_ended"]
    started = first["time"] - first["step_time_s"]
    startup = next((r for r in records if r.get("event") == "startup" and r["time"] >= second["time"]), {})
    return {"warm": second["warm"], "resumed_step": first["step"], "end_to_next_step_s": first["time"] - ended,
            "breakdown_s": {"teardown (stop decided -> mpirun ended)": ended - stopped["time"],
                            "judge and relaunch (-> launch record)": second["time"] - ended,
                            "start-up and state load (-> first step starts)": started - second["time"],
                            "first step": first["step_time_s"]},
            # the logging rank's own start-up (from its process start, or its release from the standby), by phase
            "startup_phases_s": startup.get("phases_s", {})}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=60, help="late enough for the standby to be ready")
    ap.add_argument("--steps-after", type=int, default=10)
    add_headline_run_args(ap, out="runs/bench/relaunch")
    ap.set_defaults(hidden=64, intermediate=256, layers=6, seq=64, micro_batch=4, vocab=4096)  # the main job's model
    args = ap.parse_args(argv)
    out = fresh_out_dir(args)
    results = {}
    for variant in ("off", "auto"):
        ft = {"enabled": True, "min_replicas": args.dp, "standby": variant,
              "inject": [{"step": args.kill_step, "replica": 1, "rank": 0, "phase": "backward"}]}
        config = make_config(dp=args.dp, tp=args.tp, pp=args.pp, accumulation=args.accumulation,
                             steps=args.kill_step + args.steps_after, size=size_from_args(args), fault_tolerance=ft)
        results[variant] = run_variant(config, out / f"standby_{variant}", args.timeout_s)
        print(f"[relaunch] standby {variant}: {json.dumps(results[variant])}", flush=True)
    return _write(results, args, argv, out)


def _write(results: dict, args: argparse.Namespace, argv: Sequence[str] | None, out: Path) -> dict:
    cold, warm = results["off"], results["auto"]
    if cold["warm"] or not warm["warm"]:
        raise RuntimeError(f"expected a cold then a warm relaunch, got warm={cold['warm']}, {warm['warm']}")
    command = command_line(argv, "benchmarks/relaunch_bench.py")
    data = {"command": command, "machine": machine_line(),
            "setup": f"{args.dp} replicas x TP{args.tp} x PP{args.pp} ({args.dp * args.tp * args.pp} processes), "
                     f"replica 1 killed at step {args.kill_step} with min_replicas {args.dp}, --max-restarts 1",
            "cold_s": cold["end_to_next_step_s"], "warm_s": warm["end_to_next_step_s"],
            "warm_over_cold": warm["end_to_next_step_s"] / cold["end_to_next_step_s"],
            "standby_rank_rss_gb": warm["standby_rank_rss_gb"], "runs": results}
    write_json(out / "relaunch.json", data)
    write_json(RESULTS / "relaunch.json", data)
    figures = {k: data[k] for k in ("cold_s", "warm_s", "warm_over_cold", "standby_rank_rss_gb")}
    write_record("relaunch", argv=argv, command=command, args=args, samples=data, figures=figures)
    rows = [[part, f"{cold['breakdown_s'][part]:.2f}", f"{warm['breakdown_s'][part]:.2f}"]
            for part in cold["breakdown_s"]]
    rows.append(["**old job ended -> next step committed**", f"**{data['cold_s']:.2f}**", f"**{data['warm_s']:.2f}**"])
    cold_phases, warm_phases = cold["startup_phases_s"], warm["startup_phases_s"]
    phases = [[phase, f"{cold_phases.get(phase, 0.0):.2f}", f"{warm_phases.get(phase, 0.0):.2f}"]
              for phase in dict.fromkeys([*cold_phases, *warm_phases])]
    md = "\n".join([f"command: `{command}`", "", f"machine: {data['machine']}", "", f"setup: {data['setup']}", "",
                    md_table(["part (s)", "cold", "warm"], rows), "",
                    "The logging rank's start-up by phase (from its process's start, or its release from the standby; "
                    "the run's `startup` event):", "", md_table(["phase (s)", "cold", "warm"], phases), "",
                    f"warm / cold = {data['warm_over_cold']:.2f}; a standby rank's resident set while waiting: "
                    f"{data['standby_rank_rss_gb']:.2f} GB", ""])
    (out / "relaunch.md").write_text(md)
    (RESULTS / "relaunch.md").write_text(md)
    print(md)
    print(f"cold_s={data['cold_s']:.3f} warm_s={data['warm_s']:.3f} warm_over_cold={data['warm_over_cold']:.3f}")
    return data


if __name__ == "__main__":
    main()
