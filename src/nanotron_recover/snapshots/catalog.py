"""The catalog of the snapshots on a node: file names keyed by (coordinate, history, step), and the scan that
finds the complete, readable ones of this run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

from nanotron_recover.snapshots.format import DamagedHeader, read_header
from nanotron_recover.snapshots.store import _say, _valid_id

SUFFIX = ".snap"
_FILE = re.compile(r"r(\d+)-c(\d+)\.h([0-9a-f]{8,64})\.s(\d+)" + re.escape(SUFFIX))


def file_name(name: str, history: str, step: int) -> str:
    return f"{name}.h{history}.s{step:010d}{SUFFIX}"


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
    ones, are refused (and said so). A file whose header fails its checksum is damaged: deleted, as a payload that
    fails its own is at the agreement, so that no launch tries it again."""
    found: list[Snapshot] = []
    if not Path(folder).is_dir():
        return found
    for path in sorted(Path(folder).glob(f"*{SUFFIX}")):
        try:
            header, n = read_header(path)
        except DamagedHeader as e:
            path.unlink(missing_ok=True)
            _say(log, f"local snapshot {path} is damaged ({e}): deleted; not used")
            continue
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
