"""ReCoVer's data-parallel path for HSDP replicas (each replica = one FSDP shard group of F ranks).

Only what differs from :class:`~nanotron_recover.recovery.resilient.ResilientDataParallel` is here: the replica's
nanotron context (dp = F inside it), the sharding of the model, the row split, the loss scaling 1/(M F), the clip
of a sharded gradient and the checkpoint layout. bf16: FSDP2's mixed precision (fp32 sharded parameters = masters,
bf16 gathered parameters for compute, gradients reduce-scattered in fp32 into the same fp32 buckets). Planning, buckets,
snapshots, recovery, spares (state copied shard by shard: coordinate = shard index) and the commit are inherited
unchanged.
"""

from __future__ import annotations

import datetime

import torch

from nanotron_recover.config import RecoverConfig
from nanotron_recover.hsdp.checkpoint import ShardedLayout
from nanotron_recover.hsdp.sharding import local_rows, shard_replica_model
from nanotron_recover.nanotron_compat.parallel_context import ReplicaParallelContext
from nanotron_recover.recovery.resilient import ResilientDataParallel
from nanotron_recover.training.seam import AttachedModel
from nanotron_recover.training.training_state import TrainingState


class ShardedReplicaDataParallel(ResilientDataParallel):
    def __init__(self, config: RecoverConfig, timeout_s: float, end_job, **injected) -> None:
        super().__init__(config, timeout_s, end_job, **injected)
        self.shard_size = config.fault_tolerance.fsdp_shard_size
        self.loss_divisor = self.M * self.shard_size  # each rank's loss covers 1/F of a microbatch's rows

    def _replica_parallel_context(self, timeout: datetime.timedelta) -> ReplicaParallelContext:
        """Inside the replica nanotron sees dp = F (its dp group is the shard group), tp = pp = 1."""
        shards = self.config.fault_tolerance.fsdp_shard_size
        return ReplicaParallelContext(1, 1, data_parallel_size=shards, timeout=timeout)

    def _reports_loss(self) -> bool:
        return True  # every shard computes the loss of its own rows

    def parameter_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """fp32: the sharded parameters are the optimizer's masters; FSDP2 gathers them in ``compute_dtype``."""
        return torch.float32

    def attach_model(self, model, named_params, device) -> AttachedModel:
        """Shard the freshly initialised model (every replica holds the same full weights before), then lay the
        gradient shards into the flat buckets."""
        shard_replica_model(model, self.parallel_context.dp_pg, compute_dtype=self.config.model.dtype)
        sharded = list(model.named_parameters())  # now the sharded DTensor parameters
        return super().attach_model(model, sharded, device)

    def local_rows(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return local_rows(microbatch, self.local_rank, self.shard_size)

    def clip_grad_norm(self, state: TrainingState, max_norm: float) -> float:
        return self.buckets.clip_norm_(max_norm, self.parallel_context.dp_pg)

    def sync_tied_gradients(self, state: TrainingState) -> None:
        """Nothing is tied across ranks: tp = pp = 1 and tied embeddings are rejected by the config."""

    def checkpoint_layout(self) -> ShardedLayout:
        return ShardedLayout(shard=self.local_rank, num_shards=self.shard_size)
