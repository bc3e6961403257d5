"""Relaunches fitted to the nodes that answer (pure parts): how many replicas fit, the launch line chosen, and
when a job run narrower hears that a node is back. The probe itself (a Slurm job step) runs for real in
``tests/slurm/test_sbatch_nodes.py``; here the allocation's answers are given."""

from __future__ import annotations

import pytest

from nanotron_recover.launcher.node_fit import NodeFit
from nanotron_recover.launcher.slurm_nodes import Allocation, Node, fitting_replicas, host_option, whole_replica_hosts


@pytest.mark.parametrize(("slots", "rpr", "replicas", "spares", "m", "want"), [
    ([2, 2], 2, 2, 0, 4, 2),  # every node answers: full width
    ([2], 2, 2, 0, 4, 1),  # one node of two: half
    ([4, 3], 2, 4, 0, 8, 2),  # 3 slots hold one replica of 2 (no replica spans nodes): 3 fit, 3 does not divide 8
    ([4, 4], 2, 4, 1, 8, 2),  # a spare takes a replica's slots: 3 fit, M = 8 -> 2
    ([1, 1], 2, 2, 0, 4, 0),  # no node holds a whole replica
    ([8, 8, 8], 2, 6, 0, 12, 6),  # never wider than the job
])
def test_fitting_replicas(slots, rpr, replicas, spares, m, want):
    assert fitting_replicas(slots, rpr, replicas, spares, m) == want


def test_host_option_names_each_node_with_its_slots():
    assert host_option([Node("n1", 2), Node("n3", 4)]) == "n1:2,n3:4"


def test_host_option_gives_each_node_whole_replicas_only():
    """Ranks fill slots in rank order: 3 slots with 2 ranks a replica would put half of replica 1 on the next node."""
    assert host_option([Node("n1", 3), Node("n2", 4), Node("n3", 1)], ranks_per_replica=2) == "n1:2,n2:4"


@pytest.mark.parametrize(("slots", "world", "want"), [
    ([4, 4], 8, None),  # whole replicas already: the allocation's own placement
    ([3, 5], 6, "n1:2,n2:4"),  # 3 + 5 slots, 6 ranks of replicas of 2: rounded down, still holding the job
    ([3, 5], 8, None),  # rounded down they hold 6 of 8: Open MPI places it (and the launcher warns)
])
def test_a_first_launch_names_whole_replica_slots_where_the_allocation_has_odd_ones(slots, world, want):
    nodes = [Node(f"n{i + 1}", n) for i, n in enumerate(slots)]
    assert whole_replica_hosts(nodes, 2, world) == want


class GivenAnswers(Allocation):
    """An allocation whose nodes answer as the test says (no Slurm here)."""

    alive: set[str]

    def still_allocated(self) -> list[Node]:
        return list(self.nodes)

    def answers(self, node: str) -> bool:
        return node in self.alive


def _fit(alive: set[str], min_replicas: int = 1) -> tuple[NodeFit, list[str]]:
    allocation = GivenAnswers("7", [Node("n1", 2), Node("n2", 2), Node("n3", 2)], batch_node="n1")
    allocation.alive = alive
    said: list[str] = []
    fit = NodeFit(allocation, ranks_per_replica=2, replicas=3, spares=0, microbatches=6, min_replicas=min_replicas,
                  full_cmd=["mpirun", "-n", "6", "train"],
                  reshape=lambda r, hosts: ["mpirun", "--host", hosts, "-n", str(2 * r), "train", "--replicas", str(r)])
    return fit, said


def test_a_node_that_does_not_answer_is_left_out_and_comes_back_with_the_full_line():
    fit, said = _fit({"n3"})  # n1 is the batch node: never asked
    assert fit.fit(said.append) == (["mpirun", "--host", "n1:2,n3:2", "-n", "4", "train", "--replicas", "2"], 2)
    assert fit.out == ("n2",) and "n2 did not run a job step" in said[-1]
    fit.allocation.alive = {"n2", "n3"}
    assert fit.fit(said.append) == (["mpirun", "-n", "6", "train"], 3)
    assert fit.out == () and "back to 3 replicas" in said[-1]


def test_too_few_replicas_on_the_nodes_that_answer_is_the_schedulers_turn():
    fit, said = _fit(set(), min_replicas=2)
    assert fit.fit(said.append) is None and "fewer than min_replicas 2" in said[-1]


def test_a_job_run_narrower_hears_a_node_is_back_without_blocking(monkeypatch):
    monkeypatch.setattr("nanotron_recover.launcher.node_fit.REPROBE_EVERY_S", 0.0)
    fit, said = _fit({"n3"})
    fit.fit(said.append)
    assert not fit.back_now(said.append)  # the missing node is asked in the background
    fit._asking.join(timeout=10)
    assert not fit.back_now(said.append)  # it did not answer (and is asked again)
    fit.allocation.alive = {"n2", "n3"}
    for _ in range(3):  # the round under way may have asked before it came back
        if fit._asking is not None:
            fit._asking.join(timeout=10)
        if fit.back_now(said.append):
            break
    assert fit.back_now(said.append) and "n2 answer again" in said[-1]
    assert fit.back_now(said.append)  # until the next relaunch
