"""Pipeline engines for a variable number of microbatches per replica, with the loss scaled by 1/M.

ReCoVer's invariant: every step commits exactly M microbatches, split in any way across the live replicas. Each
microbatch's loss is divided by the GLOBAL count M (``loss_divisor``), never by the replica's own quota, and the
cross-replica reduction is a SUM; then every split yields the same summed gradient. nanotron 0.4's engines divide
by ``nb_microbatches`` (the local count) inside ``PipelineEngine.forward``; the override below swaps the divisor
for the duration of that call and leaves nanotron's schedules untouched.

Returned losses: a list with one ``{"loss": tensor}`` per local microbatch on the output pipeline stage (a
``TensorPointer`` elsewhere), each already SCALED by 1/loss_divisor (the exact tensor that was backpropagated).
Summing them over all M microbatches of a step (across replicas) gives the step's mean loss.

Also: 1F1B needs at least pp-1 microbatches; with fewer it falls back to AFAB for that call (same math). The
model's ``NonBlockingP2P`` sends are completed before a call returns. nanotron's ``PipelineTrainBatchState`` keeps
its queues as *class* attributes, shared by all states: a step aborted by a failure would leave entries that
poison the next one, so every call starts by emptying them.
"""

from __future__ import annotations

import collections.abc
from typing import Dict, Iterable, List, Optional, Union

import torch
from nanotron import distributed as dist
from nanotron.optim.gradient_accumulator import GradientAccumulator
from nanotron.parallel import ParallelContext
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.engine import (
    AllForwardAllBackwardPipelineEngine,
    OneForwardOneBackwardPipelineEngine,
    PipelineEngine,
)
from nanotron.parallel.pipeline_parallel.state import PipelineBatchState, PipelineTrainBatchState
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotron.utils import ContextManagers
from torch import nn

from nanotron_recover.nanotron_compat.p2p import NonBlockingP2P

MaybeTensor = Union[torch.Tensor, TensorPointer]
MicroBatch = Dict[str, MaybeTensor]

_SHARED_QUEUES = (
    (PipelineBatchState, "activations_buffer"),
    (PipelineTrainBatchState, "microbatches_activations_to_send"),
    (PipelineTrainBatchState, "microbatches_activations_to_recv"),
    (PipelineTrainBatchState, "microbatches_grads_to_send"),
    (PipelineTrainBatchState, "microbatches_grads_to_recv"),
    (PipelineTrainBatchState, "grads_buffer"),
    (PipelineTrainBatchState, "microbatches_activations_requiring_backward"),
)


def pipeline_p2ps(model: nn.Module) -> List[NonBlockingP2P]:
    """The distinct non-blocking P2P objects used by the model's PipelineBlocks."""
    found: Dict[int, NonBlockingP2P] = {}
    for module in model.modules():
        if isinstance(module, PipelineBlock) and isinstance(module.p2p, NonBlockingP2P):
            found[id(module.p2p)] = module.p2p
    return list(found.values())


def wait_pipeline_sends(model: nn.Module) -> None:
    """Complete the batch's posted pipeline sends (NonBlockingP2P never waits inside the schedule)."""
    for p2p in pipeline_p2ps(model):
        p2p.wait_sends()


def reset_pipeline_queues() -> None:
    """Empty nanotron's class-level pipeline queues (left over when a step was aborted mid-way)."""
    for cls, attr in _SHARED_QUEUES:
        getattr(cls, attr).clear()


class _GlobalLossDivisor(PipelineEngine):
    """Mixin: ``train_batch_iter(..., loss_divisor=M)`` divides each microbatch loss by M, not the local count."""

    _loss_divisor: Optional[int] = None

    def forward(
        self, context: ContextManagers, state: PipelineTrainBatchState, micro_batch: MicroBatch, model: nn.Module
    ) -> Dict[str, MaybeTensor]:
        local_count = self.nb_microbatches
        if self._loss_divisor is not None:
            self.nb_microbatches = self._loss_divisor  # nanotron divides by this attribute
        try:
            return super().forward(context=context, state=state, micro_batch=micro_batch, model=model)
        finally:
            self.nb_microbatches = local_count

    def train_batch_iter(
        self,
        model: nn.Module,
        pg: dist.ProcessGroup,
        batch: Iterable[MicroBatch],
        nb_microbatches: int,
        grad_accumulator: Optional[GradientAccumulator] = None,
        loss_divisor: Optional[int] = None,
    ) -> List[Dict[str, MaybeTensor]]:
        """Forward+backward ``nb_microbatches`` (>= 0) microbatches; gradients accumulate into ``param.grad``
        (or ``grad_accumulator``). ``loss_divisor`` defaults to ``nb_microbatches`` (stock nanotron)."""
        if isinstance(batch, collections.abc.Sized) and len(batch) != nb_microbatches:
            raise ValueError(f"batch has {len(batch)} microbatches, nb_microbatches={nb_microbatches}")
        if loss_divisor is not None and loss_divisor < 1:
            raise ValueError(f"loss_divisor must be >= 1, got {loss_divisor}")
        self._loss_divisor = loss_divisor
        reset_pipeline_queues()
        try:
            outputs = self._schedule(model, pg, batch, nb_microbatches, grad_accumulator)
        finally:
            self._loss_divisor = None
        wait_pipeline_sends(model)
        return outputs

    def _schedule(self, model, pg, batch, nb_microbatches, grad_accumulator) -> List[Dict[str, MaybeTensor]]:
        return super().train_batch_iter(
            model=model, pg=pg, batch=batch, nb_microbatches=nb_microbatches, grad_accumulator=grad_accumulator
        )


