"""The simulated job's layout: GPUs in nodes, ranks in replica slots.

Ranks fill nodes with whole replicas in order (as the launcher maps them), so replica slot ``r`` holds GPUs
``r * ranks_per_replica ... (r + 1) * ranks_per_replica - 1`` and a node loss removes every slot that touches the
node's GPUs (one or more whole replicas, or part of a replica larger than a node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Cluster"]


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of which the job uses ``slots * ranks_per_replica``; ``spare_replicas`` slots start idle."""

    gpus: int
    tp: int = 1
    pp: int = 1
    fsdp: int = 1  # ranks of an HSDP shard group (tp = pp = 1 then)
    gpus_per_node: int = 8
    spare_replicas: int = 0

    def __post_init__(self) -> None:
        if min(self.gpus, self.tp, self.pp, self.fsdp, self.gpus_per_node) < 1:
            raise ValueError("gpus, tp, pp, fsdp and gpus_per_node must be positive")
        if self.slots < 1:
            raise ValueError(f"{self.gpus} GPUs hold no replica of {self.ranks_per_replica} ranks")
        if not 0 <= self.spare_replicas < self.slots:
            raise ValueError(f"spare_replicas must be in [0, {self.slots - 1}]")

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.pp * self.fsdp

    @property
    def slots(self) -> int:
        """Replica slots the GPUs hold (training replicas + spares)."""
        return self.gpus // self.ranks_per_replica

    @property
    def replicas(self) -> int:
        """Training replicas (data-parallel size) at launch."""
        return self.slots - self.spare_replicas

    @property
    def job_gpus(self) -> int:
        return self.slots * self.ranks_per_replica

    @property
    def nodes(self) -> int:
        return math.ceil(self.job_gpus / self.gpus_per_node)

    def slot_of_gpu(self, gpu: int) -> int:
        return gpu // self.ranks_per_replica

    def slots_of_node(self, node: int) -> range:
        first = node * self.gpus_per_node
        last = min(first + self.gpus_per_node, self.job_gpus) - 1
        return range(self.slot_of_gpu(first), self.slot_of_gpu(last) + 1)

    def describe(self) -> str:
        layout = f"FSDP{self.fsdp}" if self.fsdp > 1 else f"TP{self.tp} x PP{self.pp}"
        return (f"{self.gpus} GPUs ({self.nodes} nodes of {self.gpus_per_node}), replicas of {layout} = "
                f"{self.ranks_per_replica} ranks: {self.replicas} training + {self.spare_replicas} spare")

    def with_spares(self, spare_replicas: int) -> "Cluster":
        from dataclasses import replace

        return replace(self, spare_replicas=spare_replicas)
