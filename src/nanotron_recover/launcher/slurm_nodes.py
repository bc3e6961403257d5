"""A Slurm allocation's nodes: which of them answer, and the widest job that fits on those.

After a node is really lost (its daemons, its ranks, its ``slurmd``), a relaunch with the full launch line would
start a daemon there and fail; the scheduler's requeue would wait for a whole new allocation. The launcher asks
every node of its allocation instead, with a job step of its own (``srun --overlap -w NODE true``, bounded by
:data:`PROBE_TIMEOUT_S`: slurmctld itself marks a silent node down only after ``SlurmdTimeout``, 300 s by
default), and relaunches on the nodes that answered at the width that fits them (``--replicas R``, the global
batch kept), naming them with ``--host`` (``mpirun`` starts daemons only on the nodes its ranks are mapped to;
measured on PRRTE 3.0.14 under a Slurm allocation whose second node's ``slurmd`` was dead). While the job runs
narrower, the launcher asks the missing nodes again every :data:`REPROBE_EVERY_S`; a node that answers (it came
back before Slurm took it out of the allocation) lets the job regrow to full width.

A node Slurm marked down leaves the allocation when the job was submitted with ``--no-kill`` (without it, Slurm
ends the job); ``scontrol show job`` then no longer lists it, and it is not asked again: a Slurm allocation does
not grow back, so that job runs at the narrower width until it ends or the scheduler requeues it.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from nanotron_recover.launcher.mpirun import slurm_tasks_per_node

PROBE_TIMEOUT_S_ENV = "NANOTRON_RECOVER_NODE_PROBE_S"
PROBE_TIMEOUT_S = 10.0  # a node whose probe step did not finish in this time is out (a healthy one: ~0.05 s here)
REPROBE_EVERY_S = 10.0  # while the job runs narrower: how often the missing nodes are asked again


@dataclass(frozen=True)
class Node:
    name: str
    slots: int  # Slurm task slots (SLURM_TASKS_PER_NODE)


def fitting_replicas(slots: Sequence[int], ranks_per_replica: int, replicas: int, spares: int,
                     microbatches: int) -> int:
    """The most training replicas (at most ``replicas``) that, with the ``spares``, fill these nodes' slots in
    whole replicas per node (a replica never spans two nodes) and divide the global batch of ``microbatches``
    (``--replicas R`` keeps M: each replica's accumulation becomes M / R); 0 when not even one fits."""
    whole = sum(s // ranks_per_replica for s in slots)
    for r in range(min(replicas, whole - spares), 0, -1):
        if microbatches % r == 0:
            return r
    return 0


def host_option(nodes: Sequence[Node], ranks_per_replica: int = 1) -> str:
    """``mpirun --host`` for these nodes and their slots (``n1:2,n3:2``), each node's slots rounded down to whole
    replicas: ranks fill the slots in rank order (``--map-by slot``), so a node of 3 slots with 2 ranks a replica
    would otherwise hold half of a replica whose other half is on the next node (lost with either node)."""
    whole = [(n.name, n.slots // ranks_per_replica * ranks_per_replica) for n in nodes]
    return ",".join(f"{name}:{slots}" for name, slots in whole if slots > 0)


def whole_replica_hosts(nodes: Sequence[Node], ranks_per_replica: int, world_size: int) -> str | None:
    """``--host`` for a launch on these nodes when a node's slots are not whole replicas and the whole-replica
    slots still hold the job's ``world_size`` ranks; None when every node's slots are whole replicas already (or
    they would not hold the job: then Open MPI's placement stands, and the launcher warns)."""
    if all(n.slots % ranks_per_replica == 0 for n in nodes):
        return None
    if sum(n.slots // ranks_per_replica for n in nodes) * ranks_per_replica < world_size:
        return None
    return host_option(nodes, ranks_per_replica)


@dataclass
class Allocation:
    """This Slurm job's nodes (the batch node first, as Slurm lists it), and how to ask them."""

    job_id: str
    nodes: list[Node]
    batch_node: str
    probe_timeout_s: float = PROBE_TIMEOUT_S

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Allocation | None:
        """The allocation the launcher runs in, or None: not under Slurm, one node, or a shape it cannot read."""
        env = os.environ if environ is None else environ
        job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
        tasks = env.get("SLURM_TASKS_PER_NODE", "")
        if not job or not nodelist or not tasks:
            return None
        names = hostnames(nodelist)
        try:
            slots = slurm_tasks_per_node(tasks)
        except ValueError:
            return None
        if len(names) < 2 or len(slots) != len(names):
            return None
        timeout = float(env.get(PROBE_TIMEOUT_S_ENV) or PROBE_TIMEOUT_S)
        return cls(job, [Node(n, s) for n, s in zip(names, slots)], env.get("SLURMD_NODENAME", names[0]), timeout)

    def still_allocated(self) -> list[Node]:
        """The nodes Slurm still counts in this job (one it marked down has left a ``--no-kill`` job)."""
        try:
            out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True,
                                 timeout=self.probe_timeout_s).stdout
        except (OSError, subprocess.TimeoutExpired):
            return list(self.nodes)
        field = next((f for f in out.split() if f.startswith("NodeList=")), None)
        if field is None:
            return list(self.nodes)
        now = set(hostnames(field.split("=", 1)[1]))
        return [n for n in self.nodes if n.name in now]

    def answering(self, nodes: Sequence[Node]) -> list[Node]:
        """Those of ``nodes`` that run a job step within the probe timeout, asked all at once (the batch node,
        where the launcher itself runs, without asking)."""
        return ask_nodes(nodes, self.batch_node, self.answers)

    def answers(self, node: str) -> bool:
        cmd = ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
               "--quiet", "true"]
        try:
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=self.probe_timeout_s).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def ask_nodes(nodes: Sequence[Node], batch_node: str, answers: Callable[[str], bool]) -> list[Node]:
    """Those of ``nodes`` for which ``answers(name)`` is True, asked all at once (``batch_node``, where the launcher
    itself runs, without asking)."""
    asked = [n for n in nodes if n.name != batch_node]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(asked)))) as pool:
        said = dict(zip((n.name for n in asked), pool.map(answers, (n.name for n in asked))))
    return [n for n in nodes if n.name == batch_node or said.get(n.name)]


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list (``n[1-3],gpu7``) expanded by ``scontrol show hostnames``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.split()
