"""nanotron's fp32 master-weight recipe on the project's flat fp32 gradient buckets, on any device.

nanotron 0.4 trains bf16 models through ``FP32GradientAccumulator`` + ``OptimizerFromGradientAccumulator``: bf16
parameters for compute, fp32 master copies that the optimizer steps, gradients accumulated in fp32 buffers, and
after the step the bf16 copies refreshed from the masters. Its ``__init__`` (and ``build_grad_buffers``) allocate
both buffers with ``device="cuda"``, so it cannot be built on a CPU host; and it owns its gradient buffer, while
ReCoVer's snapshot/restore/orphan-recompute logic needs the gradients in :class:`GradBuckets`' flat buffer.

:class:`BucketFP32GradientAccumulator` keeps every other method of nanotron's class (``step`` = copy masters to
the bf16 parameters, ``get_parameter_for_optimizer``, ``get_grad_buffer``, ``state_dict`` / ``load_state_dict`` =
the masters, which nanotron's ``save_optimizer`` writes under ``gradient_accumulator``) and only replaces the
construction: the masters live in one flat fp32 buffer on the parameters' device, and each gradient buffer *is*
the parameter's ``main_grad`` view into the buckets (filled by :class:`GradBuckets`' post-accumulate hook, once per
microbatch backward). Each master's ``.grad`` is that same view: the optimizer reads the bucket with no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import torch
from nanotron.optim.gradient_accumulator import FP32GradientAccumulator


class BucketFP32GradientAccumulator(FP32GradientAccumulator):
    """fp32 masters for low-precision parameters whose fp32 gradients live in ``param.main_grad``."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        # nanotron limitation: FP32GradientAccumulator.__init__ allocates on "cuda" and builds its own grad buffer
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        for name, p in named:
            if p.dtype == torch.float32:
                raise ValueError(f"{name} is already float32: fp32 masters are for low-precision parameters")
            if not hasattr(p, "main_grad"):
                raise ValueError(f"{name} has no main_grad: lay the parameters into GradBuckets first")
        device = named[0][1].device if named else torch.device("cpu")
        self.fp32_grad_buffers = OrderedDict((name, {"half": p, "fp32_grad": p.main_grad}) for name, p in named)
        self._contiguous_fp32_grad_buffer = None  # the buckets own the gradient storage (zeroed by them)
        flat = torch.empty(sum(p.numel() for _, p in named), dtype=torch.float32, device=device)
        self.parameters = {}
        offset = 0
        with torch.no_grad():
            for name, p in named:
                master = flat[offset : offset + p.numel()].view_as(p)
                master.copy_(p)
                self.parameters[name] = {"fp32": torch.nn.Parameter(master), "half": p}
                offset += p.numel()
        self._is_accumulation_sync_step = False
        self.fp32_grads_allreduce_handle = None
        self.bind_master_grads()

    def bind_master_grads(self) -> None:
        """Point every master's ``.grad`` at its bucket view (again, if an optimizer's ``zero_grad`` dropped it)."""
        for name, elt in self.parameters.items():
            grad = self.fp32_grad_buffers[name]["fp32_grad"]
            if elt["fp32"].grad is None or elt["fp32"].grad.data_ptr() != grad.data_ptr():
                elt["fp32"].grad = grad

    def zero_grad(self) -> None:
        """Zero the fp32 gradients in place and keep the masters bound to them (nanotron's drops ``.grad``)."""
        for name, elt in self.fp32_grad_buffers.items():
            elt["half"].grad = None
            elt["fp32_grad"].zero_()
        self.bind_master_grads()


def has_low_precision_params(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> bool:
    """Whether any trainable parameter is below fp32 (then the optimizer needs fp32 masters)."""
    return any(p.requires_grad and p.dtype != torch.float32 for _, p in named_params)
