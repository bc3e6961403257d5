"""Worker of tests/models/test_llama.py.

``reference OUT.pt``: one process (tp=pp=1) trains each config for a few steps and saves per-step losses, full
gradients and final weights. ``parallel REF.pt OUT.json``: 4 ranks train the same configs at TP2xPP2 (AFAB, and
1F1B with tied embeddings) and TP2 REDUCE_SCATTER x DP2 (microbatches split 3/1 between the replicas) and compare
every local shard with the reference; rank 0 writes the max differences.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist
from nanotron.parallel.parameters import NanotronParameter

from nanotron_recover.models.llama import build_llama, canonical_names, init_weights
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.nanotron_compat.tied import sync_tied_gradients
from nanotron_recover.training.engines import build_engine, place_microbatch, summed_loss
from tests.models import llama_harness as H

STEPS, M, STD, SEED, LR = 3, 4, 0.02, 1234, 1e-3
CONFIGS = {"untied": H.tiny_config(tied=False), "tied": H.tiny_config(tied=True)}
# name: (config, tp, pp, dp, engine, tp_mode, microbatches of each dp rank)
SCENARIOS = {
    "tp2pp2_afab": ("untied", 2, 2, 1, "afab", "all_reduce", [[0, 1, 2, 3]]),
    "tp2pp2_1f1b_tied": ("tied", 2, 2, 1, "1f1b", "all_reduce", [[0, 1, 2, 3]]),
    "tp2dp2_reduce_scatter": ("untied", 2, 1, 2, "afab", "reduce_scatter", [[0, 1, 2], [3]]),
}


def build(config_key: str, tp: int, pp: int, dp: int, engine: str, mode: str):
    pc = ReplicaParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    model = build_llama(CONFIGS[config_key], pc, H.parallelism(dp, pp, tp, engine, mode), torch.float32,
                        torch.device("cpu"))
    init_weights(model, std=STD, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return pc, model, build_engine(engine), optimizer


def train_step(pc, model, engine, step: int, indices: List[int]):
    for p in model.parameters():
        p.grad = None
    batch = [place_microbatch(H.microbatch(step, i), model, pc) for i in indices]
    outputs = engine.train_batch_iter(model, pc.pp_pg, batch, len(batch), None, loss_divisor=M)
    sync_tied_gradients(model, pc)
    return summed_loss(outputs)


def reference(out_path: str) -> None:
    result = {}
    for key in CONFIGS:
        pc, model, engine, optimizer = build(key, 1, 1, 1, "afab", "all_reduce")
        names = canonical_names(model)
        losses, grads = [], []
        for step in range(STEPS):
            losses.append(train_step(pc, model, engine, step, list(range(M))).item())
            grads.append({names[n]: p.grad.detach().clone() for n, p in model.named_parameters()})
            optimizer.step()
        params = {names[n]: p.detach().clone() for n, p in model.named_parameters()}
        result[key] = {"losses": losses, "grads": grads, "params": params}
    torch.save(result, out_path)


def shard_diff(local: torch.Tensor, param: torch.Tensor, full: torch.Tensor) -> float:
    """Max |local shard - matching slice of the full reference tensor|."""
    if isinstance(param, NanotronParameter) and param.is_sharded:
        info = param.get_sharded_info()
        assert tuple(full.shape) == tuple(info.unsharded_shape), (full.shape, info.unsharded_shape)
        return max((local[p.local_slices] - full[p.global_slices]).abs().max().item()
                   for p in info.local_global_slices_pairs)
    return (local - full).abs().max().item()


def parallel(ref_path: str, out_path: str) -> None:
    ref = torch.load(ref_path, weights_only=False)
    report: Dict[str, Dict[str, float]] = {}
    for name, (key, tp, pp, dp, engine_name, mode, split) in SCENARIOS.items():
        t0 = time.time()
        pc, model, engine, optimizer = build(key, tp, pp, dp, engine_name, mode)
        names = canonical_names(model)
        dp_rank = dist.get_rank(pc.dp_pg)
        loss_diff, grad_diff, n_losses = 0.0, 0.0, 0
        for step in range(STEPS):
            loss = train_step(pc, model, engine, step, split[dp_rank])
            for p in model.parameters():  # cross-replica SUM (stock layout: torch dp group)
                torch_dist.all_reduce(p.grad, group=pc.dp_pg)
            if loss is not None:
                torch_dist.all_reduce(loss, group=pc.dp_pg)
                loss_diff = max(loss_diff, abs(loss.item() - ref[key]["losses"][step]))
                n_losses += 1
            for n, p in model.named_parameters():
                grad_diff = max(grad_diff, shard_diff(p.grad, p, ref[key]["grads"][step][names[n]]))
            optimizer.step()
        param_diff = max(shard_diff(p.detach(), p, ref[key]["params"][names[n]]) for n, p in model.named_parameters())
        report[name] = {
            "loss": loss_diff,
            "grad": grad_diff,
            "param": param_diff,
            "loss_checks": n_losses,
            "n_params": len(names),
            "seconds": time.time() - t0,
        }
        pc.release_groups()
    gathered: List[Dict] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, report)
    if torch_dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered, "ref_losses": {k: v["losses"] for k, v in ref.items()}}, f, indent=1)


if __name__ == "__main__":
    H.init_torch_world()
    mode, *args = sys.argv[1:]
    {"reference": reference, "parallel": parallel}[mode](*args)
    torch_dist.destroy_process_group()
