"""The snapshot store: a private folder per user and run on each node (0700, files 0600, no links followed),
the names and ids in it, the space it leaves free, and the removal of other runs' stale folders."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from nanotron_recover.snapshots.settings import SnapshotSettings

RESERVED_FRACTION = 10  # snapshots leave 1/10 of their file system free
_ID = re.compile(r"[0-9a-f]{8,64}")  # run ids and history ids: they become path components
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
PREFIX = "[nanotron-recover]"


class StoreRefused(ValueError):
    """The snapshot store (or a file in it) is not this user's private one: never used."""


def _say(log: Callable[[str], None], message: str) -> None:
    log(f"{PREFIX} {message}")
    sys.stdout.flush()


def node_folder_name(name: str) -> str:
    """A node's name as a path component: refused unless a plain host name."""
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


def snapshot_folder(settings: SnapshotSettings, run_id: str) -> Path:
    """This node's folder of the snapshots of run ``run_id`` (the node the settings name)."""
    return settings.folder / run_id / node_folder_name(settings.node)


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
