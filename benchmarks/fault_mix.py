"""The fault mix: ReCoVer and torchft under faults at random times, in the shape of a published chaos run of
torchft, scaled to this machine; kept throughput and trajectory of each, in one invocation.

The published run (2026-06, one CPU machine): 32 replica groups on 16 cores, 62 faults in 30 minutes (kill -9,
SIGSTOP, network partitions), 97.7 % of the fault-free throughput kept. Here: ``--replicas`` one-process replica
groups (default 4: two per core of a 2-core machine, as there), faults at the published rate *per group*
(``--mean-gap-s``, default 30 min x 32 / 62 / R between faults), each a SIGKILL of a rank or a SIGSTOP of it for
``--stop-s`` (default twice the hang timeout), then a SIGCONT; the times (a Poisson process from the first
committed step), kinds and victims drawn from ``--seed``, the same for both systems. Network partitions need
nodes with networks of their own (``nanotron_recover.testbed``); this script runs on one host and sends none.

Systems (``benchmarks/vs_torchft.py``'s, the same model, data, batch, optimizer and processes):

* ``recover+regrow``: ReCoVer as its user runs it (relaunched in place by its launcher, the lost replica regrown;
  ``fault_tolerance.hang_timeout_s`` ``--hang-timeout-s``, default 5 s: a frozen rank is killed after that long);
* ``torchft-mar``: torchft with its restarting agents (``--peer-python``/``--peer-pg`` for the newest torchft;
  its process group timeout is 5 s, the lighthouse's heartbeat timeout 5 s).

Each system trains ``--steps`` N steps failure-free, then N steps under the mix. Kept throughput = (useful samples
of its first N committed steps / time from its first committed step to the N-th) under the mix, over the same of
its failure-free run; useful samples count the microbatches whose gradients a committed step used (ReCoVer: always
M; torchft: the participants' shares). Trajectory: max |loss - failure-free loss| over the N steps (ReCoVer's must
be at the fp32 floor; torchft's changes where a step dropped a share).

Prints a table and, last, one line:
  recover_kept_throughput=<a> torchft_kept_throughput=<b> recover_max_dloss=<c> torchft_max_dloss=<d>
``--quick``: a smoke test's size (2 replicas, a SIGSTOP after step 20, a kill -9 after step 250).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import fresh_out_dir, parse_sized  # noqa: E402
from benchmarks.lib.outside_faults import KILL, STOP, Fault, fault_mix  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, write_json  # noqa: E402
from benchmarks.lib.side_by_side import SystemRun, clockwork_numbers, full_steps, max_dloss, ratio  # noqa: E402
from benchmarks.lib.torchft_runner import INSTALL_HINT, peer_versions, torchft_available  # noqa: E402
from benchmarks.vs_torchft import (  # noqa: E402
    check_complete,
    peer_figures,
    prepare_data,
    run_system,
    steps_to_run,
)

PUBLISHED = {"groups": 32, "cores": 16, "faults": 62, "minutes": 30, "kept_throughput": 0.977}
SYSTEMS = ("recover+regrow", "torchft-mar")
# a smoke test's size: its two faults are placed by step, not drawn in time, so that both land on a machine of any
# speed: a SIGSTOP after step 20 (both replicas live, so a peer watches the frozen one), a kill -9 after step 250
QUICK = dict(replicas=2, hidden=64, intermediate=128, layers=2, seq=64, micro_batch=2, steps=400, stop_s=10.0)
QUICK_FAULTS = (Fault(after_step=20, u=0.75, kind=STOP, stop_s=10.0), Fault(after_step=250, u=0.0))


def published_gap_s(replicas: int) -> float:
    """Seconds between faults at the published run's rate per replica group, for ``replicas`` groups."""
    return PUBLISHED["minutes"] * 60 * PUBLISHED["groups"] / PUBLISHED["faults"] / replicas


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4, help="one-process replica groups (M = R x accumulation)")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000, help="N: steps of each run")
    ap.add_argument("--mean-gap-s", type=float, default=None,
                    help="mean time between faults (default: the published rate per group, for --replicas groups)")
    ap.add_argument("--stop-share", type=float, default=0.5, help="share of the faults that are a SIGSTOP")
    ap.add_argument("--hang-timeout-s", type=float, default=5.0, help="ReCoVer's fault_tolerance.hang_timeout_s")
    ap.add_argument("--stop-s", type=float, default=None, help="how long a SIGSTOP lasts (default 2 x hang timeout)")
    ap.add_argument("--max-faults", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--peer-python", default=sys.executable, help="the interpreter torchft runs on")
    ap.add_argument("--peer-pg", choices=["torchft", "native"], default="torchft")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--data-folder", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test's size (see QUICK)")
    ap.add_argument("--out", default="runs/bench/fault_mix")
    ap.add_argument("--timeout-s", type=float, default=3600, help="bound of each run")
    ap.add_argument("--from-out", default=None,
                    help="run nothing: the figures of a finished run again, from its --out folder (for figures added "
                         "since it ran); its own arguments are used")
    args = parse_sized(ap, argv, QUICK, vocab=4096)
    args.mean_gap_s = args.mean_gap_s or published_gap_s(args.replicas)
    args.stop_s = args.stop_s or 2 * args.hang_timeout_s
    return args


