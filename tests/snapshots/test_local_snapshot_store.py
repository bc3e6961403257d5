"""The node-local snapshot store without processes: the binary header, no pickle, a private store (modes, owners,
links, run ids), stale runs, a full tmpfs (a real one, mounted here), histories kept apart across launches, and a
damaged agreed file that is deleted and replaced by the one before (no restart loop).

Resume logic runs here against a one-rank world (the multi-rank agreement runs for real in
``test_snapshot_histories.py``)."""

from __future__ import annotations

import os
import pickle
import stat
import struct
import time
from pathlib import Path

import pytest
import torch
import xxhash

from nanotron_recover.run.run_folder import ensure_run_id, run_id
from nanotron_recover.snapshots.catalog import scan
from nanotron_recover.snapshots.format import MAGIC, DamagedHeader, decode_header, encode_header, verify_file
from nanotron_recover.snapshots.local_snapshot import LocalSnapshots
from nanotron_recover.snapshots.store import StoreRefused, private_dir, private_tree, remove_stale_runs
from nanotron_recover.snapshots.writer import SnapshotWriter
from tests.snapshots.snapshot_world import config, mounted_tmpfs, training_state, write_line
from tests.snapshots.test_local_snapshot import flip_a_digit

RUN, CONFIG = "00000000000000aa", "cfg-a"
OTHER_UID = 65534  # nobody: a uid that is not ours (we run as root: chown works without a real user)


def tensors(seed: float) -> list[torch.Tensor]:
    return [torch.full((5,), seed, dtype=torch.bfloat16), torch.arange(7, dtype=torch.float32) + seed,
            torch.tensor(seed)]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------------------------- the format
def test_the_header_round_trips_and_damaged_headers_are_refused():
    header = {"step": 3, "coord": 1, "checksum": "xxh3_64:0000000000000007", "payload_bytes": 0, "tensors": [],
              "extras": {"x": 1.5}}
    data = encode_header(header)
    assert data.startswith(MAGIC) and decode_header(data + b"payload") == (header, len(data))
    flipped = bytearray(data)
    flipped[data.index(b"1.5") + 2] ^= 0x06  # 1.5 -> 1.3: still JSON, not the header written
    for bad in (data[:-1], b"NRSNAP01" + data[8:], data[:8] + struct.pack("<I", 2**31) + data[12:],
                MAGIC + struct.pack("<IQ", 2, xxhash.xxh3_64_intdigest(b"{]")) + b"{]", bytes(flipped)):
        with pytest.raises(ValueError):
            decode_header(bad)
    with pytest.raises(DamagedHeader, match="header checksum"):
        decode_header(bytes(flipped))


