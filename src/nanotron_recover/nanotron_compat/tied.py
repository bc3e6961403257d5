"""Tied parameters: marking them and syncing their gradients, with short-timeout groups.

nanotron 0.4 keeps ``mark_tied_parameters`` in ``trainer.py`` (unimportable here: it imports flash_attn) and its
``create_pg_for_tied_weights`` creates groups with the 10-minute default timeout. We reuse nanotron's
``tie_parameters`` / ``sync_tied_weights_gradients`` and only build the groups ourselves.

Two kinds of ties, as in nanotron:
* word embeddings <-> lm_head (``tie_word_embeddings``), possibly on two pipeline stages: gradients are SUMmed;
* every non-sharded parameter (RMSNorm weights) across the TP group: no reduction under ALL_REDUCE (each TP rank
  computes the same gradient), a SUM under REDUCE_SCATTER (each TP rank saw only its sequence shard).
"""

from __future__ import annotations

from typing import Optional

import torch
from nanotron import distributed as dist
from nanotron.config import ParallelismArgs
from nanotron.models.base import NanotronModel
from nanotron.parallel import ParallelContext
from nanotron.parallel.parameters import NanotronParameter
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
from nanotron.parallel.tensor_parallel.nn import TensorParallelRowLinear
from nanotron.parallel.tied_parameters import sync_tied_weights_gradients, tie_parameters
from torch import nn

from nanotron_recover.nanotron_compat.parallel_context import DEFAULT_GROUP_TIMEOUT


def pp_rank_of(param_name: str, model: nn.Module) -> int:
    """The pipeline rank of the PipelineBlock that owns ``param_name``."""
    parts = param_name.split(".")
    for end in range(1, len(parts)):  # shortest prefix first: deeper modules exist only on the owning rank
        module = model.get_submodule(".".join(parts[:end]))
        if isinstance(module, PipelineBlock):
            return module.rank
    raise ValueError(f"{param_name} is not inside a PipelineBlock")


def mark_tied_parameters(
    model: NanotronModel, parallel_context: ParallelContext, parallel_config: Optional[ParallelismArgs]
) -> None:
    """Mark tied parameters the way nanotron's trainer does, then create their groups (collective over world)."""
    pc = parallel_context
    ep, dp, tp = (dist.get_rank(pc.expert_pg), dist.get_rank(pc.dp_pg), dist.get_rank(pc.tp_pg))
    tied_names = model.get_embeddings_lm_head_tied_names()
    if tied_names:
        ties = [(name, (int(pc.world_rank_matrix[ep, pp_rank_of(name, model), dp, tp]),)) for name in tied_names]
        tie_parameters(root_module=model, ties=ties, parallel_context=pc, reduce_op=dist.ReduceOp.SUM)

    tp_ranks = tuple(sorted(dist.get_process_group_ranks(pc.tp_pg)))
    all_reduce_mode = parallel_config is None or parallel_config.tp_mode is TensorParallelLinearMode.ALL_REDUCE
    for module_name, module in model.named_modules():
        for param_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, NanotronParameter) and (param.is_sharded or param.is_tied):
                continue
            if isinstance(module, TensorParallelRowLinear) and param_name == "bias":
                continue  # lives on TP rank 0 only
            tie_parameters(
                root_module=model,
                ties=[(f"{module_name}.{param_name}", tp_ranks)],
                parallel_context=pc,
                reduce_op=None if all_reduce_mode else dist.ReduceOp.SUM,
            )
    _create_tied_groups(model, pc)


def _create_tied_groups(model: nn.Module, pc: ParallelContext) -> None:
    mine = {
        p.get_tied_info().global_ranks for p in model.parameters() if isinstance(p, NanotronParameter) and p.is_tied
    }
    gathered = [None] * pc.world_pg.size()
    dist.all_gather_object(gathered, mine, group=pc.world_pg)
    timeout = getattr(pc, "timeout", DEFAULT_GROUP_TIMEOUT)
    for ranks in sorted(set().union(*gathered)):
        if ranks not in pc.world_ranks_to_pg:
            pc.world_ranks_to_pg[ranks] = dist.new_group(ranks=list(ranks), timeout=timeout)


def sync_tied_gradients(model: nn.Module, parallel_context: ParallelContext, grad_accumulator=None) -> None:
    """SUM the gradients of tied parameters over their groups (``param.grad``, or the fp32 buffers of
    ``grad_accumulator`` in mixed precision); run after the last backward. A tied ``param.grad`` that is still None
    (no microbatch ran on this replica) takes part as zeros."""
    if grad_accumulator is not None:
        sync_tied_weights_gradients(module=model, parallel_context=parallel_context, grad_accumulator=grad_accumulator)
        return
    for param in model.parameters():
        if param.requires_grad and param.grad is None and isinstance(param, NanotronParameter) and param.is_tied:
            param.grad = torch.zeros_like(param)
    sync_tied_weights_gradients(module=model, parallel_context=parallel_context, grad_accumulator=None)
