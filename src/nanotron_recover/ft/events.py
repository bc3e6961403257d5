"""The record of one repair, as every survivor saw it (JSON-serialisable for logs and metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RepairEvent:
    """One completed repair.

    ``failed_ranks`` are ORIGINAL world ranks that died (identical on every survivor: it is derived from the
    ``Shrink`` result); ``evicted_ranks`` are the alive ranks of failed replicas that left the world, or, when
survivors are recycled, ``pooled`` holds them instead (they stay in the world, in no replica).
    Phase times are milliseconds: ``detect_ms`` runs from this rank's first failure notice to the start of the
    repair, ``total_ms`` from the start of the repair to its end.
    """

    epoch: int
    failed_ranks: list[int]
    failed_replicas: list[int]
    evicted_ranks: list[int]
    live_replicas: list[int]
    active_replicas: list[int]
    attempts: int = 1
    detect_ms: float = 0.0
    revoke_ms: float = 0.0
    shrink_ms: float = 0.0
    agree_ms: float = 0.0
    rebuild_ms: float = 0.0
    total_ms: float = 0.0
    by_watcher: bool = False
    pooled: dict[int, tuple[int, int]] = field(default_factory=dict)  # recycle: {rank: (old replica, coordinate)}
    wall_time: float = 0.0  # time.time() when the repair finished (to line up with other processes' logs)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def detect_to_repaired_ms(self) -> float:
        """Time from the first notice of the failure until the world was usable again."""
        return self.detect_ms + self.total_ms

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["detect_to_repaired_ms"] = self.detect_to_repaired_ms
        return out
