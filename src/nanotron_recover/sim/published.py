"""Published scenarios fed to the simulator: FT-HSDP at ~100K GPUs (arXiv 2602.00277).

FT-HSDP reports, at O(100K) GPUs, an effective training time of 44% for fully synchronous training with
checkpoint-restart (about 10 minutes of stall per failure) and 80% with their replica-level fault tolerance (3
minutes of stall; the failed replica restarts and catches up while the others train). What we feed:

* 100,000 GPUs in nodes of 8, HSDP replicas of 128 GPUs (781 replicas);
* failures at the job MTTF of arXiv 2410.21680's anchors, log-log interpolated to 100,000 GPUs (~18 min);
* checkpoint-restart: the whole 10 min is the stall (teardown + restart; checkpoints every step at no cost, so
  the lost work is half a step): FT-HSDP's number is the whole recovery;
* replica-level FT: 3 min stall for everybody per failure, the failed replica back after ``replica_back_s``
  (10 min: a restart of one replica) with the batch shrinking meanwhile (as torchft / FT-HSDP do);
* every failure costs its full stall (``failure_during_stall = "queue"``), our reading of their 44% = 1 - 10/18.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import simulate
from nanotron_recover.sim.params import Params

__all__ = ["FTHSDP", "ft_hsdp_scenario"]


@dataclass(frozen=True)
class FTHSDP:
    gpus: int = 100_000
    replica_gpus: int = 128
    sync_stall_s: float = 600.0
    ft_stall_s: float = 180.0
    replica_back_s: float = 600.0
    step_s: float = 10.0
    published_sync: float = 0.44
    published_ft: float = 0.80


def ft_hsdp_scenario(s: FTHSDP = FTHSDP(), *, days: float = 14.0, seeds: tuple[int, ...] = (0, 1, 2),
                     failure_during_stall: str = "queue") -> dict[str, float]:
    """Mean ETTR of both policies over ``seeds`` (and the MTTF used, hours)."""
    cluster = Cluster(s.gpus, fsdp=s.replica_gpus)
    src = "FT-HSDP (arXiv 2602.00277) scenario"
    p = Params().with_(src, mb_s=(s.step_s - 0.0) / 4, base_s=0.0, accumulation=4, hang_fraction=0.0,
                       node_fraction=0.2, teardown_s=0.0, restart_fixed_s=s.sync_stall_s, restart_per_node_s=0.0,
                       ckpt_fixed_s=0.0, state_gb_per_rank=0.0, detect_s=s.ft_stall_s, repair_s=0.0,
                       rejoin_s=s.replica_back_s, failure_during_stall=failure_during_stall)
    sync = P.ckpt_restart(1)
    ft = P.shrinking(None, 1).with_(name="replica_ft")
    horizon = days * 86400.0
    out = {"mttf_hours": p.mttf_hours(cluster.job_gpus)}
    for pol in (sync, ft):
        runs = [simulate(cluster, pol, p, horizon_s=horizon, seed=k) for k in seeds]
        out[pol.name] = sum(r.ettr for r in runs) / len(runs)
    return out
