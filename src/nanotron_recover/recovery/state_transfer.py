"""The state transfer that activates a spare or a formed replica: the committed state, broadcast from a donor.

Every rank of the coordinate groups takes part; then every rank agrees world-wide that every coordinate's
broadcast completed (each ends on its own, so one can complete while another lost its donor), or all repair and
transfer again (:func:`activate_new_replicas`, the transaction the resilient strategy runs after a commit).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from nanotron_recover.ft import FailureDetected
from nanotron_recover.ft.protocol import ReplicaWorld
from nanotron_recover.recovery.errors import BelowMinimumReplicas
from nanotron_recover.run.devices import needs_host_staging
from nanotron_recover.run.phases import Phase
from nanotron_recover.training.seam import StepServices
from nanotron_recover.training.training_state import TrainingState, ensure_adam_state, local_tensor, state_tensors
from nanotron_recover.workload.spares import ReplicaRoster


def activate_new_replicas(ft: ReplicaWorld, roster: ReplicaRoster, step: int, state: TrainingState,
                          services: StepServices, *, formed_at: float | None, min_replicas: int,
                          computes: Callable[[], bool], repair: Callable[[int], Any]) -> None:
    """The replicas in the roster's active set that did not compute step ``step`` (spares that took a failed
    replica's slot, replicas formed from the pool) receive its committed state, then the reduction widens to them.
    Returns once every rank agreed that every transfer completed; a fault repairs (``repair(since_epoch)``, which
    updates the roster) and the transfer starts again from the donors left. ``computes``: whether this rank is in
    an active replica now (a repair may have moved it to the pool)."""
    donors = set(ft.active_replicas)  # replicas that computed (and committed) this step, still alive
    while True:
        epoch = ft.epoch
        try:
            new = set(roster.active) - donors
            ft.set_active_replicas(roster.active)
            record = None
            if new and computes():  # over the coordinate groups of the active replicas
                services.fault_point(step, Phase.TRANSFER)
                record = copy_state_to_new_replicas(ft, state, min(donors), new, formed_at)
            # each coordinate's broadcast ends on its own: one can complete while another lost its donor, so
            # every rank agrees that all of them did, or all repair and do the transfer again
            ft.agree(True, epoch)
            if record is not None:
                services.metrics.log_event(record)
            return
        except Exception as exc:  # noqa: BLE001 - a fault; or the watcher pooled this rank mid-transfer
            if not isinstance(exc, FailureDetected) and ft.epoch == epoch:
                raise
            repair(epoch)
            donors -= {r for e in ft.events if e.epoch > epoch for r in e.failed_replicas}
            if not donors:
                raise BelowMinimumReplicas(
                    len(roster.active), min_replicas, step,
                    reason=f"no live replica holds the committed state of step {step}: the donors of the "
                           "state transfer were lost") from None
            if roster.below_minimum(min_replicas):
                raise BelowMinimumReplicas(len(roster.active), min_replicas, step) from None


def copy_state_to_new_replicas(ft: ReplicaWorld, state: TrainingState, donor: int, new: set[int],
                               formed_at: float | None) -> dict[str, Any]:
    """Broadcast parameters and Adam state from a replica that computed the committed step, tensor by tensor;
    -> the ``spare_activated`` record (logged once every rank agreed that the transfer completed). ``formed_at``:
    ``perf_counter()`` when the new replica was formed from the pool, if it was."""
    t0 = time.perf_counter()
    ensure_adam_state(state.optimizer)
    for tensor in state_tensors(state):
        bcast_tensor(ft, tensor, donor)
    now = time.perf_counter()
    record = {"event": "spare_activated", "replicas": sorted(new), "donor": donor, "epoch": ft.epoch,
              "transfer_ms": (now - t0) * 1e3}
    if formed_at is not None:  # a replica formed from the pool: its torch world, model build and state
        record["formed_to_active_ms"] = (now - formed_at) * 1e3
    return record


def bcast_tensor(ft: ReplicaWorld, tensor: torch.Tensor, donor: int) -> None:
    """Broadcast one tensor in place from ``donor``'s rank of this coordinate (CUDA tensors via a host copy).

    Coordinates match shard for shard: a rank of an FSDP replica receives its own shard from the donor replica's
    rank of the same shard index. A bf16 tensor travels as its raw 16-bit words (numpy has no bfloat16)."""
    tensor = local_tensor(tensor.detach())  # a sharded (FSDP) tensor: this rank's shard
    host = tensor.cpu() if needs_host_staging(tensor.device) else tensor  # zero-copy on CPU
    words = host.view(-1)
    if words.dtype == torch.bfloat16:
        words = words.view(torch.int16)
    ft.bcast_(words.numpy(), root_replica=donor, comm="coord")
    if host is not tensor:
        tensor.copy_(host)
