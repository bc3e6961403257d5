"""What /proc says of real processes: alive, a zombie, gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from nanotron_recover.run.procfs import proc_stat, process_is_gone


def test_a_running_process_is_not_gone_and_names_its_parent() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stat = proc_stat(child.pid)
        assert stat is not None and stat[0] == os.getpid() and stat[1].startswith("python"), stat
        assert not process_is_gone(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_gone_before_it_is_reaped_and_after() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while (proc_stat(pid) or (0, "", "?"))[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc_stat(pid)[2] == "Z"  # exited, not yet reaped by us
    assert process_is_gone(pid)
    os.waitpid(pid, 0)
    assert proc_stat(pid) is None and process_is_gone(pid)
