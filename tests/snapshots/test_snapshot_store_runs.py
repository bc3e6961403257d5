"""The node-local snapshot store with real training runs (``mpirun --with-ft ulfm``, 2 ranks).

* **Another user's store** (issue #23, item 4): a second Unix user (made here with ``useradd``) owns the snapshot
  folder the victim's run is configured with and plants a snapshot for the victim's run id in it, in the old
  pickle format, whose unpickling would create a marker file. The victim's run refuses the folder (and says so),
  trains from step 1, and the marker never appears. The victim's own store is 0700 / 0600 and the other user
  cannot read it.
* **A full store** (item 5): ``local_snapshot_dir`` on a small tmpfs (mounted here), filled up after the launch
  (past the launcher's free-space check): the run finishes, no ``.tmp`` is left, and the output says why
  snapshots turned off.
"""

from __future__ import annotations

import os
import pickle
import pwd
import secrets
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.launcher.runs import run_training, write_config
from nanotron_recover.run.run_folder import ensure_run_id, last_logged_step, read_metrics
from tests.conftest import make_tiny_config
from tests.snapshots.snapshot_world import mounted_tmpfs
from tests.snapshots.test_local_snapshot_resume import launch_and_kill_the_job

TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT_S)]


def tiny(store: Path, steps: int) -> dict:
    ft = {"enabled": True, "reduce_bucket_mb": 0.01, "local_snapshot_dir": str(store), "local_snapshot_interval": 1}
    return make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2, fault_tolerance=ft)


# ------------------------------------------------------------------------------------------- another user
@pytest.fixture
def other_user():
    name = f"nrtest{secrets.token_hex(3)}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a second user here: {made.stderr.decode().strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def shared_dir():
    """A world-writable sticky folder both users reach, like ``/dev/shm`` (pytest's own tmp dirs are root's 0700)."""
    path = Path(f"/tmp/nr-shared-{secrets.token_hex(4)}")
    path.mkdir()
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def old_format_snapshot(run: str, marker: Path) -> bytes:
    """A file in the old format (``NRSNAP01``: JSON header, then pickled extras) claiming step 99 of ``run``."""
    head = (b'{"run_id": "%s", "config_hash": "x", "coord": 0, "step": 99, "crc32": 0, "payload_bytes": 0}'
            % run.encode())
    blob = pickle.dumps(_Planted(marker))
    return b"NRSNAP01" + struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(blob)) + blob


def as_user(user: pwd.struct_passwd, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], user=user.pw_uid, group=user.pw_gid, capture_output=True, text=True,
                          timeout=60)


def test_a_store_planted_by_another_user_is_neither_loaded_nor_executed(other_user, shared_dir, tmp_path):
    run_dir = tmp_path / "victim"
    run = ensure_run_id(run_dir)  # the victim's run exists (a relaunch would come next)
    marker = tmp_path / "pwned"
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Planted(control)))  # noqa: S301 - the control: unpickling the plant does run it
    assert control.exists()
    staged = shared_dir / "staged"
    staged.write_bytes(old_format_snapshot(run, marker))
    staged.chmod(0o644)
    store = shared_dir / "store"
    node = store / run / socket.gethostname()
    planted = as_user(other_user, f"mkdir -p {node} && cp {staged} {node}/r0-c0.h0000000000aa.s0000000099.snap && "
                                  f"chmod -R a+rwX {store}")
    assert planted.returncode == 0, planted.stderr
    assert os.lstat(store).st_uid == other_user.pw_uid

    result = run_training(tiny(store, 2), run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    assert not marker.exists(), "the planted pickle ran"
    assert f"owned by uid {other_user.pw_uid}, not by this user" in result.output, result.output[-3000:]
    assert "turned off" in result.output and "resumed from the local snapshot" not in result.output
    assert [s["step"] for s in result.steps] == [1, 2]  # from scratch: nothing of the plant was loaded

    own = shared_dir / "own"
    again = tmp_path / "again"
    launch_and_kill_the_job(write_config(tiny(own, 20), again / "config.yaml"), again, 2)
    dirs = [own, *[p for p in own.rglob("*") if p.is_dir()]]
    files = [p for p in own.rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.lstat().st_mode) for p in dirs} == {0o700}
    assert {stat.S_IMODE(p.lstat().st_mode) for p in files} == {0o600}
    assert as_user(other_user, f"cat {files[0]} > /dev/null").returncode != 0  # the other user cannot read it


# ------------------------------------------------------------------------------------------- a full store
@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "shm", "size=4m,mode=0700") as mount:
        yield mount


def fill(folder: Path) -> None:
    """Take every free byte of ``folder``'s file system."""
    with open(folder / "filler", "wb") as f:
        piece = b"\0" * 65536
        try:
            while True:
                f.write(piece)
                f.flush()
        except OSError:
            pass


def written_snapshots(mount: Path) -> list[Path]:
    """The complete snapshot files in the store (a rank has passed its start-up space check and writes)."""
    return [p for p in mount.rglob("*") if p.is_file() and not p.name.endswith(".tmp") and p.name != "filler"]


def test_a_full_store_does_not_end_the_run(small_tmpfs, tmp_path):
    steps = 600  # a step takes 7-15 ms here: enough of them that snapshots are still being written after the fill
    run_dir = tmp_path / "run"
    config_path = write_config(tiny(small_tmpfs / "store", steps), run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    log = open(tmp_path / "output.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not written_snapshots(small_tmpfs):
            time.sleep(0.01)
        filled_at = last_logged_step(run_dir)
        fill(small_tmpfs)  # past the launcher's and the ranks' checks: the next snapshot writes find no space
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    log.seek(0)
    output = log.read()
    said = "\n".join(line for line in output.splitlines() if not line.startswith("[step"))  # what is not a step
    assert [s["step"] for s in read_metrics(run_dir)[0]] == list(range(1, steps + 1)), said[-3000:]
    assert filled_at < steps, f"the run had ended before the store was filled\n{said[-3000:]}"
    assert "local snapshots turned off on this rank: no space left in" in output, said[-3000:]
    assert "partial file was removed" in output
    assert not list(small_tmpfs.rglob("*.tmp"))
    assert not (small_tmpfs / "store" / ensure_run_id(run_dir)).exists()  # the finished run removed its folder
