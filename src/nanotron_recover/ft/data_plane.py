"""The data plane: what carries the cross-replica gradient bytes. ULFM stays the control plane either way.

``MpiDataPlane`` reduces each bucket on the ULFM coordinate communicator itself (a zero-copy numpy view on CPU; a
host copy on GPU, since the PyPI Open MPI is not CUDA-aware and its ULFM build runs over TCP). ``TorchDataPlane``
reduces it on a torch process group that mirrors the coordinate communicator (gloo on CPU, NCCL on GPU), in place
on the device buffer. Detection, the agreed failed set, the epoch and the commit stay on ULFM in both.

The torch plane's group is built lazily, collectively by the coordinate's members, whenever the coordinate
communicator changed (first step, a repair, a spare or a formed replica joining): the coordinate's rank 0 hosts a
fresh ``TCPStore`` and sends its address over ULFM. A torch collective cannot be revoked, so a failure is handled
by *closing*: a survivor that learns of a death (the watcher's notice, an error of the collective, or the repair it
enters) first waits until its own pending collective has ended, then destroys its group. Only destroying a gloo
group closes its sockets (``abort`` and ``shutdown`` do not); a closed socket fails the peers' pending collective at
once ("connection closed by peer"), so the closes cascade and no survivor waits for the group's timeout. Waiting for
the own collective first is what keeps the in-step recovery exact: no byte of the failed reduction can land in a
bucket after its snapshot was restored. NCCL groups are aborted instead (``ncclCommAbort`` ends pending kernels).
docs/data-plane.md has the measurements.
"""

from __future__ import annotations

import datetime
import functools
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist

from nanotron_recover.run.devices import data_plane_backend, default_data_plane

if TYPE_CHECKING:
    from .world import FTWorld

LOOPBACK = "127.0.0.1"
_CLOSE_GRACE_S = 5.0  # beyond the group's own timeout, after which its pending collective has surely failed


class StagedBuckets(Protocol):
    """What a data plane needs of the flat gradient buckets (:class:`nanotron_recover.training.buckets.GradBuckets`)."""

    def view(self, i: int) -> torch.Tensor: ...

    def to_host(self, i: int) -> np.ndarray: ...

    def from_host(self, i: int) -> None: ...


class MpiDataPlane:
    """Every bucket on the ULFM coordinate communicator (the world's own ``allreduce_sum_``)."""

    name = "mpi"
    backend = "mpi"

    def __init__(self, ft: Any) -> None:
        self.ft = ft
        self.last_build: dict[str, Any] | None = None  # nothing to build

    def allreduce_sum_(self, buckets: StagedBuckets, i: int) -> None:
        self.ft.allreduce_sum_(buckets.to_host(i), "coord")
        buckets.from_host(i)

    def close(self) -> None:
        """Nothing to release: the communicators belong to the world."""


