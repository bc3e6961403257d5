"""Which committed steps get a node-local snapshot: a fixed interval, or one chosen from the measured cost.

A snapshot costs the step its write (the writer thread's CPU seconds, on cores that also compute, plus any time
the next update waited for it); a relaunch costs the steps since the last snapshot. With ``auto`` the interval is
Young's rule, the interval that minimises the expected time lost to both: ``sqrt(2 * cost * MTBF)`` seconds, with
``MTBF`` the expected time between faults that end the job (``relaunch_mtbf_h``), converted to steps with the
measured step time, and capped at ``local_snapshot_max_interval``, the most steps a relaunch may lose. Until a
write was measured, every step is snapshotted. The interval moves only when Young's value leaves a band of a factor
:data:`DEAD_BAND` around it: the measured costs vary from step to step, and without the band the interval flipped
between neighbours (logging an event each time) for nothing, since the expected loss is flat near the optimum (an
interval k times off costs ``(k + 1/k) / 2 - 1`` more of it: 8 % at 1.5x).

Every rank must snapshot the same steps (a relaunch loads a step that every coordinate holds), so the schedule is
fed only the step's world-wide sums (:mod:`~nanotron_recover.recovery.step_sums`), which are
integers of microseconds: their sums are exact in float64 and the same on every rank, whatever order MPI adds
in, and so is every decision drawn from them, spares and pool ranks included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanotron_recover.snapshots.settings import SnapshotSettings

DEAD_BAND = 1.5  # the auto interval stays while Young's value is within this factor of it
# this tenant's entries of the step's sums: the writers' last write cost, the ranks' last step (whole µs), and how
# many of each measured one
SNAPSHOT_SUMS = (("snapshot_cost_us", 1), ("snapshot_writers", 1), ("step_us", 1), ("step_ranks", 1))


def young_steps(cost_s: float, step_s: float, mtbf_s: float, max_interval: int) -> float:
    """Young's rule (``sqrt(2 * cost * MTBF)`` seconds) in steps, unrounded, within ``[1, max_interval]``."""
    if step_s <= 0:
        return 1.0
    steps = math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s) / step_s
    if not math.isfinite(steps):  # never from validated settings; an overflow must not end the run
        return float(max_interval)
    return max(1.0, min(float(max_interval), steps))


def young_interval(cost_s: float, step_s: float, mtbf_s: float, max_interval: int) -> int:
    """Steps between snapshots by Young's rule, rounded, in ``[1, max_interval]``."""
    return round(young_steps(cost_s, step_s, mtbf_s, max_interval))


def next_interval(current: int, cost_s: float, step_s: float, mtbf_s: float, max_interval: int) -> int:
    """``current`` while Young's value is within a factor :data:`DEAD_BAND` of it, else Young's interval."""
    steps = young_steps(cost_s, step_s, mtbf_s, max_interval)
    if current / DEAD_BAND <= steps <= current * DEAD_BAND:
        return current
    return round(steps)  # within [1, max_interval] already


@dataclass
class SnapshotSchedule:
    """``fixed``: every this many steps (``step % fixed == 0``, as a user reads the setting); None: ``auto``;
    ``enabled``: the settings' word on whether snapshots are on at all (:class:`SnapshotSettings`)."""

    fixed: int | None
    max_interval: int
    mtbf_s: float
    interval: int = 1
    cost_s: float | None = None  # the writers' mean cost of their last measured write (agreed)
    step_s: float | None = None  # the ranks' mean step time (agreed)
    last: int | None = None  # the last step snapshotted (or the step before the first this launch trains)
    due_now: bool = False  # the last committed step's decision (:meth:`commit`)
    _reported: int = 1  # the auto interval last reported (:meth:`news`)
    enabled: bool = True

    @classmethod
    def of(cls, setting: int | str, max_interval: int, mtbf_h: float) -> SnapshotSchedule:
        return cls.of_settings(SnapshotSettings(interval=setting, max_interval=max_interval, mtbf_h=mtbf_h))

    @classmethod
    def of_settings(cls, settings: SnapshotSettings) -> SnapshotSchedule:
        return cls(fixed=settings.fixed, max_interval=settings.max_interval, mtbf_s=settings.mtbf_h * 3600,
                   enabled=settings.enabled)

    def observe(self, cost_us: float, writers: float, step_us: float, ranks: float) -> None:
        """A committed step's sums: writers' last write costs (and how many writers measured one), ranks' step
        times (and how many ranks measured one), all in whole microseconds."""
        if writers > 0:
            self.cost_s = cost_us / writers / 1e6
        if ranks > 0:
            self.step_s = step_us / ranks / 1e6
        if self.fixed is None and self.cost_s is not None and self.step_s is not None:
            self.interval = next_interval(self.interval, self.cost_s, self.step_s, self.mtbf_s, self.max_interval)

    def commit(self, step: int, sums: tuple[float, float, float, float], last: bool = False) -> bool:
        """A committed step, with its world-wide sums (:meth:`observe`): whether it is snapshotted (also kept in
        ``due_now``). ``last``: the job stops after it (a stop signal): snapshotted unless snapshots are off."""
        self.observe(*sums)
        self.due_now = self.due(step)
        if last and not self.due_now and self.fixed != 0:
            self.due_now, self.last = True, step
        return self.due_now

    def news(self, step: int) -> dict | None:
        """A ``snapshot_interval`` event when the auto interval changed since the last one (None otherwise)."""
        if self.fixed is not None or self.cost_s is None or self.interval == self._reported:
            return None
        self._reported = self.interval
        return {"event": "snapshot_interval", "step": step, "interval": self.interval,
                "write_cost_s": round(self.cost_s, 6), "step_s": round(self.step_s or 0.0, 6)}

    def due(self, step: int) -> bool:
        """Whether committed ``step`` is snapshotted; call once per committed step, on every rank."""
        if not self.enabled:
            return False
        if self.fixed is not None:
            return step % self.fixed == 0
        if self.last is None:
            self.last = step - 1
        if step - self.last < self.interval:
            return False
        self.last = step
        return True
