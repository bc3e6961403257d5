"""The background save's parts on a real folder: a writer's part moved into place with its checksums, the
publisher's wait (for every announced writer; given up when the world changes) and which errors come back."""

from __future__ import annotations

import errno
import shutil
import threading
import time
from pathlib import Path

import pytest

from nanotron_recover.training.checkpoint_background import (
    WRITERS,
    BackgroundSave,
    announce_writer,
    host_room_bytes,
    wait_for_writers,
    write_part,
)
from nanotron_recover.training.checkpoint_integrity import CHECKSUM_KIND, file_checksum


def _writes(files: dict[str, bytes]):
    def write(folder: Path) -> None:
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return write


def test_a_writers_part_lands_in_the_save_folder_with_its_checksums(tmp_path: Path) -> None:
    announce_writer(tmp_path, "a")
    write_part(_writes({"model/w.safetensors": b"x" * 100, "optimizer/o.pt": b"y" * 7}), tmp_path, "a")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        f"{WRITERS}/a.done", f"{WRITERS}/a.pending", "model/w.safetensors", "optimizer/o.pt"]  # the part folder gone
    files = wait_for_writers(tmp_path, threading.Event())
    assert files == {name: {"bytes": (tmp_path / name).stat().st_size, CHECKSUM_KIND: file_checksum(tmp_path / name)}
                     for name in ("model/w.safetensors", "optimizer/o.pt")}


def test_the_publisher_waits_for_every_announced_writer(tmp_path: Path) -> None:
    announce_writer(tmp_path, "a")
    announce_writer(tmp_path, "b")
    write_part(_writes({"a.bin": b"1"}), tmp_path, "a")
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_writers(tmp_path, threading.Event())))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not found  # b announced itself and is not done
    write_part(_writes({"b.bin": b"22"}), tmp_path, "b")
    waiter.join(timeout=5)
    assert not waiter.is_alive() and sorted(found[0]) == ["a.bin", "b.bin"]


def test_a_save_given_up_stops_waiting_for_a_writer_that_never_finishes(tmp_path: Path) -> None:
    announce_writer(tmp_path, "dead")
    given_up = threading.Event()
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_writers(tmp_path, given_up)))
    waiter.start()
    time.sleep(0.1)
    given_up.set()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and found == [None]


def test_a_full_disk_comes_back_and_an_error_of_a_save_given_up_does_not(tmp_path: Path) -> None:
    def full(_: threading.Event) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    save = BackgroundSave(4, 0, tmp_path, full)
    save.wait()
    assert save.done() and isinstance(save.error(), OSError) and save.error().errno == errno.ENOSPC

    def broken(given_up: threading.Event) -> None:
        given_up.wait(5)
        raise FileNotFoundError(errno.ENOENT, "gone")

    save = BackgroundSave(6, 0, tmp_path, broken)
    assert save.error() is None and not save.done()  # running
    save.give_up()
    save.wait()
    assert save.error() is None  # given up: its folder is a leftover, its error nobody's

    save = BackgroundSave(8, 0, tmp_path, lambda _: (_ for _ in ()).throw(ValueError("a bug")))
    save.wait()
    assert isinstance(save.error(), ValueError)  # not given up, its folder exists: a bug is raised


def test_the_host_says_how_much_memory_a_copy_may_take() -> None:
    room = host_room_bytes()
    assert room is None or room > 0


@pytest.mark.parametrize("n", [1, 3])
def test_every_writer_done_merges_their_files(tmp_path: Path, n: int) -> None:
    for i in range(n):
        announce_writer(tmp_path, f"w{i}")
    for i in range(n):
        write_part(_writes({f"model/{i}.bin": bytes([i]) * (i + 1)}), tmp_path, f"w{i}")
    files = wait_for_writers(tmp_path, threading.Event())
    assert sorted(files) == [f"model/{i}.bin" for i in range(n)]
    assert [files[f"model/{i}.bin"]["bytes"] for i in range(n)] == [i + 1 for i in range(n)]


def test_a_save_whose_folder_a_newer_save_removed_stops_waiting(tmp_path: Path) -> None:
    announce_writer(tmp_path / "old", "dead")
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_writers(tmp_path / "old", threading.Event())))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    shutil.rmtree(tmp_path / "old")  # the next save's publisher removes leftovers
    waiter.join(timeout=5)
    assert not waiter.is_alive() and found == [None]


def test_a_wait_with_a_bound_returns_while_the_save_runs(tmp_path: Path) -> None:
    release = threading.Event()
    save = BackgroundSave(2, 0, tmp_path, lambda given_up: given_up.wait(10) or release.wait(10))
    t0 = time.monotonic()
    save.wait(0.2)
    assert not save.done() and time.monotonic() - t0 < 2
    save.give_up()
    release.set()
    save.wait()
    assert save.done() and save.error() is None


def test_the_publisher_waits_for_as_many_writers_as_the_strategy_says(tmp_path: Path) -> None:
    """A stale listing (a shared file system's cache) shows one writer of two: the publish must not go ahead on it."""
    announce_writer(tmp_path, "a")
    write_part(_writes({"a.bin": b"1"}), tmp_path, "a")
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(wait_for_writers(tmp_path, threading.Event(), writers=2)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not found  # a's part alone is not the save
    announce_writer(tmp_path, "b")
    write_part(_writes({"b.bin": b"22"}), tmp_path, "b")
    waiter.join(timeout=5)
    assert not waiter.is_alive() and sorted(found[0]) == ["a.bin", "b.bin"]
