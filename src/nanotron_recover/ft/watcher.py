"""Early failure notice: a background thread that learns of a dead peer while the main thread computes.

It keeps a pending ``Irecv(source=ANY_SOURCE)`` on its own duplicate of COMM_WORLD (nobody ever sends to it)
and polls it with ``Test()``.  ULFM interrupts such a receive with ``MPI_ERR_PROC_FAILED_PENDING`` 50-120 ms
after a peer dies; ``Ack_failed()`` + ``Get_failed()`` then name the dead.  The thread only *reports*
(callback); what to do about it is the owner's business (see :class:`~nanotron_recover.ft.world.FTWorld`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from .errors import error_class

WATCH_TAG = 0x5EC0  # never sent: the receive exists only to be interrupted by a failure notice
POLL_INTERVAL_S = 0.005

FailureCallback = Callable[[frozenset[int], float], None]


class FailureWatcher:
    """Polls a never-matched ``ANY_SOURCE`` receive and reports newly dead ORIGINAL world ranks.

    ``on_failure(new_dead_ranks, notice_time)`` runs in the watcher thread (``time.monotonic()`` clock).
    """

    def __init__(self, base_comm: MPI.Comm, on_failure: FailureCallback, poll_interval_s: float = POLL_INTERVAL_S):
        self._comm = base_comm.Dup()
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._group = self._comm.Get_group()
        self._on_failure = on_failure
        self._poll = poll_interval_s
        self._buf = np.zeros(1, dtype=np.uint8)
        self._stop = threading.Event()
        self._dead: set[int] = set()
        self._dead_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ulfm-failure-watcher", daemon=True)

    def start(self) -> "FailureWatcher":
        self._thread.start()
        return self

    @property
    def dead_ranks(self) -> frozenset[int]:
        """Every rank this watcher has seen die (or exit without finalizing) so far."""
        with self._dead_lock:
            return frozenset(self._dead)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop polling and cancel the pending receive (done by the thread itself: one thread per request)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _post(self) -> MPI.Request:
        return self._comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=WATCH_TAG)

    def _run(self) -> None:
        req = self._post()
        while not self._stop.is_set():
            try:
                if req.Test():  # a message we never send: just listen again
                    req = self._post()
            except MPI.Exception as exc:
                notice = time.monotonic()
                self._collect(notice, error_class(exc))
                if req == MPI.REQUEST_NULL:
                    req = self._post()
            time.sleep(self._poll)
        cancel_quietly(req)

    def _collect(self, notice: float, err_class: int) -> None:
        try:
            self._comm.Ack_failed()
            failed = self._comm.Get_failed()
            ranks = set(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), self._group))
            failed.Free()
        except MPI.Exception:
            return
        with self._dead_lock:
            new = frozenset(ranks - self._dead)
            self._dead |= new
        if new:
            self._on_failure(new, notice)


def cancel_quietly(req: MPI.Request) -> None:
    """Cancel a pending receive that a failure may already have completed or broken (errors are expected)."""
    if req == MPI.REQUEST_NULL:
        return
    try:
        req.Cancel()
        req.Wait()
    except MPI.Exception:
        pass
