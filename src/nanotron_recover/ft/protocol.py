"""What the recovery layer may use of the fault-tolerant world: the written interface of :class:`.world.FTWorld`.

The resilient strategy, the formation transaction, the state transfer and the node-local snapshots talk to the
world only through these members. The in-process tests of the step logic drive the strategy with an in-memory
world; ``tests/ft/test_protocol.py`` checks that :class:`.world.FTWorld` has every member below with the same
signature, and that the in-memory world matches it where it stands in.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .events import RepairEvent
from .hang_policy import HangPolicy, MainThreadProgress
from .layout import ReplicaAssignment


class ReplicaWorld(Protocol):
    # who this rank is and who is alive, as of the last repair it took part in
    rank: int
    epoch: int
    events: list[RepairEvent]
    active_replicas: list[int]
    live_ranks: list[int]
    assignment: ReplicaAssignment
    hosts: list[str]
    starting: bool  # before every rank agreed it is ready: a failure ends the job
    evicted: bool
    notice_timeout_s: float
    progress: MainThreadProgress  # what the main thread does, for the hang monitor
    hang_monitor: Any
    repair_hook: Callable[[str, int], None] | None  # (point, attempt): a fault point inside the repair

    @property
    def replica(self) -> int | None: ...

    @property
    def local_rank(self) -> int | None: ...

    @property
    def pooled(self) -> bool: ...

    @property
    def pool_ranks(self) -> list[int]: ...

    @property
    def live_replicas(self) -> list[int]: ...

    # collectives: raise FailureDetected when a process of the world failed
    def allreduce_sum_(self, buf: np.ndarray, comm: str = "coord") -> np.ndarray: ...

    def bcast_(self, buf: np.ndarray, root_replica: int, comm: str = "coord") -> np.ndarray: ...

    def allgather_object(self, obj): ...

    def exchange_bytes(self, sends: dict[int, bytes], recv_from: int | None,
                       recv_size: int = 0) -> bytearray | None: ...

    def agree(self, flag: bool = True, epoch: int | None = None) -> bool: ...

    # the repair and the world's shape
    def repair(self, since_epoch: int | None = None) -> RepairEvent: ...

    def repair_if_pending(self) -> RepairEvent | None: ...

    def wait_for_failure_notice(self, extra_s: float = 0.0) -> bool: ...

    def set_active_replicas(self, replicas: Sequence[int]) -> None: ...

    def form_replica(self, replica: int, ranks: Sequence[int]) -> Any: ...

    # the process's life
    def complete_startup(self) -> None: ...

    def start_hang_monitor(
        self, policy: HangPolicy, on_hang: Callable[[dict], None], end_job: Callable[[str], None]
    ) -> Any: ...

    def leave(self) -> None: ...

    def shutdown(self, had_failure: bool | None = None, code: int = 0) -> None: ...
