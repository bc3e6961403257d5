"""A full disk, named: recognizing it in whatever error a writer raised, and the one line that says it.

A full file system (ENOSPC) or an exhausted quota (EDQUOT) is not a fault that a relaunch repairs: the job ends
for a person, with the path, the free space and what was kept. The writers do not all say it the same way: Python
raises ``OSError`` with the errno, safetensors wraps the OS error in its own exception's text (``StorageFull``), and
torch's zip writer says only ``file write failed`` (then ``unexpected pos`` as it closes); for a writer given its
path, the free space of the file system then settles it. Standard
library only.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")
NEARLY_FULL_BYTES = 2**20  # below this, a write that failed without saying why failed for lack of space


def free_bytes(path: Path) -> int | None:
    """Free bytes of the file system holding ``path`` (its nearest existing ancestor), or None."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def is_disk_full(error: BaseException, path: Path | None = None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a write that failed for lack of space or quota.
    ``path``: where it wrote, for writers that do not say why: any error with that file system nearly full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_ERRNOS:
            return True
        if any(text in str(current) for text in FULL_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    if path is not None:  # torch's zip writer: "file write failed", then "unexpected pos" on closing
        free = free_bytes(path)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


def written_path(error: BaseException, fallback: Path | None = None) -> Path | None:
    """The file a failed write named (``OSError.filename``), else ``fallback``."""
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, OSError) and current.filename:
            return Path(current.filename)
        current = current.__cause__ or current.__context__
    return fallback


def full_disk_line(path: Path | None, kept: str) -> str:
    """The one line a person reads: what was full, how much is free there now, what was kept."""
    free = free_bytes(path) if path is not None else None
    room = f"{free / 2**20:.1f} MiB free there now" if free is not None else "free space unknown"
    return (f"disk full (ENOSPC or quota) writing {path if path is not None else 'the run folder'} ({room}); "
            f"kept: {kept}; nothing partial was published. Free space, then relaunch: nothing committed is lost")


class DiskFull(OSError):
    """A checkpoint write that ran out of space; its partial folder is already removed."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(errno.ENOSPC, f"no space left writing a checkpoint ({type(cause).__name__}: {cause})",
                         str(path))
