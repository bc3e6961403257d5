"""The accounting of one simulated run: :class:`SimResult` and the ideal rate its ETTR is measured against.

It lives apart from :mod:`.engine` (the event loop) so that the engine stays one concern and under the house
limit on module length (issue #39); the engine fills a :class:`SimResult`, the callers read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.params import Params
from nanotron_recover.sim.regrow import RegrowDecision

__all__ = ["SimResult", "ideal_tokens_per_gpu_s"]


@dataclass
class SimResult:
    policy: str
    cluster: Cluster
    wall_s: float
    tokens: float
    steps: float
    gpu_s_allocated: float
    process_s: float
    failures: int = 0
    node_failures: int = 0
    crashes: int = 0  # job ends that roll back to a checkpoint
    requeues: int = 0  # planned checkpoint + relaunch below min_replicas
    spares_used: int = 0
    formations: int = 0  # replicas formed from recycled ranks
    regrows: int = 0  # relaunches at full width (issue #40)
    regrow_declined: int = 0  # decisions that a relaunch would not pay ("not yet")
    decisions: list[RegrowDecision] = field(default_factory=list)  # every regrow decision, with its numbers
    stall_s: float = 0.0  # wall time the job spent not training (startup excluded)
    ideal_tokens_per_gpu_s: float = 0.0
    failure_free_tokens_per_s: float = 0.0  # this policy's own rate without failures (its checkpoints included)
    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def ettr(self) -> float:
        """Useful tokens / tokens the whole cluster could have trained failure-free in the same wall time."""
        ideal = self.cluster.gpus * self.wall_s * self.ideal_tokens_per_gpu_s
        return self.tokens / ideal if ideal else 0.0

    @property
    def tokens_per_gpu_hour(self) -> float:
        return self.tokens / (self.gpu_s_allocated / 3600.0) if self.gpu_s_allocated else 0.0

    @property
    def effective_throughput(self) -> float:
        """Tokens per live process-second (the benchmarks' effective throughput)."""
        return self.tokens / self.process_s if self.process_s else 0.0

    @property
    def tokens_lost_per_failure(self) -> float:
        """(This policy's failure-free tokens in the same wall time - useful tokens) / failures."""
        if not self.failures:
            return 0.0
        return max(0.0, self.failure_free_tokens_per_s * self.wall_s - self.tokens) / self.failures


def ideal_tokens_per_gpu_s(cluster: Cluster, p: Params) -> float:
    """Failure-free, checkpoint-free stock job with every slot training: tokens per GPU-second."""
    slots = cluster.slots
    step = p.step_s(p.accumulation, slots * cluster.ranks_per_replica, cluster.pp)
    return slots * p.accumulation * p.tokens_per_microbatch / step / cluster.job_gpus