class _Planted:
    """Unpickling this creates a marker file: what an attacker's snapshot would do to a reader that unpickles."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_an_old_format_file_with_a_pickle_is_neither_loaded_nor_executed(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Planted(str(marker)))
    head = b'{"run_id": "%s", "config_hash": "%s", "coord": 0, "step": 9}' % (RUN.encode(), CONFIG.encode())
    planted = tmp_path / "r0-c0.h0000000000aa.s0000000009.snap"
    planted.write_bytes(b"NRSNAP01" + struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(blob)) + blob)
    planted.chmod(0o600)
    said: list[str] = []
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == []
    assert not marker.exists() and "not a snapshot file of this format" in said[0]


# ------------------------------------------------------------------------------------------- a private store
def test_the_store_is_private_0700_folders_and_0600_files(tmp_path):
    umask = os.umask(0o022)  # the usual one: 0755 folders and 0644 files unless the store asks for less
    try:
        folder = private_tree(tmp_path / "store", RUN, "node1")
        writer = SnapshotWriter(folder, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0)
        writer.write(1, tensors(1.0), {})
        writer.close()
    finally:
        os.umask(umask)
    assert [mode(p) for p in (tmp_path / "store", tmp_path / "store" / RUN, folder)] == [0o700] * 3
    assert [mode(p) for p in folder.iterdir()] == [0o600]
    (tmp_path / "loose").mkdir(mode=0o755)
    private_dir(tmp_path / "loose")
    assert mode(tmp_path / "loose") == 0o700  # our own folder with a loose mode is tightened


def test_a_store_owned_by_another_user_or_a_link_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreRefused, match="owned by uid 65534, not by this user"):
        private_dir(theirs)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(StoreRefused, match="not a folder"):
        private_dir(tmp_path / "link")


def test_a_file_of_another_user_or_readable_by_others_is_refused(tmp_path):
    writer = SnapshotWriter(tmp_path, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0)
    writer.write(1, tensors(1.0), {})
    writer.close()
    (path,) = tmp_path.glob("*.snap")
    path.chmod(0o644)
    said: list[str] = []
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == [] and "refused" in said[0]
    path.chmod(0o600)
    os.chown(path, OTHER_UID, OTHER_UID)
    assert scan(tmp_path, RUN, CONFIG, log=said.append) == [] and "owner uid 65534" in said[1]


def test_a_run_id_that_is_not_hex_never_becomes_a_path(tmp_path):
    (tmp_path / "run_id.txt").write_text("../../../not-a-run-nr\n")  # a traversal (harmless target)
    assert run_id(tmp_path) is None
    with pytest.raises(ValueError, match="does not hold a run id"):
        ensure_run_id(tmp_path)


def test_only_other_runs_untouched_for_long_are_removed(tmp_path):
    for name in ("crashed", "recent", RUN):
        (tmp_path / name / "node").mkdir(parents=True)
        (tmp_path / name / "node" / "f.snap").write_bytes(b"x")
    old = time.time() - 10 * 24 * 3600
    for path in (tmp_path / "crashed", tmp_path / "crashed" / "node", tmp_path / "crashed" / "node" / "f.snap",
                 tmp_path / RUN / "node" / "f.snap"):
        os.utime(path, (old, old))
    assert remove_stale_runs(tmp_path, keep=RUN, max_age_s=3 * 24 * 3600, log=lambda m: None) == [tmp_path / "crashed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["recent", RUN])


# ------------------------------------------------------------------------------------------- a full store
@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "size=256k") as mount:
        yield mount


def test_a_full_store_turns_snapshots_off_leaving_no_partial_file(small_tmpfs):
    said: list[str] = []
    writer = SnapshotWriter(small_tmpfs, "r0-c0", run_id=RUN, config_hash=CONFIG, coord=0, log=said.append)
    big = [torch.zeros(100 * 1024 // 4)]  # 100 KiB: two files fit, the third does not (256 KiB)
    for step in range(1, 6):
        writer.write(step, big, {})
    writer.close()  # never raises
    assert writer.failed is not None and not list(small_tmpfs.glob("*.tmp"))
    assert len(said) == 1 and "no space left" in said[0] and "turned off" in said[0], said
    assert [s.step for s in scan(small_tmpfs, RUN, CONFIG)] == [1, 2]  # the complete ones stay usable


# ------------------------------------------------------------------------------------------- resuming
class OneRankWorld:
    """The world of a one-rank job (what ``FTWorld`` gives a single rank): the agreement logic without processes."""

    rank = 0

    def allgather_object(self, obj):
        return [obj]

    def exchange_bytes(self, sends, recv_from, recv_size=0):
        raise AssertionError("a one-rank world has nobody to exchange with")


def launch(tmp_path: Path, log: list[str]) -> LocalSnapshots:
    return LocalSnapshots.for_config(config(tmp_path / "store"), tmp_path / "run", OneRankWorld(), replica=0, coord=0,
                          log=log.append)


def test_a_relaunch_writes_a_new_history_and_keeps_the_file_it_resumed_from(tmp_path):
    said: list[str] = []
    first = launch(tmp_path, said)
    assert first.resume(training_state(0.0), None) is None
    for step in (1, 2, 3):
        first.after_commit(step, training_state(float(step)))
    first.finish()
    second = launch(tmp_path, said)
    state = training_state(0.0)
    assert second.resume(state, None) == 3 and float(state.named_params[0][1].detach()[0]) == 3.0
    assert second.history != first.history
    second.after_commit(4, training_state(4.0))
    second.finish()
    files = sorted(p.name for p in second.folder.glob("*.snap"))
    assert any(f".h{first.history}.s0000000003" in f for f in files), files  # resumed from: still there
    assert any(f".h{second.history}.s0000000004" in f for f in files), files
    second.after_commit(5, training_state(5.0))
    second.finish()
    assert all(f".h{second.history}." in p.name for p in second.folder.glob("*.snap"))  # 2 own: old line gone


def test_files_newer_than_the_resumed_step_are_deleted(tmp_path):
    """Two coordinates; step 3 is not whole in any history (coordinate 1's copy is of another launch): step 2 is
    resumed and every step-3 file goes, so that no later launch mixes them."""
    cfg = config(tmp_path / "store")
    cfg.ranks_per_replica = 2
    snapshots = LocalSnapshots.for_config(cfg, tmp_path / "run", OneRankWorld(), replica=0, coord=0, log=lambda m: None)
    h, other = "0000000000a1", "0000000000b2"
    for coord, history, steps in ((0, h, [2, 3]), (1, h, [1, 2]), (1, other, [3])):
        write_line(snapshots.folder, snapshots.run_id, snapshots.config_hash, coord, history, steps)
    assert snapshots.resume(training_state(0.0), None) == 2
    left = sorted((s.step, s.history, s.coord) for s in scan(snapshots.folder, snapshots.run_id, snapshots.config_hash))
    assert left == [(1, h, 1), (2, h, 0), (2, h, 1)], left


def two_steps_written(tmp_path: Path, said: list[str]) -> Path:
    """A launch that snapshots steps 1 and 2 and finishes; -> the file of step 2."""
    first = launch(tmp_path, said)
    first.resume(training_state(0.0), None)
    for step in (1, 2):
        first.after_commit(step, training_state(float(step)))
    first.finish()
    (newest,) = [p for p in first.folder.glob("*.snap") if p.name.endswith("s0000000002.snap")]
    return newest


def test_a_damaged_agreed_file_is_deleted_and_the_one_before_is_loaded(tmp_path):
    said: list[str] = []
    newest = two_steps_written(tmp_path, said)
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    state = training_state(0.0)
    assert launch(tmp_path, said).resume(state, None) == 1 and float(state.named_params[0][1].detach()[0]) == 1.0
    assert not newest.exists() and any("damaged" in m and "deleted" in m for m in said)
    with pytest.raises(FileNotFoundError):
        verify_file(newest)
    assert launch(tmp_path, said).resume(training_state(0.0), None) == 1  # the next launch too: no loop


def test_a_flipped_byte_in_the_newest_files_extras_is_never_applied_the_one_before_is_loaded(tmp_path):
    """A digit of the saved learning rate flipped on disk (0.001 -> 0.007): the file is damaged, deleted, and the
    step before is resumed with its own learning rate; the flipped value never reaches the optimizer."""
    said: list[str] = []
    newest = two_steps_written(tmp_path, said)
    flip_a_digit(newest, b'"param_groups"', b"0.001")
    state = training_state(0.0)
    state.optimizer.param_groups[0]["lr"] = 0.5  # what the resume must overwrite
    assert launch(tmp_path, said).resume(state, None) == 1 and float(state.named_params[0][1].detach()[0]) == 1.0
    assert state.optimizer.param_groups[0]["lr"] == 1e-3
    assert not newest.exists() and any("damaged" in m and "deleted" in m for m in said), said


def test_a_store_of_another_user_turns_snapshots_off_and_the_run_goes_on(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o777)
    os.chown(store, OTHER_UID, OTHER_UID)
    said: list[str] = []
    snapshots = launch(tmp_path, said)
    assert snapshots.resume(training_state(0.0), None) is None
    snapshots.after_commit(1, training_state(1.0))
    snapshots.remove()
    assert not snapshots.writing and any("owned by uid 65534" in m and "turned off" in m for m in said), said
    assert list(store.iterdir()) == []


def test_a_node_without_room_for_its_ranks_snapshots_turns_them_off_at_start(small_tmpfs):
    said: list[str] = []
    cfg = config(small_tmpfs / "store")
    snapshots = LocalSnapshots.for_config(cfg, small_tmpfs / "run", OneRankWorld(), replica=0, coord=0, log=said.append)
    assert snapshots.resume(training_state(0.0, numel=30_000), None) is None  # 3 x 360 KB > 256 KiB
    assert not snapshots.writing and any("need" in m and "larger folder" in m for m in said), said
    snapshots.after_commit(1, training_state(1.0, numel=30_000))
    snapshots.remove()
    assert not list(small_tmpfs.rglob("*.snap"))
