"""A standby's priority, on a real process: idle while it waits (threads it starts then inherit it), normal for
every thread once released, read back from ``/proc`` (the scheduling policy of each thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_recover.process.priority import can_idle

SCHED_OTHER, SCHED_IDLE = 0, 5

CHILD = """
import sys, threading, time
from nanotron_recover.process import priority
assert priority.to_idle()
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(60)), daemon=True).start()  # as an import's thread
started.wait()
print("idle", flush=True)
sys.stdin.readline()
priority.to_normal()
print("normal", flush=True)
sys.stdin.readline()
"""


def policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of ``pid`` (field 41 of its ``stat``)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out.add(int(fields[38]))
    return out


@pytest.mark.skipif(not can_idle(), reason="this user may not leave the idle class (root or RLIMIT_NICE >= 20)")
def test_a_standby_waits_at_idle_priority_and_trains_at_normal_priority():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline() == "idle\n"
        assert policies(child.pid) == {SCHED_IDLE}  # the thread started after to_idle inherits it
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "normal\n"
        assert policies(child.pid) == {SCHED_OTHER}
    finally:
        child.kill()
        child.wait(timeout=10)
