"""Node-local snapshots of each rank's committed state: a relaunch continues from the newest committed step.

Why: on this Open MPI a node's loss ends the whole ``mpirun`` (README, "Running on many nodes"), and a relaunch
from the last disk checkpoint recomputes every step since. But replicas are identical after each commit, so the
ranks on the other nodes still hold, together, a full copy of the state of the last committed step. Each rank
writes its state (parameters, fp32 masters in bf16, Adam, LR scheduler, step) every
``fault_tolerance.local_snapshot_interval`` committed steps to memory-backed storage on its node; a relaunch
agrees on the newest step for which every coordinate of a replica has a copy somewhere and loads it (ranks whose
node has none receive it over MPI from one that has).

File format (one file per slot, two slots per rank: the newest and the one before it)::

    b"NRSNAP01" | u64 header length | header JSON | u64 extras length | extras (pickle) | payload

The payload is the raw bytes of the state tensors, in :func:`~nanotron_recover.recovery.optim_state.state_tensors`
order; the header names the run (run id, config hash), the step, the coordinate, each tensor's dtype and size and
the payload's CRC-32. A slot is written as ``<name>.tmp`` then renamed into place, after the previous file of that
slot was removed: a reader (or a kill mid-write) only ever finds complete files, and the other slot still holds
the previous snapshot. Writing runs in a background thread after a copy into a host buffer allocated once.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import secrets
import shutil
import socket
import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from nanotron_recover.recovery.buckets import local_tensor

MAGIC = b"NRSNAP01"
NODE_NAME_ENV = "NANOTRON_RECOVER_NODE_NAME"  # set by a test bed's stand-in for ssh; else the host name
SLOTS = 2
_U64 = struct.Struct("<Q")


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


RUN_ID_FILE = "run_id.txt"


def run_id(run_dir: Path) -> str | None:
    """The id that the run dir's first launch gave the run (None before it): kept by every relaunch in that dir."""
    try:
        return (Path(run_dir) / RUN_ID_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def ensure_run_id(run_dir: Path) -> str:
    """This run's id, created at its first launch. Why not the run dir's path: a new run in a run dir of the same
    path (the old one deleted, or a test bed whose temporary folders repeat) would take the old run's snapshots that
    are still in ``/dev/shm``. Every rank may call it at once: the id is written to a temporary file and hard-linked
    into place, so one wins and the others read the complete file."""
    run_dir = Path(run_dir)
    found = run_id(run_dir)
    if found is not None:
        return found
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RUN_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.write_text(secrets.token_hex(8) + "\n")
    try:
        os.link(tmp, run_dir / RUN_ID_FILE)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    found = run_id(run_dir)
    assert found is not None
    return found


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


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (this rank's shard of a sharded one) as a flat uint8 view: no copy, so writing into it
    writes the tensor."""
    t = local_tensor(t.detach())
    if not t.is_contiguous():
        raise ValueError("snapshots need contiguous state tensors")
    return t.reshape(-1).view(torch.uint8)


def _describe(tensors: Sequence[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), local_tensor(t).numel()] for t in tensors]


@dataclass
class Snapshot:
    """A complete snapshot file found on this node (header read and checked; payload not read yet)."""

    path: Path
    header: dict

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def coord(self) -> int:
        return int(self.header["coord"])

    @property
    def size(self) -> int:
        return self.path.stat().st_size


class SnapshotWriter:
    """Writes one rank's snapshots into ``folder/<name>.slot<k>``, alternating slots, in a background thread."""

    def __init__(self, folder: Path, name: str, *, run_id: str, config_hash: str, coord: int) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._base = {"run_id": run_id, "config_hash": config_hash, "coord": coord}
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._layout: list[list] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._pending: Future | None = None
        self._count = 0
        self.bytes_written = 0

    @property
    def payload_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def paths(self) -> list[Path]:
        return [self.folder / f"{self.name}.slot{k}" for k in range(SLOTS)]

    def write(self, step: int, tensors: Sequence[torch.Tensor], extras: dict, epoch: int = 0) -> None:
        """Copy ``tensors`` into the host buffer (the only work on the caller's thread) and queue the file write.
        Waits for the previous write first: the buffer is reused."""
        self.wait()
        if self._buffer is None:
            self._allocate(tensors)
        elif _describe(tensors) != self._layout:
            raise ValueError("the state tensors changed shape or dtype between snapshots")
        for view, t in zip(self._views, tensors):
            view.copy_(_raw_bytes(t))
        header = {**self._base, "step": step, "epoch": epoch, "tensors": self._layout}
        blob = pickle.dumps(extras)
        slot = self.paths()[self._count % SLOTS]
        self._count += 1
        self._pending = self._pool.submit(self._write_file, slot, header, blob)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> None:
        self._layout = _describe(tensors)
        sizes = [_raw_bytes(t).numel() for t in tensors]
        pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
        self._buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self._views = [self._buffer[a:b] for a, b in zip(offsets, offsets[1:])]

    def _write_file(self, slot: Path, header: dict, blob: bytes) -> None:
        payload = memoryview(self._buffer.numpy())
        header["crc32"] = zlib.crc32(payload)
        header["payload_bytes"] = len(payload)
        head = json.dumps(header).encode()
        tmp = slot.with_name(slot.name + ".tmp")
        slot.unlink(missing_ok=True)  # the other slot keeps the previous snapshot meanwhile
        with open(tmp, "wb") as f:
            f.write(MAGIC + _U64.pack(len(head)) + head + _U64.pack(len(blob)) + blob)
            f.write(payload)
        os.replace(tmp, slot)
        self.bytes_written += len(payload) + len(head) + len(blob)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def read_header(path: Path) -> dict:
    """The header of a snapshot file (raises ValueError on anything but a complete snapshot)."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not a snapshot file")
        (n,) = _U64.unpack(f.read(_U64.size))
        return json.loads(f.read(n))


def parse(data: bytes | memoryview) -> tuple[dict, dict, memoryview]:
    """(header, extras, payload) of a whole snapshot file's bytes; the payload's CRC is checked."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a snapshot")
    pos = len(MAGIC)
    (n,) = _U64.unpack(view[pos : pos + _U64.size])
    pos += _U64.size
    header = json.loads(bytes(view[pos : pos + n]))
    pos += n
    (m,) = _U64.unpack(view[pos : pos + _U64.size])
    pos += _U64.size
    extras = pickle.loads(view[pos : pos + m])
    payload = view[pos + m :]
    if len(payload) != header["payload_bytes"]:
        raise ValueError(f"payload of {len(payload)} bytes, header says {header['payload_bytes']}")
    if zlib.crc32(payload) != header["crc32"]:
        raise ValueError("payload checksum mismatch")
    return header, extras, payload


def scan(folder: Path, run_id: str, config_hash: str, log: Callable[[str], None] = print) -> list[Snapshot]:
    """Complete snapshots of this run in ``folder``; files of another run or config are refused (and said so)."""
    found: list[Snapshot] = []
    if not Path(folder).is_dir():
        return found
    for path in sorted(Path(folder).glob("*.slot*")):
        if path.name.endswith(".tmp"):
            continue
        try:
            header = read_header(path)
        except (OSError, ValueError) as e:
            log(f"[nanotron-recover] local snapshot {path} is unreadable ({e}); not used")
            continue
        if header.get("run_id") != run_id or header.get("config_hash") != config_hash:
            log(f"[nanotron-recover] local snapshot {path} belongs to another run or config (run "
                f"{header.get('run_id')}, config {header.get('config_hash')}; this run: {run_id}, {config_hash}); "
                "refused")
            continue
        found.append(Snapshot(path, header))
    return found


def choose_step(offers: Sequence[Iterable[tuple[int, int]]], coords: Iterable[int], newer_than: int | None) -> int | None:
    """The newest step at which every coordinate in ``coords`` is offered by some rank (``offers[rank]`` =
    ``(coord, step)`` pairs), if newer than ``newer_than`` (the disk checkpoint's step); None otherwise."""
    held: dict[int, set[int]] = {}
    for pairs in offers:
        for coord, step in pairs:
            held.setdefault(step, set()).add(coord)
    needed = set(coords)
    for step in sorted(held, reverse=True):
        if newer_than is not None and step <= newer_than:
            return None
        if needed <= held[step]:
            return step
    return None


def transfer_plan(offers: Sequence[Iterable[tuple[int, int]]], coord_of: Sequence[int], step: int) -> dict[int, int]:
    """``{receiver rank: sender rank}`` for every rank that does not hold its own coordinate at ``step``: the
    lowest rank that holds it. The same on every rank (computed from the gathered offers)."""
    holders: dict[int, int] = {}
    has: list[set[int]] = []
    for rank, pairs in enumerate(offers):
        mine = {c for c, s in pairs if s == step}
        has.append(mine)
        for coord in mine:
            holders.setdefault(coord, rank)
    return {rank: holders[coord] for rank, coord in enumerate(coord_of) if coord not in has[rank]}


def unpack_into(tensors: Sequence[torch.Tensor], header: dict, payload: memoryview) -> None:
    """Copy a snapshot's payload into this rank's state tensors (same order, dtypes and sizes, else ValueError)."""
    if header["tensors"] != _describe(tensors):
        raise ValueError("the snapshot's tensors do not match this rank's state (another model or layout)")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            target = _raw_bytes(t)
            n = target.numel()
            target.copy_(raw[offset : offset + n])
            offset += n


def _group_settings(optimizer: Any) -> list[dict]:
    """The optimizer's per-group settings (lr, betas, ...), without the parameters."""
    from nanotron_recover.recovery.optim_state import torch_optimizer

    return [{k: v for k, v in group.items() if k != "params"} for group in torch_optimizer(optimizer).param_groups]


def remove_folder(folder: Path) -> None:
    """Delete this node's snapshots of the run (best effort: another rank of the node may be doing the same)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # the run's folder, once no node folder is left in it
    except OSError:
        pass


class LocalSnapshots:
    """One rank's side of node-local snapshots: write after commits, resume at (re)launch, clean up at the end.

    ``ft`` is the rank's :class:`~nanotron_recover.ft.FTWorld` (its ``allgather_object`` and ``exchange_bytes``
    carry the agreement and the transfers); a coordinate is the rank's index inside its replica (TP x PP position,
    or HSDP shard index), the same in every replica and in every launch of the run.
    """

    def __init__(self, config: Any, run_dir: Path, ft: Any, replica: int, coord: int,
                 log: Callable[[str], None] = print) -> None:
        self.interval = config.fault_tolerance.local_snapshot_interval
        self.run_id, self.config_hash = ensure_run_id(run_dir), config_hash(config)
        self.folder = snapshot_folder(config, self.run_id)
        self.coords = range(config.ranks_per_replica)
        self.ft, self.replica, self.coord, self.log = ft, replica, coord, log
        self._writer: SnapshotWriter | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def after_commit(self, step: int, state: Any, epoch: int = 0,
                     log_event: Callable[[dict], None] = lambda record: None) -> None:
        """Snapshot the state of committed ``step`` (every ``interval`` steps); the first one is logged as a
        ``local_snapshot`` event (its bytes per rank)."""
        if not self.enabled or step % self.interval:
            return
        from nanotron_recover.recovery.optim_state import state_tensors

        first = self._writer is None
        if first:
            self._writer = SnapshotWriter(self.folder, f"r{self.replica}-c{self.coord}", run_id=self.run_id,
                                          config_hash=self.config_hash, coord=self.coord)
        extras = {"lr_scheduler": state.lr_scheduler.state_dict(), "param_groups": _group_settings(state.optimizer)}
        self._writer.write(step, list(state_tensors(state)), extras, epoch=epoch)
        if first:
            log_event({"event": "local_snapshot", "step": step, "folder": str(self.folder),
                       "bytes_per_rank": self._writer.payload_bytes})

    def resume(self, state: Any, newer_than: int | None) -> int | None:
        """Collective over the world at start-up: agree on the newest step that every coordinate holds somewhere
        (and that is newer than the disk checkpoint's ``newer_than``), load it; None if there is none."""
        if not self.enabled:
            return None
        from nanotron_recover.recovery.optim_state import ensure_adam_state, state_tensors, torch_optimizer

        mine = scan(self.folder, self.run_id, self.config_hash, self.log)
        offers = self.ft.allgather_object([(s.coord, s.step, s.size) for s in mine])
        pairs = [[(c, s) for c, s, _ in offer] for offer in offers]
        step = choose_step(pairs, self.coords, newer_than)
        if step is None:
            return None
        coord_of = self.ft.allgather_object(self.coord)
        plan = transfer_plan(pairs, coord_of, step)
        at_step = {s.coord: s for s in mine if s.step == step}
        sends = {dest: at_step[coord_of[dest]].path.read_bytes() for dest, src in plan.items() if src == self.ft.rank}
        source = plan.get(self.ft.rank)
        size = 0
        if source is not None:
            size = next(n for c, s, n in offers[source] if c == self.coord and s == step)
        received = self.ft.exchange_bytes(sends, source, size)
        data = received if received is not None else at_step[self.coord].path.read_bytes()
        header, extras, payload = parse(data)
        ensure_adam_state(state.optimizer)
        unpack_into(list(state_tensors(state)), header, payload)
        state.lr_scheduler.load_state_dict(extras["lr_scheduler"])
        # the scheduler sets each group's lr only when it steps: the next step must use the saved one
        for group, saved in zip(torch_optimizer(state.optimizer).param_groups, extras["param_groups"], strict=True):
            group.update(saved)
        how = f"received from rank {source}" if source is not None else f"from {at_step[self.coord].path}"
        self.log(f"[nanotron-recover] resumed from the local snapshot of step {step} ({how})")
        return step

    def finish(self) -> None:
        """Wait for the last write (before the run's final agreement)."""
        if self._writer is not None:
            self._writer.close()

    def remove(self) -> None:
        """The run finished: delete this node's snapshots of it."""
        self.finish()
        remove_folder(self.folder)
