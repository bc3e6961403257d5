import math

import pytest

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import simulate
from nanotron_recover.sim.optimal import interval_steps, recommend, recover_interval_s, rollback_mtbf_s, young_daly_s
from nanotron_recover.sim.params import Params


def test_young_daly():
    assert young_daly_s(10.0, 3600.0) == pytest.approx(math.sqrt(72000.0))
    with pytest.raises(ValueError):
        young_daly_s(1.0, 0.0)


def test_recover_rolls_back_only_on_node_losses():
    c, p = Cluster(1024, tp=8), Params(node_fraction=0.25)
    assert rollback_mtbf_s(c, p, in_place=True) == pytest.approx(4 * rollback_mtbf_s(c, p, in_place=False))
    assert interval_steps(c, p, in_place=True) > interval_steps(c, p, in_place=False) >= 1


def test_the_young_daly_interval_is_near_the_simulated_optimum():
    c = Cluster(4096, tp=8, pp=4)
    p = Params(ckpt_fixed_s=60.0, state_gb_per_rank=0.0)
    k = interval_steps(c, p, in_place=False)

    def ettr(interval):
        return sum(simulate(c, P.ckpt_restart(interval), p, horizon_s=20 * 86400.0, seed=s).ettr
                   for s in range(3)) / 3

    at = ettr(k)
    assert at >= ettr(max(1, k // 4)) - 0.005 and at >= ettr(k * 4) - 0.005


def test_recommendation_is_at_least_as_good_as_the_defaults():
    c, p = Cluster(2048, tp=8, pp=4), Params()
    rec = recommend(c, p, horizon_s=5 * 86400.0, seeds=(0,))
    default = simulate(c, P.recover_spares(rec.checkpoint_interval, 0, 1), p, horizon_s=5 * 86400.0, seed=0).ettr
    assert rec.ettr >= default - 1e-12
    assert 0 <= rec.spare_replicas < c.slots and 1 <= rec.min_replicas <= c.slots - rec.spare_replicas


def test_a_background_save_stalls_recover_only_for_its_host_copy():
    p = Params(state_gb_per_rank=10.0, host_copy_gb_per_s=20.0, ckpt_fixed_s=5.0, storage_gb_per_s=2.0)
    assert p.ckpt_stall_s(True) == pytest.approx(0.5)
    assert p.ckpt_stall_s(False) == pytest.approx(p.ckpt_save_s()) == pytest.approx(10.0)  # stock writes in the step
    assert Params(ckpt_async=False).ckpt_stall_s(True) == pytest.approx(Params().ckpt_save_s())


def test_recover_checkpoints_guard_only_against_losing_every_snapshot_at_once():
    p = Params(state_gb_per_rank=10.0, host_copy_gb_per_s=20.0, all_snapshots_lost_hours=168.0)
    assert recover_interval_s(p) == pytest.approx(young_daly_s(0.5, 168 * 3600.0))
    capped = p.with_(ckpt_async=False, all_snapshots_lost_hours=10_000.0)  # long MTBF, slow saves: the cap decides
    assert recover_interval_s(capped) == pytest.approx(capped.ckpt_max_interval_hours * 3600.0)
    cheap = p.with_(state_gb_per_rank=0.0, ckpt_fixed_s=0.01)  # a save that costs nothing: the floor decides
    assert recover_interval_s(cheap) == pytest.approx(cheap.ckpt_min_interval_s)
    slow = p.with_(ckpt_fixed_s=1000.0)  # a write longer than the interval: the next save would wait for it
    assert recover_interval_s(slow) == pytest.approx(slow.ckpt_save_s())
    c = Cluster(8192, tp=8, pp=4)
    step = p.step_s(p.accumulation, c.slots * c.ranks_per_replica, c.pp, recover=True)
    assert interval_steps(c, p, in_place=True, recover_path=True) == max(1, round(recover_interval_s(p) / step))
    # independent of the job's failure rate: node losses resume from snapshots
    assert interval_steps(c, p.with_(job_mttf_hours=0.1), True, True) == interval_steps(c, p, True, True)
