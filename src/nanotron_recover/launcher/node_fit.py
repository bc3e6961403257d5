"""Each relaunch fitted to the nodes that answer (a Slurm allocation's, or a hostfile's); a job run narrower learns
when a node is back.

The relauncher asks :class:`NodeFit` for the launch line before every relaunch in place: the full one when every
node of the allocation answers, else one for the nodes that do (``--replicas R --host ...``, the global batch
kept, :mod:`nanotron_recover.launcher.slurm_nodes`), or none when fewer than ``min_replicas`` fit (the job then
exits 3 and the scheduler requeues it on a new allocation). While a job runs narrower, :meth:`NodeFit.back_now`
asks the missing nodes again in the background; the launcher then tells the ranks, which regrow at a step boundary
when it pays (:mod:`nanotron_recover.recovery.regrow`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Union

from nanotron_recover.launcher.hostfile_nodes import HostfileNodes
from nanotron_recover.launcher.slurm_nodes import REPROBE_EVERY_S, Allocation, Node, fitting_replicas, host_option

Nodes = Union[Allocation, HostfileNodes]  # a Slurm allocation's nodes (asked with srun) or a hostfile's (with ssh)

Say = Callable[[str], None]


@dataclass
class NodeFit:
    """The job's shape on the allocation (``replicas`` training replicas of ``ranks_per_replica`` ranks, plus
    ``spares``, M = ``microbatches``) and how to launch it narrower (``reshape(R, hosts)``)."""

    allocation: Nodes
    ranks_per_replica: int
    replicas: int
    spares: int
    microbatches: int
    min_replicas: int
    full_cmd: list[str]
    reshape: Callable[[int, str], list[str]]
    out: tuple[str, ...] = ()  # the nodes the running launch leaves out
    _asked_at: float = 0.0
    _asking: threading.Thread | None = None
    _back: list[str] = field(default_factory=list)
    _said_back: bool = False

    def fit(self, say: Say) -> tuple[list[str], int] | None:
        """(launch line, replicas) for the nodes that answer now, or None when too few replicas fit on them."""
        healthy = self.allocation.answering(self.allocation.still_allocated())
        names = {n.name for n in healthy}
        out = tuple(n.name for n in self.allocation.nodes if n.name not in names)
        self._asked_at, self._said_back = time.monotonic(), False
        if not out:
            if self.out:
                say(f"node(s) {', '.join(self.out)} answer again: back to {self.replicas} replicas on all "
                    f"{len(self.allocation.nodes)} nodes")
            self.out = ()
            return self.full_cmd, self.replicas
        fits = self._replicas_on(healthy)
        how = "run a job step" if isinstance(self.allocation, Allocation) else "answer over ssh"
        why = f"node(s) {', '.join(out)} did not {how} within {self.allocation.probe_timeout_s:g} s"
        if fits < max(1, self.min_replicas):
            say(f"{why}; {fits} replica(s) fit on the others, fewer than min_replicas {self.min_replicas}: the "
                "scheduler's turn (exit 3)")
            return None
        if out != self.out:
            say(f"{why}: relaunching on {', '.join(n.name for n in healthy)} with {fits} of {self.replicas} "
                "replicas (the same global batch)")
        self.out = out
        return self.reshape(fits, host_option(healthy, self.ranks_per_replica)), fits

    def back_now(self, say: Say) -> bool:
        """While the job runs narrower: True once a missing node answers again and the job would be wider with it.
        Never blocks: the nodes are asked in a background thread, every :data:`REPROBE_EVERY_S`."""
        if self._asking is not None and not self._asking.is_alive():
            self._asking = None
            if self._back and not self._said_back:
                say(f"node(s) {', '.join(self._back)} answer again: the job may regrow at a step boundary")
                self._said_back = True
        if self._said_back:
            return True
        if self._asking is None and time.monotonic() - self._asked_at >= REPROBE_EVERY_S:
            self._asked_at = time.monotonic()
            self._asking = threading.Thread(target=self._ask_missing, name="nodes-back", daemon=True)
            self._asking.start()
        return False

    def _ask_missing(self) -> None:
        allocated = self.allocation.still_allocated()
        missing = [n for n in allocated if n.name in self.out]
        back = self.allocation.answering(missing) if missing else []
        healthy = [n for n in allocated if n.name not in self.out] + back
        wider = self._replicas_on(healthy) > self._replicas_on([n for n in allocated if n.name not in self.out])
        self._back = [n.name for n in back] if wider else []

    def _replicas_on(self, nodes: list[Node]) -> int:
        return fitting_replicas([n.slots for n in nodes], self.ranks_per_replica, self.replicas, self.spares,
                                self.microbatches)
