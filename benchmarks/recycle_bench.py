"""Recycling survivors (issue #15): the same faults with ``fault_tolerance.recycle`` off and on.

3 replicas x TP2 x PP2 (12 processes), no spares, M = 3 x accumulation. One rank of replica 1 is SIGKILLed in
backward at step ``--first``, the same coordinate of replica 2 in the reduction at step ``--second``. Off: the
broken replicas' survivors exit, replica 0 computes all M alone from then on. On: the 6 survivors wait in a pool,
4 of them form a new replica after step ``--second``, 2 replicas compute the rest. Both commit the same samples.

Reported per variant: replicas computing after the second fault, the median step time after it, committed tokens
per process-second over the whole run (pool ranks count as live: they hold hardware) and from the second fault on,
and for recycling the time from the formation to the new replica's first step with state (``formed_to_active_ms``).
On a 2-core CPU machine 12 processes share two cores, so a second computing replica does not run in parallel: the
step-time ratio here says little about GPUs, where each rank has its own.

Writes recycle.json / .md under --out. Last line: ``recycle_step_time_ratio=X live_replicas_off=A live_replicas_on=B``.
Minimal size: --steps 8 --first 3 --second 5 --hidden 32 --intermediate 64 --seq 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.config import add_headline_run_args, fresh_out_dir, make_config, size_from_args  # noqa: E402
from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line, machine_line, md_table, median, write_json  # noqa: E402
from benchmarks.lib.timeline import launch, summarize  # noqa: E402


def _run(name: str, config: dict, out: Path, args: argparse.Namespace) -> tuple[dict, object]:
    """One run (recycling off or on): what it measured after the faults, and its summary."""
    attempt = launch(config, out / name, timeout_s=args.timeout_s)
    if attempt.returncode != 0 or attempt.steps[-1]["step"] != args.steps:
        raise RuntimeError(f"recycle {name}: stopped early (exit {attempt.returncode})")
    summary = summarize(f"recycle {name}", [attempt], args.steps, rpr=4)
    after = [s for s in attempt.steps if s["step"] > args.second + 1]
    t_second = next(s["time"] for s in attempt.steps if s["step"] == args.second)
    tokens_after = sum(s["tokens"] for s in attempt.steps if s["step"] > args.second)
    ps_after = summary.process_seconds - summary.process_seconds_at(t_second)
    activated = [e for e in attempt.events if e.get("event") == "spare_activated" and "formed_to_active_ms" in e]
    (state,) = [e for e in attempt.events if e.get("event") == "training_state"]
    # what a transfer carries for one coordinate (the logging rank's): parameters, fp32 masters, Adam
    state_mb = sum(state["bytes"][k] for k in ("params", "masters", "optimizer")) / 1e6
    result = {
        "live_replicas_after": after[0]["live_replicas"],
        "median_step_s_after": median(s["step_time_s"] for s in after),
        "tokens_per_process_s": summary.effective_throughput, "tokens_per_process_s_after": tokens_after / ps_after,
        "formed_to_active_ms": activated[0]["formed_to_active_ms"] if activated else None,
        "transfer_ms": activated[0]["transfer_ms"] if activated else None, "state_mb_per_rank": state_mb,
        "process_seconds": summary.process_seconds, "committed_tokens": summary.committed_tokens,
        "final_loss": summary.final_loss, "load_avg_1min": attempt.load_avg_1min,
    }
    return result, summary


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--first", type=int, default=4)
    ap.add_argument("--second", type=int, default=8)
    add_headline_run_args(ap, out="runs/bench/recycle")
    args = ap.parse_args(argv)
    if not 1 <= args.first < args.second < args.steps:
        ap.error("need 1 <= --first < --second < --steps")
    size = size_from_args(args)
    out = fresh_out_dir(args)
    inject = [{"step": args.first, "replica": 1, "rank": 1, "phase": "backward"},
              {"step": args.second, "replica": 2, "rank": 1, "phase": "reduce"}]
    rows, data, summaries = [], {}, {}
    for name, recycle in (("off", False), ("on", True)):
        ft = {"enabled": True, "recycle": recycle, "local_snapshot_interval": 0, "inject": inject}
        config = make_config(dp=3, tp=2, pp=2, accumulation=args.accumulation, steps=args.steps, size=size,
                             fault_tolerance=ft)
        data[name], summaries[name] = _run(name, config, out, args)
        d = data[name]
        rows.append([name, d["live_replicas_after"], d["median_step_s_after"] * 1000, d["tokens_per_process_s"],
                     d["tokens_per_process_s_after"], d["formed_to_active_ms"] or float("nan"),
                     d["transfer_ms"] or float("nan"), d["final_loss"]])
        print(f"[recycle] {name}: {d}", flush=True)
    if data["off"]["final_loss"] != data["on"]["final_loss"]:
        print(f"[recycle] note: final losses differ by {abs(data['off']['final_loss'] - data['on']['final_loss']):.2e} "
              "(summation order)", flush=True)
    return _write(data, rows, summaries, args, size, argv, out)


def figures(data: dict) -> dict[str, float | None]:
    """The record's figures of a ``recycle.json``: per variant the replicas computing after the faults, the median
    step after them, tokens at equal process-seconds; the on / off step ratio and the new replica's timings."""
    out: dict[str, float | None] = {"step_time_ratio_on_off": data["step_time_ratio_on_off"],
                                    "transfer_ms_per_mb": data["transfer_ms_per_mb"],
                                    "formed_to_active_ms": data["on"]["formed_to_active_ms"]}
    for name in ("off", "on"):
        out[f"live_replicas_after_{name}"] = data[name]["live_replicas_after"]
        out[f"median_step_ms_after_{name}"] = data[name]["median_step_s_after"] * 1e3
        out[f"tokens_at_equal_process_seconds_{name}"] = data["committed_tokens_at_equal_process_seconds"][name]
    return out


