"""How a rank waits for its peers in a cross-replica MPI collective: inside MPI, or asleep.

Open MPI waits by polling its progress engine; with ``--oversubscribe`` it calls ``sched_yield`` between polls.
On a node with a core per rank that is the fastest way to wait. On a node that holds more ranks than it has cores
(CI's 2 cores, a laptop, several replicas sharing a host) every waiting rank keeps taking CPU time from the ranks
it waits for: measured on 2 cores with 8 one-rank replicas (``benchmarks/overhead.py --breakdown``), a 30-step
ReCoVer job waiting inside MPI made 4.4 million involuntary context switches against stock torch DDP's 31 thousand
(gloo waits asleep in the kernel), and 1.9x its system CPU; waiting asleep, 0.28 million and a 7 % shorter step.

``poll`` mode waits asleep: an ``Ibarrier`` polled with short, growing sleeps (20 us up to 1 ms) until every peer
has arrived, and only then the blocking collective itself, which then runs at full speed with everyone present.
(A nonblocking collective polled the same way would progress only at our polls: Open MPI runs no progress thread
by default, so every round of its algorithm would wait for our next test.)
The Ibarrier fails on a death or a revoke exactly as the collective would, so the failure path is unchanged. The
commit agreement is an ``Iagree``, which matches a peer's blocking ``Agree`` (measured), as a repair's entry needs.

The failure watcher's polls cost too (each wake-up runs Open MPI's progress engine, a cost per wake-up, so ten
times fewer wake-ups cost about ten times less): it polls every 25 ms with a core per rank and every 50 ms in
``poll`` mode. That delays only the early notice, which ULFM itself gives 50-120 ms after a death (a collective
notices a death by itself). At 5 ms the polls took ~3 % of a rank's CPU samples and the step was 2.5 % longer
(2 one-rank replicas on 2 cores, ``benchmarks/vs_torchft.py``'s model, 400 failure-free steps; py-spy).

``auto`` (the default, ``fault_tolerance.mpi_wait``) asks for ``poll`` when the node is oversubscribed (more ranks
on this node than cores this rank may run on), ``block`` otherwise. The mode must be the same on every rank (an
``Ibarrier`` before each collective has to meet the peers' ``Ibarrier``), so :class:`~.world.FTWorld` gathers every
rank's wish at start-up and polls if any rank asked to. docs/operations.md has the numbers.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # importing mpi4py runs MPI_Init: this module's choices are made (and tested) without it
    from mpi4py import MPI

WATCHER_POLL_S = {"block": 0.025, "poll": 0.05}  # the failure watcher's interval, by mode
FIRST_PAUSE_S = 2e-5
MAX_PAUSE_S = 1e-3


def node_oversubscribed(local_size: int | None = None, cores: int | None = None) -> bool:
    """More ranks on this node (the launcher's ``OMPI_COMM_WORLD_LOCAL_SIZE``) than cores this process may use."""
    if local_size is None:
        local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))  # Open MPI's: ranks on this node
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return local_size > cores


def resolve_mpi_wait(setting: str = "auto") -> str:
    """``block`` or ``poll`` for a ``fault_tolerance.mpi_wait`` setting."""
    if setting == "auto":
        return "poll" if node_oversubscribed() else "block"
    if setting not in ("block", "poll"):
        raise ValueError(f"mpi_wait must be auto, block or poll, got {setting!r}")
    return setting


def wait_asleep(req: MPI.Request) -> None:
    """Complete ``req`` by testing it with growing sleeps between tests (raises what ``Test`` raises)."""
    pause = FIRST_PAUSE_S
    while not req.Test():
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)


def agree_asleep(comm: MPI.Comm, value: int) -> int:
    """``comm.Agree(value)`` waited for asleep."""
    box = np.array([value], dtype=np.intc)
    wait_asleep(comm.Iagree(box))
    return int(box[0])
