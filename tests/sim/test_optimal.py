import math

import pytest

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import simulate
from nanotron_recover.sim.optimal import interval_steps, recommend, rollback_mtbf_s, young_daly_s
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
