"""The snapshot file format: a fixed binary header and JSON (never pickle), the payload's checksum, and reading a
payload into state tensors piece by piece."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

import torch
import xxhash

from nanotron_recover.snapshots.store import open_private
from nanotron_recover.training.training_state import local_tensor

MAGIC = b"NRSNAP02"
CHUNK_BYTES = 16 * 2**20  # a relaunch's transfer and reads go in pieces of this size: bounded memory
MAX_HEADER_BYTES = 64 * 2**20
_U32 = struct.Struct("<I")


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
