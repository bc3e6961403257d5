"""Failure injection from a deterministic schedule: the chosen process SIGKILLs itself at (step, phase).

Real process death, never a simulated exception.  A schedule entry is ``{step, replica, rank, phase}`` where
``rank`` is the local rank within the replica.  For ``reduce`` the reduction loop calls
``maybe_fail(step, "reduce")`` after its first bucket was sent, so the failure lands mid-reduction.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

# "repair": the process dies inside the survivors' repair (after Shrink): a failure during recovery.
PHASES = ("forward", "backward", "reduce", "optimizer", "checkpoint", "dataload", "repair")


@dataclass(frozen=True)
class FailureSpec:
    """Kill local rank ``rank`` of replica ``replica`` when it reaches ``phase`` of ``step``."""

    step: int
    replica: int
    rank: int
    phase: str

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; expected one of {PHASES}")
        if self.step < 0 or self.replica < 0 or self.rank < 0:
            raise ValueError(f"negative field in {self}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FailureSpec":
        extra = set(d) - {"step", "replica", "rank", "phase"}
        if extra:
            raise ValueError(f"unknown keys in failure spec: {sorted(extra)}")
        return cls(int(d["step"]), int(d["replica"]), int(d.get("rank", 0)), str(d["phase"]))


def parse_schedule(schedule: Iterable[Mapping[str, Any] | FailureSpec] | str | None) -> list[FailureSpec]:
    """Accepts a list of dicts/specs or a JSON string (e.g. from an environment variable)."""
    if schedule is None or schedule == "":
        return []
    if isinstance(schedule, str):
        schedule = json.loads(schedule)
    return [s if isinstance(s, FailureSpec) else FailureSpec.from_dict(s) for s in schedule]  # type: ignore[union-attr]


class FailureInjector:
    """Holds the entries that target this process and kills it when one comes due."""

    def __init__(
        self,
        schedule: Iterable[Mapping[str, Any] | FailureSpec] | str | None,
        my_replica: int,
        my_local_rank: int,
        fired_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``fired_dir``: where a marker per fired entry is kept, so that a relaunch of the same run (resuming from
        a checkpoint, replaying the step) does not fire it again: a failure happens once per run."""
        self.my_replica = my_replica
        self.my_local_rank = my_local_rank
        self.schedule = parse_schedule(schedule)
        self.fired_dir = Path(fired_dir) if fired_dir is not None else None
        self._mine = {
            (s.step, s.phase)
            for s in self.schedule
            if s.replica == my_replica and s.rank == my_local_rank and not self._marker(s.step, s.phase).is_file()
        }

    def _marker(self, step: int, phase: str) -> Path:
        name = f"step{step}-replica{self.my_replica}-rank{self.my_local_rank}-{phase}"
        return self.fired_dir / name if self.fired_dir is not None else Path(os.devnull) / name

    def will_fail(self, step: int, phase: str) -> bool:
        return (step, phase) in self._mine

    def maybe_fail(self, step: int, phase: str) -> None:
        """SIGKILL this process if the schedule says so; otherwise return at once."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        if (step, phase) not in self._mine:
            return
        if self.fired_dir is not None:
            self.fired_dir.mkdir(parents=True, exist_ok=True)
            with open(self._marker(step, phase), "w") as f:
                f.write(f"{time.time():.6f}\n")
                f.flush()
                os.fsync(f.fileno())
        sys.stdout.flush()
        sys.stderr.write(
            f"[inject] KILL replica {self.my_replica} local rank {self.my_local_rank} pid {os.getpid()} "
            f"at step {step} phase {phase} t={time.time():.6f}\n"
        )
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous in theory; never run on past the injection point
