"""When a disk checkpoint is written with ``checkpoints.checkpoint_interval: auto`` (the default of the resilient
path): the cadence that follows from what a relaunch reads.

A relaunch resumes from a node-local snapshot whenever one copy of the committed step survives (a rank, a node or
the launcher lost, a requeue on the same nodes), so with snapshots on the disk checkpoint guards only against
losing every copy at once (``checkpoints.all_snapshots_lost_h``, the expected hours between such losses); with
snapshots off it guards against every fault that ends the job (``fault_tolerance.relaunch_mtbf_h``). The interval
is Young/Daly on that MTBF with what a save costs the training (the stall: a background save's host copy, or the
whole write of a save in the step): ``sqrt(2 * stall * MTBF)`` seconds, at least
``checkpoints.checkpoint_min_interval_s`` and at most ``checkpoints.checkpoint_max_interval_h`` (the most training a
person accepts to redo). Until a save was measured the interval is the minimum: the first save measures the stall.

Every writer must save the same steps, so the cadence is fed only the step's world-wide sums (the ranks' mean step
time and last save stall, in whole microseconds: the same numbers on every rank), and counts in steps since the
newest checkpoint on disk (which every rank agreed on at resume): a relaunch does not restart the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# this tenant's entries of the step's sums: each rank's wall time of its last save (whole µs) and how many measured one
CADENCE_SUMS = (("save_stall_us", 1), ("save_stall_ranks", 1))


def cadence_interval_s(stall_s: float | None, mtbf_s: float, min_s: float, max_s: float) -> float:
    """Young/Daly on ``mtbf_s`` with a save's ``stall_s`` (None: not measured yet, the minimum), in
    ``[min_s, max_s]``."""
    if stall_s is None:
        return min_s
    tau = math.sqrt(2.0 * max(stall_s, 0.0) * mtbf_s)
    return min(max(tau, min_s), max_s) if math.isfinite(tau) else max_s


@dataclass
class CheckpointCadence:
    """The ``auto`` cadence of one launch. ``last_saved``: the step of the newest checkpoint (0: none)."""

    mtbf_s: float
    min_s: float
    max_s: float
    last_saved: int = 0
    step_s: float | None = None  # the running mean of the ranks' agreed step times (this launch)
    stall_s: float | None = None  # the ranks' mean wall time of the last save (agreed)
    _steps_seen: int = 0

    @property
    def interval_s(self) -> float:
        return cadence_interval_s(self.stall_s, self.mtbf_s, self.min_s, self.max_s)

    def observe(self, step_s: float | None, stall_s: float | None) -> None:
        """A committed step's agreed numbers (None: no rank measured one)."""
        if step_s is not None:
            self._steps_seen += 1
            self.step_s = step_s if self.step_s is None else self.step_s + (step_s - self.step_s) / self._steps_seen
        if stall_s is not None:
            self.stall_s = stall_s

    def due(self, step: int) -> bool:
        """Whether committed ``step`` is saved: the training since the newest checkpoint reached the interval.
        Call once per committed step, on every rank, after :meth:`observe`."""
        if self.step_s is None:
            return False
        if (step - self.last_saved) * self.step_s < self.interval_s:
            return False
        self.last_saved = step
        return True

    def event(self, step: int) -> dict:
        """The ``checkpoint_cadence`` event of a save it decided: the rule's inputs and result."""
        return {"event": "checkpoint_cadence", "step": step, "interval_s": round(self.interval_s, 3),
                "stall_s": None if self.stall_s is None else round(self.stall_s, 6),
                "step_s": round(self.step_s or 0.0, 6), "mtbf_h": round(self.mtbf_s / 3600, 3)}
