"""The guarded collectives of :class:`~.world.FTWorld`: every MPI operation either completes or raises
:class:`FailureDetected` on every survivor, after a revoke so that no peer stays blocked.

An object the world holds (``ft.collectives``), apart from :mod:`.world` (start-up, the repair, the watcher's
notices, shutdown). It owns what the guard keeps between operations: the operation lock (the watcher never repairs
while the main thread is inside MPI), the first error's cause and time (kept in the next repair's event), and
whether the last commit Agree already matched a peer's repair. What it reads of the world (the communicators,
``live_ranks``, ``assignment``, ``active_replicas``, ``epoch``, ``evicted``, the watcher, the main thread's
progress, the wait mode) it reads through ``world``, the one world it serves.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal

import numpy as np
from mpi4py import MPI

from .errors import FailureDetected, error_class
from .layout import try_revoke
from .repair import HEALTHY_BIT
from .waiting import agree_asleep, wait_asleep

CommName = Literal["coord", "world"]


class Collectives:
    """FTWorld's collectives over the world / coordinate communicators, and the guard every one runs under."""

    def __init__(self, world: Any) -> None:
        """``world``: the :class:`~.world.FTWorld` that holds this object (its state is read through it)."""
        self.world = world
        # Held by whichever thread is inside MPI on world/coord comms (a guarded collective or a repair), so the
        # watcher never runs a repair concurrently with a main-thread collective on the same communicator.
        self.op_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.error_time: float | None = None  # when this rank first met the failure the next repair is for
        self.commit_agree_failed = False  # our last Agree already matched the peers' repair-entry Agree
        self.cause: dict | None = None  # what made this rank enter the next repair (kept in the event)

    # ------------------------------------------------------------ collectives
    def allreduce_sum_(self, buf: np.ndarray, comm: CommName = "coord") -> np.ndarray:
        """In-place SUM over ``comm`` (zero-copy: pass a numpy view of a torch CPU fp32 tensor)."""
        self.check_buffer(buf)
        c = self.comm(comm)
        with self.guard(f"allreduce({comm})", c):
            self.arrive(c)
            c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    def bcast_(self, buf: np.ndarray, root_replica: int, comm: CommName = "coord") -> np.ndarray:
        """In-place broadcast from ``root_replica`` (on ``world``: from its local rank 0)."""
        self.check_buffer(buf)
        c = self.comm(comm)
        if comm == "coord":
            root = self.world.active_replicas.index(root_replica)
        else:
            root = self.world.live_ranks.index(self.world.assignment.world_rank(root_replica, 0))
        with self.guard(f"bcast({comm})", c):
            self.arrive(c)
            c.Bcast(buf, root=root)
        return buf

    def allgather_coord(self, obj) -> list:
        """Every member's ``obj`` (picklable, small) over my coordinate, in coordinate-communicator rank order."""
        c = self.comm("coord")
        with self.guard("allgather(coord)", c):
            self.arrive(c)
            return c.allgather(obj)

    def allgather_object(self, obj):
        """Every live rank's ``obj`` (picklable, small), in live-rank order."""
        c = self.comm("world")
        with self.guard("allgather", c):
            self.arrive(c)
            return c.allgather(obj)

    def exchange_bytes(self, sends: dict[int, bytes], recv_from: int | None, recv_size: int = 0) -> bytearray | None:
        """Point to point over the world: send ``sends[dest]`` to each world rank ``dest`` and receive
        ``recv_size`` bytes from world rank ``recv_from`` (if any). Sends are posted first: no ordering deadlock."""
        c = self.comm("world")
        index = {rank: i for i, rank in enumerate(self.world.live_ranks)}
        received = bytearray(recv_size) if recv_from is not None else None
        with self.guard("exchange_bytes", c):
            requests = [c.Isend(data, dest=index[dest], tag=71) for dest, data in sends.items()]
            if recv_from is not None:
                c.Recv(received, source=index[recv_from], tag=71)
            MPI.Request.Waitall(requests)
        return received

    def barrier(self) -> None:
        c = self.comm("world")
        with self.guard("barrier", c):
            self.barrier_on(c)

    def agree(self, flag: bool = True, epoch: int | None = None) -> bool:
        """The commit point: uniform AND of ``flag`` over all live ranks.

        Raises FailureDetected (on every survivor alike) if a rank of the world died since the last repair or a
        peer already entered :meth:`repair`: then the step's collective results must be thrown away.
        Agree is the one operation that Revoke does not interrupt; ``repair`` starts with a matching Agree.
        ``epoch``: the epoch the caller's work began in. If the watcher repaired since (a replica-mate died while
        the main thread was outside MPI, e.g. building a model), the peers have already matched this Agree with
        that repair: it raises FailureDetected of that epoch without an Agree (the caller's repair then returns
        the watcher's, see :meth:`repair`).
        """
        c = self.comm("world")
        repaired_meanwhile = False
        try:
            with self.guard("agree", c, check_pending=False):
                if epoch is not None and self.world.epoch != epoch:
                    repaired_meanwhile = True
                else:
                    value = HEALTHY_BIT | (1 if flag else 0)
                    result = agree_asleep(c, value) if self.world.mpi_wait == "poll" else c.Agree(value)
        except FailureDetected:
            self.commit_agree_failed = True
            raise
        if repaired_meanwhile:
            raise FailureDetected("agree", -1, epoch, "the watcher repaired meanwhile")
        if not result & HEALTHY_BIT:
            self.commit_agree_failed = True  # a peer entered repair (its Agree completed ours): so must we
            self.note_error()
            self.set_cause("agree", -1, "a peer is repairing")
            raise FailureDetected("agree", -1, self.world.epoch, "a peer is repairing")
        return bool(result & 1)

    # ---------------------------------------------------------------- helpers
    def comm(self, name: CommName) -> MPI.Comm:
        if self.world.evicted:
            raise RuntimeError(f"rank {self.world.rank} was evicted; no collectives allowed")
        if name == "world":
            assert self.world.world_comm is not None
            return self.world.world_comm
        if name == "coord":
            if self.world.coord_comm is None:
                raise RuntimeError(f"rank {self.world.rank} (replica {self.world.replica}) is not active: "
                                   "no coord_comm")
            return self.world.coord_comm
        raise ValueError(f"unknown communicator {name!r}")

    @contextmanager
    def guard(self, op: str, comm: MPI.Comm, check_pending: bool = True) -> Iterator[None]:
        """Turn every MPI error into FailureDetected, after revoking so that no peer stays blocked."""
        with self.op_lock:
            if self.world.evicted:
                raise RuntimeError(f"rank {self.world.rank} was evicted; no collectives allowed")
            if check_pending and self.world.fail_fast and self.world.failure_pending():
                dead = sorted(self.world.watcher.dead_ranks)
                raise self.failed(op, comm, -1, f"failure notice before start: dead {dead}",
                                  "failure notice before start")
            self.world.progress.waiting(op)
            try:
                yield
            except MPI.Exception as exc:
                raise self.failed(op, comm, error_class(exc), str(exc)) from exc
            finally:
                self.world.progress.resume()

    def barrier_on(self, comm: MPI.Comm) -> None:
        """A barrier in this world's wait mode (MPI never matches a blocking barrier with a peer's nonblocking one)."""
        if self.world.mpi_wait == "poll":
            wait_asleep(comm.Ibarrier())
        else:
            comm.Barrier()

    def arrive(self, comm: MPI.Comm) -> None:
        """In ``poll`` mode: sleep until every member of ``comm`` has reached this collective (see :mod:`.waiting`)."""
        if self.world.mpi_wait == "poll":
            wait_asleep(comm.Ibarrier())

    def wait_outside_mpi(self, op: str, is_done: Callable[[], bool], abandon: Callable[[], None],
                         comm: CommName = "coord") -> None:
        """Wait for a cross-replica operation that runs outside MPI (a torch collective of the data plane) as for a
        guarded collective: it completes, or every survivor gets :class:`FailureDetected`. On a death noticed by the
        watcher, or an error of the operation itself, the MPI communicators are revoked first (peers blocked in MPI
        move on to the repair), then ``abandon`` runs: it must return only once no byte of the operation is in
        flight."""
        c = self.comm(comm)
        with self.op_lock:
            self.world.progress.waiting(op)
            try:
                pause = 5e-5
                while True:
                    try:
                        if is_done():
                            return
                        cause = (f"failure notice: dead {sorted(self.world.watcher.dead_ranks)}"
                                 if self.world.fail_fast and self.world.failure_pending() else None)
                    except RuntimeError as exc:
                        cause = f"the operation failed: {exc}"
                    if cause is not None:
                        failure = self.failed(op, c, -1, cause)
                        abandon()
                        raise failure
                    time.sleep(pause)
                    pause = min(2 * pause, 2e-3)
            finally:
                self.world.progress.resume()

    def failed(self, op: str, comm: MPI.Comm, err_class: int, cause: str, detail: str | None = None
                ) -> FailureDetected:
        """Record why this rank leaves for the repair and revoke, so that no peer stays blocked; the error to raise."""
        self.note_error()
        self.revoke_all(comm)
        self.set_cause(op, err_class, cause)
        return FailureDetected(op, err_class, self.world.epoch, detail if detail is not None else cause)

    def set_cause(self, op: str, err_class: int, detail: str) -> None:
        if self.cause is None:  # the first error of this failure is the one that explains it
            self.cause = {"op": op, "error_class": err_class, "detail": detail}

    def note_error(self) -> None:
        self.world.had_failure = True
        with self.state_lock:
            if self.error_time is None:
                self.error_time = time.monotonic()

    def revoke_all(self, comm: MPI.Comm) -> None:
        try_revoke(comm)
        try_revoke(self.world.world_comm)

    @staticmethod
    def check_buffer(buf: np.ndarray) -> None:
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise TypeError("buffer must be a writable C-contiguous numpy array (e.g. tensor.numpy())")