def _write(data: dict, rows: list, summaries: dict, args: argparse.Namespace, size, argv: Sequence[str] | None,
           out: Path) -> dict:
    ratio = data["on"]["median_step_s_after"] / data["off"]["median_step_s_after"]
    budget = min(s.process_seconds for s in summaries.values())  # committed tokens at equal process-seconds
    at_budget = {name: s.tokens_at_process_seconds(budget) for name, s in summaries.items()}
    on = data["on"]
    per_mb = on["transfer_ms"] / on["state_mb_per_rank"]
    command = command_line(argv, "benchmarks/recycle_bench.py")
    setup = (f"3 replicas x TP2 x PP2, M = {3 * args.accumulation}, {args.steps} steps, {size.describe()}, synthetic "
             f"data; kills: replica 1 rank 1 backward at step {args.first}, replica 2 rank 1 reduce at step "
             f"{args.second}")
    data.update(command=command, machine=machine_line(), setup=setup, step_time_ratio_on_off=ratio,
                equal_process_seconds=budget, committed_tokens_at_equal_process_seconds=at_budget,
                transfer_ms_per_mb=per_mb)
    write_json(out / "recycle.json", data)
    write_record("recycle", argv=argv, command=command, args=args, samples=data, figures=figures(data))
    md = "\n".join([
        f"command: `{command}`", "", f"machine: {data['machine']}", "", f"setup: {setup}", "",
        md_table(["recycle", "replicas computing after", "median step after (ms)", "tokens / process-s",
                  "tokens / process-s after 2nd fault", "formed -> active (ms)", "state transfer (ms)", "final loss"],
                 rows), "",
        f"median step after the second fault, on / off = {ratio:.3f} (12 processes on this machine's cores); "
        f"committed tokens at {budget:.0f} process-seconds: on {at_budget['on']:.0f}, off {at_budget['off']:.0f}; "
        f"state transfer {per_mb:.1f} ms per MB of one rank's state ({on['state_mb_per_rank']:.2f} MB)",
    ]) + "\n"
    (out / "recycle.md").write_text(md)
    print(md)
    print(f"recycle_step_time_ratio={ratio:.3f} live_replicas_off={data['off']['live_replicas_after']} "
          f"live_replicas_on={data['on']['live_replicas_after']}")
    return data


if __name__ == "__main__":
    main()
