"""Worker of tests/training/test_engines.py (4 ranks). Checks, each a max abs difference written by rank 0:

PP2 x DP2 (stock layout, two pipelines):
* ``onef1b_single_mb``: 1F1B on 1 microbatch (= pp-1) equals AFAB on it;
* ``divisor_half``: 2 microbatches with divisor 4 give half the gradient of divisor 2;
* ``split_local``: grads of [0,1] (AFAB) + [2,3] (1F1B), divisor 4, equal 1F1B on [0..3];
* ``split_dp``: dp rank 0 runs [0,1,2], dp rank 1 runs [3], SUM over dp equals 1F1B on [0..3];
* ``scaled_losses``: returned losses are the unscaled ones / divisor (divisor 4 vs divisor 1);
PP4:
* ``fallback_1mb`` / ``fallback_2mb``: 1F1B with fewer than pp-1 microbatches (AFAB fallback) equals AFAB;
* ``native_3mb``: 1F1B with 3 = pp-1 microbatches equals AFAB;
* ``zero_mb``: 0 microbatches run nothing on any stage (grads stay None).
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as torch_dist

from nanotron_recover.models.llama import build_llama, init_weights
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.training.engines import build_engine, place_microbatch
from tests.models import llama_harness as H


def grads(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], scale_b: float = 1.0) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - scale_b * b[k]).abs().max().item() for k in a)


def run(pc, model, engine_name: str, indices: List[int], divisor: Optional[int], zero: bool = True):
    if zero:
        for p in model.parameters():
            p.grad = None
    engine = build_engine(engine_name)
    batch = [place_microbatch(H.microbatch(0, i), model, pc) for i in indices]
    return engine.train_batch_iter(model, pc.pp_pg, batch, len(batch), None, loss_divisor=divisor)


def pp2_dp2(report: Dict[str, float]) -> None:
    pc = ReplicaParallelContext(tensor_parallel_size=1, pipeline_parallel_size=2, data_parallel_size=2)
    model = build_llama(H.tiny_config(), pc, H.parallelism(dp=2, pp=2), torch.float32, torch.device("cpu"))
    init_weights(model, std=0.02, seed=7)

    run(pc, model, "afab", [0], 1)
    afab_one = grads(model)
    run(pc, model, "1f1b", [0], 1)
    report["onef1b_single_mb"] = max_diff(grads(model), afab_one)

    run(pc, model, "afab", [0, 1], 4)
    by4 = grads(model)
    run(pc, model, "afab", [0, 1], 2)
    report["divisor_half"] = max_diff(by4, grads(model), scale_b=0.5)

    out4 = run(pc, model, "1f1b", [0, 1, 2, 3], 4)
    full = grads(model)
    report["full_grad_max"] = min(g.abs().max().item() for g in full.values())  # every local grad is nonzero
    run(pc, model, "afab", [0, 1], 4)
    run(pc, model, "1f1b", [2, 3], 4, zero=False)
    report["split_local"] = max_diff(grads(model), full)

    mine = [[0, 1, 2], [3]][torch_dist.get_rank(pc.dp_pg)]
    run(pc, model, "1f1b", mine, 4)
    for p in model.parameters():
        torch_dist.all_reduce(p.grad, group=pc.dp_pg)
    report["split_dp"] = max_diff(grads(model), full)

    out1 = run(pc, model, "afab", [0, 1, 2, 3], 1)
    if isinstance(out4[0]["loss"], torch.Tensor):
        report["scaled_losses"] = max(abs(a["loss"].item() - b["loss"].item() / 4) for a, b in zip(out4, out1))
    pc.release_groups()


def pp4(report: Dict[str, float]) -> None:
    pc = ReplicaParallelContext(tensor_parallel_size=1, pipeline_parallel_size=4, data_parallel_size=1)
    model = build_llama(H.tiny_config(layers=4), pc, H.parallelism(pp=4), torch.float32, torch.device("cpu"))
    init_weights(model, std=0.02, seed=7)
    for label, indices in (("fallback_1mb", [0]), ("fallback_2mb", [0, 1]), ("native_3mb", [0, 1, 2])):
        run(pc, model, "afab", indices, 4)
        ref = grads(model)
        run(pc, model, "1f1b", indices, 4)
        report[label] = max_diff(grads(model), ref)
    run(pc, model, "1f1b", [], 4)
    report["zero_mb"] = float(sum(p.grad is not None for p in model.parameters()))
    pc.release_groups()


if __name__ == "__main__":
    H.init_torch_world()
    report: Dict[str, float] = {}
    pp2_dp2(report)
    pp4(report)
    gathered: List[Dict[str, float]] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, report)
    if torch_dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f, indent=1)
    torch_dist.destroy_process_group()
