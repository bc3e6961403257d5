"""A relaunch's agreement and transfer: which (history, step) every rank loads, who sends each coordinate to the
ranks whose node lacks it, the chunked stream over MPI (bounded memory), and the one line that says what was
loaded."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, BinaryIO, Iterable, NamedTuple, Sequence

import torch

from nanotron_recover.snapshots.format import CHUNK_BYTES, PayloadSink, _pieces, decode_header, read_header
from nanotron_recover.snapshots.store import open_private


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
    """Pour this rank's own snapshot file into its state, piece by piece (both checksums checked on the way)."""
    header, start = read_header(path)
    sink = PayloadSink(tensors, header)
    with open_private(path) as f:
        f.seek(start)
        for piece in _pieces(f, header["payload_bytes"], bytearray(min(chunk, max(1, header["payload_bytes"])))):
            sink.feed(piece)
    sink.check(header)
    return header


class Loaded(NamedTuple):
    """What one rank loaded at a relaunch, gathered once every rank has: the launch's one line about it."""

    rank: int  # its world rank
    coord: int
    sender: int | None  # the world rank it received its state from; None: its node's own file
    checksum: str  # the payload's


SHOWN = 8  # receivers or coordinates the line names; the rest are counted


def resumed_line(step: int, history: str, loaded: Sequence[Loaded]) -> str:
    """What a launch says about its resume, once (from one rank; every rank's line would repeat it): the payload
    checksum of each coordinate (two, joined by ``/``, would be a bug: replicas of a coordinate must agree) and
    which ranks received their state over MPI, from whom."""
    sums: dict[int, list[str]] = {}
    for item in loaded:
        seen = sums.setdefault(item.coord, [])
        if item.checksum not in seen:
            seen.append(item.checksum)
    coords = [f"coordinate {coord} {'/'.join(seen)}" for coord, seen in sorted(sums.items())]
    received = [f"rank {i.rank} received from rank {i.sender}" for i in sorted(loaded) if i.sender is not None]
    over_mpi = f"{len(received)} received it over MPI" + (f": {_named(received)}" if received else "")
    return (f"resumed from the local snapshot of step {step} (history {history}, {len(loaded)} rank(s); payload "
            f"checksum of {_named(coords)}; {len(loaded) - len(received)} rank(s) read their node's file, {over_mpi})")


def _named(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown if len(items) <= SHOWN else f"{shown} and {len(items) - SHOWN} more"
