"""The snapshot file format: a fixed binary header and JSON (never pickle), the checksums of the header and of the
payload, and reading a payload into state tensors piece by piece.

``NRSNAP03 | u32 header length | u64 xxh3-64 of the header JSON | header JSON | payload``. The header's checksum
(new in 03) covers everything applied at resume besides the tensors: the extras (LR scheduler state, optimizer group
settings), the step, the layout and the payload's checksum; it is checked before the JSON is even parsed. Files of
02 (header unchecked) are not read: a relaunch right after an upgrade resumes from the disk checkpoint instead."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

import torch
import xxhash

from nanotron_recover.snapshots.store import open_private
from nanotron_recover.training.training_state import local_tensor

MAGIC = b"NRSNAP03"
CHUNK_BYTES = 16 * 2**20  # a relaunch's transfer and reads go in pieces of this size: bounded memory
MAX_HEADER_BYTES = 64 * 2**20
_PREFIX = struct.Struct("<IQ")  # the header JSON's length and xxh3-64


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


class DamagedHeader(ValueError):
    """A header that does not match its checksum: the file is damaged (deleted where found, like a bad payload)."""


def encode_header(header: dict) -> bytes:
    """``MAGIC | u32 length | u64 xxh3-64 | JSON``: the bytes in front of the payload."""
    head = json.dumps(header, allow_nan=True).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header of {len(head)} bytes (at most {MAX_HEADER_BYTES})")
    return MAGIC + _PREFIX.pack(len(head), xxhash.xxh3_64_intdigest(head)) + head


def _check_magic(magic: bytes) -> None:
    if magic == MAGIC:
        return
    older = f" ({magic.decode('ascii', 'replace')}, an earlier version's: this one reads {MAGIC.decode()})"
    known = len(magic) == len(MAGIC) and magic.startswith(b"NRSNAP")
    raise ValueError("not a snapshot file of this format" + (older if known else ""))


def decode_header(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """(header, its length in bytes) from the start of a snapshot, its checksum checked; DamagedHeader on a
    mismatch, ValueError on anything else."""
    view = memoryview(data)
    start = len(MAGIC) + _PREFIX.size
    _check_magic(bytes(view[: len(MAGIC)]))
    if len(view) < start:
        raise ValueError("not a snapshot file of this format (cut short)")
    n, digest = _PREFIX.unpack(view[len(MAGIC) : start])
    if n > MAX_HEADER_BYTES or len(view) < start + n:
        raise ValueError(f"snapshot header of {n} bytes is cut or too long")
    head = bytes(view[start : start + n])
    if xxhash.xxh3_64_intdigest(head) != digest:
        raise DamagedHeader("snapshot header checksum mismatch")
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"snapshot header is not JSON: {e}") from None
    if not isinstance(header, dict) or not {"step", "coord", "payload_bytes", "tensors", "checksum"} <= set(header):
        raise ValueError("snapshot header lacks fields")
    return header, start + n


WRITE_PIECE_BYTES = 2**20  # a write checksums and writes this much at a time: the bytes are read from cache


class PayloadHash:
    """A payload's streaming xxh3-64 checksum: about three times zlib's CRC-32 (which earlier versions used) on
    these machines; with the write, most of a snapshot's cost on the step path (``benchmarks/overhead.py
    --breakdown``)."""

    def __init__(self) -> None:
        self._xxh = xxhash.xxh3_64()

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        self._xxh.update(piece)

    @property
    def value(self) -> str:
        """``xxh3_64:hex``, of a fixed width (the header is written before the payload is hashed)."""
        return f"xxh3_64:{self._xxh.intdigest():016x}"


def payload_checksum(header: dict) -> str:
    """The checksum a header records for its payload, as :attr:`PayloadHash.value` writes it."""
    return str(header["checksum"])


def check_payload(header: dict, hashed: PayloadHash) -> None:
    if hashed.value != payload_checksum(header):
        raise ValueError("payload checksum mismatch")


def read_header(path: Path) -> tuple[dict, int]:
    """(header, header length) of a snapshot file of this user (ValueError / StoreRefused otherwise)."""
    with open_private(path) as f:
        prefix = f.read(len(MAGIC) + _PREFIX.size)
        _check_magic(prefix[: len(MAGIC)])
        if len(prefix) < len(MAGIC) + _PREFIX.size:
            raise ValueError("not a snapshot file of this format (cut short)")
        n, _ = _PREFIX.unpack(prefix[len(MAGIC) :])
        return decode_header(prefix + f.read(min(n, MAX_HEADER_BYTES)))


def extras_of(header: dict) -> dict:
    return _from_json(header.get("extras", {}))


def parse(data: bytes | bytearray | memoryview) -> tuple[dict, dict, memoryview]:
    """(header, extras, payload) of a whole snapshot file's bytes; both checksums are checked."""
    header, start = decode_header(data)
    payload = memoryview(data)[start:]
    if len(payload) != header["payload_bytes"]:
        raise ValueError(f"payload of {len(payload)} bytes, header says {header['payload_bytes']}")
    hashed = PayloadHash()
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
        self.hashed = PayloadHash()

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
    """The header of a complete, undamaged snapshot file (both checksums checked, the payload piece by piece)."""
    header, start = read_header(path)
    hashed = PayloadHash()
    with open_private(path) as f:
        f.seek(start)
        for piece in _pieces(f, header["payload_bytes"], bytearray(min(chunk, max(1, header["payload_bytes"])))):
            hashed.update(piece)
        if f.read(1):
            raise ValueError("snapshot file longer than its header says")
    check_payload(header, hashed)
    return header
