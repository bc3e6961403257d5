"""The snapshot store's settings, read from a config in one place: ``fault_tolerance.local_snapshot_interval``,
``local_snapshot_max_interval``, ``relaunch_mtbf_h``, ``local_snapshot_dir`` and ``local_snapshot_max_gb``.

It is also where the interval's meaning is read: ``auto`` (chosen from the measured cost by
:mod:`~nanotron_recover.snapshots.schedule`), every this many committed steps, or 0: off. Every consumer (the
schedule, one rank's store, the store's folder, the launcher's preflight) reads this object, not the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanotron_recover.config import snapshots_on

AUTO = "auto"
_OPTIONAL = {"max_interval": "local_snapshot_max_interval", "mtbf_h": "relaunch_mtbf_h",
             "max_gb": "local_snapshot_max_gb"}  # settings a stand-in config may lack


@dataclass(frozen=True)
class SnapshotSettings:
    interval: int | str = AUTO  # ``auto``, or every this many committed steps; 0: off (:attr:`enabled`)
    max_interval: int = 10  # the most steps a relaunch may lose (``auto``'s cap)
    mtbf_h: float = 2.0  # the expected time between faults that end the job (``auto``'s Young rule)
    folder: Path = Path(".")  # the node-local base folder of the store
    max_gb: float | None = None  # the most the store may hold on a node (None: half the free space)

    @classmethod
    def of(cls, config: Any) -> SnapshotSettings:
        """From ``config.fault_tolerance``; a stand-in config (a benchmark's, a test's) that has only the interval
        and the folder takes the defaults of the others, which are ``FaultToleranceArgs``'s
        (``tests/snapshots/test_snapshot_schedule.py`` holds them equal)."""
        ft = config.fault_tolerance
        given = {name: getattr(ft, key) for name, key in _OPTIONAL.items() if hasattr(ft, key)}
        return cls(interval=ft.local_snapshot_interval, folder=Path(ft.local_snapshot_dir), **given)

    @property
    def enabled(self) -> bool:
        """Whether snapshots are on (:func:`nanotron_recover.config.snapshots_on` reads an interval of 0 as off)."""
        return snapshots_on(self.interval)

    @property
    def fixed(self) -> int | None:
        """The fixed interval in steps (0 when off), None for ``auto``."""
        return None if self.interval == AUTO else int(self.interval)
