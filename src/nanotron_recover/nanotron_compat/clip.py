"""Gradient clipping on a rank that owns no gradient, without CUDA.

nanotron 0.4's ``clip_grad_norm`` builds the local norm of a rank whose gradient list is empty with
``torch.zeros(..., device="cuda")``: with tied embeddings every tied copy but the owner's is left out, so under
TP x PP a rank can own none (the v0.4 example config, TP2 x PP2 with tied embeddings, crashed at step 1 on CPU).
:func:`clip_grad_norm` calls nanotron's function whenever the rank owns a gradient, and otherwise takes part in
the same SUM over the model-parallel group with a zero norm on the project's compute device, then scales its
(non-owner) gradients by the same coefficient.
"""

from __future__ import annotations

from typing import Sequence

import torch
from nanotron import distributed as dist
from nanotron.optim.clip_grads import clip_grad_norm as nanotron_clip_grad_norm
from nanotron.optim.gradient_accumulator import GradientAccumulator

from nanotron_recover.run import devices

_NORM_EPS = 1.0e-6  # nanotron's


def _owns(param: torch.nn.Parameter, world_rank: int) -> bool:
    return not param.is_tied or world_rank == param.get_tied_info().global_ranks[0]


def clip_grad_norm(
    mp_pg: dist.ProcessGroup,
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    max_norm: float,
    grad_accumulator: GradientAccumulator | None = None,
) -> float:
    """Clip the replica's gradient (``param.grad``, or the accumulator's fp32 buffers) to L2 norm ``max_norm``."""
    world_rank = dist.get_rank()
    if any(_owns(p, world_rank) for _, p in named_params):
        return float(nanotron_clip_grad_norm(mp_pg, named_params, max_norm, grad_accumulator))
    total = torch.zeros([], dtype=torch.float32, device=devices.compute_device())
    dist.all_reduce(total, group=mp_pg, op=dist.ReduceOp.SUM)
    total.sqrt_()
    coef = torch.clamp(max_norm / (total + _NORM_EPS), max=1.0)
    with torch.no_grad():
        for name, p in named_params:
            grad = p.grad if grad_accumulator is None else grad_accumulator.get_grad_buffer(name)
            if grad is not None:
                grad.mul_(coef.to(grad.device))
    return float(total)