def run_pair(kind: str, args: argparse.Namespace, data: Path, out: Path) -> tuple[SystemRun, SystemRun]:
    """``kind`` failure-free, then under the mix (the same seeded faults for every system)."""
    faults = list(QUICK_FAULTS) if args.quick else fault_mix(args.seed, args.mean_gap_s, args.timeout_s,
                                                              args.stop_share, args.stop_s)[:args.max_faults]
    settings = {"hang_timeout_s": args.hang_timeout_s}
    runs = []
    for name, sent in (("ff", []), ("mix", faults)):
        run = run_system(kind, args, data, out / f"{name}_{kind}", steps_to_run(kind, args.steps),
                         copy.deepcopy(sent), relaunch_every_s=args.mean_gap_s, recover_settings=settings)
        check_complete(run, args.steps)
        runs.append(run)
        print(f"[fault_mix] {kind} {name}: {args.steps} steps, {sum(k.pid is not None for k in run.kills)} faults",
              flush=True)
    return runs[0], runs[1]


def paced_share(steps: dict[int, dict[str, Any]], n: int, replicas: int, M: int) -> tuple[float, float]:
    """(the run's own pace: the median time between two commits at full width, steps 6..n; the share of its time
    from step 1 to n that N steps at that pace take, times its useful fraction). Measured inside one run, so a
    machine whose speed drifts between two runs minutes apart does not enter."""
    full = [s for s in range(6, n) if s in steps and s + 1 in steps and steps[s]["participants"] == replicas
            and steps[s + 1]["participants"] == replicas]
    if not full:  # nothing to measure a pace on (too few steps, none at full width twice in a row)
        return math.nan, math.nan
    pace = statistics.median(steps[s + 1]["time"] - steps[s]["time"] for s in full)
    useful = sum(steps[s]["microbatches"] for s in range(1, n + 1)) / (n * M)
    return pace, (n - 1) * pace / (steps[n]["time"] - steps[1]["time"]) * useful


def drift_free(ff: dict[int, dict[str, Any]], mix: dict[int, dict[str, Any]], args: argparse.Namespace,
               faults: int) -> dict[str, float]:
    """Kept throughput with each run measured against its own full-width pace (the mix's share over the
    failure-free run's), and the seconds the faults cost beyond what the failure-free run lost the same way."""
    n, M = args.steps, args.replicas * args.accumulation
    (pace_ff, share_ff), (pace_mix, share_mix) = (paced_share(x, n, args.replicas, M) for x in (ff, mix))
    lost = [(x[n]["time"] - x[1]["time"]) - (n - 1) * pace for x, pace in ((ff, pace_ff), (mix, pace_mix))]
    return {"kept_throughput_drift_free": share_mix / share_ff, "pace_ff_s": pace_ff, "pace_mix_s": pace_mix,
            "fault_cost_s": lost[1] - lost[0], "fault_cost_per_fault_s": (lost[1] - lost[0]) / max(1, faults)}


def numbers(ff: SystemRun, mix: SystemRun, args: argparse.Namespace) -> dict[str, Any]:
    """One system's figures: kept throughput, trajectory, what was sent."""
    M = args.replicas * args.accumulation
    a, b = (clockwork_numbers(r, args.steps, args.micro_batch, M) for r in (ff, mix))
    rate = {k: c["useful_samples"] / c["time_to_n_from_first_step_s"] for k, c in (("ff", a), ("mix", b))}
    first_n = lambda s: s <= args.steps  # noqa: E731
    full = full_steps(mix, M)
    return {
        **drift_free(ff.steps, mix.steps, args, sum(1 for k in mix.kills if k.pid is not None)),
        "kept_throughput": ratio(rate["mix"], rate["ff"]),
        "samples_per_s_ff": rate["ff"], "samples_per_s_mix": rate["mix"],
        "time_to_n_ff_s": a["time_to_n_from_first_step_s"], "time_to_n_mix_s": b["time_to_n_from_first_step_s"],
        "useful_fraction": b["useful_fraction"],
        "max_dloss": max_dloss(mix, ff, first_n),
        "max_dloss_full_steps": max_dloss(mix, ff, lambda s: first_n(s) and full(s)),
        "kills_sent": sum(1 for k in mix.kills if k.pid is not None and k.kind == KILL),
        "stops_sent": sum(1 for k in mix.kills if k.pid is not None and k.kind == STOP),
        "faults_without_target": sum(1 for k in mix.kills if k.pid is None),
        "fault_times_s": [round(k.time - (mix.extra.get("clock_t0") or mix.t0), 2) for k in mix.kills],
        "launches": mix.launches, "restarts": mix.extra.get("restarts"),
    }


