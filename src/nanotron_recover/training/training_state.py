"""The training state at the bottom of the house: what every layer reads of it, in one place.

:class:`TrainingState` is what a strategy, a checkpoint layout or a snapshot reads of the trainer's state; the
helpers below find the parts of nanotron's wrappers (the fp32 gradient accumulator, the torch optimizer inside
``NamedOptimizer``), this rank's shard of a sharded tensor, the Adam state that must exist before the first step,
and the one order in which a rank's whole state is copied (spare activation, node-local snapshots). No MPI and
no project imports: checkpoint readers, the memory census and the recovery layer all use it.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, Protocol

import torch


class TrainingState(Protocol):
    """What a strategy or a checkpoint layout reads of the training state (the trainer provides it)."""

    config: Any
    device: torch.device
    M: int
    parallel_context: Any
    named_params: list[tuple[str, torch.nn.Parameter]]
    unwrapped_model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any


def fp32_accumulator(state: TrainingState) -> Any:
    """The optimizer's fp32 gradient accumulator (mixed precision: its buffers are the gradients), else None."""
    return getattr(state.optimizer, "gradient_accumulator", None)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor``, without importing ``torch.distributed.tensor`` (~0.7 s per process, which
    every rank of every job would pay at start-up): a DTensor exists only once that module was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor`` (a view, no copy), else ``t`` itself."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


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
