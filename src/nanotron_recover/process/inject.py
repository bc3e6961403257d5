"""Failure injection from a deterministic schedule: the chosen process signals itself at (step, phase).

Real process faults, never a simulated exception. A schedule entry (:class:`FailureSpec`, the one schema the
config and the injector share) is ``{step, replica, rank, phase, signal, at}`` where ``rank`` is the local rank
within the replica and ``signal`` says what happens to the process:

* ``kill`` (default): SIGKILL, a crash;
* ``stop``: SIGSTOP, a frozen process (none of its threads runs; only the hang detector ends it);
* ``hang``: the main thread blocks forever while the process's other threads run on, as a rank stuck in a GPU
  kernel or in a collective does;
* ``slow`` (with ``factor``): not a fault but a straggler. From ``step`` on, every microbatch this rank computes
  takes ``factor`` times as long, for real (:class:`Slowdown`: a sleep of ``factor - 1`` times its own measured
  time per microbatch, at each microbatch's forward). Its replica-mates wait for it in their TP / PP / FSDP
  collectives, so the whole replica is slowed. Only time changes: the trajectory is the same. ``phase`` is not
  used; it lasts for the rest of the run (a relaunch is slowed again: it is the hardware).
* ``nan`` (phase ``forward`` only): not a process fault but a non-finite microbatch: the rank's next forward
  produces NaN (the trainer poisons a layer's output), as an overflow or a bad sample would. The step must not
  be committed: the run ends for a person (``NeedsPerson``) with the last finite state kept.

For ``reduce`` the reduction loop calls ``maybe_fail(step, "reduce")`` after its first bucket was sent, so the
fault lands mid-reduction. Phase ``startup`` fires before the first step, at the point named by ``at``
(:data:`STARTUP_POINTS`); its ``step`` must be 0. A marker file per fired entry (``<run_dir>/injected/``) makes a
fault happen once per run (a relaunch that resumes does not fire it again) and records what fired and when; an
entry with ``every_launch: true`` fires once in every launch instead, as a crash that a bad sample or a faulty
device brings back at the same step would.

This module must stay light (standard library only): it runs before ``MPI_Init``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from nanotron_recover.run import run_folder
from nanotron_recover.run.phases import FAULT_PHASES

PHASES = tuple(p.value for p in FAULT_PHASES)  # see nanotron_recover.run.phases for what each means
SIGNALS = ("kill", "stop", "hang", "slow", "nan")
# Where a ``startup`` fault lands, in start-up order.
STARTUP_POINTS = ("before_mpi_init", "after_mpi_init", "model_build", "checkpoint_load", "agreed")


@dataclass(frozen=True)
class FailureSpec:
    """Fault local rank ``rank`` of replica ``replica`` with ``signal`` when it reaches ``phase`` of ``step``."""

    step: int
    replica: int
    rank: int = 0
    phase: str = "backward"
    signal: str = "kill"
    at: str | None = None  # phase "startup" only: one of STARTUP_POINTS (default: after_mpi_init)
    factor: float | None = None  # signal "slow" only: how many times slower each microbatch becomes (> 1)
    every_launch: bool = False  # fire in every launch, not once per run: a crash that comes back (a bad sample)

    def problems(self) -> list[tuple[str, str]]:
        """``(field, message)`` for every value that cannot work, whatever the config (empty: valid)."""
        out = []
        if self.phase not in PHASES:
            out.append(("phase", f"{self.phase!r} is not one of {', '.join(PHASES)}"))
        if self.signal not in SIGNALS:
            out.append(("signal", f"{self.signal!r} is not one of {', '.join(SIGNALS)}"))
        for name in ("step", "replica", "rank"):
            if getattr(self, name) < 0:
                out.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.phase == "startup":
            if self.step != 0:
                out.append(("step", f"a startup fault happens before step 1: use step 0, got {self.step}"))
            if self.at is not None and self.at not in STARTUP_POINTS:
                out.append(("at", f"{self.at!r} is not one of {', '.join(STARTUP_POINTS)}"))
        elif self.at is not None:
            out.append(("at", "is only used with phase: startup"))
        if self.signal == "slow":
            factor = self.factor
            if factor is None or not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
                out.append(("factor", f"signal slow needs a factor > 1 (how many times slower), got {factor!r}"))
            if self.phase == "startup":
                out.append(("phase", "signal slow slows the training steps: not phase startup"))
        elif self.factor is not None:
            out.append(("factor", "is only used with signal: slow"))
        if self.signal == "nan" and self.phase != "forward":
            out.append(("phase", f"signal nan poisons a forward: use phase forward, got {self.phase!r}"))
        return out

    @property
    def point(self) -> str:
        """The phase, or for a startup fault the start-up point (``startup:after_mpi_init``)."""
        if self.phase != "startup":
            return self.phase
        return f"startup:{self.at or 'after_mpi_init'}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FailureSpec":
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown keys in failure spec: {sorted(extra)}; allowed: {sorted(known)}")
        spec = cls(
            int(d["step"]), int(d["replica"]), int(d.get("rank", 0)), str(d.get("phase", "backward")),
            str(d.get("signal", "kill")), None if d.get("at") is None else str(d["at"]),
            None if d.get("factor") is None else float(d["factor"]), bool(d.get("every_launch", False)),
        )
        bad = spec.problems()
        if bad:
            raise ValueError("; ".join(f"{key}: {msg}" for key, msg in bad))
        return spec


def parse_schedule(schedule: Iterable[Mapping[str, Any] | FailureSpec] | str | None) -> list[FailureSpec]:
    """Accepts a list of dicts/specs or a JSON string (e.g. from an environment variable)."""
    if schedule is None or schedule == "":
        return []
    if isinstance(schedule, str):
        schedule = json.loads(schedule)
    return [s if isinstance(s, FailureSpec) else FailureSpec.from_dict(s) for s in schedule]  # type: ignore[union-attr]


def marker_name(spec: FailureSpec, launch_token: str = "0") -> str:
    """The marker file of a fired entry: ``step{s}-replica{r}-rank{k}-{phase}[-{signal}][-launch-{token}]`` (kill
    adds nothing; an ``every_launch`` entry is marked per launch, so that each launch fires it once)."""
    name = f"step{spec.step}-replica{spec.replica}-rank{spec.rank}-{spec.point.replace(':', '.')}"
    name = name if spec.signal == "kill" else f"{name}-{spec.signal}"
    return f"{name}-launch-{launch_token}" if spec.every_launch else name


class FailureInjector:
    """Holds the entries that target this process and fires one when it comes due."""

    def __init__(
        self,
        schedule: Iterable[Mapping[str, Any] | FailureSpec] | str | None,
        my_replica: int,
        my_local_rank: int,
        run_dir: str | os.PathLike[str] | None = None,
        launch_token: str = "0",
    ) -> None:
        """``run_dir``: where a record per fired entry is kept (:func:`run_folder.record_fired_fault`), so that a
        relaunch of the same run (resuming from a checkpoint, replaying the step) does not fire it again: a failure
        happens once per run. Without one, nothing is recorded."""
        self.schedule = parse_schedule(schedule)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.launch_token = launch_token  # an ``every_launch`` entry fires once in each launch
        self._poison = False  # a ``nan`` entry fired: the trainer poisons this forward
        self.retarget(my_replica, my_local_rank)

    def retarget(self, my_replica: int, my_local_rank: int) -> None:
        """This process is now local rank ``my_local_rank`` of replica ``my_replica`` (a replica formed from
        recycled ranks): the entries for that name target it from now on."""
        self.my_replica = my_replica
        self.my_local_rank = my_local_rank
        mine = [s for s in self.schedule if s.replica == my_replica and s.rank == my_local_rank]
        self._mine = {(s.step, s.point): s for s in mine if s.signal != "slow" and not self._fired(s)}
        self.slowdown = Slowdown([s for s in mine if s.signal == "slow"], my_replica, my_local_rank)

    def _fired(self, spec: FailureSpec) -> bool:
        if self.run_dir is None:
            return False
        return run_folder.fault_marker_path(self.run_dir, marker_name(spec, self.launch_token)).is_file()

    def take_poison(self) -> bool:
        """Whether a ``nan`` entry fired since the last call (the current forward must produce NaN)."""
        fired, self._poison = self._poison, False
        return fired

    def targets_me(self) -> bool:
        return any(s.replica == self.my_replica and s.rank == self.my_local_rank for s in self.schedule)

    def will_fail(self, step: int, phase: str) -> bool:
        return (step, phase) in self._mine

    def maybe_fail(self, step: int, phase: str) -> None:
        """Fault this process if the schedule says so; otherwise return at once.

        ``phase`` is one of :data:`PHASES` (other than ``startup``) or ``startup:<point>``.
        """
        spec = self._mine.get((step, phase))
        if spec is None:
            if phase.split(":")[0] not in PHASES:
                raise ValueError(f"unknown phase {phase!r}")
            return
        del self._mine[(step, phase)]
        if self.run_dir is not None:
            run_folder.record_fired_fault(self.run_dir, marker_name(spec, self.launch_token), {
                "step": spec.step, "replica": spec.replica, "rank": spec.rank, "phase": spec.phase, "at": spec.at,
                "signal": spec.signal})
        sys.stdout.flush()
        sys.stderr.write(
            f"[inject] {spec.signal.upper()} replica {self.my_replica} local rank {self.my_local_rank} "
            f"pid {os.getpid()} at step {step} phase {phase} t={time.time():.6f}\n"
        )
        sys.stderr.flush()
        if spec.signal == "nan":
            self._poison = True
            return
        if spec.signal == "hang":
            threading.Event().wait()  # the calling thread never comes back (the main thread, or a background
            # save's: then training goes on); the other threads keep running
        os.kill(os.getpid(), signal.SIGSTOP if spec.signal == "stop" else signal.SIGKILL)
        if spec.signal == "kill":
            time.sleep(60)  # SIGKILL is asynchronous in theory; never run on past the injection point
        else:
            threading.Event().wait()  # woken from SIGSTOP (SIGCONT): still never run on past the point


class Slowdown:
    """``signal: slow`` entries for this rank, made real: from an entry's step on, each microbatch sleeps
    ``factor - 1`` times this rank's own time per microbatch (measured without the sleeps: the fastest compute call
    so far, the way a device has one speed; the last call's time would pass on the host's contention, amplified by
    the factor, which on a shared machine made equal ranks look 1.7x apart).

    The trainer calls :meth:`begin` and :meth:`end` around each compute call and :meth:`microbatch` at each
    microbatch's forward (inside the computation, so that replica-mates wait for this rank in their collectives).
    Before a time per microbatch is known (the first slowed call), the whole call's sleep comes at its end."""

    def __init__(self, specs: Iterable[FailureSpec], replica: int, local_rank: int) -> None:
        self.specs = sorted(specs, key=lambda s: s.step)
        self.who = f"replica {replica} local rank {local_rank}"
        self.per_microbatch_s: float | None = None
        self._started = 0.0
        self._slept = 0.0
        self._announced = False

    def factor(self, step: int) -> float:
        """How many times slower this rank computes at ``step`` (the latest entry that has begun; 1: not slowed)."""
        due = [s.factor for s in self.specs if s.step <= step and s.factor is not None]
        return float(due[-1]) if due else 1.0

    def begin(self) -> None:
        self._started, self._slept = time.perf_counter(), 0.0

    def _sleep(self, step: int, seconds: float) -> None:
        if not self._announced:
            sys.stderr.write(f"[inject] SLOW x{self.factor(step):g} {self.who} pid {os.getpid()} from step {step}\n")
            sys.stderr.flush()
            self._announced = True
        time.sleep(seconds)
        self._slept += seconds

    def microbatch(self, step: int) -> None:
        factor = self.factor(step)
        if factor > 1 and self.per_microbatch_s is not None:
            self._sleep(step, (factor - 1) * self.per_microbatch_s)

    def end(self, step: int, microbatches: int) -> None:
        """After a compute call of ``microbatches``: the first slowed call's sleep, then this rank's own speed."""
        natural = time.perf_counter() - self._started - self._slept
        factor = self.factor(step)
        if factor > 1 and self.per_microbatch_s is None:
            self._sleep(step, (factor - 1) * natural)
        if microbatches > 0 and natural > 0:
            per_microbatch = natural / microbatches
            self.per_microbatch_s = min(self.per_microbatch_s or per_microbatch, per_microbatch)
