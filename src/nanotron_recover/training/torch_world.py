"""The torch worlds: one per replica (ReCoVer), or one over every rank (stock nanotron).

ReCoVer layout (see :class:`nanotron_recover.ft.layout.ReplicaLayout`): world rank ``r`` belongs to replica
``r // (tp * pp)``; inside its replica it has local rank ``r % (tp * pp) = pp_rank * tp + tp_rank``. Each replica runs
its own torch default process group over only its ranks, so TP/PP traffic never touches another replica's sockets: a
failure in one replica cannot block another. The replica's rendezvous (a TCPStore on its local rank 0) is agreed over
MPI.

Stock layout (fault tolerance off): one torch world over all ranks, nanotron's own (pp, dp, tp) order.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as torch_dist

from nanotron_recover.run import devices

if TYPE_CHECKING:
    from mpi4py import MPI


def _set_torch_env(rank: int, world_size: int, host: str, port: int) -> None:
    # nanotron's ParallelContext reads RANK / WORLD_SIZE from the environment.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(devices.local_rank()),
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
    )


def rendezvous_host(host: str | None = None) -> str:
    """Address other ranks use to reach this host's TCPStore (``host``, the launch's word, wins when given)."""
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class ReplicaTorchWorld:
    """How a replica's torch world is started, at start-up and when recycled ranks form a new replica: the
    collective timeout, and the rendezvous address the launch names (None: this host's)."""

    timeout_s: float
    host: str | None = None

    def start(self, replica_comm: "MPI.Comm") -> None:
        init_replica_torch_world(replica_comm, self.timeout_s, self.host)


def init_replica_torch_world(replica_comm: "MPI.Comm", timeout_s: float, host: str | None = None) -> None:
    """Start this replica's torch default group; the rendezvous address is agreed over ``replica_comm``.

    Local rank 0 opens a TCPStore on a free port (port 0: no race for a port) and broadcasts where it is.
    """
    rank, size = replica_comm.Get_rank(), replica_comm.Get_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if rank == 0:
        host = rendezvous_host(host)
        store = torch_dist.TCPStore(host, 0, world_size=size, is_master=True, timeout=timeout, wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = replica_comm.bcast(address, root=0)
    # A member lost before the rendezvous fails this barrier on every member (ULFM), instead of leaving the others
    # in gloo's connection set-up until its timeout.
    replica_comm.Barrier()
    if store is None:
        store = torch_dist.TCPStore(host, port, world_size=size, is_master=False, timeout=timeout)
    _set_torch_env(rank, size, host, port)
    devices.set_current_device()
    torch_dist.init_process_group(
        backend=devices.torch_backend(), store=store, rank=rank, world_size=size, timeout=timeout
    )


def init_stock_torch_world(timeout_s: float) -> None:
    """Stock layout: one torch world over every rank (as torchrun would set it up).

    Rank and size come from the launcher (Open MPI or torchrun variables); MASTER_ADDR/MASTER_PORT must be set.
    """
    # Open MPI's (or torchrun's) rank and size, and torch's rendezvous address, as stock nanotron reads them
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))  # Open MPI's, torchrun's
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))  # Open MPI's, torchrun's
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # torch's rendezvous
    port = int(os.environ.get("MASTER_PORT", "29500"))  # torch's rendezvous
    _set_torch_env(rank, size, host, port)
    devices.set_current_device()
    torch_dist.init_process_group(
        backend=devices.torch_backend(),
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