class TorchDataPlane:
    """Every bucket on a torch process group over the coordinate's members, rebuilt after every change of them.

    Args:
        ft: the fault-tolerant world (its coordinate communicator, failure notices, and repair hooks).
        device: where the gradient buckets live (``cpu``: gloo; ``cuda``: NCCL).
        timeout_s: the group's own timeout, a safety net only (a death is handled by closing, see the module doc).
    """

    name = "torch"

    def __init__(self, ft: FTWorld, device: torch.device, timeout_s: float) -> None:
        self.ft = ft
        self.device = torch.device(device)
        self.backend = data_plane_backend(self.device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group: Any = None
        self._store: Any = None  # kept with the group: on the coordinate's rank 0 it is the rendezvous server
        self._mirrors: Any = None  # the coordinate communicator the group was built for
        self._work: Any = None
        self._mpi = MpiDataPlane(ft)  # for a coordinate whose members share a GPU
        self.builds = 0
        self.last_build: dict[str, Any] | None = None  # {"ms", "members", "epoch"} of the newest group, once
        ft.before_repair.append(self.close)

    # ------------------------------------------------------------------------------------------ the reduction
    def allreduce_sum_(self, buckets: StagedBuckets, i: int) -> None:
        """SUM bucket ``i`` in place over the coordinate; raises FailureDetected as a ULFM collective would."""
        if self._current_group() is None:
            self._mpi.allreduce_sum_(buckets, i)
            return
        # no local reference to the group or its work: a failure's traceback must not keep its sockets open
        self._work = self._group.allreduce([buckets.view(i)])
        self.ft.wait_outside_mpi("torch_allreduce(coord)", self._work_done, self.close)
        self._work = None

    def _work_done(self) -> bool:
        work = self._work
        if work is None:  # the watcher's repair closed the group between the start and this wait
            raise RuntimeError("the data-plane group was closed by a repair")
        if not work.is_completed():
            return False
        try:
            work.wait()  # raises the collective's error, if it had one
        except RuntimeError as exc:
            message = str(exc)
            del work, exc  # (see allreduce_sum_)
            raise RuntimeError(message) from None
        return True

    # ----------------------------------------------------------------------------------------- group lifetime
    def _current_group(self) -> Any:
        """The group over the coordinate's current members; ``None`` when they share a GPU (NCCL refuses two
        ranks on one device: that coordinate reduces on MPI, which every member decides alike from the same
        gathered placement)."""
        comm = self.ft.coord_comm
        if self._mirrors is comm:
            return self._group
        self.close()
        t0 = time.perf_counter()
        rank, size = comm.Get_rank(), comm.Get_size()
        # a fresh TCPStore on the coordinate's rank 0 (an unused port); every member's host, GPU and that port
        master = dist.TCPStore(LOOPBACK, 0, size, is_master=True, timeout=self.timeout,
                               wait_for_workers=False) if rank == 0 else None
        me = (socket.gethostname(), self._gpu_index(), master.port if master is not None else None)
        members = self.ft.allgather_coord(me)
        gpus = [(host, gpu) for host, gpu, _ in members if gpu is not None]
        if len(set(gpus)) < len(gpus):
            self._mirrors = comm
            self.last_build = {"ms": (time.perf_counter() - t0) * 1e3, "members": size, "epoch": self.ft.epoch,
                               "fallback": "mpi: members share a GPU"}
            return None
        host, _, port = members[0]
        address = (LOOPBACK if host == me[0] else host, port)
        build = _GroupBuild(functools.partial(self._connect, address, master, rank, size))
        del master  # the build owns it now: nothing here may keep a group's resources alive after a failure
        self.ft.wait_outside_mpi("torch_group_build(coord)", build.done, build.abandon)
        self._group, self._store, self._mirrors = build.group, build.store, comm
        self.builds += 1
        self.last_build = {"ms": (time.perf_counter() - t0) * 1e3, "members": size, "epoch": self.ft.epoch}
        return self._group

    def _gpu_index(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _connect(self, address: tuple[str, int], master: Any, rank: int, size: int) -> tuple[Any, Any]:
        """The store (rank 0 hosts it, the others connect) and the group: connects to every peer."""
        store = master if master is not None else dist.TCPStore(*address, size, is_master=False, timeout=self.timeout)
        prefix = dist.PrefixStore("nanotron-recover/plane", store)  # a fresh store per group: no key is reused
        return self._new_group(prefix, rank, size), store

    def _new_group(self, store: Any, rank: int, size: int) -> Any:
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)

    def close(self) -> None:
        """Leave the group without leaving a byte in flight: end (NCCL) or wait out (gloo) the own pending
        collective, then destroy the group in the background (which closes its sockets: the peers' pending
        collectives fail at once). Idempotent; run on every survivor before a repair."""
        group, work, store = self._group, self._work, self._store
        self._group = self._work = self._store = self._mirrors = None
        if group is None:  # never built, or a coordinate that reduces on MPI (its store is None too)
            return
        if self.backend == "nccl":
            group.abort()
        if work is not None:
            _wait_until_ended(work, self.timeout.total_seconds() + _CLOSE_GRACE_S)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        del work
        reaper = threading.Thread(target=_destroy, args=([group, store],), name="data-plane-close")
        del group, store
        reaper.start()


def make_data_plane(kind: str, ft: Any, device: torch.device, timeout_s: float) -> MpiDataPlane | TorchDataPlane:
    """The plane that ``fault_tolerance.data_plane`` names (``auto``: :func:`~nanotron_recover.run.devices.
    default_data_plane`)."""
    kind = default_data_plane(torch.device(device)) if kind == "auto" else kind
    if kind == "mpi":
        return MpiDataPlane(ft)
    if kind == "torch":
        return TorchDataPlane(ft, torch.device(device), timeout_s)
    raise ValueError(f"unknown data plane {kind!r}")


class _GroupBuild:
    """A group's connect, in a thread: it may wait on a peer that just died, and the main thread must keep
    polling the world's failure notice meanwhile. Abandoned, the build hands what it made (now or later) to a
    background destroy, so that no socket of it stays open for a peer to wait on."""

    def __init__(self, connect: Callable[[], tuple[Any, Any]]) -> None:
        self._lock = threading.Lock()
        self._made: list[Any] = []
        self._error: Exception | None = None
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, args=(connect,), daemon=True, name="data-plane-build")
        self._thread.start()

    def _run(self, connect: Callable[[], tuple[Any, Any]]) -> None:
        try:
            made = list(connect())
        except Exception as exc:  # noqa: BLE001 - reported to the waiting main thread
            self._error = exc
            return
        with self._lock:
            if self._abandoned:
                _destroy(made)
            else:
                self._made = made

    def done(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._error is not None:
            raise RuntimeError(f"building the data-plane group failed: {self._error}")
        return True

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            made, self._made = self._made, []
        if made:
            threading.Thread(target=_destroy, args=(made,), name="data-plane-close").start()

    @property
    def group(self) -> Any:
        return self._made[0]

    @property
    def store(self) -> Any:
        return self._made[1]


def _wait_until_ended(work: Any, limit_s: float) -> None:
    """Until the collective has ended, either way (its peers close their groups, or its timeout fires)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            if work.is_completed():
                return
        except RuntimeError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"a data-plane collective was still running {limit_s:.0f} s after its group closed: "
                               "its result could still land in a restored bucket")
        time.sleep(1e-3)


def _destroy(objects: list[Any]) -> None:
    """The last references: the group's destructor joins its threads and closes its sockets (~0.4 s on gloo).
    Run in a thread that is not a daemon: the interpreter joins it before exiting (a daemon thread stopped
    inside the destructor at exit aborts the process: "terminate called without an active exception")."""
    objects.clear()
