"""The start-up watchdog: a real forked process that ends a rank that is not ready in time (or leaves quietly)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {SRC!r})
        from nanotron_recover.watchdog import StartupWatchdog
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
