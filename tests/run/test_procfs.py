"""What /proc says of real processes: alive, a zombie, gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from nanotron_recover.run.procfs import in_my_pid_namespace, proc_stat, process_is_gone


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


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--uts", "--fork", "true"], capture_output=True).returncode == 0


def _child_in(namespaces: list[str]) -> tuple[subprocess.Popen, int]:
    """``unshare NAMESPACES --fork sleep``: the unshare process and its forked child (inside the new namespaces)."""
    inner = subprocess.Popen(["unshare", *namespaces, "--fork", "sleep", "30"])
    deadline = time.monotonic() + 10
    child = None
    while child is None and time.monotonic() < deadline:
        child = next((int(p) for p in os.listdir("/proc") if p.isdigit()
                      and (proc_stat(int(p)) or (0,))[0] == inner.pid), None)
        time.sleep(0.01)
    assert child is not None
    return inner, child


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare of pid and UTS namespaces (root)")
def test_a_process_of_another_node_is_told_from_a_container_on_this_one():
    """An isolated test-bed node (its own pid and UTS namespaces) is another node, though the host's /proc shows its
    processes; a process in a pid namespace of its own that keeps this node's host name is a container here."""
    inner, child = _child_in(["--pid", "--uts"])
    try:
        assert in_my_pid_namespace(inner.pid)  # unshare itself stays in ours; its forked child is pid 1 of the new
        assert not in_my_pid_namespace(child)
        assert in_my_pid_namespace(os.getpid())
    finally:
        inner.kill()
        inner.wait()
    inner, child = _child_in(["--pid"])
    try:
        assert in_my_pid_namespace(child)
    finally:
        inner.kill()
        inner.wait()

