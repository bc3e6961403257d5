"""A nanotron ``ParallelContext`` over a torch default process group that the caller already created.

nanotron 0.4's ``ParallelContext.__init__`` (a) calls ``torch.cuda.set_device``, (b) asserts ``backend == "nccl"``,
(c) would itself initialise torch distributed (CUDA only), and (d) creates every group through
``nanotron.distributed.new_group`` whose default timeout is 10 minutes, so a dead peer blocks survivors for 10 min.
This subclass keeps nanotron's layout code (``_init_parallel_groups``: the (ep, pp, dp, tp) rank matrix) and
replaces only those four points. It serves both layouts of the project:

* ReCoVer: one replica = one torch world, ``data_parallel_size=1``;
* stock nanotron: all replicas in one torch world, ``data_parallel_size > 1``.

The caller must have run ``torch.distributed.init_process_group(backend=devices.torch_backend(), timeout=short)``
with the ``RANK`` / ``WORLD_SIZE`` env vars set to the values of that torch world (nanotron's group code reads them).
"""

from __future__ import annotations

import datetime
import os
from typing import Iterable, Sequence, Tuple

import numpy as np
import torch.distributed as torch_dist
from nanotron import distributed as dist
from nanotron.parallel.context import ParallelContext

from nanotron_recover.run import devices

DEFAULT_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def clear_nanotron_rank_caches() -> None:
    """nanotron caches ``get_rank(group)`` / ``get_global_rank(group, r)`` keyed by group object: after groups are
    rebuilt, stale entries keep old groups alive (their gloo sockets stay open) and can return stale ranks."""
    dist.get_rank.cache_clear()
    dist.get_global_rank.cache_clear()


def _check_env_matches_torch_world() -> Tuple[int, int]:
    if not torch_dist.is_initialized():
        raise RuntimeError(
            "ReplicaParallelContext needs an initialised torch default process group: call "
            "torch.distributed.init_process_group(backend=devices.torch_backend(), timeout=...) first"
        )
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")  # torch's, which nanotron reads
    if env_rank is None or env_world is None or (int(env_rank), int(env_world)) != (rank, world):
        raise RuntimeError(
            f"RANK/WORLD_SIZE env ({env_rank}/{env_world}) must equal the torch world ({rank}/{world}): "
            "nanotron's group construction reads them"
        )
    return rank, world


class ReplicaParallelContext(ParallelContext):
    """nanotron ParallelContext on an existing default group (gloo or NCCL), every group with a short timeout."""

    def __init__(
        self,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        data_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        timeout: datetime.timedelta = DEFAULT_GROUP_TIMEOUT,
    ) -> None:
        # nanotron's __init__ is not called: it builds world_pg with a 10 min timeout before we could intervene.
        _, world_size = _check_env_matches_torch_world()
        per_replica = tensor_parallel_size * pipeline_parallel_size * expert_parallel_size
        if per_replica * data_parallel_size != world_size:
            raise ValueError(
                f"tp*pp*ep*dp = {tensor_parallel_size}*{pipeline_parallel_size}*{expert_parallel_size}"
                f"*{data_parallel_size} != torch world size {world_size}"
            )
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.data_parallel_size = data_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.timeout = timeout
        self._groups = {}
        clear_nanotron_rank_caches()
        self.set_device()
        self.world_pg = self.new_group(range(world_size))
        self._init_parallel_groups()  # nanotron's layout; calls our create_new_group

    def new_group(self, ranks: Iterable[int]) -> dist.ProcessGroup:
        """A torch group (default backend) with this context's timeout; every rank of the world must call it."""
        return dist.new_group(ranks=list(int(r) for r in ranks), timeout=self.timeout)

    def create_new_group(self, all_groups_ranks: np.ndarray) -> dist.ProcessGroup:
        """Same contract as nanotron's (all ranks create all groups, deduplicated by sorted ranks), plus timeout."""
        torch_dist.barrier()
        rank = torch_dist.get_rank()
        mine = None
        for group_ranks in all_groups_ranks:
            key = tuple(sorted(int(r) for r in group_ranks))
            if key not in self.world_ranks_to_pg:
                self.world_ranks_to_pg[key] = self.new_group(group_ranks)
            if rank in key:
                mine = self.world_ranks_to_pg[key]
        torch_dist.barrier()
        return mine

    def ensure_group(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The group over ``ranks`` (created if missing, e.g. for tied weights); collective over the world."""
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self.world_ranks_to_pg:
            self.world_ranks_to_pg[key] = self.new_group(key)
        return self.world_ranks_to_pg[key]

    def set_device(self) -> None:
        """nanotron calls ``torch.cuda.set_device``; the project's device choice lives in devices.py."""
        devices.set_current_device()

    def release_groups(self) -> None:
        """Drop every reference this context holds to torch groups (frees gloo sockets), without any collective:
        safe when a peer is dead. The context is unusable afterwards."""
        for attr in ("world_pg", "tp_pg", "dp_pg", "pp_pg", "expert_pg", "mp_pg"):
            if hasattr(self, attr):
                setattr(self, attr, None)
        self.world_ranks_to_pg = {}
        clear_nanotron_rank_caches()

    def destroy(self) -> None:
        """Unlike nanotron's (barrier first), never blocks on peers: releases groups, then the default group."""
        self.release_groups()
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
