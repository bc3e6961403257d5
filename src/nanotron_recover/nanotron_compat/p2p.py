"""Pipeline point-to-point that does not deadlock on gloo.

nanotron 0.4's ``P2P`` sends the two metadata messages with a *synchronous* ``dist.send`` from buffers it reuses
(``self.first_metadata`` / ``self.second_metadata``), and ``send_tensors`` waits for the data send. A gloo send
completes only once the peer has posted the matching receive. Under 1F1B two neighbouring stages send to each
other at the same moment (stage s an activation downstream, stage s+1 a gradient upstream) and each waits for the
other to receive first: deadlock (seen at PP2 in the metadata send, at PP4 in the data send).

Here every send is posted non-blocking and is NOT waited on in ``send_tensors``: metadata from freshly allocated
buffers, data from the tensor itself, each Work kept (with the tensor it reads) in ``self.in_flight`` until
``wait_sends()`` (the engines call it at the end of each batch) or until it is found complete. The receive side is
nanotron's unchanged: gloo keeps message order per (peer, tag), so receives still match sends in order.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData


class NonBlockingP2P(P2P):
    """``P2P`` whose sends never block; ``wait_sends()`` completes them."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(pg=pg, device=device)
        # (work, tensor it reads): kept alive until complete
        self.in_flight: List[Tuple[dist.Work, torch.Tensor]] = []

    def _send_meta(self, tensor: torch.Tensor, to_rank: int, tag: int) -> None:
        peer = dist.get_global_rank(group=self.pg, group_rank=to_rank)
        for meta in (
            P2PTensorMetaData.to_first_metadata(tensor=tensor, device=self.device),
            P2PTensorMetaData.to_second_metadata(tensor=tensor, device=self.device),
        ):
            self.in_flight.append((dist.isend(meta, dst=peer, group=self.pg, tag=tag), meta))

    def isend_tensors(self, tensors: List[torch.Tensor], to_rank: int, tag: int = 0) -> List[dist.Work]:
        works = super().isend_tensors(tensors=tensors, to_rank=to_rank, tag=tag)  # calls _send_meta per tensor
        self.in_flight.extend(zip(works, tensors))
        return works

    def send_tensors(self, tensors: List[torch.Tensor], to_rank: int, tag: int = 0) -> None:
        """Post the sends and return at once (nanotron waits here, which deadlocks 1F1B on gloo)."""
        self.isend_tensors(tensors=tensors, to_rank=to_rank, tag=tag)
        self.in_flight = [(w, t) for w, t in self.in_flight if not w.is_completed()]

    def wait_sends(self) -> None:
        """Block until every posted send has completed."""
        while self.in_flight:
            work, _ = self.in_flight.pop(0)
            work.wait()
