"""Node-local snapshots of each rank's committed state: a relaunch continues from the newest committed step.

Why: on this Open MPI a node's loss ends the whole ``mpirun`` (README, "Running on many nodes"), and a relaunch
from the last disk checkpoint recomputes every step since. But replicas are identical after each commit, so the
ranks on the other nodes still hold, together, a full copy of the state of the last committed step. Each rank
writes its state (parameters, fp32 masters in bf16, Adam, LR scheduler, step) after the committed steps that
:mod:`~nanotron_recover.snapshots.schedule` picks (``fault_tolerance.local_snapshot_interval``: fixed, or
``auto`` from the measured write cost) to memory-backed storage on its node; a relaunch
agrees on the newest snapshot for which every coordinate of a replica has a copy somewhere and loads it (ranks
whose node has none receive it over MPI from one that has, chunk by chunk).

**Histories.** Every launch is a *history* (an id agreed at start-up: the launch time in hex, then random hex).
Within one history a (coordinate, step) has one content (the replicas are identical after each commit); across
histories it need not (another replica count sums in another order). So a file is named and keyed by (coordinate,
history, step), the relaunch agrees on one (history, step) for every rank, and deletes on its nodes every file
newer than it (and the other histories' files of that step). The new launch writes under its own history, so it
never overwrites the file it resumed from; it deletes a previous history's files of its coordinate only once it
holds :data:`KEEP` of its own. The agreed files are checksummed *before* any rank touches its state: a damaged
one is deleted and the agreement runs again without it (no restart loop on a bad file).

**The store is private** (per user; nothing read from it runs code): the base folder must be a real folder owned
by this user (created 0700; looser modes are tightened), files are 0600, opened without following links and
checked for owner and mode; anything else is refused with a message and snapshots go off on that rank. The file
format is a fixed binary header and JSON, never pickle::

    b"NRSNAP02" | u32 header length | header JSON (run, config, history, step, coordinate, tensors, checksum, extras)
    | payload (the raw bytes of the state tensors, in ``state_tensors`` order)

**Full storage never ends the run.** A file is written as ``<name>.tmp`` and renamed into place only when
complete; older files go only after that. If a write fails (``ENOSPC``), the partial file is removed, a message
says so at once, and this rank's snapshots turn off (its older complete ones stay usable); ``finish`` never raises.
At a relaunch every node checks its own free space for its ranks (the launcher can check only its own host).
Snapshot folders of other runs of this user untouched for :data:`STALE_AFTER_S` (crashed runs) are deleted.

**Bounded memory at a relaunch.** A rank that lacks its coordinate's snapshot receives it piece by piece
(:data:`CHUNK_BYTES`) straight into its state tensors; a sender reads each piece once for all of its receivers, and
the receivers of one coordinate are spread over its holders (``benchmarks/snapshot_resume_memory_bench.py``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import sys
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, NamedTuple, Sequence

import torch
import xxhash

from nanotron_recover.run.run_folder import ensure_run_id
from nanotron_recover.training.training_state import local_tensor

MAGIC = b"NRSNAP02"
NODE_NAME_ENV = "NANOTRON_RECOVER_NODE_NAME"  # set by a test bed's stand-in for ssh; else the host name
STALE_AFTER_ENV = "NANOTRON_RECOVER_SNAPSHOT_STALE_S"
STALE_AFTER_S = 3 * 24 * 3600.0  # another run's folder untouched this long: its run crashed and was not relaunched
KEEP = 2  # complete snapshots each rank keeps of its own history (the newest and the one before)
CHUNK_BYTES = 16 * 2**20  # a relaunch's transfer and reads go in pieces of this size: bounded memory
MAX_HEADER_BYTES = 64 * 2**20
SUFFIX = ".snap"
RESERVED_FRACTION = 10  # snapshots leave 1/10 of their file system free
_U32 = struct.Struct("<I")
_ID = re.compile(r"[0-9a-f]{8,64}")  # run ids and history ids: they become path components
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_FILE = re.compile(r"r(\d+)-c(\d+)\.h([0-9a-f]{8,64})\.s(\d+)" + re.escape(SUFFIX))
PREFIX = "[nanotron-recover]"


class StoreRefused(ValueError):
    """The snapshot store (or a file in it) is not this user's private one: never used."""


