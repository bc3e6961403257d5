"""Toy data-parallel "training" on FTWorld, run under ``mpirun --with-ft ulfm`` by the ft tests.

Each step every active rank sums ``buckets`` fp32 buffers over its coord communicator, then all live ranks
(spares included) ``agree``: the commit point.  Injected SIGKILLs come from the config's ``schedule``.
On FailureDetected: repair, (optionally activate spares), rebuild the buffers, redo the step.
Every rank writes ``<outdir>/rank<r>.json``; contributions are integers so sums are exact in fp32.

Usage: python worker.py '<json config>'
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from nanotron_recover.ft import FailureDetected, FTWorld, ReplicaEvicted, WorldOptions
from nanotron_recover.process.inject import FailureInjector


def contribution(replica: int, local: int, step: int, bucket: int, n: int) -> np.ndarray:
    base = (replica + 1) * 1000 + local * 100 + step * 10 + bucket
    return (np.arange(n, dtype=np.float32) + base).astype(np.float32)


def expected_sum(active: list[int], local: int, step: int, bucket: int, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.float64)
    for r in active:
        out += contribution(r, local, step, bucket, n)
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    outdir = Path(cfg["outdir"])
    rpr = int(cfg.get("ranks_per_replica", 1))
    steps = int(cfg.get("steps", 5))
    n_buckets = int(cfg.get("buckets", 4))
    bucket_len = int(cfg.get("bucket_len", 1024))
    compute_s = float(cfg.get("compute_s", 0.02))
    activate_spares = bool(cfg.get("activate_spares", False))

    result: dict = {"status": "running", "steps_completed": 0, "events": [], "failures": [], "errors": []}

    def write(status: str) -> None:
        result.update(status=status, epoch=world.epoch, t_end=time.time(), active=world.active_replicas,
                      live_replicas=world.live_replicas, events=[e.as_dict() for e in world.events])
        tmp = outdir / f"rank{world.rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, outdir / f"rank{world.rank}.json")

    def on_evict(exc: ReplicaEvicted) -> None:
        result["evicted_reason"] = str(exc)
        write("evicted_by_watcher")

    wait = cfg.get("mpi_wait", "auto")  # a list: each rank's own setting, as on nodes of different sizes
    wait = wait[MPI.COMM_WORLD.Get_rank()] if isinstance(wait, list) else wait
    world = FTWorld(MPI.COMM_WORLD, rpr, cfg.get("active"), on_evict=on_evict, options=WorldOptions(mpi_wait=wait))
    result["mpi_wait"] = world.mpi_wait
    result.update(rank=world.rank, replica=world.replica, local=world.local_rank)
    inj = FailureInjector(cfg.get("schedule", []), world.replica, world.local_rank, run_dir=outdir)
    stuck = {(s["step"], s["replica"], s["rank"]) for s in cfg.get("stuck", [])}
    die_in_repair = {(d["epoch"], d["replica"], d["rank"]) for d in cfg.get("die_in_repair", [])}
    die_at = {(d["epoch"], d["replica"], d["rank"]): (d["point"], d.get("attempt", 1)) for d in cfg.get("die_at", [])}

    def repair_hook(point: str, attempt: int) -> None:
        """Real death inside the repair protocol (after Shrink / after the rebuild), for the retry-loop tests."""
        if die_at.get((world.epoch + 1, world.replica, world.local_rank)) == (point, attempt):
            print(f"[worker rank {world.rank}] KILL inside repair at {point} attempt {attempt} t={time.time():.6f}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    world.repair_hook = repair_hook
    step = 0
    while step < steps:
        try:
            inj.maybe_fail(step, "dataload")
            if (step, world.replica, world.local_rank) in stuck:
                # A real block, as in a gloo recv from a peer that will never answer: only the watcher frees us.
                a, _b = socket.socketpair()
                print(f"[worker rank {world.rank}] STUCK in recv at step {step} t={time.time():.6f}", flush=True)
                result["stuck_since"] = time.time()
                a.recv(1)
            inj.maybe_fail(step, "forward")
            time.sleep(compute_s)
            inj.maybe_fail(step, "backward")
            if world.is_active:
                local, active = world.local_rank, list(world.active_replicas)
                bufs = [contribution(world.replica, local, step, b, bucket_len) for b in range(n_buckets)]
                for b, buf in enumerate(bufs):
                    world.allreduce_sum_(buf)
                    if b == 0:
                        inj.maybe_fail(step, "reduce")
            if not world.agree(True):
                raise RuntimeError("agree returned False without an error")
            inj.maybe_fail(step, "optimizer")
            if world.is_active:
                for b, buf in enumerate(bufs):
                    if not np.array_equal(buf.astype(np.float64), expected_sum(active, local, step, b, bucket_len)):
                        result["errors"].append(f"step {step} bucket {b}: wrong sum over {active}")
            result["steps_completed"] = step + 1
            step += 1
        except FailureDetected as exc:
            result["failures"].append({"step": step, "epoch": world.epoch, "op": exc.op, "class": exc.error_class,
                                       "t": time.time()})
            if (world.epoch + 1, world.replica, world.local_rank) in die_in_repair:
                print(f"[worker rank {world.rank}] KILL on entering repair t={time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                event = world.repair()
            except ReplicaEvicted as ev:
                print(f"[worker rank {world.rank}] EVICTED: {ev}; exiting 0", flush=True)
                result["evicted_reason"] = str(ev)
                write("evicted")
                world.shutdown(had_failure=True, code=0)
            print(f"[worker rank {world.rank}] REPAIRED {json.dumps(event.as_dict())}", flush=True)
            if activate_spares:
                spares = world.spare_replicas
                lost = int(cfg.get("n_active", len(world.live_replicas))) - len(world.active_replicas)
                if spares and lost > 0:
                    world.set_active_replicas(world.active_replicas + spares[:lost])
                    state = np.array([step], dtype=np.float32)  # state transfer: a real trainer sends weights
                    if world.is_active:
                        world.bcast_(state, root_replica=world.active_replicas[0])
                    result.setdefault("activations", []).append(world.active_replicas)
    write("done")
    print(f"[worker rank {world.rank}] DONE steps={result['steps_completed']} epoch={world.epoch}", flush=True)
    world.shutdown()


if __name__ == "__main__":
    main()
