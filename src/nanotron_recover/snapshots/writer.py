"""The snapshot writer: one rank's state written in the background to a temporary file, renamed into place when
complete; the older ones dropped after (it keeps :data:`KEEP`); a full store turns it off, never the run."""

from __future__ import annotations

import errno
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

import torch

from nanotron_recover.run import fence
from nanotron_recover.snapshots.catalog import _FILE, SUFFIX, file_name
from nanotron_recover.snapshots.format import (
    WRITE_PIECE_BYTES,
    PayloadHash,
    _describe,
    _raw_bytes,
    _to_json,
    encode_header,
)
from nanotron_recover.snapshots.store import _say, _valid_id, new_history_id

KEEP = 2  # complete snapshots each rank keeps of its own history (the newest and the one before)


class SnapshotWriter:
    """Writes one rank's snapshots into ``folder/<name>.h<history>.s<step>.snap`` in a background thread, keeping
    its :data:`KEEP` newest. A failed write (storage full) turns the writer off and says so; it never raises.

    Host tensors are written straight from their memory, with no copy: the caller must :meth:`wait` before it next
    changes them (the next optimizer step), which on the step path leaves a whole forward and backward for the
    write. Device tensors are first copied into one pinned host buffer (the only work on the caller's thread)."""

    def __init__(self, folder: Path, name: str, *, run_id: str, config_hash: str, coord: int,
                 history: str | None = None, log: Callable[[str], None] = print) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.name = name
        self.history = history or new_history_id()
        if not _valid_id(self.history):
            raise ValueError(f"history id {self.history!r} is not hex")
        self.coord, self.log = coord, log
        self._base = {"run_id": run_id, "config_hash": config_hash, "coord": coord, "history": self.history}
        self._buffer: torch.Tensor | None = None  # device tensors only: their host copy
        self._views: list[torch.Tensor] = []
        self._sources: list[torch.Tensor] = []  # what the pending write reads: the buffer, or the tensors' own bytes
        self._payload_bytes = 0
        self._layout: list[list] = []
        self._pool: ThreadPoolExecutor | None = None  # made at a write, ended by close()
        self._pending: Future | None = None
        self.failed: BaseException | None = None
        self.bytes_written = 0
        # what a write costs training: its host copy, its thread's CPU seconds (on cores that also compute) and
        # the time the caller waited for it; known once the caller waited for it (None before)
        self.last_cost_s: float | None = None
        self._copy_s = 0.0
        self._write_cpu_s = 0.0
        for leftover in self.folder.glob(f"{name}.*.tmp"):  # a write of this rank's name killed mid-way
            leftover.unlink(missing_ok=True)
        self._spare.unlink(missing_ok=True)  # a previous launch's

    @property
    def payload_bytes(self) -> int:
        return self._payload_bytes

    def paths(self) -> list[Path]:
        """This writer's complete files, oldest first."""
        return sorted(self.folder.glob(f"{self.name}.h{self.history}.s*{SUFFIX}"))

    def write(self, step: int, tensors: Sequence[torch.Tensor], extras: dict, epoch: int = 0) -> None:
        """Queue the file write of ``tensors`` (device tensors: after a copy to the host buffer). Waits for the
        previous write first. Nothing is written once a write failed."""
        self.wait()
        if self.failed is not None:
            return
        fence.guard(f"the node-local snapshot of step {step}")
        if not self._layout:
            self._layout = _describe(tensors)
            self._payload_bytes = sum(_raw_bytes(t).numel() for t in tensors)
        elif _describe(tensors) != self._layout:
            raise ValueError("the state tensors changed shape or dtype between snapshots")
        started = time.perf_counter()
        if any(t.device.type != "cpu" for t in tensors):
            if self._buffer is None:
                self._allocate(tensors)
            for view, t in zip(self._views, tensors):
                view.copy_(_raw_bytes(t))
            self._sources = [self._buffer]
        else:
            self._sources = [_raw_bytes(t) for t in tensors]
        self._copy_s = time.perf_counter() - started
        header = {**self._base, "step": step, "epoch": epoch, "tensors": self._layout, "extras": _to_json(extras)}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._pending = self._pool.submit(self._write_safely, step, header)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> None:
        sizes = [_raw_bytes(t).numel() for t in tensors]
        pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
        self._buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self._views = [self._buffer[a:b] for a, b in zip(offsets, offsets[1:])]

    def _write_safely(self, step: int, header: dict) -> None:
        path = self.folder / file_name(self.name, self.history, step)
        tmp = path.with_name(path.name + ".tmp")
        cpu = time.thread_time()
        try:
            self._write_file(path, tmp, header)
            self._write_cpu_s = time.thread_time() - cpu
        except Exception as e:  # noqa: BLE001 - storage full, or gone: training goes on without snapshots
            tmp.unlink(missing_ok=True)
            self.failed = e
            full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
            why = f"no space left in {self.folder}" if full else f"writing {path} failed"
            _say(self.log, f"local snapshots turned off on this rank: {why} ({e}); the partial file was removed, "
                           f"{len(self.paths())} older complete snapshot(s) stay usable; training goes on")
            return
        self._drop_old()

    def _write_file(self, path: Path, tmp: Path, header: dict) -> None:
        """One pass over the payload: each piece is checksummed and written while it is in cache; the header,
        written first with a placeholder of the checksum's width, is rewritten in place at the end."""
        hashed = PayloadHash()
        header["checksum"] = hashed.value  # the placeholder: same width as the real value
        header["payload_bytes"] = self._payload_bytes
        head = encode_header(header)
        with self._open_for_write(tmp) as f:
            f.write(head)
            for source in self._sources:
                if not source.numel():
                    continue
                data = memoryview(source.numpy())
                for at in range(0, len(data), WRITE_PIECE_BYTES):
                    piece = data[at:at + WRITE_PIECE_BYTES]
                    hashed.update(piece)
                    f.write(piece)
            f.truncate()  # a reused file may have been longer
            header["checksum"] = hashed.value
            final = encode_header(header)
            if len(final) != len(head):
                raise RuntimeError("snapshot header changed length")  # a bug: the placeholder's width is fixed
            f.seek(0)
            f.write(final)
        fence.guard("a node-local snapshot")  # the launch may have been replaced while the file was written
        os.replace(tmp, path)  # complete: only now does it replace anything
        self.bytes_written += len(head) + self._payload_bytes

    @property
    def _spare(self) -> Path:
        """The file the last write made surplus, kept to be written over: on tmpfs a new file costs a page fault
        and a zeroed page per 4 KiB, about a fifth of the write. It is never a snapshot (no ``.snap`` name)."""
        return self.folder / f"{self.name}.spare"

    def _open_for_write(self, tmp: Path) -> BinaryIO:
        tmp.unlink(missing_ok=True)
        try:
            os.replace(self._spare, tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():  # never: the folder is private
                os.close(fd)
                raise OSError(f"{tmp} is not this user's regular file")
        except OSError:
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        return os.fdopen(fd, "wb")

    def _drop_old(self) -> None:
        """Keep the :data:`KEEP` newest own files; once there are that many, a previous history's files of this
        coordinate (the one resumed from among them) are no longer needed."""
        own = self.paths()
        for old in own[:-KEEP]:
            if self._spare.exists():
                old.unlink(missing_ok=True)
            else:
                os.replace(old, self._spare)
        if len(own) < KEEP:
            return
        for path in self.folder.glob(f"*{SUFFIX}"):
            found = _FILE.fullmatch(path.name)
            if found and int(found.group(2)) == self.coord and found.group(3) != self.history:
                path.unlink(missing_ok=True)

    def wait(self) -> None:
        """The pending write is done: the tensors it read may change again."""
        if self._pending is not None:
            started = time.perf_counter()
            self._pending.result()
            self.last_cost_s = self._copy_s + self._write_cpu_s + (time.perf_counter() - started)
            self._pending = None
        self._sources = []

    def close(self) -> None:
        """Wait for the last write and end the thread (a later write starts another)."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
