"""Checksums of a checkpoint's files: written last into ``trainer_state.json``, verified before a checkpoint loads.

A save records, for every file it wrote, its size and its xxh3-64 checksum (the node-local snapshots' checksum:
several GB/s, so reading the files back costs more than hashing them), and seals the state file with a checksum of
its own content. A load checks them before anything is read into the model: a flipped region, a truncation or a
missing file anywhere in a checkpoint makes it *damaged*, and the relaunch falls back to the newest intact one.
The work of verifying is shared: with ``count`` ranks, rank ``index`` checks every ``count``-th file, and the
verdict is agreed by gathering every rank's findings. Checkpoints written before checksums existed carry none: they
load unverified (said once). Standard library and xxhash only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

STATE_FILE = "trainer_state.json"
CHECKSUM_KIND = "xxh3_64"
FILES_KEY = "files"  # {relative path: {"bytes": n, "xxh3_64": hex}}
SEAL_KEY = "state_checksum"  # the checksum of the state file's other keys
PUBLISHING_MARKER = ".publishing"  # written before the rename into place, removed once ``latest.txt`` names the step
READ_BYTES = 4 * 2**20


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match what its save recorded (or whose state file cannot be read)."""


def file_checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    return f"{digest.intdigest():016x}"


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and checksum of every file under ``folder`` except the state file (which holds the manifest) and the
    publish marker (removed once the pointer names the folder: its absence must not make the folder damaged)."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in (STATE_FILE, PUBLISHING_MARKER))
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, CHECKSUM_KIND: file_checksum(p)}
            for p in files}


def _seal_of(state: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in state.items() if k != SEAL_KEY}, sort_keys=True).encode()
    return f"{xxhash.xxh3_64_intdigest(body):016x}"


def sealed_state_text(state: dict[str, Any]) -> str:
    """The state file's text: ``state`` plus the seal over it."""
    return json.dumps({**state, SEAL_KEY: _seal_of(state)}, indent=2)


def read_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.json``; :class:`DamagedCheckpoint` if it cannot be parsed, is not a
    mapping, lacks a step, or does not match its seal (a state file without a seal is an older checkpoint's)."""
    path = Path(folder) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DamagedCheckpoint(f"{path} does not hold a checkpoint's state (no step)")
    if SEAL_KEY in state and state[SEAL_KEY] != _seal_of(state):
        raise DamagedCheckpoint(f"{path} does not match its own checksum")
    return state


def is_verifiable(state: dict[str, Any]) -> bool:
    return isinstance(state.get(FILES_KEY), dict)


def verify_share(folder: Path, state: dict[str, Any], index: int = 0, count: int = 1) -> list[str]:
    """Check this rank's share of the recorded files (every ``count``-th, from ``index``): one line per problem
    (a missing file, a wrong size, a wrong checksum), each naming the file. Empty: the share is intact."""
    recorded = state.get(FILES_KEY) or {}
    problems = []
    for name in sorted(recorded)[index::count]:
        path = Path(folder) / name
        want = recorded[name]
        try:
            size = path.stat().st_size
            if size != want.get("bytes"):
                problems.append(f"{path}: {size} bytes, the save wrote {want.get('bytes')}")
            elif file_checksum(path) != want.get(CHECKSUM_KIND):
                problems.append(f"{path}: checksum differs from the one recorded at the save")
        except OSError as e:
            problems.append(f"{path}: cannot be read ({type(e).__name__}: {e})")
    return problems


def verify_folder(folder: Path) -> list[str]:
    """The whole check of one checkpoint by one process, one line per problem (empty: intact). The state file must
    parse, match its seal and carry checksums (this version always writes them); every recorded size is checked
    before any checksum, so a truncated or missing file is found without reading the others."""
    try:
        state = read_state(folder)
    except DamagedCheckpoint as e:
        return [str(e)]
    if SEAL_KEY not in state or not is_verifiable(state):
        return [f"{Path(folder) / STATE_FILE} carries no checksums of its files"]
    return _size_problems(Path(folder), state[FILES_KEY]) or verify_share(folder, state)


def _size_problems(folder: Path, recorded: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for name in sorted(recorded):
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError as e:
            problems.append(f"{path}: cannot be read ({type(e).__name__}: {e})")
            continue
        if size != recorded[name].get("bytes"):
            problems.append(f"{path}: {size} bytes, the save wrote {recorded[name].get('bytes')}")
    return problems
