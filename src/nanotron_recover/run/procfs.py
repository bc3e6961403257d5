"""What ``/proc`` says about a process: its state and its parent. Linux only; standard library only (the start-up
guard and the hang monitor read it without torch or MPI)."""

from __future__ import annotations

import os


def proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, name, state letter) of ``pid`` from ``/proc/<pid>/stat``; None when there is no such process.
    The name sits in parentheses and may itself hold spaces or parentheses: the last ``)`` ends it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    if len(fields) < 2:
        return None
    return int(fields[1]), head[head.find("(") + 1:], fields[0]


def process_is_gone(pid: int) -> bool:
    """True when ``pid`` has exited: no such process, or a zombie (dead, its parent has not reaped it yet)."""
    stat = proc_stat(pid)
    return stat is None or stat[2] in ("Z", "X")


def in_my_pid_namespace(pid: int) -> bool:
    """``pid`` runs on this node, as far as ``/proc`` can tell: in this process's pid namespace, or in another one
    with this node's host name (a container on this node, ``apptainer --pid``). A test bed's isolated nodes each
    have a pid and a UTS namespace of their own, and the host that runs them sees every node's processes in
    ``/proc``, which no launcher on a real node could."""
    try:
        return any(os.readlink(f"/proc/{pid}/ns/{kind}") == os.readlink(f"/proc/self/ns/{kind}")
                   for kind in ("pid", "uts"))
    except OSError:  # gone, or not ours to inspect (another user's): not known to be elsewhere
        return True
