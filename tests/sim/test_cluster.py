import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanotron_recover.sim.cluster import Cluster


def test_layout_counts():
    c = Cluster(1000, tp=8, pp=4, spare_replicas=2)
    assert c.ranks_per_replica == 32 and c.slots == 31 and c.replicas == 29 and c.job_gpus == 992
    assert c.nodes == 124


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError):
        Cluster(8, tp=16)
    with pytest.raises(ValueError):
        Cluster(16, tp=8, spare_replicas=2)


@given(st.integers(1, 4096), st.sampled_from([1, 2, 4, 8, 16, 64]), st.sampled_from([4, 8]))
def test_a_node_loss_covers_exactly_the_slots_of_its_gpus(gpus, rpr, gpn):
    if gpus < rpr:
        return
    c = Cluster(gpus, tp=rpr, gpus_per_node=gpn)
    for node in range(c.nodes):
        gpu_slots = {c.slot_of_gpu(g) for g in range(node * gpn, min((node + 1) * gpn, c.job_gpus))}
        assert set(c.slots_of_node(node)) == gpu_slots
