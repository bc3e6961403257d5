"""ReCoVer side by side with torchft (and plain torch DDP): the same model, data, batch, optimizer and processes,
the same faults, in one invocation.

Systems (R replicas of one process each, TP1; M = R x accumulation microbatches per step):

* ``ddp``: plain torch DDP over gloo (``torchrun --nproc_per_node R``), failure-free only;
* ``stock``: this project's stock nanotron path (fault tolerance off: nanotron modules + torch DDP under
  ``mpirun``), failure-free only: it separates the cost of the project's model code and launcher from ReCoVer's;
* ``recover``: ReCoVer through ``nanotron-recover train`` (its defaults: node-local snapshots every step),
  ``recover+spare``: the same with one spare replica (one more process); ``recover+regrow``: the same with
  ``regrow: auto``, relaunched in place by its launcher, and ``standby: after_loss`` (the standby starts when a
  replica is lost, on what it freed: every core of this machine trains, so a standby started ahead would import
  torch beside the full-width job);
* ``torchft``: torchft 0.2.0 as its examples run it: ``torchft_lighthouse`` + one ``torchrun --max_restarts``
  per replica group, ``torchft.Manager`` + its DDP wrapper + its optimizer wrapper on ``ProcessGroupGloo``; a
  killed replica is restarted by its agent and heals from a live peer;
* ``torchft-mar``: the same, with the gradient averaged by ``Manager.allreduce`` instead of the DDP wrapper (in
  torchft 0.2.0 on gloo the wrapper's comm hook crashes the survivor when a peer dies: see
  ``benchmarks/lib/torchft_worker.py``); Clockwork runs this variant.

Every system trains ``benchmarks/lib/tiny_llama.py``'s model (the project's tiny Llama, bit-identical init) on
the project's KJV token stream (step s = global microbatches s*M ... s*M+M-1), AdamW + warmup/cosine + clipping
as in the config. Experiments:

1. failure-free: median step time per system, ``--repeats`` interleaved runs, ratios to plain DDP;
2. one fault: replica 1 SIGKILLed from outside (by pid) right after step ``--fail-after`` is committed; per
   system: fault -> next committed step, microbatches per step around it, time until all R replicas compute
   again, committed steps lost, max |dloss| and final weights vs its own failure-free run;
3. Clockwork: time to ``--clockwork-steps`` steps with a replica SIGKILLed every T seconds (``--clockwork-every``,
   the k-th kill at k*T after the first committed step, the victim drawn from ``--seed`` among the live
   replicas: the same times and draws for both systems); ReCoVer as its user would run it on the same R
   processes (no spares, ``min_replicas`` 1, relaunched by a restart loop when no replica is left, resuming
   from the node-local snapshot; ``relaunch_mtbf_h`` set to R x T, the time between relaunches it faces, from which
   the snapshot interval follows), torchft with its restarts; and the useful samples each trained.

Prints the report and, last, one line:
  recover_vs_torchft_time_to_N=<x> recover_vs_torchft_overhead=<y> recover_max_dloss=<a> torchft_max_dloss=<b>
(ratios > 1: ReCoVer better). ``--quick`` is the smoke test's size (~1-2 min on 2 cores).

torchft is an optional extra: ``pip install -e .[peers]`` (or ``pip install torchft==0.2.0``). The newest torchft
needs torch >= 2.14 and runs in an environment of its own (``scripts/setup_peer_venv.sh``): ``--peer-python
.venv-peer/bin/python``, with ``--peer-pg native`` for torch's own gloo group reconfigured in place. Every report
and record names the peer's torchft and torch versions.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import fresh_out_dir, make_config, parse_sized, size_from_args  # noqa: E402
from benchmarks.lib.outside_faults import Fault, clockwork_faults  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.side_by_side import (  # noqa: E402
    SystemRun,
    clockwork_numbers,
    fault_numbers,
    max_dloss,
    median_step_s,
    ratio,
)
from benchmarks.lib.tiny_llama import TrainSpec  # noqa: E402
from benchmarks.lib.torchft_runner import INSTALL_HINT, peer_versions, torchft_available  # noqa: E402

FP32_TOL = 1e-5  # the project's fp32 trajectory tolerance (the summation-order floor is ~1e-7 .. 1e-6)
# the smoke test's size: start-up dominates; enough steps after the kill that torchft's restarted replica (5 s of
# heartbeat timeout, then its restart) is back before the survivor finishes
QUICK = dict(hidden=64, intermediate=128, layers=2, seq=64, micro_batch=2, steps=60, fail_after=4, repeats=1,
             clockwork_every=[0.5], clockwork_steps=100, clockwork_max_kills=1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=2, help="microbatches per replica per step (M = R x this)")
    ap.add_argument("--steps", type=int, default=30, help="steps of the failure-free and one-fault runs")
    ap.add_argument("--fail-after", type=int, default=10, help="the one fault: right after this step committed")
    ap.add_argument("--repeats", type=int, default=2, help="failure-free runs per system (interleaved)")
    ap.add_argument("--clockwork-every", type=float, nargs="*", default=[20.0, 40.0], help="T values (s); none: skip")
    ap.add_argument("--clockwork-steps", type=int, default=300, help="N of the Clockwork protocol")
    ap.add_argument("--clockwork-max-kills", type=int, default=None)
    ap.add_argument("--clockwork-systems", nargs="+", default=["recover", "torchft-mar"],
                    choices=["recover", "recover+spare", "recover+regrow", "torchft-mar"],
                    help="recover+spare: one more process, an idle spare replica (the victims are drawn among all "
                         "live replicas, the spare too)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Clockwork victim draws")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="the interpreter the peer systems (ddp excepted) run on: e.g. .venv-peer/bin/python, the "
                         "newest torchft on torch 2.14 (scripts/setup_peer_venv.sh); default: this one")
    ap.add_argument("--peer-pg", choices=["torchft", "native"], default="torchft",
                    help="torchft's process group: its gloo wrapper (rebuilt at each quorum change), or torch's own "
                         "gloo group reconfigured in place (torch >= 2.14, the peer's recommended path there)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process of every system")
    ap.add_argument("--data-folder", default=None, help="prepared KJV tokens (default: prepared under --out)")
    ap.add_argument("--quick", action="store_true", help="the smoke test's size (see QUICK)")
    ap.add_argument("--clockwork-only", action="store_true",
                    help="only the Clockwork protocol: its table and the time-to-N ratio per T")
    ap.add_argument("--out", default="runs/bench/vs_torchft")
    ap.add_argument("--timeout-s", type=float, default=900, help="bound of each run")
    args = parse_sized(ap, argv, QUICK, vocab=4096)
    return args


def prepare_data(args: argparse.Namespace, out: Path) -> Path:
    """The KJV token folder: ``--data-folder``, or ``nanotron-recover prepare-data`` (the project's CLI) under
    ``out`` with the vocab size of the model."""
    if args.data_folder:
        return Path(args.data_folder).resolve()
    folder = out / "kjv"
    cli = Path(sys.executable).parent / "nanotron-recover"
    cmd = [str(cli) if cli.exists() else "nanotron-recover", "prepare-data", "--output", str(folder),
           "--vocab-size", str(args.vocab)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return folder


def base_config(args: argparse.Namespace, data: Path, steps: int, ft: dict | None) -> dict[str, Any]:
    """The run's nanotron-format config: the project's benchmark Llama, resized, on the KJV tokens; one
    checkpoint at the end (the final weights)."""
    cfg = make_config(dp=args.replicas, accumulation=args.accumulation, steps=steps, size=size_from_args(args),
                      fault_tolerance=copy.deepcopy(ft), checkpoint_interval=steps)
    cfg["data"]["dataset"] = {"dataset_folder": str(data)}
    cfg["tokenizer"]["tokenizer_name_or_path"] = str(data / "tokenizer.json")
    return cfg


def recover_ft(spares: int = 0, relaunch_every_s: float | None = None) -> dict[str, Any]:
    """ReCoVer's settings; ``relaunch_every_s``: the time between faults that end the job, as a user who knows
    their failure rate would give it (``relaunch_mtbf_h``: the node-local snapshot interval follows from it)."""
    ft: dict[str, Any] = {"enabled": True, "min_replicas": 1, "spare_replicas": spares}
    if relaunch_every_s is not None:
        ft["relaunch_mtbf_h"] = relaunch_every_s / 3600
    return ft


# ------------------------------------------------------------------------------------------------ running
def run_system(kind: str, args: argparse.Namespace, data: Path, out: Path, steps: int, faults: list[Fault],
               relaunch_every_s: float | None = None, recover_settings: dict[str, Any] | None = None) -> SystemRun:
    """One run of system ``kind`` (see the module doc) for ``steps`` steps with ``faults`` sent from outside;
    ``relaunch_every_s``: ReCoVer is relaunched when it exits 3, and expects that every this many seconds;
    ``recover_settings``: more of ReCoVer's ``fault_tolerance`` settings (its hang timeout)."""
    from benchmarks.lib.recover_runner import run_recover
    from benchmarks.lib.torchft_runner import run_ddp, run_torchft

    spec = TrainSpec.from_config(base_config(args, data, steps, None), str(data))
    R, bound = args.replicas, args.timeout_s
    if kind == "ddp":
        return run_ddp(spec, out, R, bound)
    if kind in ("torchft", "torchft-mar"):
        return run_torchft(spec, out, R, faults, bound, grad_sync="ddp" if kind == "torchft" else "manager",
                           name=kind, python=args.peer_python, pg=args.peer_pg)
    ft = {"stock": None, "recover": recover_ft(0, relaunch_every_s),
          "recover+spare": recover_ft(1, relaunch_every_s),
          "recover+regrow": {**recover_ft(0, relaunch_every_s), "regrow": "auto", "standby": "after_loss"}}[kind]
    if ft is not None and recover_settings:
        ft = {**ft, **recover_settings}
    return run_recover(kind, base_config(args, data, steps, ft), out, faults, bound,
                       relaunch=relaunch_every_s is not None, in_place=kind == "recover+regrow")


def failure_free(args: argparse.Namespace, data: Path, out: Path, systems: list[str]) -> dict[str, list[SystemRun]]:
    """``--repeats`` failure-free runs of each system, the order rotated every repeat (load drifts hit all)."""
    runs: dict[str, list[SystemRun]] = {s: [] for s in systems}
    for i in range(args.repeats):
        order = systems[i % len(systems):] + systems[:i % len(systems)]
        for kind in order:
            run = run_system(kind, args, data, out / f"ff{i}_{kind}", args.steps, [])
            check_complete(run, args.steps)
            runs[kind].append(run)
            print(f"[vs_torchft] failure-free {kind} #{i + 1}: median step {median_step_s(run) * 1e3:.1f} ms, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return runs


def one_fault(args: argparse.Namespace, data: Path, out: Path, systems: list[str]) -> dict[str, SystemRun]:
    """Each system once with replica 1 SIGKILLed right after step ``--fail-after`` committed."""
    runs = {}
    for kind in systems:
        run = run_system(kind, args, data, out / f"fault_{kind}", args.steps, [Fault(after_step=args.fail_after,
                                                                                     replica=1)])
        check_complete(run, args.steps)
        runs[kind] = run
        print(f"[vs_torchft] one fault {kind}: {run.last_step} steps, {run.extra.get('restarts', 0)} restarts",
              flush=True)
    return runs


def clockwork(args: argparse.Namespace, data: Path, out: Path) -> dict[float, dict[str, SystemRun]]:
    """The Clockwork protocol at each T: ReCoVer (restart loop) and torchft (restarts), the same kill schedule."""
    runs: dict[float, dict[str, SystemRun]] = {}
    N = args.clockwork_steps
    for T in args.clockwork_every:
        faults = clockwork_faults(args.seed, T, horizon_s=100 * T)[:args.clockwork_max_kills]
        runs[T] = {}
        for kind in args.clockwork_systems:
            # every (R + spares)-th kill takes the last replica and costs a relaunch; with regrow, every kill is
            # followed by one (by choice): its user gives the failure rate itself
            replicas = args.replicas + (1 if kind == "recover+spare" else 0)
            every = T if kind == "recover+regrow" else replicas * T
            steps = steps_to_run(kind, N)
            run = run_system(kind, args, data, out / f"clockwork_T{T:g}_{kind}", steps, copy.deepcopy(faults),
                             relaunch_every_s=every)
            check_complete(run, N)
            runs[T][kind] = run
            c = clockwork_numbers(run, N, args.micro_batch, M_of(args))
            print(f"[vs_torchft] clockwork T={T:g} {kind}: {N} steps in {c['time_to_n_s']:.1f} s, "
                  f"{c['kills_sent']} kills, useful samples {c['useful_fraction']:.3f}", flush=True)
    return runs


def M_of(args: argparse.Namespace) -> int:
    return args.replicas * args.accumulation


def steps_to_run(kind: str, n: int) -> int:
    """Steps a system is asked for to commit ``n``: torchft trains past N, its N-th step that used the full batch
    comes later than its N-th step."""
    return n + max(10, n // 10) if kind.startswith("torchft") else n


def check_complete(run: SystemRun, steps: int) -> None:
    missing = [s for s in range(1, steps + 1) if s not in run.steps]
    if missing:
        raise RuntimeError(f"{run.name}: steps {missing[:10]} were never committed")


# ------------------------------------------------------------------------------------------------ numbers
def weights_diff(run: SystemRun, ref: SystemRun) -> float | None:
    """Final weights vs the failure-free run's: max over tensors of max|a - b| / max|a|."""
    if run.final_weights is None or ref.final_weights is None:
        return None
    if run.final_weights.suffix == ".pt":
        import torch

        from benchmarks.lib.side_by_side import relative_weight_diff

        return relative_weight_diff(torch.load(ref.final_weights), torch.load(run.final_weights))
    from nanotron_recover.launcher.runs import max_relative_param_diff

    return max_relative_param_diff(ref.final_weights, run.final_weights)


def summarize(args: argparse.Namespace, ff: dict[str, list[SystemRun]], faults: dict[str, SystemRun],
              cw: dict[float, dict[str, SystemRun]]) -> dict[str, Any]:
    """Every number of the report, from the runs."""
    M = M_of(args)
    step = {k: median(median_step_s(r) for r in runs) for k, runs in ff.items()}
    ref_of = {k: ff["recover" if k == "recover+spare" else k][0] for k in faults}
    fault = {k: {**fault_numbers(r, ref_of[k], M), "weights_rel_diff": weights_diff(r, ref_of[k]),
                 "restarts": r.extra.get("restarts", 0), "launches": r.launches, "processes": r.processes}
             for k, r in faults.items()}
    clock = {T: {k: {**clockwork_numbers(r, args.clockwork_steps, args.micro_batch, M), "processes": r.processes}
                 for k, r in d.items()} for T, d in cw.items()}
    return {
        "step_s": step,
        "per_run_step_s": {k: [median_step_s(r) for r in runs] for k, runs in ff.items()},
        "overhead_vs_ddp": {k: ratio(v, step["ddp"]) for k, v in step.items()},
        "same_training_max_dloss_vs_recover": {k: max_dloss(runs[0], ff["recover"][0]) for k, runs in ff.items()},
        "fault": fault,
        "clockwork": clock,
        "processes": {k: runs[0].processes for k, runs in ff.items()},
    }


# ------------------------------------------------------------------------------------------------ report
def headline(s: dict[str, Any]) -> dict[str, float]:
    """The line's four numbers (ratios > 1: ReCoVer better). Time to N: the shortest T, from the first
    committed step (where the kill clock starts); torchft's dloss: the variant that survives the fault, over
    the steps that used all M microbatches (a shrunken step's own loss is over other samples)."""
    cw = s["clockwork"]
    t_min = min(cw) if cw else None
    tt = {k: v["time_to_n_from_first_step_s"] for k, v in cw[t_min].items()} if t_min is not None else {}
    ft = "torchft-mar" if "torchft-mar" in s["fault"] else "torchft"
    return {
        "recover_vs_torchft_time_to_N": ratio(tt.get("torchft-mar"), tt.get("recover")),
        "recover_vs_torchft_overhead": ratio(s["step_s"].get("torchft"), s["step_s"].get("recover")),
        "recover_max_dloss": s["fault"]["recover"]["max_dloss"],
        "torchft_max_dloss": s["fault"][ft]["max_dloss_full_steps"],
    }


def _key(system: str) -> str:
    return system.replace("-", "_").replace("+", "_")


def clockwork_figures(clock: dict, ratios: dict[str, float]) -> dict[str, float | None]:
    """The record's figures of Clockwork runs: the time-to-N ratios, and per T and system the time to N from the
    first committed step and the kills sent."""
    out: dict[str, float | None] = dict(ratios)
    for T, systems in clock.items():
        for system, c in systems.items():
            out[f"time_to_N_T{float(T):g}_{_key(system)}_s"] = c["time_to_n_from_first_step_s"]
            out[f"kills_T{float(T):g}_{_key(system)}"] = c["kills_sent"]
    return out


def figures(data: dict[str, Any]) -> dict[str, float | None]:
    """The record's figures of a full run (``vs_torchft.json``): the line's four numbers; per system its
    failure-free median step and ratio to plain DDP; per system of the one fault, fault -> next commit, committed
    steps lost, max |dloss| over the steps with M, and the time until all replicas compute again."""
    s = data["summary"]
    out: dict[str, float | None] = dict(data["headline"])
    for system, step in s["step_s"].items():
        out[f"{_key(system)}_step_ms"] = step * 1e3
        out[f"{_key(system)}_over_ddp"] = s["overhead_vs_ddp"][system]
    for system, f in s["fault"].items():
        out.update({f"{_key(system)}_fault_to_next_commit_s": f["fault_to_next_commit_s"],
                    f"{_key(system)}_committed_steps_lost": f["committed_steps_lost"],
                    f"{_key(system)}_max_dloss_full_steps": f["max_dloss_full_steps"],
                    f"{_key(system)}_full_replicas_again_s": f["full_replicas_again_s"]})
    return out


def _fmt(x: Any, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:.3g}{unit}" if isinstance(x, float) else f"{x}{unit}"


def fault_table(s: dict[str, Any]) -> str:
    rows = []
    for k, f in s["fault"].items():
        around = " ".join(f"{st}:{mb}" for st, mb in f["microbatches_around_fault"].items())
        rows.append([k, f["processes"], f["kill_after_step"], _fmt(f["fault_to_next_commit_s"], " s"),
                     _fmt(f["longest_commit_gap_s"], " s"), around,
                     len(f["steps_not_full"]), f["microbatches_dropped"], _fmt(f["committed_steps_lost"]),
                     _fmt(f["full_replicas_again_s"], " s"), f["restarts"], _fmt(f["max_dloss"]),
                     _fmt(f["max_dloss_full_steps"]), _fmt(f["weights_rel_diff"])])
    return md_table(["system", "processes", "kill after step", "fault -> next commit", "longest commit gap",
                     "microbatches per step",
                     "steps < M", "microbatches dropped", "committed steps lost", "all replicas again",
                     "restarts", "max \\|dloss\\|", "max \\|dloss\\| (steps with M)", "final weights rel. diff"], rows)


def clockwork_table(s: dict[str, Any], M: int, mbs: int) -> str:
    rows = []
    for T, d in s["clockwork"].items():
        for k, c in d.items():
            rows.append([_fmt(T, " s"), k, c.get("processes", "n/a"), c["kills_sent"], c["launches"],
                         _fmt(c["time_to_n_s"], " s"),
                         _fmt(c["time_to_n_from_first_step_s"], " s"), c["useful_samples"],
                         _fmt(c["useful_fraction"])])
    return md_table(["T", "system", "processes", "kills sent", "launches", "time to N (from launch)",
                     "time to N (from 1st step)", "useful samples", "of N x M x mbs"], rows)


def report_md(args: argparse.Namespace, s: dict[str, Any], line: str, command: str) -> str:
    M = M_of(args)
    size = size_from_args(args)
    ff_rows = [[k, s["processes"][k], ", ".join(f"{t * 1e3:.1f}" for t in s["per_run_step_s"][k]),
                s["step_s"][k] * 1e3, s["overhead_vs_ddp"][k], _fmt(s["same_training_max_dloss_vs_recover"][k])]
               for k in s["step_s"]]
    return "\n".join([
        f"command: `{command}`", "", f"machine: {machine_line()}, load at the end {os.getloadavg()[0]:.1f}", "",
        _peer_line(args), "",
        f"setup: {args.replicas} replicas x TP1, M = {M} microbatches/step, {size.describe()}, KJV tokens, "
        f"{args.steps} steps (failure-free, one fault after step {args.fail_after}); Clockwork N = "
        f"{args.clockwork_steps}, T = {', '.join(f'{t:g}' for t in args.clockwork_every) or 'none'} s, seed "
        f"{args.seed}; OMP_NUM_THREADS={args.threads}", "",
        "failure-free (median step over steps 6.., median over runs):", "",
        md_table(["system", "processes", "per-run median step (ms)", "median (ms)", "/ plain DDP",
                  "max \\|dloss\\| vs recover (same training?)"], ff_rows), "",
        "one fault (replica 1 SIGKILLed from outside after the step named):", "", fault_table(s), "",
        "Clockwork:", "", clockwork_table(s, M, args.micro_batch), "", line,
    ]) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # a SIGTERM (`timeout`, a scheduler) unwinds through the runners' cleanup: the peers' agents run in sessions of
    # their own and restart their workers, so left behind they train on for ever (seen: a timed-out run's agents
    # took half the machine from the next benchmark)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not torchft_available(args.peer_python):
        sys.exit(INSTALL_HINT)
    args.peer = peer_versions(args.peer_python)  # named in every record and report: which torchft ran
    if args.peer_pg == "native" and not args.peer["in_place"]:
        sys.exit(f"--peer-pg native needs torch >= 2.14 in the peer's environment; it has {args.peer['torch_version']}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every process of every system inherits it
    out = fresh_out_dir(args)
    out.mkdir(parents=True)
    data = prepare_data(args, out)
    if args.clockwork_only:
        return clockwork_only(args, data, out, argv)
    full = not args.quick
    ff_systems = ["ddp", "recover", "torchft"] + (["stock", "torchft-mar"] if full else ["torchft-mar"])
    ff = failure_free(args, data, out, ff_systems)
    faults = one_fault(args, data, out, ["recover", "torchft-mar"] + (["recover+spare", "torchft"] if full else []))
    cw = clockwork(args, data, out)
    s = summarize(args, ff, faults, cw)
    h = headline(s)
    line = " ".join(f"{k}={v:.4g}" for k, v in h.items())
    command = command_line(argv, "benchmarks/vs_torchft.py")
    md = report_md(args, s, line, command)
    write_json(out / "vs_torchft.json", {"command": command, "machine": machine_line(), "args": vars(args),
                                         "summary": s, "headline": h})
    write_record("vs_torchft", argv=argv, command=command, args=args, samples={"summary": s, "headline": h},
                 figures={**figures({"summary": s, "headline": h}), **peer_figures(args)})
    (out / "vs_torchft.md").write_text(md)
    print(md, flush=True)
    print(line)
    return {"summary": s, "headline": h}


def peer_figures(args: argparse.Namespace) -> dict[str, str]:
    """The peer that ran, as the record's figures (the pages name it beside the ratios)."""
    peer = args.peer or {}
    return {"peer_torchft": str(peer.get("torchft_version")), "peer_torch": str(peer.get("torch_version")),
            "peer_process_group": "torch's own gloo group, reconfigured in place" if args.peer_pg == "native"
            else "torchft's gloo wrapper, rebuilt at each quorum change"}


def _peer_line(args: argparse.Namespace) -> str:
    peer = args.peer or {}
    return (f"peer: {peer.get('torchft_version')} on torch {peer.get('torch_version')}, process group "
            f"{args.peer_pg} ({args.peer_python})")


def clockwork_only(args: argparse.Namespace, data: Path, out: Path, argv: Sequence[str] | None) -> dict[str, Any]:
    """``--clockwork-only``: the Clockwork runs alone, with torchft-mar / ReCoVer's time to N per T."""
    M = M_of(args)
    clock = {T: {k: {**clockwork_numbers(r, args.clockwork_steps, args.micro_batch, M), "processes": r.processes}
                 for k, r in d.items()} for T, d in clockwork(args, data, out).items()}
    ratios = {f"{k.replace('+', '_')}_vs_torchft_time_to_N_T{T:g}":
              ratio(d["torchft-mar"]["time_to_n_from_first_step_s"], d[k]["time_to_n_from_first_step_s"])
              for T, d in clock.items() for k in d if k.startswith("recover") and "torchft-mar" in d}
    ratios_full_batch = {f"{k.replace('+', '_')}_vs_torchft_time_to_N_full_batch_T{T:g}":
                         ratio(d["torchft-mar"]["time_to_n_full_batch_s"], d[k]["time_to_n_full_batch_s"])
                         for T, d in clock.items() for k in d if k.startswith("recover") and "torchft-mar" in d}
    command = command_line(argv, "benchmarks/vs_torchft.py")
    md = "\n".join([f"command: `{command}`", "", f"machine: {machine_line()}", "", _peer_line(args), "",
                     clockwork_table({"clockwork": clock}, M, args.micro_batch), "",
                     " ".join(f"{name}={r:.4g}" for name, r in {**ratios, **ratios_full_batch}.items())]) + "\n"
    write_json(out / "vs_torchft_clockwork.json", {"command": command, "machine": machine_line(),
                                                   "args": vars(args), "clockwork": clock, "ratios": ratios,
                                                   "ratios_full_batch": ratios_full_batch})
    spare = "_spare" if "recover+spare" in args.clockwork_systems else ""
    write_record(f"vs_torchft_clockwork{spare}", argv=argv, command=command, args=args,
                 samples={"clockwork": clock, "ratios": ratios, "ratios_full_batch": ratios_full_batch},
                 figures={**clockwork_figures(clock, {**ratios, **ratios_full_batch}), **peer_figures(args)})
    (out / "vs_torchft_clockwork.md").write_text(md)
    print(md, flush=True)
    return {"clockwork": clock, "ratios": ratios, "ratios_full_batch": ratios_full_batch}


if __name__ == "__main__":
    main()
