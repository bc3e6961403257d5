"""Worker of tests/nanotron_compat/test_parallel_context.py (4 ranks): group layouts for dp=1 and dp>1, the
short timeout on the context's groups, and a NonBlockingP2P exchange in both directions at once."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist

from nanotron_recover.nanotron_compat.p2p import NonBlockingP2P
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from tests.models import llama_harness as H


def ranks(pg) -> list[int]:
    return sorted(torch_dist.get_process_group_ranks(pg))


def main(out: str) -> None:
    H.init_torch_world()
    rank = torch_dist.get_rank()
    report = {}
    pc = ReplicaParallelContext(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=1)
    report["tp2pp2"] = {"tp": ranks(pc.tp_pg), "pp": ranks(pc.pp_pg), "dp": ranks(pc.dp_pg),
                        "world": ranks(pc.world_pg)}
    pc.release_groups()
    pc = ReplicaParallelContext(
        tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=2, timeout=datetime.timedelta(seconds=2)
    )
    report["tp2dp2"] = {"tp": ranks(pc.tp_pg), "dp": ranks(pc.dp_pg), "mp": ranks(pc.mp_pg)}
    report["cached_tp_rank"] = dist.get_rank(pc.tp_pg)

    # both dp peers send to each other at once, twice, then receive: must not block
    p2p = NonBlockingP2P(pc.dp_pg, device=torch.device("cpu"))
    peer = 1 - dist.get_rank(pc.dp_pg)
    mine = [torch.full((3, 5), float(rank)), torch.arange(7.0) + rank]
    p2p.send_tensors([mine[0]], to_rank=peer)
    p2p.send_tensors([mine[1]], to_rank=peer)
    got = p2p.recv_tensors(1, from_rank=peer) + p2p.recv_tensors(1, from_rank=peer)
    p2p.wait_sends()
    other = torch_dist.get_process_group_ranks(pc.dp_pg)[peer]
    report["p2p_ok"] = bool(torch.equal(got[0], torch.full((3, 5), float(other)))
                            and torch.equal(got[1], torch.arange(7.0) + other))

    # short timeout: rank 0 all-reduces on its tp group, rank 1 never joins
    if rank == 0:
        t0 = time.time()
        try:
            torch_dist.all_reduce(torch.ones(1), group=pc.tp_pg)
            report["timeout_s"] = None
        except RuntimeError:
            report["timeout_s"] = time.time() - t0
    torch_dist.barrier()
    gathered = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered, indent=1))
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
