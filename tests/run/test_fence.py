"""The fence (``nanotron_recover.run.fence``): a rank of a replaced launch ends at its next write and writes nothing.

Real processes: each case runs a small Python program that arms the fence for a launch token and then writes through
the run folder's own writers (an exit record, an event line), with the folder owned by that launch, by another one,
or by none; the test reads what the folder holds afterwards and how the process ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_recover.run import fence
from nanotron_recover.run.fence_audit import writes_after_replacement
from nanotron_recover.run.run_folder import (
    EXTERNAL_PREFIX,
    begin_launch,
    fault_marker_path,
    read_exits,
    read_metrics_jsonl,
)

WRITER = """import sys
from pathlib import Path
from nanotron_recover.run import fence, run_folder
run_dir, token = Path(sys.argv[1]), sys.argv[2]
fence.arm(run_dir, token)
run_folder.append_metrics_record(run_dir, {"event": "probe"}, launch=token)
run_folder.record_exit(run_dir, 7, 3, "probe")
print("wrote", flush=True)
"""


def _write_as(run_dir: Path, token: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITER, str(run_dir), token], capture_output=True, text=True,
                          timeout=60)


def test_a_rank_of_the_launch_that_owns_the_folder_writes(tmp_path):
    begin_launch(tmp_path, {"token": "aaaa"})
    assert fence.current_launch(tmp_path) == "aaaa"
    done = _write_as(tmp_path, "aaaa")
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    assert [r["launch"] for r in read_metrics_jsonl(tmp_path)] == ["aaaa"]
    assert read_exits(tmp_path)[7]["reason"] == "probe"


def test_a_rank_of_a_replaced_launch_ends_at_its_first_write_and_writes_nothing(tmp_path):
    begin_launch(tmp_path, {"token": "aaaa"})
    begin_launch(tmp_path, {"token": "bbbb"})  # relaunched: the folder is launch bbbb's now
    done = _write_as(tmp_path, "aaaa")
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr)
    assert "fenced: launch aaaa was replaced by launch bbbb" in done.stderr
    assert "wrote" not in done.stdout
    assert read_metrics_jsonl(tmp_path) == [] and read_exits(tmp_path) == {}


def test_a_launch_without_a_token_of_its_own_fences_every_launchers_rank(tmp_path):
    begin_launch(tmp_path, {"token": "aaaa"})
    begin_launch(tmp_path, {})  # a batch script's launch: its ranks say no token
    assert fence.current_launch(tmp_path) == fence.UNNAMED
    assert _write_as(tmp_path, "aaaa").returncode == -signal.SIGKILL


@pytest.mark.parametrize("owner", [None, "bbbb"])
def test_a_rank_started_by_hand_is_never_fenced(tmp_path, owner):
    if owner:
        begin_launch(tmp_path, {"token": owner})
    done = _write_as(tmp_path, fence.NOT_A_LAUNCHERS)
    assert done.returncode == 0, done.stderr
    assert read_exits(tmp_path)[7]["code"] == 3


def test_a_folder_no_launcher_named_fences_nobody(tmp_path):
    assert fence.current_launch(tmp_path) is None
    assert _write_as(tmp_path, "aaaa").returncode == 0


def test_the_check_in_this_process_follows_the_current_file(tmp_path):
    try:
        fence.arm(tmp_path, "aaaa")
        assert fence.replaced_by() is None
        begin_launch(tmp_path, {"token": "aaaa"})
        assert fence.replaced_by() is None
        begin_launch(tmp_path, {"token": "cccc"})
        assert fence.replaced_by() == "cccc"
    finally:
        fence.disarm()
    assert fence.replaced_by() is None


def test_the_audit_names_what_a_replaced_launch_wrote(tmp_path):
    """``writes_after_replacement`` on a folder written by hand: launch aaaa at t=100, then bbbb at t=200; a line of
    aaaa after bbbb began, a stacks file nobody of bbbb reported, an exit record of a rank that bbbb did not have."""
    launches = [{"launch": 1, "time": 100.0, "token": "aaaa", "world_size": 4},
                {"launch": 2, "time": 200.0, "token": "bbbb", "world_size": 2}]
    (tmp_path / "launches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in launches))
    marker = fault_marker_path(tmp_path, f"{EXTERNAL_PREFIX}hangs-written-by-hand")  # the session's false-alarm
    marker.parent.mkdir()  # scan: these hangs are made up, "provoked" from t=0 on (before their made-up times)
    marker.write_text(json.dumps({"external": "hangs-written-by-hand", "time": 0.0}))
    lines = [{"step": 1, "loss": 1.0, "time": 150.0, "launch": "aaaa"},
             {"step": 2, "loss": 1.0, "time": 201.0, "launch": "bbbb"},
             {"event": "hang_detected", "by_rank": 1, "wall_time": 202.0, "launch": "bbbb"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "rank-1-step-2.txt").write_text("stacks")  # reported by rank 1 of bbbb: its own
    os.utime(tmp_path / "hangs" / "rank-1-step-2.txt", (202.0, 202.0))
    assert writes_after_replacement(tmp_path) == []
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "hang_detected", "by_rank": 3, "wall_time": 203.0, "launch": "aaaa"}) + "\n")
    (tmp_path / "hangs" / "rank-3-step-1.txt").write_text("stacks")
    os.utime(tmp_path / "hangs" / "rank-3-step-1.txt", (203.0, 203.0))
    (tmp_path / "exits").mkdir()
    (tmp_path / "exits" / "rank-3.json").write_text(json.dumps({"rank": 3, "code": 3, "reason": "x"}))
    (tmp_path / "exits" / "rank-1.json").write_text(json.dumps({"rank": 1, "code": 0, "reason": "x"}))
    assert writes_after_replacement(tmp_path) == [
        "a line of launch aaaa at 203.000, while launch bbbb owned the folder: hang_detected",
        "rank-3-step-1.txt, written at 203.000 by no rank of launch bbbb",
        "an exit record of rank 3 among launch 2's (2 ranks)"]


def test_the_startup_watchdog_writes_no_exit_record_for_a_replaced_launch(tmp_path):
    """The start-up watchdog (forked before MPI, after the fence is armed) records a rank's timeout unless its launch
    was replaced."""
    from nanotron_recover.process.watchdog import _write_exit_record

    path = tmp_path / "exits" / "rank-5.json"
    begin_launch(tmp_path, {"token": "aaaa"})
    try:
        fence.arm(tmp_path, "aaaa")
        _write_exit_record(path, "start-up timeout")
        assert read_exits(tmp_path)[5]["reason"] == "start-up timeout"
        path.unlink()
        begin_launch(tmp_path, {"token": "bbbb"})
        _write_exit_record(path, "start-up timeout")
        assert not path.exists()
    finally:
        fence.disarm()
