"""The fence: a rank whose launch was replaced never writes the run folder again.

A rank can outlive its launch where nothing reaches it. A node cut off from the network (not killed) keeps its ranks
alive: its Open MPI daemon has not heard that the job ended, and the ranks' own hang watch ends them only after its
timeout. Meanwhile the launcher has relaunched on the nodes that answer, and the cut-off ranks may still reach the
shared file system (a storage network of its own, or the link restored). What they would write is stale: a metrics
line that overrides a newer step's, an exit record in the new launch's ``exits/`` that makes its outcome read wrong,
a checkpoint publish that first deletes the new launch's half-written save, a node-local snapshot that a later
relaunch would take for fresh.

So the launcher names the launch that owns the run folder (:data:`CURRENT_FILE`, the launch's token, written before
its ranks start or its standby is released), and every write of a rank to shared state is preceded by
:func:`guard`: a rank armed with another launch's token says so on stderr and SIGKILLs itself, leaving nothing
half-written and no exit record. One small file read per write (a metrics line per step), no lock and no clock: the
launcher writes the file only between launches.

A rank started by hand (no launcher, token ``"0"``) is never armed and never fenced. A read of the file that fails
(the shared file system unreachable) lets the write through: a hiccup must not end a live rank, a rank cut off from
the shared file system cannot write to it either, and its node-local snapshot is no newer than the survivors' (it
commits no step without them).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

CURRENT_FILE = "launch.current"
UNNAMED = "-"  # a launch begun without a token of its own (a batch script's): every armed rank is fenced by it
NOT_A_LAUNCHERS = "0"  # the token of a rank that no launcher started

_armed: tuple[Path, str] | None = None


def current_path(run_dir: Path) -> Path:
    return Path(run_dir) / CURRENT_FILE


def current_launch(run_dir: Path) -> str | None:
    """The token of the launch that owns ``run_dir`` now; None when no launcher named one."""
    try:
        return current_path(run_dir).read_text().strip() or None
    except OSError:
        return None


def arm(run_dir: Path, token: str) -> None:
    """This process writes ``run_dir`` for the launch ``token`` from now on (a rank's entry point, once released)."""
    global _armed
    _armed = (Path(run_dir), token) if token != NOT_A_LAUNCHERS else None


def disarm() -> None:
    global _armed
    _armed = None


def replaced_by() -> str | None:
    """The launch that replaced this process's, or None while its own launch owns the folder (or it is not armed)."""
    if _armed is None:
        return None
    run_dir, token = _armed
    now = current_launch(run_dir)
    return now if now is not None and now != token else None


def guard(what: str) -> None:
    """Call before writing ``what`` to shared state: returns while this process's launch owns the run folder, else
    ends the process at once (SIGKILL: no exit handler, no flush of a half-written file runs)."""
    other = replaced_by()
    if other is None:
        return
    try:
        sys.stderr.write(f"[nanotron-recover] fenced: launch {_armed[1] if _armed else '?'} was replaced by launch "
                         f"{other} in {_armed[0] if _armed else '?'}; this rank ends without writing {what}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not keep a fenced rank alive
        pass
    os.kill(os.getpid(), signal.SIGKILL)

