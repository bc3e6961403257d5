"""What the launcher passes on of the job's output: everything, less Open MPI's internal noise at a repair.

Every repair makes Open MPI's nonblocking collectives print ``NBC_Progress: an error 75 was found during schedule
0x... - aborting the schedule`` (a revoked communicator ends the schedules of the collectives in flight), several
times per rank. That is the expected course of a repair, not news for the user: the lines are counted and the
count is said once at the end. Standard library only.
"""

from __future__ import annotations

import re

MAX_HELD_BYTES = 65536
NOISE = (re.compile(rb"NBC_Progress: an error \d+ was found during schedule"),)


class NoiseFilter:
    """Feed chunks as they come; complete lines go out unless they are noise. A line cut by a chunk boundary is
    held until its end arrives (or :meth:`flush`)."""

    def __init__(self) -> None:
        self._partial = b""
        self.dropped = 0

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        if len(data) - cut > MAX_HELD_BYTES:  # a line that never ends (a progress bar): pass it on as it is
            cut = len(data)
        self._partial = data[cut:]
        return self._keep(data[:cut])

    def flush(self) -> bytes:
        data, self._partial = self._partial, b""
        return self._keep(data)

    def _keep(self, data: bytes) -> bytes:
        if not data:
            return data
        lines = data.splitlines(keepends=True)
        kept = [line for line in lines if not any(p.search(line) for p in NOISE)]
        self.dropped += len(lines) - len(kept)
        return b"".join(kept)


def noise_summary(dropped: int) -> str | None:
    """One line for the end of the job, or None if nothing was dropped."""
    if not dropped:
        return None
    return (f"[nanotron-recover] {dropped} line(s) of Open MPI's 'NBC_Progress: ... aborting the schedule' "
            "were not shown: each repair ends the collectives in flight on the revoked communicator")