class AllForwardAllBackwardEngine(_GlobalLossDivisor, AllForwardAllBackwardPipelineEngine):
    """nanotron's AFAB schedule with a global loss divisor."""


class OneForwardOneBackwardEngine(_GlobalLossDivisor, OneForwardOneBackwardPipelineEngine):
    """nanotron's 1F1B schedule with a global loss divisor; AFAB when given fewer than pp-1 microbatches."""

    def __init__(self) -> None:
        super().__init__()
        self._fallback = AllForwardAllBackwardEngine()

    def _schedule(self, model, pg, batch, nb_microbatches, grad_accumulator) -> List[Dict[str, MaybeTensor]]:
        if nb_microbatches < pg.size() - 1:  # nanotron's 1F1B asserts nb_microbatches >= pp - 1
            self._fallback._loss_divisor = self._loss_divisor
            try:
                return self._fallback._schedule(model, pg, batch, nb_microbatches, grad_accumulator)
            finally:
                self._fallback._loss_divisor = None
        return super()._schedule(model, pg, batch, nb_microbatches, grad_accumulator)


RecoverEngine = Union[AllForwardAllBackwardEngine, OneForwardOneBackwardEngine]
_BY_NAME = {"afab": AllForwardAllBackwardEngine, "1f1b": OneForwardOneBackwardEngine}


def build_engine(name_or_engine: Union[str, PipelineEngine, type]) -> RecoverEngine:
    """Our engine for ``"afab"`` / ``"1f1b"`` or for a nanotron engine (instance or class, e.g. a config's
    ``parallelism.pp_engine``)."""
    if isinstance(name_or_engine, str):
        key = name_or_engine.lower()
        if key not in _BY_NAME:
            raise ValueError(f"unknown pipeline engine {name_or_engine!r}; expected one of {sorted(_BY_NAME)}")
        return _BY_NAME[key]()
    cls = name_or_engine if isinstance(name_or_engine, type) else type(name_or_engine)
    if issubclass(cls, OneForwardOneBackwardPipelineEngine):
        return OneForwardOneBackwardEngine()
    if issubclass(cls, AllForwardAllBackwardPipelineEngine):
        return AllForwardAllBackwardEngine()
    raise ValueError(f"unsupported pipeline engine {name_or_engine!r}")


def place_microbatch(
    batch: Dict[str, torch.Tensor],
    model: nn.Module,
    parallel_context: ParallelContext,
    device: Optional[torch.device] = None,
) -> MicroBatch:
    """A microbatch as this rank must feed it: ``input_ids``/``input_mask`` as tensors on the model's input stage,
    ``label_ids``/``label_mask`` on its output stage, ``TensorPointer``s elsewhere (like nanotron's dataloader).
    Tensors this rank feeds are moved to ``device`` when given."""
    pp_rank = dist.get_rank(parallel_context.pp_pg)
    placed: MicroBatch = {}
    for key, stage in (
        ("input_ids", model.input_pp_rank),
        ("input_mask", model.input_pp_rank),
        ("label_ids", model.output_pp_rank),
        ("label_mask", model.output_pp_rank),
    ):
        if pp_rank != stage:
            placed[key] = TensorPointer(group_rank=stage)
        else:
            placed[key] = batch[key] if device is None else batch[key].to(device, non_blocking=True)
    return placed


def summed_loss(outputs: List[Dict[str, MaybeTensor]]) -> Optional[torch.Tensor]:
    """Sum of the (already ``loss_divisor``-scaled) microbatch losses, or None off the output stage / with none."""
    losses = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)]
    return torch.stack(losses).sum() if losses else None
