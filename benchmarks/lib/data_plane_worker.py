"""One rank of ``benchmarks/data_plane_bench.py --micro`` (run under ``mpirun --with-ft ulfm``): the in-place SUM of
one fp32 buffer across all ranks on both data planes, and the torch plane's group rebuild.

Every rank is one "replica" of one rank, so the coordinate communicator spans the world, as the cross-replica
reduction of a 1-rank-per-replica job does. Rank 0 prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from nanotron_recover.ft import FTWorld
from nanotron_recover.ft.data_plane import MpiDataPlane, TorchDataPlane


class _OneBucket:
    """The one-bucket stand-in for the flat gradient buckets (CPU: the host view is the tensor itself)."""

    def __init__(self, numel: int) -> None:
        self.t = torch.ones(numel, dtype=torch.float32)
        self.np = self.t.numpy()

    def view(self, i: int) -> torch.Tensor:
        return self.t

    def to_host(self, i: int):
        return self.np

    def from_host(self, i: int) -> None:
        pass


def _median_s(fn, repeats: int, barrier) -> float:
    fn()  # warm-up (the torch plane builds its group here)
    out = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(sizes_mb: list[float], repeats: int, rebuilds: int) -> None:
    ft = FTWorld()
    torch_plane, mpi_plane = TorchDataPlane(ft, torch.device("cpu"), 60.0), MpiDataPlane(ft)
    say = (lambda record: print(json.dumps(record), flush=True)) if ft.rank == 0 else (lambda record: None)
    n = len(ft.live_ranks)
    for mb in sizes_mb:
        bucket = _OneBucket(max(1, int(mb * 2**20) // 4))
        for plane in (mpi_plane, torch_plane):
            s = _median_s(lambda: plane.allreduce_sum_(bucket, 0), repeats, ft.barrier)
            say({"what": "allreduce", "plane": plane.name, "ranks": n, "mb": mb, "median_ms": s * 1e3,
                 "gb_per_s_bus": 2 * (n - 1) / n * mb / 1024 / s})
    times = []
    for _ in range(rebuilds):
        torch_plane.close()  # what a repair does; the next reduction builds the new group
        time.sleep(1.0)  # builds come seconds apart in training; back to back, TCPStore connects can take 5 s
        ft.barrier()
        t0 = time.perf_counter()
        torch_plane.allreduce_sum_(_OneBucket(1), 0)
        times.append(time.perf_counter() - t0)
    say({"what": "rebuild", "plane": "torch", "ranks": n, "median_ms": statistics.median(times) * 1e3,
         "max_ms": max(times) * 1e3, "n": rebuilds})
    torch_plane.close()
    ft.shutdown()


def kill_inside_a_reduction(victim: int, mb: float) -> None:
    """Rank ``victim`` SIGKILLs itself 20 ms into a large torch-plane reduction. Every survivor reports how long
    after the reduction's start it got FailureDetected, repairs, and reduces again on the rebuilt group (a SUM of
    ones must equal the number of survivors)."""
    import os
    import signal
    import threading

    from nanotron_recover.ft import FailureDetected

    ft = FTWorld()
    plane = TorchDataPlane(ft, torch.device("cpu"), 60.0)
    bucket = _OneBucket(max(1, int(mb * 2**20) // 4))
    plane.allreduce_sum_(bucket, 0)  # builds the group
    ft.barrier()
    if ft.rank == victim:
        threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.perf_counter()
    try:
        for _ in range(100):
            plane.allreduce_sum_(bucket, 0)
        failed_after_s = None
    except FailureDetected:
        failed_after_s = time.perf_counter() - t0
    event = ft.repair()
    bucket.t.fill_(1.0)
    plane.allreduce_sum_(bucket, 0)
    print(json.dumps({"what": "kill", "rank": ft.rank, "failed_after_s": failed_after_s,
                      "failed_ranks": event.failed_ranks, "sum_after": float(bucket.t[0]),
                      "survivors": len(ft.live_ranks), "rebuild_ms": plane.last_build["ms"]}), flush=True)
    plane.close()
    ft.shutdown()  # after a failure: a barrier, then os._exit (MPI_Finalize can hang, as can joining the reaper)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    if "victim" in config:
        kill_inside_a_reduction(config["victim"], config["mb"])
    else:
        main(config["sizes_mb"], config["repeats"], config["rebuilds"])
