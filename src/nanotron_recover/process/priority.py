"""A warm standby's CPU and I/O priority: idle while it imports and waits, normal once it is released.

A standby imports torch, nanotron and the training stack (seconds of CPU per rank) beside the job it stands by for.
At normal priority those imports take the cores from the training ranks: on a machine where every core trains, the
job's steps were ~1.75 times slower for as long as the standby imported. At Linux's idle class (``SCHED_IDLE``, and
the idle I/O class) it runs only on what the training leaves idle, so it costs the job nothing. Where no core is
ever idle (as many ranks as cores, polling inside MPI) it would get no CPU at all: the standby's rank climbs back to
normal priority after a bound (:mod:`nanotron_recover.process.standby_rank`). Threads it creates inherit the
class; on release every thread of the process goes back to ``SCHED_OTHER`` and the default I/O class, so that the
relaunched job trains at full speed.

Going back from the idle class needs the right to raise one's priority: root, ``CAP_SYS_NICE``, or an
``RLIMIT_NICE`` of 20 or more. Without it the standby keeps the normal priority (:func:`can_idle` says so, and the
launcher logs it): a standby stuck at idle priority would make the job it becomes crawl.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource

IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_IDLE, IOPRIO_CLASS_NONE = 3, 0
IOPRIO_WHO_PROCESS = 1
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set system call's number on Linux


def can_idle() -> bool:
    """Whether this process may leave the idle class again (root, or an ``RLIMIT_NICE`` that allows nice 0)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def to_idle() -> bool:
    """The calling thread (and the threads it creates from now on) at idle CPU and I/O priority; False when it may
    not come back (then nothing changes)."""
    if not can_idle():
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _ioprio(0, IOPRIO_CLASS_IDLE)
    return True


def to_normal() -> None:
    """Every thread of this process back at normal CPU priority and the default I/O class."""
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        _ioprio(tid, IOPRIO_CLASS_NONE)


def _ioprio(tid: int, io_class: int) -> None:
    """The I/O class of thread ``tid`` (0: this one); best effort (an unknown architecture keeps its class)."""
    number = _IOPRIO_SET.get(platform.machine())
    if number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, IOPRIO_WHO_PROCESS, tid, io_class << IOPRIO_CLASS_SHIFT)
