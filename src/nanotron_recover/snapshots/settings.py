"""The snapshot store's settings, read from a config in one place: ``fault_tolerance.local_snapshot_interval``,
``local_snapshot_max_interval``, ``relaunch_mtbf_h``, ``local_snapshot_dir`` and ``local_snapshot_max_gb``; and where
this node's files go (its name, from the launch).

It is also where the interval's meaning is read: ``auto`` (chosen from the measured cost by
:mod:`~nanotron_recover.snapshots.schedule`), every this many committed steps, or 0: off. Every consumer (the
schedule, one rank's store, the store's folder, the launcher's preflight) reads this object, not the config.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanotron_recover.config import snapshots_on

AUTO = "auto"
STALE_AFTER_S = 3 * 24 * 3600.0  # another run's folder untouched this long: its run crashed and was not relaunched
_OPTIONAL = {"max_interval": "local_snapshot_max_interval", "mtbf_h": "relaunch_mtbf_h",
             "max_gb": "local_snapshot_max_gb"}  # settings a stand-in config may lack


@dataclass(frozen=True)
class SnapshotSettings:
    interval: int | str = AUTO  # ``auto``, or every this many committed steps; 0: off (:attr:`enabled`)
    max_interval: int = 10  # the most steps a relaunch may lose (``auto``'s cap)
    mtbf_h: float = 2.0  # the expected time between faults that end the job (``auto``'s Young rule)
    folder: Path = Path(".")  # the node-local base folder of the store
    max_gb: float | None = None  # the most the store may hold on a node (None: half the free space)
    node: str = field(default_factory=socket.gethostname)  # this node's folder in the store (the launch may name it)
    stale_after_s: float = STALE_AFTER_S  # a user's folders of other runs untouched this long are removed

    @classmethod
    def of(cls, config: Any, node: str | None = None, stale_after_s: float | None = None) -> SnapshotSettings:
        """From ``config.fault_tolerance``; a stand-in config (a benchmark's, a test's) that has only the interval
        and the folder takes the defaults of the others, which are ``FaultToleranceArgs``'s
        (``tests/snapshots/test_snapshot_schedule.py`` holds them equal). ``node`` and ``stale_after_s``: what the
        launch says (:class:`~nanotron_recover.run.launch_contract.LaunchContract`; None: the host's name, 3 days)."""
        ft = config.fault_tolerance
        given = {name: getattr(ft, key) for name, key in _OPTIONAL.items() if hasattr(ft, key)}
        where = {k: v for k, v in (("node", node), ("stale_after_s", stale_after_s)) if v is not None}
        return cls(interval=ft.local_snapshot_interval, folder=Path(ft.local_snapshot_dir), **given, **where)

    @property
    def enabled(self) -> bool:
        """Whether snapshots are on (:func:`nanotron_recover.config.snapshots_on` reads an interval of 0 as off)."""
        return snapshots_on(self.interval)

    @property
    def fixed(self) -> int | None:
        """The fixed interval in steps (0 when off), None for ``auto``."""
        return None if self.interval == AUTO else int(self.interval)
