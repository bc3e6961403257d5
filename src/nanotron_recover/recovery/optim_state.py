"""Adam state that exists before the first optimizer step, so that it can be filled in place.

An idle spare never stepped, and a resumed HSDP run loads shards into existing tensors: both need the state
tensors AdamW would create on its first step. And the one order in which a rank's whole training state is copied
(spare activation, node-local snapshots). No MPI here: checkpoint readers import this.
"""

from __future__ import annotations

from typing import Iterator

import torch

from nanotron_recover.recovery.buckets import local_tensor
from nanotron_recover.strategy import fp32_accumulator


def ensure_adam_state(optimizer) -> None:
    """Create missing AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``) the way AdamW's first step would:
    moments shaped like the parameter (a ``DTensor`` for a sharded one), ``step`` a float32 scalar on the CPU, or
    on the parameter's device for the fused / capturable implementations."""
    inner = torch_optimizer(optimizer)
    for group in inner.param_groups:
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            state = inner.state[p]
            if not state:
                device = local_tensor(p).device if on_device else torch.device("cpu")
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside nanotron's wrappers (``NamedOptimizer``, ``OptimizerFromGradientAccumulator``)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def state_tensors(state) -> Iterator[torch.Tensor]:
    """Parameters, their fp32 masters (mixed precision), then each one's optimizer state, in the same order on
    every replica."""
    accumulator = fp32_accumulator(state)  # mixed precision: fp32 masters
    stepped = [param for _, param in state.named_params]  # what the optimizer steps: the params, or their masters
    for param in stepped:
        yield param.data
    if accumulator is not None:
        stepped = [accumulator.get_parameter_for_optimizer(name) for name, _ in state.named_params]
        for master in stepped:
            yield master.data
    inner = torch_optimizer(state.optimizer)
    for param in stepped:
        param_state = inner.state[param]
        for key in sorted(param_state):
            yield param_state[key]