def table(s: dict[str, dict[str, Any]]) -> str:
    rows = [[k, c["kills_sent"], c["stops_sent"], f"{c['time_to_n_ff_s']:.1f}", f"{c['time_to_n_mix_s']:.1f}",
             f"{c['useful_fraction']:.3f}", f"{c['kept_throughput']:.3f}",
             f"{c['kept_throughput_drift_free']:.3f}", f"{c['fault_cost_per_fault_s']:.1f}", f"{c['max_dloss']:.2e}"]
            for k, c in s.items()]
    return md_table(["system", "kill -9", "SIGSTOP", "N steps failure-free (s)", "N steps under the mix (s)",
                     "useful samples", "kept throughput", "kept, each run at its own pace", "s per fault",
                     "max \\|dloss\\|"], rows)


def figures_of(s: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    recover, peer = s.get("recover+regrow", {}), s.get("torchft-mar", {})
    return {"recover_kept_throughput": recover.get("kept_throughput"),
            "torchft_kept_throughput": peer.get("kept_throughput"),
            "recover_kept_throughput_drift_free": recover.get("kept_throughput_drift_free"),
            "torchft_kept_throughput_drift_free": peer.get("kept_throughput_drift_free"),
            "recover_fault_cost_per_fault_s": recover.get("fault_cost_per_fault_s"),
            "torchft_fault_cost_per_fault_s": peer.get("fault_cost_per_fault_s"),
            "recover_max_dloss": recover.get("max_dloss"), "torchft_max_dloss": peer.get("max_dloss"),
            "faults_sent": max((c["kills_sent"] + c["stops_sent"] for c in s.values()), default=0),
            "replica_groups": args.replicas, "mean_gap_s": round(args.mean_gap_s, 1),
            **(peer_figures(args) if args.peer else {})}


def reread(out: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--from-out``: the figures of a finished run again, from its folders (each system's per-step records), for
    figures added since it ran; what it sent and measured before is kept from its ``fault_mix.json``."""
    from benchmarks.lib.recover_runner import Metrics
    from benchmarks.lib.torchft_runner import Records, committed_steps

    def steps(kind: str, folder: Path) -> dict[int, dict[str, Any]]:
        if kind.startswith("torchft"):
            records = Records(folder, args.replicas)
            records.poll()
            return committed_steps(records)
        metrics = Metrics(folder)
        metrics.poll()
        return {n: {"time": r["time"], "microbatches": r["microbatches"],
                    "participants": r.get("live_replicas", args.replicas)} for n, r in metrics.steps.items()}

    s = json.loads((out / "fault_mix.json").read_text())["systems"]
    for kind, c in s.items():
        faults = c["kills_sent"] + c["stops_sent"]
        c.update(drift_free(steps(kind, out / f"ff_{kind}"), steps(kind, out / f"mix_{kind}"), args, faults))
    return s


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: the peers' agents go
    ran: dict[str, Any] = {}
    if args.from_out:
        out = Path(args.from_out)
        ran = json.loads((out / "fault_mix.json").read_text())
        args = argparse.Namespace(**{**ran["args"], "from_out": args.from_out})
        s = reread(out, args)
    else:
        if "torchft-mar" in args.systems and not torchft_available(args.peer_python):
            sys.exit(INSTALL_HINT)
        args.peer = peer_versions(args.peer_python) if "torchft-mar" in args.systems else None
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        out = fresh_out_dir(args)
        out.mkdir(parents=True)
        data = prepare_data(args, out)
        s = {kind: numbers(*run_pair(kind, args, data, out), args) for kind in args.systems}
    figures = figures_of(s, args)
    line = " ".join(f"{k}={figures[k]:.4g}" for k in ("recover_kept_throughput", "torchft_kept_throughput",
                                                       "recover_max_dloss", "torchft_max_dloss")
                    if isinstance(figures[k], float))
    command = command_line(argv, "benchmarks/fault_mix.py")
    md = "\n".join([f"command: `{command}`", "", f"machine: {machine_line()}", "",
                    f"{args.replicas} replica groups, mean gap {args.mean_gap_s:.0f} s between faults, SIGSTOP "
                    f"share {args.stop_share:g} of {args.stop_s:g} s, ReCoVer's hang timeout {args.hang_timeout_s:g} s",
                    "", table(s), "", line]) + "\n"
    measured = {"command": ran["command"], "machine": ran["machine"], "reread_by": command} if args.from_out else {
        "command": command, "machine": machine_line()}
    write_json(out / "fault_mix.json", {**measured, "args": vars(args), "systems": s, "figures": figures})
    write_record("fault_mix", argv=argv, command=command, args=args, figures=figures,
                 samples={"systems": s, **({"measured_by": measured} if args.from_out else {})})
    (out / "fault_mix.md").write_text(md)
    print(md, flush=True)
    print(line)
    return {"systems": s, "figures": figures}


if __name__ == "__main__":
    main()
