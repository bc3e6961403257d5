"""The stock nanotron data path: one torch world, nanotron's dp groups, DDP gradient sync over torch.

This is the failure-free reference every comparison uses (and the checkpoint-restart baseline): no MPI in the
step, the loss divided by the replica's own microbatch count and DDP averaging across dp -- exactly nanotron's
math. Data-parallel rank d computes the d-th contiguous chunk of the step's M global microbatches.

bf16 (``accumulate_grad_in_fp32: true``): nanotron's recipe accumulates each microbatch's bf16 gradient into fp32
buffers and averages those fp32 buffers over dp (its DDP comm hook, tied to its CUDA-only accumulator). Here the
fp32 buffers are :class:`GradBuckets` (one flat buffer) and the average is one fp32 all-reduce after the last
microbatch: the same math without DDP, which would reduce the bf16 gradients instead.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nanotron_recover.config import RecoverConfig
from nanotron_recover.nanotron_compat.fp32_accumulator import has_low_precision_params
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.process.stop_request import STOP
from nanotron_recover.run import devices
from nanotron_recover.run.exit_codes import EXIT_DONE, EXIT_NEEDS_PERSON, NeedsPerson
from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.run.run_folder import record_exit
from nanotron_recover.training.buckets import GradBuckets
from nanotron_recover.training.seam import (
    AttachedModel,
    CheckpointWriter,
    CommittedStep,
    DataParallelStrategy,
    StepServices,
)
from nanotron_recover.training.torch_world import init_stock_torch_world
from nanotron_recover.training.trainer import RecoverTrainer
from nanotron_recover.training.training_state import TrainingState
from nanotron_recover.workload.planner import plan_step


class StockDataParallel(DataParallelStrategy):
    saves_in_background = False  # stock nanotron writes its checkpoints in the step: the baseline keeps doing so

    def __init__(self, config: RecoverConfig, timeout_s: float) -> None:
        par = config.parallelism
        self.config = config
        self.parallel_context = ReplicaParallelContext(
            tensor_parallel_size=par.tp,
            pipeline_parallel_size=par.pp,
            data_parallel_size=par.dp,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        pc = self.parallel_context
        self.world_rank = dist.get_rank(pc.world_pg)
        self.dp_rank = dist.get_rank(pc.dp_pg)
        self.pp_rank = dist.get_rank(pc.pp_pg)
        self.tp_rank = dist.get_rank(pc.tp_pg)
        self.replica = self.dp_rank
        self.local_rank = self.pp_rank * par.tp + self.tp_rank
        self.per_replica = config.tokens.batch_accumulation_per_replica
        self.last_stage = self.pp_rank == par.pp - 1

    def attach_model(self, model, named_params, device) -> AttachedModel:
        wrapped = model
        self.buckets: GradBuckets | None = None
        if has_low_precision_params(named_params) and self.config.optimizer.accumulate_grad_in_fp32:
            self.buckets = GradBuckets(named_params, bucket_cap_mb=2**20, device=device, snapshot_slots=0)
        elif self.parallel_context.dp_pg.size() > 1:
            wrapped = DistributedDataParallel(
                model,
                process_group=self.parallel_context.dp_pg,
                broadcast_buffers=False,
                bucket_cap_mb=self.config.model.ddp_bucket_cap_mb,
            )
        return AttachedModel(model=wrapped, unwrapped=model, named_params=named_params)

    def forward_backward_reduce(self, step: int, services: StepServices) -> CommittedStep:
        dp = self.parallel_context.dp_pg.size()
        indices = plan_step(step, self.config.microbatches_per_step, range(dp))[self.dp_rank]  # dp_rank-th chunk
        # stock nanotron: loss / own microbatch count; DDP averages the gradient over dp in the last backward
        work = services.compute(step, indices, self.per_replica)
        if self.buckets is not None and dp > 1:
            torch_dist.all_reduce(self.buckets.flat, group=self.parallel_context.dp_pg)  # fp32 SUM, then the mean
            self.buckets.flat.div_(dp)
        contribution = work.loss_sum / dp if (self.last_stage and self.tp_rank == 0) else 0.0
        loss = torch.tensor([contribution], dtype=torch.float64, device=devices.compute_device())
        torch_dist.all_reduce(loss, group=self.parallel_context.world_pg)
        value = float(loss.item())
        return CommittedStep(loss=value, microbatches=dp * self.per_replica, live_replicas=dp,
                             nonfinite=None if math.isfinite(value) else f"the step's loss is {value}")

    def clip_grad_norm(self, state: TrainingState, max_norm: float) -> float:
        """nanotron's clipping; a non-finite norm (known to every rank: one world, no spares) ends the run before
        the optimizer steps."""
        norm = super().clip_grad_norm(state, max_norm)
        if not math.isfinite(float(norm)):
            raise NeedsPerson("non-finite step", f"the gradient norm is {float(norm)}")
        return norm

    def startup_share(self) -> tuple[int, int]:
        return torch_dist.get_rank(), torch_dist.get_world_size()

    def gather_at_startup(self, obj: Any) -> list:
        out: list = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(out, obj)
        return out

    def zero_grad(self, state: TrainingState) -> None:
        state.optimizer.zero_grad()  # with fp32 masters: the accumulator zeroes the buckets in place

    def is_logging_rank(self) -> bool:
        return self.world_rank == 0

    def save_checkpoint(self, step: int, write: CheckpointWriter, services: StepServices,
                        extra_state: dict | None = None) -> None:
        # every rank writes its part (nanotron's serialize filters dp>0 itself); rank 0 publishes
        write(True, lambda: torch_dist.barrier(), self.world_rank == 0, extra_state, torch_dist.get_world_size())


def run_stock(config: RecoverConfig, run_dir: Path, timeout_s: float, launch: LaunchContract) -> int:
    """A rank of the stock path, from its torch world to its exit record; returns its exit code."""
    STOP.uninstall()  # stock nanotron ends on a signal: the checkpoint-restart baseline keeps doing so
    init_stock_torch_world(timeout_s)
    trainer = RecoverTrainer(config, run_dir, StockDataParallel(config, timeout_s), launch)
    code, reason, extra = EXIT_DONE, "finished", {}
    try:
        trainer.train()
    except NeedsPerson as e:  # every rank alike (one world): damaged state, a non-finite step
        code, reason, extra = EXIT_NEEDS_PERSON, str(e), e.record
        trainer.metrics.close()
        if torch_dist.get_rank() == 0:
            print(f"[nanotron-recover] stopping for a person (exit {code}): {e}", file=sys.stderr, flush=True)
    torch_dist.barrier()
    record_exit(run_dir, torch_dist.get_rank(), code, reason, **extra)
    torch_dist.destroy_process_group()
    return code
