"""Why the resilient path stops a rank: the errors it raises to the process lifecycle."""

from __future__ import annotations

from nanotron_recover.run.exit_codes import EXIT_RESTART

EXIT_BELOW_MIN_REPLICAS = EXIT_RESTART


class BelowMinimumReplicas(RuntimeError):
    """The job cannot go on: fewer than ``fault_tolerance.min_replicas`` replicas are left, or none that holds the
    committed state. Checkpoint (from a holder, if one is left) and stop with the restart outcome."""

    def __init__(self, live: int, minimum: int, last_committed_step: int, reason: str | None = None) -> None:
        super().__init__(reason or f"{live} live replica(s) < fault_tolerance.min_replicas={minimum}")
        self.last_committed_step = last_committed_step


class StragglerEvicted(RuntimeError):
    """This rank's replica is a persistent straggler that an idle spare replaces (``straggler_action: evict``): it
    leaves the world without a word, and the others repair around it as around a failed replica."""

    def __init__(self, replica: int, step: int) -> None:
        super().__init__(f"replica {replica} evicted as a persistent straggler before step {step}: a spare takes "
                         "its slot")
