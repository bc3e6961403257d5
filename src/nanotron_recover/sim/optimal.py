"""Checkpoint intervals (Young/Daly) and the search behind ``plan``'s recommendations.

Young/Daly: the interval that minimises checkpoint cost + expected lost work is ``sqrt(2 * save_s * MTBF)``,
where MTBF is the mean time between the failures that *roll back to the checkpoint*: every failure for
checkpoint-restart; for ReCoVer, whose relaunches resume from node-local snapshots of the committed step, only the
loss of every copy at once (:func:`recover_interval_s`, with the cost a background save puts on the step).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.accounting import SimResult
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import simulate
from nanotron_recover.sim.params import Params

__all__ = ["young_daly_s", "interval_steps", "recover_interval_s", "rollback_mtbf_s", "Recommendation", "recommend",
           "run_policies"]


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """The optimal compute time between checkpoints, first order (Young 1974; Daly 2006)."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError("save_s must be >= 0 and mtbf_s > 0")
    return math.sqrt(2.0 * save_s * mtbf_s)


def rollback_mtbf_s(cluster: Cluster, p: Params, in_place: bool) -> float:
    mtbf = p.mttf_hours(cluster.job_gpus) * 3600.0
    return mtbf / max(p.node_fraction, 1e-9) if in_place else mtbf


def recover_interval_s(p: Params) -> float:
    """ReCoVer's disk-checkpoint cadence, from what a relaunch reads. With node-local snapshots a relaunch resumes
    from the committed step whenever one copy of it survives (a process or a node lost, a requeue), so the disk
    checkpoint guards only against losing every copy at once (``all_snapshots_lost_hours``): Young/Daly on that
    MTBF with what a save costs the step (``ckpt_stall_s``: the host copy of a background save), at least
    ``ckpt_min_interval_s`` and one save's write (the next save never waits for the one in flight), at most
    ``ckpt_max_interval_hours``."""
    tau = young_daly_s(p.ckpt_stall_s(True), p.all_snapshots_lost_hours * 3600.0)
    return min(max(tau, p.ckpt_min_interval_s, p.ckpt_save_s()), p.ckpt_max_interval_hours * 3600.0)


def interval_steps(cluster: Cluster, p: Params, in_place: bool, recover_path: bool = False) -> int:
    """The checkpoint interval in whole steps (at least 1): ReCoVer's cadence rule (:func:`recover_interval_s`),
    else Young/Daly on the failures that roll back."""
    step = p.step_s(p.accumulation, cluster.slots * cluster.ranks_per_replica, cluster.pp, recover=recover_path)
    if recover_path:
        tau = recover_interval_s(p)
    else:
        tau = young_daly_s(p.ckpt_save_s(), rollback_mtbf_s(cluster, p, in_place))
    return max(1, round(tau / step))


def mean_result(results: Sequence[SimResult]) -> dict[str, float]:
    return {
        "ettr": statistics.fmean(r.ettr for r in results),
        "tokens_per_gpu_hour": statistics.fmean(r.tokens_per_gpu_hour for r in results),
        "tokens_lost_per_failure": statistics.fmean(r.tokens_lost_per_failure for r in results),
        "failures": statistics.fmean(r.failures for r in results),
        "crashes": statistics.fmean(r.crashes for r in results),
        "requeues": statistics.fmean(r.requeues for r in results),
        "ettr_min": min(r.ettr for r in results),
        "ettr_max": max(r.ettr for r in results),
    }


def run_policies(cluster: Cluster, p: Params, policies: Sequence[P.Policy], horizon_s: float,
                 seeds: Sequence[int]) -> dict[str, dict[str, float]]:
    """Each policy over the same seeds (the same failure draws where the policies see the same hardware)."""
    return {pol.name: mean_result([simulate(cluster, pol, p, horizon_s=horizon_s, seed=s) for s in seeds])
            for pol in policies}


@dataclass(frozen=True)
class Recommendation:
    spare_replicas: int
    min_replicas: int
    checkpoint_interval: int  # for ReCoVer (its cadence rule: recover_interval_s)
    ckpt_restart_interval: int  # for the stock path
    ettr: float
    shrinking_interval: int = 1  # shrinking batch (no snapshots: Young/Daly on the node losses that roll it back)


def _candidates(replicas: int) -> tuple[list[int], list[int]]:
    spares = sorted({s for s in (0, 1, 2, 4, 8, 16, 32, 64) if s <= max(0, replicas // 4)})
    fracs = (1.0, 0.99, 0.97, 0.95, 0.9, 0.75, 0.5)
    mins = sorted({max(1, min(replicas, math.floor(f * replicas))) for f in fracs} | {1})
    return spares, mins


def recommend(cluster: Cluster, p: Params, horizon_s: float, seeds: Sequence[int] = (0, 1),
              spares: Sequence[int] | None = None) -> Recommendation:
    """Search spare_replicas x min_replicas for ReCoVer (as coded) at its Young/Daly interval; best mean ETTR.

    ``min_replicas`` is a count of *training* replicas left (spares excluded), as the config's field."""
    slots = cluster.slots
    k_rec = interval_steps(cluster, p, in_place=True, recover_path=True)
    k_ckpt = interval_steps(cluster, p, in_place=False)
    k_shrink = interval_steps(cluster, p, in_place=True)
    best: Recommendation | None = None
    spares_c = list(spares) if spares is not None else _candidates(slots)[0]
    for n_spares in spares_c:
        train = slots - n_spares
        if train < 1:
            continue
        _, mins = _candidates(train)
        for mn in mins:
            pol = P.recover_spares(k_rec, n_spares, mn)
            e = statistics.fmean(simulate(cluster, pol, p, horizon_s=horizon_s, seed=s).ettr for s in seeds)
            if best is None or e > best.ettr + 1e-12:
                best = Recommendation(n_spares, mn, k_rec, k_ckpt, e, k_shrink)
    assert best is not None
    return best
