"""Where a rank's main thread is: the one list of phase names.

The same names appear in a fault schedule (``phase: backward``), in the heartbeats of the hang monitor (as an
index into :data:`HEARTBEAT_ORDER`: the order is part of the wire format, append only), in repair and hang events
of ``metrics.jsonl``, and in the I/O allowance of the hang policy. A :class:`Phase` is a ``str``: it is written
and compared as its value. Standard library only (the fault injector runs before ``MPI_Init``).
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    STARTING = "start-up"  # before the first step (the hang monitor's name)
    DATALOAD = "dataload"
    FORWARD = "forward"
    BACKWARD = "backward"
    REDUCE = "reduce"  # the cross-replica reduction (a fault fires after its first bucket was sent)
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    REPAIR = "repair"  # inside the survivors' repair, after Shrink: a failure during recovery
    SPARE_ACTIVATION = "spare-activation"
    WAITING = "waiting"  # in a cross-replica MPI operation
    OTHER = "other"
    SNAPSHOT = "snapshot"  # a node-local snapshot of the committed state
    LOCAL_SNAPSHOT_RESUME = "local-snapshot-resume"
    REPLICA_FORMATION = "replica-formation"  # recycling: the pool forms a replica
    FORMATION = "formation"  # a member with its model built, before the formation is agreed and its state arrives
    TRANSFER = "transfer"  # a rank of an active replica right before the state transfer (the donor's)
    RENDEZVOUS = "rendezvous"  # a member of a forming replica, before its torch world's rendezvous
    FORMING = "forming"  # any rank of the world as a replica is formed, before its world Split
    METRICS_IO = "metrics-io"  # starting wandb (a new logging rank, mid-run)
    REPLICA_BUILD = "replica-build"  # a recycled replica's torch rendezvous and model build
    STARTUP = "startup"  # the fault schedule's start-up phase (with a point: ``startup:after_mpi_init``)
    CHECKPOINT_WRITE = "checkpoint-write"  # a writer's part of a save is written, before the writers' barrier
    CHECKPOINT_PUBLISH = "checkpoint-publish"  # the save's folder renamed into place, before latest.txt
    CHECKPOINT_BACKGROUND = "checkpoint-background"  # a background save's part written, before it says it is done

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# what a heartbeat carries: an index into this order
HEARTBEAT_ORDER: tuple[Phase, ...] = tuple(p for p in Phase if p is not Phase.STARTUP)
# where a scheduled fault may fire
FAULT_PHASES: tuple[Phase, ...] = (
    Phase.FORWARD, Phase.BACKWARD, Phase.REDUCE, Phase.OPTIMIZER, Phase.CHECKPOINT, Phase.DATALOAD, Phase.REPAIR,
    Phase.STARTUP, Phase.FORMING, Phase.RENDEZVOUS, Phase.FORMATION, Phase.TRANSFER, Phase.CHECKPOINT_WRITE,
    Phase.CHECKPOINT_PUBLISH, Phase.CHECKPOINT_BACKGROUND)
# judged by the I/O allowance besides a checkpoint save: a node-local snapshot (its write waits for the previous
# background write) takes as long as the store is slow, whatever the step time
SLOW_IO_PHASES = frozenset({Phase.METRICS_IO, Phase.REPLICA_BUILD, Phase.SNAPSHOT})