def _say(log: Callable[[str], None], message: str) -> None:
    log(f"{PREFIX} {message}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------- names and ids
def node_name() -> str:
    """This node's name (a path component: refused unless a plain host name)."""
    name = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    if not _NODE.fullmatch(name):
        raise StoreRefused(f"node name {name!r} is not a plain host name: not used as a snapshot folder")
    return name


def _valid_id(value: str) -> bool:
    return bool(_ID.fullmatch(value))


def new_history_id() -> str:
    """A launch's history id: hex milliseconds first, so a later launch's id sorts after an earlier one's."""
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


def config_hash(config: Any) -> str:
    """What decides the state's layout and the trajectory (model, dtype, optimizer, seed, data, M, tp x pp or the
    shard size), not the replica count: a relaunch with ``--replicas R`` (M kept) continues the same run."""
    ft, par, tok = config.fault_tolerance, config.parallelism, config.tokens
    key = {
        "model": repr(config.model.model_config),
        "dtype": str(config.model.dtype),
        "optimizer": repr(config.optimizer),
        "seed": config.general.seed,
        "data": repr(config.data),
        "M": config.microbatches_per_step,
        "micro_batch_size": tok.micro_batch_size,
        "sequence_length": tok.sequence_length,
        "layout": (par.tp, par.pp, ft.replica, ft.fsdp_shard_size),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def snapshot_folder(config: Any, run_id: str) -> Path:
    """This node's folder of the snapshots of run ``run_id``."""
    return Path(config.fault_tolerance.local_snapshot_dir) / run_id / node_name()


def file_name(name: str, history: str, step: int) -> str:
    return f"{name}.h{history}.s{step:010d}{SUFFIX}"


# ------------------------------------------------------------------------------------------- a private store
def private_dir(path: Path) -> Path:
    """Create ``path`` (0700) or check it: a real folder (not a link) owned by this user; group and other access
    is removed. Why: the snapshots hold the weights and optimizer state, and whatever is read from them is loaded
    into the run; another user's folder is refused (with the reason), never used."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreRefused(f"{path} is not a folder (a link or a file): refused as a snapshot store")
    if st.st_uid != os.geteuid():
        raise StoreRefused(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): refused as a "
                           "snapshot store; set fault_tolerance.local_snapshot_dir to a folder of your own")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def private_tree(base: Path, *parts: str) -> Path:
    """``base/parts...``, every level private (the parents of ``base`` are created if missing, and not checked)."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    path = private_dir(base)
    for part in parts:
        path = private_dir(path / part)
    return path


def open_private(path: Path) -> BinaryIO:
    """Open a snapshot file for reading only if it is a regular file of this user that nobody else can access."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise StoreRefused(f"{path}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o} (must be this user's, "
                           "0600): refused")
    return os.fdopen(fd, "rb")


# ------------------------------------------------------------------------------------------- the format
def _to_json(value: Any) -> Any:
    """Extras (LR scheduler state, optimizer group settings) as JSON that round-trips their Python types: tuples
    and dicts with non-string keys are tagged. Anything else (a tensor) is an error, not a silent change."""
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {"__tuple__", "__items__"} & set(value):
            return {k: _to_json(v) for k, v in value.items()}
        return {"__items__": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a snapshot's extras hold only JSON-like values, not {type(value).__name__}")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {_hashable(_from_json(k)): _from_json(v) for k, v in value["__items__"]}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def encode_header(header: dict) -> bytes:
    """``MAGIC | u32 length | JSON``: the bytes in front of the payload."""
    head = json.dumps(header, allow_nan=True).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header of {len(head)} bytes (at most {MAX_HEADER_BYTES})")
    return MAGIC + _U32.pack(len(head)) + head


def decode_header(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """(header, its length in bytes) from the start of a snapshot; ValueError on anything else."""
    view = memoryview(data)
    start = len(MAGIC) + _U32.size
    if len(view) < start or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a snapshot file of this format")
    (n,) = _U32.unpack(view[len(MAGIC) : start])
    if n > MAX_HEADER_BYTES or len(view) < start + n:
        raise ValueError(f"snapshot header of {n} bytes is cut or too long")
    try:
        header = json.loads(bytes(view[start : start + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"snapshot header is not JSON: {e}") from None
    if (not isinstance(header, dict) or not {"step", "coord", "payload_bytes", "tensors"} <= set(header)
            or not {"checksum", "crc32"} & set(header)):
        raise ValueError("snapshot header lacks fields")
    return header, start + n


# ------------------------------------------------------------------------------------------- checksums
CHECKSUM_KIND = "xxh3_64"  # new files; "crc32" (files of earlier versions) is still read
WRITE_PIECE_BYTES = 2**20  # a write checksums and writes this much at a time: the bytes are read from cache


class PayloadHash:
    """A payload's streaming checksum. xxh3-64 runs at about three times zlib's CRC-32 on these machines and, with
    the write, is most of a snapshot's cost on the step path (``benchmarks/overhead.py --breakdown``)."""

    def __init__(self, kind: str = CHECKSUM_KIND) -> None:
        if kind not in ("xxh3_64", "crc32"):
            raise ValueError(f"unknown snapshot checksum {kind!r}")
        self._xxh = xxhash.xxh3_64() if kind == "xxh3_64" else None
        self._crc = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        if self._xxh is not None:
            self._xxh.update(piece)
        else:
            self._crc = zlib.crc32(piece, self._crc)

    @property
    def value(self) -> str:
        """``kind:hex``, of a fixed width for a kind (the header is written before the payload is hashed)."""
        return f"xxh3_64:{self._xxh.intdigest():016x}" if self._xxh is not None else f"crc32:{self._crc:08x}"


def payload_checksum(header: dict) -> str:
    """The checksum a header records for its payload, as :attr:`PayloadHash.value` writes it."""
    if "checksum" in header:
        return str(header["checksum"])
    return f"crc32:{int(header['crc32']):08x}"


def hash_for(header: dict) -> PayloadHash:
    """A fresh hash of the kind ``header``'s checksum is."""
    return PayloadHash(payload_checksum(header).split(":", 1)[0])


def check_payload(header: dict, hashed: PayloadHash) -> None:
    if hashed.value != payload_checksum(header):
        raise ValueError("payload checksum mismatch")


def read_header(path: Path) -> tuple[dict, int]:
    """(header, header length) of a snapshot file of this user (ValueError / StoreRefused otherwise)."""
    with open_private(path) as f:
        prefix = f.read(len(MAGIC) + _U32.size)
        if len(prefix) < len(MAGIC) + _U32.size:
            raise ValueError("not a snapshot file of this format")
        (n,) = _U32.unpack(prefix[len(MAGIC) :])
        return decode_header(prefix + f.read(min(n, MAX_HEADER_BYTES)))


def extras_of(header: dict) -> dict:
    return _from_json(header.get("extras", {}))


def parse(data: bytes | bytearray | memoryview) -> tuple[dict, dict, memoryview]:
    """(header, extras, payload) of a whole snapshot file's bytes; the payload's checksum is checked."""
    header, start = decode_header(data)
    payload = memoryview(data)[start:]
    if len(payload) != header["payload_bytes"]:
        raise ValueError(f"payload of {len(payload)} bytes, header says {header['payload_bytes']}")
    hashed = hash_for(header)
    hashed.update(payload)
    check_payload(header, hashed)
    return header, extras_of(header), payload


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (this rank's shard of a sharded one) as a flat uint8 view: no copy, so writing into it
    writes the tensor."""
    t = local_tensor(t.detach())
    if not t.is_contiguous():
        raise ValueError("snapshots need contiguous state tensors")
    return t.reshape(-1).view(torch.uint8)


def _describe(tensors: Sequence[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), local_tensor(t).numel()] for t in tensors]


class PayloadSink:
    """Pours a payload, piece by piece, into the state tensors it was taken from (a piece may span tensors), and
    checksums it: a relaunch never holds the whole file in memory."""

    def __init__(self, tensors: Sequence[torch.Tensor], header: dict) -> None:
        if header["tensors"] != _describe(tensors):
            raise ValueError("the snapshot's tensors do not match this rank's state (another model or layout)")
        self._targets = [_raw_bytes(t) for t in tensors]
        self._index, self._offset, self.received = 0, 0, 0
        self.hashed = hash_for(header)

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        view = memoryview(piece)
        self.hashed.update(view)
        self.received += len(view)
        raw = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8) if len(view) else None
        pos = 0
        with torch.no_grad():
            while pos < len(view):
                if self._index >= len(self._targets):
                    raise ValueError("a snapshot payload longer than the state")
                target = self._targets[self._index]
                n = min(target.numel() - self._offset, len(view) - pos)
                target[self._offset : self._offset + n].copy_(raw[pos : pos + n])
                pos, self._offset = pos + n, self._offset + n
                if self._offset == target.numel():
                    self._index, self._offset = self._index + 1, 0

    def check(self, header: dict) -> None:
        if self.received != header["payload_bytes"]:
            raise ValueError(f"payload of {self.received} bytes, header says {header['payload_bytes']}")
        check_payload(header, self.hashed)


def unpack_into(tensors: Sequence[torch.Tensor], header: dict, payload: memoryview) -> None:
    """Copy a whole payload into this rank's state tensors (same order, dtypes and sizes, else ValueError)."""
    sink = PayloadSink(tensors, header)
    sink.feed(payload)
    sink.check(header)


def _pieces(f: BinaryIO, n: int, buffer: bytearray) -> Iterable[memoryview]:
    """The next ``n`` bytes of ``f`` in pieces read into ``buffer`` (reused: valid until the next piece)."""
    view = memoryview(buffer)
    while n > 0:
        got = f.readinto(view[: min(n, len(buffer))])
        if not got:
            raise ValueError("snapshot file is cut short")
        n -= got
        yield view[:got]


def verify_file(path: Path, chunk: int = CHUNK_BYTES) -> dict:
    """The header of a complete, undamaged snapshot file (its payload's checksum checked, piece by piece)."""
    header, start = read_header(path)
    hashed = hash_for(header)
    with open_private(path) as f:
        f.seek(start)
        for piece in _pieces(f, header["payload_bytes"], bytearray(min(chunk, max(1, header["payload_bytes"])))):
            hashed.update(piece)
        if f.read(1):
            raise ValueError("snapshot file longer than its header says")
    check_payload(header, hashed)
    return header


# ------------------------------------------------------------------------------------------- writing
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


# ------------------------------------------------------------------------------------------- finding
class Key(NamedTuple):
    """What one snapshot file holds: the same bytes wherever a key is found (replicas agree after a commit)."""

    coord: int
    history: str
    step: int


@dataclass
class Snapshot:
    """A complete snapshot file found on this node (header read and checked; payload not read yet)."""

    path: Path
    header: dict
    header_bytes: int = 0

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def coord(self) -> int:
        return int(self.header["coord"])

    @property
    def history(self) -> str:
        return str(self.header.get("history", ""))

    @property
    def key(self) -> Key:
        return Key(self.coord, self.history, self.step)

    @property
    def size(self) -> int:
        return self.header_bytes + int(self.header["payload_bytes"])


def scan(folder: Path, run_id: str, config_hash: str, log: Callable[[str], None] = print) -> list[Snapshot]:
    """Complete snapshots of this run in ``folder``; files of another run or config, or not this user's private
    ones, are refused (and said so)."""
    found: list[Snapshot] = []
    if not Path(folder).is_dir():
        return found
    for path in sorted(Path(folder).glob(f"*{SUFFIX}")):
        try:
            header, n = read_header(path)
        except (OSError, ValueError) as e:
            _say(log, f"local snapshot {path} is unreadable or not this user's ({e}); not used")
            continue
        if header.get("run_id") != run_id or header.get("config_hash") != config_hash:
            _say(log, f"local snapshot {path} belongs to another run or config (run {header.get('run_id')}, config "
                      f"{header.get('config_hash')}; this run: {run_id}, {config_hash}); refused")
            continue
        if not _valid_id(str(header.get("history", ""))):
            _say(log, f"local snapshot {path} has no valid history id; not used")
            continue
        found.append(Snapshot(path, header, n))
    return found


def by_key(found: Iterable[Snapshot]) -> dict[Key, Snapshot]:
    """One file per key (the first by path: several replicas of a node may hold the same key)."""
    keyed: dict[Key, Snapshot] = {}
    for snap in sorted(found, key=lambda s: str(s.path)):
        keyed.setdefault(snap.key, snap)
    return keyed


# ------------------------------------------------------------------------------------------- agreeing
def choose_snapshot(offers: Sequence[Iterable[tuple]], coords: Iterable[int],
                    newer_than: int | None) -> tuple[str, int] | None:
    """The (history, step) to resume from: the newest step for which one history has every coordinate in
    ``coords`` offered by some rank (``offers[rank]`` = ``(coord, history, step, ...)`` tuples), if newer than
    ``newer_than`` (the disk checkpoint's step). A tie between histories goes to the latest launch (the greater
    id). The same on every rank: a function of the gathered offers."""
    held: dict[tuple[int, str], set[int]] = {}
    for pairs in offers:
        for coord, history, step, *_ in pairs:
            held.setdefault((step, history), set()).add(coord)
    needed = set(coords)
    for step, history in sorted(held, reverse=True):
        if newer_than is not None and step <= newer_than:
            return None
        if needed <= held[(step, history)]:
            return history, step
    return None


def transfer_plan(offers: Sequence[Iterable[tuple]], coord_of: Sequence[int],
                  chosen: tuple[str, int]) -> dict[int, int]:
    """``{receiver rank: sender rank}`` for every rank that does not hold its own coordinate's ``chosen``
    (history, step). Receivers of one coordinate are spread over its holders in turn, so that no holder serves
    them all. The same on every rank (computed from the gathered offers)."""
    holders: dict[int, list[int]] = {}
    has: list[set[int]] = []
    for rank, pairs in enumerate(offers):
        mine = {coord for coord, history, step, *_ in pairs if (history, step) == tuple(chosen)}
        has.append(mine)
        for coord in sorted(mine):
            holders.setdefault(coord, []).append(rank)
    plan: dict[int, int] = {}
    served: dict[int, int] = {}
    for rank, coord in enumerate(coord_of):
        if coord not in has[rank]:
            turn = served.get(coord, 0)
            plan[rank] = holders[coord][turn % len(holders[coord])]
            served[coord] = turn + 1
    return plan


def _group_settings(optimizer: Any) -> list[dict]:
    """The optimizer's per-group settings (lr, betas, ...), without the parameters."""
    from nanotron_recover.training.training_state import torch_optimizer

    return [{k: v for k, v in group.items() if k != "params"} for group in torch_optimizer(optimizer).param_groups]


def reserved_bytes(folder: Path) -> int:
    """Space the snapshots leave free in their file system (``/dev/shm`` is also where Open MPI and NCCL put their
    shared memory): a tenth of it."""
    return shutil.disk_usage(folder).total // RESERVED_FRACTION


def remove_folder(folder: Path) -> None:
    """Delete this node's snapshots of the run (best effort: another rank of the node may be doing the same)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # the run's folder, once no node folder is left in it
    except OSError:
        pass


def remove_stale_runs(base: Path, keep: str, max_age_s: float, log: Callable[[str], None] = print) -> list[Path]:
    """Delete the folders of this user's other runs in ``base`` in which nothing changed for ``max_age_s`` (a run
    that crashed and was never relaunched; a finished run deletes its own). -> what was deleted."""
    removed: list[Path] = []
    now = time.time()
    for entry in sorted(Path(base).iterdir()):
        try:
            st = entry.lstat()
            if entry.name == keep or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            newest = max([st.st_mtime] + [p.lstat().st_mtime for p in entry.rglob("*")])
        except OSError:
            continue  # another rank of the node is deleting it
        if now - newest > max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            _say(log, f"removed the local snapshots of a run untouched for {(now - newest) / 3600:.0f} h: {entry}")
    return removed


# ------------------------------------------------------------------------------------------- one rank's side
class Hello(NamedTuple):
    """What each rank tells the world at a relaunch (one ``allgather_object``)."""

    proposal: str  # a history id for this launch: the lowest live rank's wins
    rank: int  # its world rank (plans index the gathered list; transfers address world ranks)
    coord: int
    node: str | None  # None: this rank's store was refused
    payload_bytes: int  # the size of this rank's snapshots
    offers: list  # (coord, history, step, header bytes, file bytes) of each snapshot file found on its node


class LocalSnapshots:
    """One rank's side of node-local snapshots: write after commits, resume at (re)launch, clean up at the end.

    ``ft`` is the rank's :class:`~nanotron_recover.ft.FTWorld` (its ``allgather_object`` and ``exchange_bytes``
    carry the agreement and the transfers; ``allgather_object`` unpickles what the peers send: acceptable, they are
    ranks of this job, unlike the files, which are never unpickled); a coordinate is the rank's index inside its
    replica (TP x PP position, or HSDP shard index), the same in every replica and in every launch of the run.
    A rank whose store is refused (another user's folder, a bad run id) still takes part in the agreement (it may
    receive its state) but writes nothing.
    """

    def __init__(self, config: Any, run_dir: Path, ft: Any, replica: int, coord: int,
                 log: Callable[[str], None] = print) -> None:
        self.setting = config.fault_tolerance.local_snapshot_interval  # 0: off; which steps: the SnapshotSchedule
        self.config_hash = config_hash(config)
        self.coords = range(config.ranks_per_replica)
        self.ft, self.replica, self.coord, self.log = ft, replica, coord, log
        self.base = Path(config.fault_tolerance.local_snapshot_dir)
        self.history: str | None = None
        self._writer: SnapshotWriter | None = None
        self.off_reason: str | None = None
        self._store_ok = False
        self._node: str | None = None
        self.run_id: str | None = None
        self.folder: Path | None = None
        self._ranks: list[int] = []  # the world ranks in gathered order (set at resume)
        if not self.enabled:
            return
        try:
            self.run_id = ensure_run_id(run_dir)
            self.folder = snapshot_folder(config, self.run_id)
            self._node = self.folder.name
            private_tree(self.base, self.run_id, self.folder.name)
            self._store_ok = True
        except (OSError, ValueError) as e:
            self._turn_off(f"{e}")

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    @property
    def writing(self) -> bool:
        return self.enabled and self.off_reason is None

    def _turn_off(self, why: str) -> None:
        if self.off_reason is None:
            self.off_reason = why
            _say(self.log, f"local snapshots turned off on this rank: {why}")

    # ----------------------------------------------------------------------------------------- writing
    def after_commit(self, step: int, state: Any, epoch: int = 0,
                     log_event: Callable[[dict], None] = lambda record: None, due: bool = True) -> None:
        """Snapshot the state of committed ``step`` if it is ``due`` (the
        :class:`~nanotron_recover.snapshots.schedule.SnapshotSchedule`'s call, the same on every rank); the
        first one is logged as a ``local_snapshot`` event (its bytes per rank). Never raises for storage trouble:
        snapshots turn off."""
        if not self.writing or not due:
            return
        from nanotron_recover.training.training_state import state_tensors

        first = self._writer is None
        if first:
            self._writer = SnapshotWriter(self.folder, f"r{self.replica}-c{self.coord}", run_id=self.run_id,
                                          config_hash=self.config_hash, coord=self.coord,
                                          # no resume (none ran): a history of this rank alone
                                          history=self.history or new_history_id(), log=self.log)
        if self._writer.failed is not None:
            self.off_reason = f"a write failed ({self._writer.failed})"  # the writer said so when it happened
            return
        extras = {"lr_scheduler": state.lr_scheduler.state_dict(), "param_groups": _group_settings(state.optimizer)}
        self._writer.write(step, list(state_tensors(state)), extras, epoch=epoch)
        if first:
            log_event({"event": "local_snapshot", "step": step, "folder": str(self.folder),
                       "bytes_per_rank": self._writer.payload_bytes})

    @property
    def cost_s(self) -> float | None:
        """What this rank's last measured write cost training (None: none measured, or not writing)."""
        return self._writer.last_cost_s if self.writing and self._writer is not None else None

    def settle(self) -> None:
        """Wait for the pending write, which reads the state tensors in place: call before changing them."""
        if self._writer is not None:
            self._writer.wait()

    def finish(self) -> None:
        """Wait for the last write (before the run's final agreement). Never raises: a failed write was said."""
        if self._writer is not None:
            self._writer.close()

    def drop_replica(self) -> None:
        """This rank leaves while the others train on (its replica broke, or was evicted): the files of its replica
        on this node go, its own and its dead mates' (no one else would delete them: a node whose ranks all left
        kept them after the run). Every live replica holds every coordinate, so no state is lost. The node folder
        stays: another replica of this node may be about to write its first file into it."""
        self.finish()
        if self.folder is None or not self._store_ok:
            return
        for path in self.folder.glob(f"r{self.replica}-c*"):
            path.unlink(missing_ok=True)

    def remove(self) -> None:
        """The run finished: delete this node's snapshots of it."""
        self.finish()
        if self.folder is not None and self._store_ok:
            remove_folder(self.folder)

    # ----------------------------------------------------------------------------------------- resuming
    def _mine(self) -> dict[Key, Snapshot]:
        if not self.writing:
            return {}
        try:
            self._clean_stale()
            return by_key(scan(self.folder, self.run_id, self.config_hash, self.log))
        except (OSError, ValueError) as e:
            self._turn_off(f"{e}")
            return {}

    def _clean_stale(self) -> None:
        max_age = float(os.environ.get(STALE_AFTER_ENV, STALE_AFTER_S))
        remove_stale_runs(self.base, self.run_id, max_age, self.log)

    def resume(self, state: Any, newer_than: int | None) -> int | None:
        """Collective over the world at start-up: agree on the newest (history, step) that every coordinate holds
        somewhere (and that is newer than the disk checkpoint's ``newer_than``), check its files, load it; None if
        there is none. A damaged file is deleted and the agreement runs again without it."""
        if not self.enabled:
            return None
        from nanotron_recover.training.training_state import ensure_adam_state, state_tensors

        ensure_adam_state(state.optimizer)
        tensors = list(state_tensors(state))
        proposal = new_history_id()
        size = sum(_raw_bytes(t).numel() for t in tensors)
        while True:
            mine = self._mine()
            hellos = self.ft.allgather_object(Hello(proposal, self.ft.rank, self.coord, self._node, size,
                                                    [(*k, s.header_bytes, s.size) for k, s in mine.items()]))
            self.history = self.history or hellos[0].proposal  # the lowest live rank's proposal, on every rank
            self._ranks = [hello.rank for hello in hellos]
            offers = [hello.offers for hello in hellos]
            coord_of = [hello.coord for hello in hellos]
            chosen = choose_snapshot(offers, self.coords, newer_than)
            if chosen is None:
                self._tidy(None)
                self._check_space(hellos)
                return None
            plan = transfer_plan(offers, coord_of, chosen)
            if self._verify_agreed(mine, chosen, plan, coord_of):
                break
        source, checksum = self._load(state, tensors, mine, offers, chosen, plan, coord_of)
        self._tidy(chosen)
        self._check_space(hellos)
        how = f"received from rank {source}" if source is not None else f"from {mine[self._key(chosen)].path}"
        _say(self.log, f"resumed from the local snapshot of step {chosen[1]} (history {chosen[0]}, coordinate "
                       f"{self.coord}, payload checksum {checksum}, {how})")
        return chosen[1]

    def _check_space(self, hellos: Sequence[Hello]) -> None:
        """On every node (the launcher checks only its own): the ranks of this node need room for :data:`KEEP`
        complete snapshots and one being written each; this run's files already there count as room (they are
        replaced). If there is not, snapshots go off here now, with the numbers, rather than at a failed write."""
        if not self.writing:
            return
        mates = [hello for hello in hellos if hello.node == self._node]
        need = (KEEP + 1) * sum(hello.payload_bytes for hello in mates)
        free = shutil.disk_usage(self.folder).free + sum(p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}"))
        free -= reserved_bytes(self.folder)  # never all of it: Open MPI and NCCL need shared memory too
        if need > free:
            self._turn_off(f"node {self._node} has {free / 2**20:.1f} MiB for snapshots in {self.folder}, its "
                           f"{len(mates)} rank(s) need {need / 2**20:.1f} MiB ({KEEP} snapshots and one being "
                           "written each); point local_snapshot_dir at a larger folder")

    def _key(self, chosen: tuple[str, int], coord: int | None = None) -> Key:
        return Key(self.coord if coord is None else coord, chosen[0], chosen[1])

    def _used_here(self, chosen: tuple[str, int], plan: dict[int, int], coord_of: Sequence[int]) -> set[Key]:
        """The chosen files this rank reads: its own coordinate's (unless it receives it), and those it sends."""
        rank = self._ranks.index(self.ft.rank)
        used = {self._key(chosen, coord_of[dest]) for dest, src in plan.items() if src == rank}
        if rank not in plan:
            used.add(self._key(chosen))
        return used

    def _verify_agreed(self, mine: dict[Key, Snapshot], chosen: tuple[str, int], plan: dict[int, int],
                       coord_of: Sequence[int]) -> bool:
        """Checksum the chosen files this rank reads; a damaged one is deleted (so no later launch picks it again)
        and said so. -> whether every rank's files are sound (the same answer everywhere)."""
        sound = True
        for key in sorted(self._used_here(chosen, plan, coord_of)):
            try:
                verify_file(mine[key].path)
            except (OSError, ValueError) as e:
                sound = False
                mine[key].path.unlink(missing_ok=True)
                _say(self.log, f"local snapshot {mine[key].path} of step {key.step} is damaged ({e}): deleted; "
                               "agreeing again without it")
        return all(self.ft.allgather_object(sound))

    def _load(self, state: Any, tensors: list[torch.Tensor], mine: dict[Key, Snapshot], offers: list,
              chosen: tuple[str, int], plan: dict[int, int], coord_of: Sequence[int]) -> tuple[int | None, str]:
        """Stream the chosen snapshot into this rank's state (from its file, or from its sender), serving the
        receivers this rank sends to on the way. -> (the sender's world rank if this rank received, the payload's
        checksum). ``plan`` and ``offers`` index the gathered list; the transfer addresses world ranks."""
        me, ranks = self._ranks.index(self.ft.rank), self._ranks
        outgoing: dict[Key, list[int]] = {}
        for dest, src in sorted(plan.items()):
            if src == me:
                outgoing.setdefault(self._key(chosen, coord_of[dest]), []).append(ranks[dest])
        source = plan.get(me)
        incoming = None
        if source is not None:
            incoming = next((head, size) for c, h, s, head, size in offers[source] if Key(c, h, s) == self._key(chosen))
        header = _stream(self.ft, {mine[k].path: dests for k, dests in outgoing.items()},
                         None if source is None else ranks[source], incoming, tensors,
                         None if source is not None else mine[self._key(chosen)].path)
        self._apply_extras(state, extras_of(header))
        self.ft.allgather_object(True)  # every rank loaded: only now may files be deleted
        return None if source is None else ranks[source], payload_checksum(header)

    @staticmethod
    def _apply_extras(state: Any, extras: dict) -> None:
        from nanotron_recover.training.training_state import torch_optimizer

        state.lr_scheduler.load_state_dict(extras["lr_scheduler"])
        # the scheduler sets each group's lr only when it steps: the next step must use the saved one
        for group, saved in zip(torch_optimizer(state.optimizer).param_groups, extras["param_groups"], strict=True):
            group.update(saved)

    def _tidy(self, chosen: tuple[str, int] | None) -> None:
        """After the agreement (no rank writes yet: the first write follows a step that all ranks commit): this
        node's partial files of killed writes go, and so do its files newer than the chosen step and other
        histories' files of that step: a line the run no longer follows (the chosen files stay until this launch
        has its own)."""
        if self.folder is None or not self._store_ok:
            return
        for path in [*self.folder.glob("*.tmp"), *self.folder.glob("*.spare")]:
            path.unlink(missing_ok=True)
        if chosen is None:
            return
        history, step = chosen
        for path in self.folder.glob(f"*{SUFFIX}"):
            found = _FILE.fullmatch(path.name)
            if found and (int(found.group(4)) > step or (int(found.group(4)) == step and found.group(3) != history)):
                path.unlink(missing_ok=True)


class _Outgoing:
    """One chosen file this rank sends at a relaunch: its header in round 0, then one payload piece a round, read
    into one reused buffer for all of its receivers."""

    def __init__(self, path: Path, dests: list[int], chunk: int) -> None:
        self.dests = dests
        header, start = read_header(path)
        self.file = open_private(path)
        self.head = self.file.read(start)
        self.left = int(header["payload_bytes"])
        self.rounds = 1 + math.ceil(self.left / chunk)
        self.buffer = bytearray(min(chunk, max(1, self.left)))

    def piece(self, r: int) -> bytes | memoryview | None:
        if r == 0:
            return self.head
        if self.left == 0:
            return None
        view = memoryview(self.buffer)[: min(len(self.buffer), self.left)]
        _read_exact(self.file, view)
        self.left -= len(view)
        return view


def _read_exact(f: BinaryIO, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"snapshot file {f.name} is cut short")
        got += n


def _stream(ft: Any, sends: dict[Path, list[int]], source: int | None, incoming: tuple[int, int] | None,
            tensors: list[torch.Tensor], local: Path | None, chunk: int | None = None) -> dict:
    """The transfer of a relaunch, in rounds of point-to-point messages: round 0 carries each file's header, then
    one piece of the payload a round (pieces of one sender to one receiver stay in order: MPI does not overtake).
    A sender reads each piece once for all of its receivers, a receiver pours it into its state: a few pieces in
    memory, not files. ``incoming`` = (header bytes, file bytes) from ``source``; ``local``: this rank's own file.
    -> the header of the snapshot loaded into ``tensors``."""
    chunk = chunk or CHUNK_BYTES
    outgoing = [_Outgoing(path, dests, chunk) for path, dests in sends.items()]
    try:
        remaining = 0 if incoming is None else incoming[1] - incoming[0]
        rounds = max([o.rounds for o in outgoing] + [1 + math.ceil(remaining / chunk)])
        header, sink = None, None
        for r in range(rounds):
            out: dict[int, Any] = {}
            for o in outgoing:
                piece = o.piece(r)
                if piece is not None:
                    out.update({dest: piece for dest in o.dests})
            size = (incoming[0] if r == 0 else min(chunk, remaining)) if incoming is not None else 0
            want = source if incoming is not None and (r == 0 or size > 0) else None
            if not out and want is None:
                continue
            got = ft.exchange_bytes(out, want, size)
            if got is None:
                continue
            if r == 0:
                header, _ = decode_header(got)
                sink = PayloadSink(tensors, header)
            else:
                sink.feed(got)
                remaining -= len(got)
    finally:
        for o in outgoing:
            o.file.close()
    if local is not None:
        return _load_local(local, tensors, chunk)
    sink.check(header)
    return header


def _load_local(path: Path, tensors: list[torch.Tensor], chunk: int) -> dict:
    """Pour this rank's own snapshot file into its state, piece by piece (the CRC checked on the way)."""
    header, start = read_header(path)
    sink = PayloadSink(tensors, header)
    with open_private(path) as f:
        f.seek(start)
        for piece in _pieces(f, header["payload_bytes"], bytearray(min(chunk, max(1, header["payload_bytes"])))):
            sink.feed(piece)
    sink.check(header)
    return header
