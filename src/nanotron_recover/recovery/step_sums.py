"""The step's world-wide sums: one float64 buffer, SUMmed over every rank once per attempt, whose entries are
declared by name by the parts that read them.

Why one buffer: the step needs one world-wide SUM anyway (its loss and committed microbatch count, in
``ResilientDataParallel._reduce``); whatever else every rank must learn in the same step rides on it, with no
extra round, and every rank reads the same numbers after it. Its tenants declare their entries as
``(name, size)`` (:class:`SumsLayout`); offsets are computed, so no part writes at a hand-counted index:

* the step: ``loss``, ``microbatches`` (local rank 0 of each computing replica counts its microbatches);
* the rebalancer (:mod:`.rebalancing`, :data:`~nanotron_recover.recovery.rebalancing.speed_entries`): per
  data-parallel slot, the compute seconds and microbatches of the replica that holds it;
* the non-finite guard: ``nonfinite_grads``, the ranks whose reduced gradient holds a NaN or an infinity (with the
  loss sum, NaN or infinite when any microbatch's was: the step must not be committed, :meth:`StepStats.nonfinite`);
* the graceful stop (:mod:`nanotron_recover.process.stop_request`): ``stop_requests``, the ranks that received a
  stop signal: the step it is seen in is the job's last (:meth:`StepStats.stop_at`);
* the snapshot schedule (:mod:`nanotron_recover.snapshots.schedule`,
  :data:`~nanotron_recover.snapshots.schedule.SNAPSHOT_SUMS`): each rank's last snapshot write cost and step time in
  whole microseconds, with how many ranks measured each;
* the checkpoint cadence (:mod:`nanotron_recover.training.checkpoint_cadence`,
  :data:`~nanotron_recover.training.checkpoint_cadence.CADENCE_SUMS`): each rank's wall time of its last save (whole
  microseconds) and how many ranks measured one.

Entries with one contributor (a slot's speed) are exact; the others are integers or counts, exact as well: the sums
are bit-identical on every rank whatever order MPI adds in. Only the committed attempt's numbers are read: a
reduction that failed may have completed on some ranks only.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from nanotron_recover.config import RecoverConfig
from nanotron_recover.process.stop_request import STOP, STOP_SUMS, stop_reason
from nanotron_recover.recovery.rebalancing import SlotSpeeds, settings_of, speed_entries
from nanotron_recover.snapshots.schedule import SNAPSHOT_SUMS
from nanotron_recover.training.checkpoint_cadence import CADENCE_SUMS
from nanotron_recover.training.seam import LocalWork, StepStop
from nanotron_recover.workload.spares import ReplicaRoster

STEP_SUMS = (("loss", 1), ("microbatches", 1), ("nonfinite_grads", 1))  # the step's own entries


class SumsLayout:
    """Named entries over one buffer: ``layout[name]`` is that entry's view (size 1 or more)."""

    def __init__(self, entries: Sequence[tuple[str, int]]) -> None:
        self.offsets: dict[str, slice] = {}
        start = 0
        for name, size in entries:
            if name in self.offsets or size < 1:
                raise ValueError(f"step sums: entry {name!r} declared twice, or with size {size}")
            self.offsets[name] = slice(start, start + size)
            start += size
        self.buffer = np.zeros(start, dtype=np.float64)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.buffer[self.offsets[name]]


def step_sums_layout(slots: int) -> SumsLayout:
    """Every tenant's entries, for a job of ``slots`` data-parallel slots."""
    return SumsLayout([*STEP_SUMS, *speed_entries(slots), *STOP_SUMS, *SNAPSHOT_SUMS, *CADENCE_SUMS])


