"""A full disk is recognized in the shapes its writers report it."""

from __future__ import annotations

import errno
from pathlib import Path

from nanotron_recover.run.disk_space import DiskFull, full_disk_line, is_disk_full, written_path


def test_full_disk_errors_are_recognized_whatever_raised_them(tmp_path: Path) -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device", "/x/y"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull })'))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/run/ckpt/a.pt")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer) and written_path(outer) == Path("/run/ckpt/a.pt")
    assert not is_disk_full(RuntimeError("file write failed"), tmp_path)  # this disk has room: another cause
    assert not is_disk_full(ValueError("a bug"))


def test_the_line_names_the_path_the_free_space_and_what_was_kept(tmp_path: Path) -> None:
    line = full_disk_line(tmp_path / "checkpoints" / ".tmp-step-6", "the checkpoint of step 4")
    assert str(tmp_path / "checkpoints" / ".tmp-step-6") in line and "MiB free" in line and "step 4" in line
    error = DiskFull(tmp_path, RuntimeError("x"))
    assert error.errno == errno.ENOSPC and is_disk_full(error)
