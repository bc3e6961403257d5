"""A checkpoint written in the background: the step goes on while the files are written.

At a checkpoint step each writing rank copies the committed state to host memory (:meth:`CheckpointLayout.capture`)
and hands the copy to a thread of its own, which writes the same files a save in the step writes, into a private
part folder inside the save's temporary folder. The thread fsyncs its files, moves them into place (a rename, no
copy), hashes them while they are still in the page cache, and says it is done in a small file of its own
(``.writers/<id>.done``: its files, sizes and checksums). Before any rank copies, each writer leaves
``.writers/<id>.pending``; the writers' barrier then makes every pending file visible to the publisher, which
therefore knows whom to wait for without counting ranks.

The publisher's thread waits until every pending writer is done, then publishes as a save in the step does
(checksums merged from the writers' files, the sealed state file, the marker, the rename, ``latest.txt``). So a
folder is published only when every writer finished: a writer that dies leaves its pending file without a done
file, and nothing is published. The publisher stops waiting once the world changed (a repair: a new epoch) and
gives the save up; the previous checkpoint stays ``latest.txt`` and the node-local snapshots cover the steps since.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nanotron_recover.run import fence
from nanotron_recover.run.disk_space import is_disk_full
from nanotron_recover.run.run_folder import fsync_path, write_atomically
from nanotron_recover.training.checkpoint_integrity import CHECKSUM_KIND, file_checksum

WRITERS = ".writers"  # inside a save's temporary folder: who writes, and who is done
PART_PREFIX = ".part-"  # a writer's private folder inside the save's temporary folder
POLL_S = 0.02

CapturedWrite = Callable[[Path], None]  # writes the captured state into a folder (the background thread's work)


def host_room_bytes() -> int | None:
    """Host memory available to a new copy (``MemAvailable``), or None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def writer_id() -> str:
    """This process, unique across the job's nodes (its world rank, its node's name and its pid)."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "x")  # Open MPI's
    return f"r{rank}-{socket.gethostname()}-{os.getpid()}"


def announce_writer(tmp: Path, me: str) -> None:
    """Before the writers' barrier: the publisher will wait for ``me``."""
    (tmp / WRITERS).mkdir(parents=True, exist_ok=True)
    (tmp / WRITERS / f"{me}.pending").touch()


def write_part(write: CapturedWrite, tmp: Path, me: str, before_done: Callable[[], None] = lambda: None) -> None:
    """The background thread of one writer: write into its part folder, make the files durable, move them into
    the save's folder, hash them, say it is done."""
    part = tmp / f"{PART_PREFIX}{me}"
    part.mkdir()
    write(part)
    files = sorted(p for p in part.rglob("*") if p.is_file())
    recorded: dict[str, dict[str, Any]] = {}
    for path in files:
        fsync_path(path)
        name = path.relative_to(part).as_posix()
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        recorded[name] = {"bytes": target.stat().st_size, CHECKSUM_KIND: file_checksum(target)}
    shutil.rmtree(part, ignore_errors=True)  # its folders, empty now
    before_done()
    fence.guard("a background checkpoint write")
    write_atomically(tmp / WRITERS / f"{me}.done", json.dumps(recorded), durable=True)


def wait_for_writers(tmp: Path, given_up: threading.Event, writers: int = 1) -> dict[str, dict[str, Any]] | None:
    """Every announced writer's files (merged), once each of at least ``writers`` is done; None if the save was
    given up first. The count is the strategy's: a shared file system may list a folder from a stale cache (NFS's
    attribute cache), and a writer missing from the listing must not be a writer the publish forgets."""
    folder = tmp / WRITERS
    while not given_up.is_set() and folder.is_dir():  # gone: a newer save removed this one as a leftover
        pending = {p.name.removesuffix(".pending") for p in folder.glob("*.pending")}
        done = {p.name.removesuffix(".done") for p in folder.glob("*.done")}
        if len(pending) >= max(writers, 1) and pending <= done:
            merged: dict[str, dict[str, Any]] = {}
            for me in sorted(pending):
                merged.update(json.loads((folder / f"{me}.done").read_text()))
            return merged
        time.sleep(POLL_S)
    return None


class BackgroundSave:
    """The save in flight on this rank: its writer thread, and on the publisher the publish after it.

    ``epoch``: the world epoch the state was captured in; a later epoch (a repair) gives the save up on the
    publisher. Errors of the thread come back through :meth:`error`: a full disk ends the job as a save in the step
    does; anything else of a save that was given up (its folder removed under it) is dropped. The thread is a
    daemon: a rank that leaves the job (evicted, aborted) is not held at its exit by a save nobody will publish."""

    def __init__(self, step: int, epoch: int, tmp: Path, work: Callable[[threading.Event], None]) -> None:
        self.step, self.epoch, self.tmp = step, epoch, tmp
        self.given_up = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[threading.Event], None]) -> None:
        try:
            work(self.given_up)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which decides
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def give_up(self) -> None:
        self.given_up.set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the thread ended (a publisher: published, or given up), or ``timeout_s`` passed."""
        self._thread.join(timeout_s)

    def error(self) -> BaseException | None:
        """The thread's error once it ended (None while it runs, or when it succeeded or was given up quietly)."""
        if not self.done() or self._error is None:
            return None
        if is_disk_full(self._error):
            return self._error
        return None if self.given_up.is_set() or not self.tmp.exists() else self._error
