"""The start-up watchdog: a real forked process that ends a rank that is not ready in time (or leaves quietly)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from nanotron_recover.run.procfs import process_is_gone

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        from nanotron_recover.process.watchdog import StartupWatchdog
        {body}
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_a_rank_not_ready_in_time_is_killed_and_says_why(tmp_path) -> None:
    record = tmp_path / "exits" / "rank-5.json"
    t0 = time.monotonic()
    proc = _run(f"w = StartupWatchdog(1.0, 'rank 5', exit_record=__import__('pathlib').Path({str(record)!r}))\n"
                "        time.sleep(30)")
    elapsed = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    assert elapsed < 10, elapsed
    assert "rank 5 not ready to train after startup_timeout_s=1 s" in proc.stderr
    assert json.loads(record.read_text()) == {"rank": 5, "code": 3, "reason": json.loads(record.read_text())["reason"]}
    assert "startup_timeout_s=1" in json.loads(record.read_text())["reason"]


def test_a_frozen_rank_is_killed_too() -> None:
    """SIGSTOP runs none of the rank's threads; the watchdog is another process."""
    proc = _run("import os, signal\n"
                "        w = StartupWatchdog(1.0, 'rank 0')\n"
                "        os.kill(os.getpid(), signal.SIGSTOP)")
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)


def test_disarmed_in_time_the_rank_lives_on_and_the_watchdog_is_gone() -> None:
    proc = _run("import os\n"
                "        w = StartupWatchdog(1.0, 'rank 0')\n"
                "        w.disarm(); time.sleep(2.0)\n"
                "        try:\n"
                "            os.kill(w.child_pid, 0); print('child alive')\n"
                "        except ProcessLookupError:\n"
                "            print('child gone')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "child gone"
    assert "not ready" not in proc.stderr


def test_the_parent_is_spared_when_it_is_not_an_mpi_daemon() -> None:
    """Here the rank's parent is this test (python), not prterun/prted: only the rank is ended."""
    proc = _run("w = StartupWatchdog(0.5, 'rank 0')\n        time.sleep(30)")
    assert proc.returncode == -signal.SIGKILL


def _record_of(tmp_path: Path, rank: int = 2) -> Path:
    return tmp_path / "exits" / f"rank-{rank}.json"


def _armed(record: Path) -> str:
    return f"        w = StartupWatchdog(60.0, 'rank 2', exit_record=__import__('pathlib').Path({str(record)!r}))\n"


def test_a_rank_ended_by_the_teardown_of_the_job_still_leaves_its_record(tmp_path) -> None:
    """Another rank's watchdog fired first and the daemon tears the job down (SIGTERM to every process of the rank):
    this rank's watchdog records the restart before its own timeout, which it never reaches."""
    record = _record_of(tmp_path)
    proc = _run("import os, signal\n"
                + _armed(record) +
                "        time.sleep(0.5)\n"
                "        os.kill(w.child_pid, signal.SIGTERM); os.waitpid(w.child_pid, 0)", timeout=30)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(record.read_text())
    assert saved["rank"] == 2 and saved["code"] == 3, saved
    assert "ended during start-up" in saved["reason"], saved


def test_a_rank_that_dies_during_start_up_is_recorded_by_its_watchdog(tmp_path) -> None:
    record = _record_of(tmp_path)
    proc = _run("import os, signal\n"
                + _armed(record) +
                "        print(w.child_pid, flush=True)\n"
                "        os.kill(os.getpid(), signal.SIGKILL)", timeout=30)
    assert proc.returncode == -signal.SIGKILL
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    saved = json.loads(record.read_text())
    assert saved["code"] == 3 and "rank 2 died during start-up" in saved["reason"], saved
    _wait_gone(child)


def test_a_record_the_rank_wrote_itself_is_kept(tmp_path) -> None:
    record = _record_of(tmp_path)
    proc = _run("import os, json\n"
                "        from pathlib import Path\n"
                f"        record = Path({str(record)!r})\n"
                "        w = StartupWatchdog(60.0, 'rank 2', exit_record=record)\n"
                "        record.parent.mkdir(parents=True, exist_ok=True)\n"
                "        record.write_text(json.dumps({'rank': 2, 'code': 4, 'reason': 'its own'}))\n"
                "        print(w.child_pid, flush=True)\n"
                "        os._exit(4)", timeout=30)
    assert proc.returncode == 4, proc.stderr
    _wait_gone(int(proc.stdout.split()[0]))
    assert json.loads(record.read_text())["reason"] == "its own"


def test_a_disarmed_watchdog_records_nothing(tmp_path) -> None:
    record = _record_of(tmp_path)
    proc = _run(f"w = StartupWatchdog(60.0, 'rank 2', exit_record=__import__('pathlib').Path({str(record)!r}))\n"
                "        w.disarm()", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not record.exists()


def _wait_gone(pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_is_gone(pid):  # exited (a container's init may leave it a zombie)
            return
        time.sleep(0.05)
    raise AssertionError(f"watchdog {pid} still alive")


def test_a_wait_for_the_peers_ends_at_its_bound_and_says_where(tmp_path) -> None:
    """The rank says it waits for its peers (bound 1 s) long before its own timeout (60 s): the wait's bound fires."""
    record = _record_of(tmp_path)
    t0 = time.monotonic()
    proc = _run("pass\n" + _armed(record) + "        w.waiting(1.0, 'MPI_Init'); time.sleep(30)")
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    assert time.monotonic() - t0 < 15
    reason = json.loads(record.read_text())["reason"]
    assert "rank 2 waited 1 s for its peers at MPI_Init" in reason, reason


def test_a_wait_that_ended_gives_the_rank_its_startup_timeout_back(tmp_path) -> None:
    """Waiting (bound 1 s), then busy again: the bound no longer applies; the disarm comes after it would have fired."""
    record = _record_of(tmp_path)
    proc = _run("pass\n" + _armed(record)
                + "        w.waiting(1.0, 'the start-up agreement'); w.busy(); time.sleep(2.5)\n"
                + "        w.disarm(); print('trained')")
    assert proc.returncode == 0 and proc.stdout.strip() == "trained", (proc.returncode, proc.stderr)
    assert not record.exists()


def test_a_rank_that_dies_while_it_waits_ends_the_job_at_once(tmp_path) -> None:
    record = _record_of(tmp_path)
    t0 = time.monotonic()
    proc = _run("import os\n" + _armed(record) + "        w.waiting(50.0, 'MPI_Init'); os._exit(9)")
    assert proc.returncode == 9
    deadline = time.monotonic() + 10
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "died during start-up" in json.loads(record.read_text())["reason"]
    assert time.monotonic() - t0 < 15