class StepStats:
    """The sums of one job's steps: ``stats`` is the buffer that is SUMmed (reused every attempt), ``speeds`` the
    rebalancer's tenant (the planner's weights, drained and evicted stragglers)."""

    def __init__(self, slots: int, microbatches_per_step: int, speeds: SlotSpeeds) -> None:
        self.slots = slots
        self.layout = step_sums_layout(slots)
        self.stats = self.layout.buffer
        self.speeds = speeds

    @classmethod
    def of(cls, config: RecoverConfig) -> StepStats:
        """The sums of a job: ``dp`` slots, M microbatches, the rebalancer's and the stragglers' settings."""
        evicts = config.fault_tolerance.straggler_action == "evict"
        speeds = SlotSpeeds(config.microbatches_per_step, settings_of(config), evicts)
        return cls(config.parallelism.dp, config.microbatches_per_step, speeds)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.layout[name]

    def fill(self, loss: float, work: LocalWork, counts: bool, slot: int | None,
             snapshot_cost_s: float | None = None, step_s: float | None = None,
             grads_finite: bool = True, stop: bool | None = None, save_stall_s: float | None = None) -> np.ndarray:
        """This rank's contribution: ``counts`` for local rank 0 of a computing replica (the count and the speeds
        are counted once per replica), ``slot`` the slot its replica holds; ``snapshot_cost_s`` and ``step_s``
        its last measured snapshot write and step (None: none measured yet); ``grads_finite``: whether its reduced
        gradient is free of NaN and infinity; ``stop``: whether it received a stop signal (None: this process's
        :data:`~nanotron_recover.process.stop_request.STOP`); ``save_stall_s``: the wall time of its last checkpoint
        save (None: none yet)."""
        self.stats[:] = 0.0
        self["loss"][0] = loss
        self["nonfinite_grads"][0] = 0.0 if grads_finite else 1.0
        self["stop_requests"][0] = 1.0 if (STOP.requested if stop is None else stop) else 0.0
        self["microbatches"][0] = work.microbatches if counts else 0.0
        if counts and slot is not None:
            self["slot_seconds"][slot] = work.compute_s
            self["slot_microbatches"][slot] = work.microbatches
        if snapshot_cost_s is not None:
            self["snapshot_cost_us"][0], self["snapshot_writers"][0] = round(snapshot_cost_s * 1e6), 1.0
        if step_s is not None:
            self["step_us"][0], self["step_ranks"][0] = round(step_s * 1e6), 1.0
        if save_stall_s is not None:
            self["save_stall_us"][0], self["save_stall_ranks"][0] = round(save_stall_s * 1e6), 1.0
        return self.stats

    def loss_and_microbatches(self) -> tuple[float, int]:
        return float(self["loss"][0]), int(round(self["microbatches"][0]))

    def nonfinite(self) -> str | None:
        """What was not finite in the committed attempt (the same answer on every rank), or None."""
        loss, ranks = float(self["loss"][0]), int(self["nonfinite_grads"][0])
        if not math.isfinite(loss):
            return f"the step's loss is {loss}" + (f" and {ranks} rank(s) hold a non-finite gradient" if ranks else "")
        if ranks:
            return f"{ranks} rank(s) hold a non-finite gradient (the loss is finite: {loss:.6g})"
        return None

    def stop_at(self, step: int) -> StepStop | None:
        """Why the committed ``step`` is the job's last, when a rank was asked to stop (the same on every rank)."""
        ranks = int(self["stop_requests"][0])
        return StepStop("stop_signal", stop_reason(ranks, step)) if ranks else None

    def snapshot_sums(self) -> tuple[float, float, float, float]:
        """The committed step's (write cost µs, writers, step µs, ranks) sums, for the snapshot schedule."""
        return tuple(float(self[name][0]) for name, _ in SNAPSHOT_SUMS)  # type: ignore[return-value]

    def cadence_inputs(self) -> tuple[float | None, float | None]:
        """The committed step's (mean step s, mean last save stall s) of the ranks that measured one (None: none),
        for the checkpoint cadence: the same numbers on every rank."""
        step_ranks, stall_ranks = float(self["step_ranks"][0]), float(self["save_stall_ranks"][0])
        return (float(self["step_us"][0]) / step_ranks / 1e6 if step_ranks else None,
                float(self["save_stall_us"][0]) / stall_ranks / 1e6 if stall_ranks else None)

    # the rebalancer's tenant, fed the committed attempt's slot speeds
    def observe(self, roster: ReplicaRoster) -> dict[str, Any]:
        """Feed the committed step's speeds to the rebalancer; what the step record carries of them."""
        return self.speeds.observe(roster, self["slot_seconds"], self["slot_microbatches"])

    def leave_if_evicted(self, replica: int | None, step: int, roster: ReplicaRoster) -> None:
        self.speeds.leave_if_evicted(replica, step, roster)

    def slot_weights(self, roster: ReplicaRoster, slots: list[int]) -> dict[int, float] | None:
        return self.speeds.slot_weights(roster, slots)

    def weights(self, replicas: list[int]) -> dict[int, float] | None:
        return self.speeds.weights(replicas)
