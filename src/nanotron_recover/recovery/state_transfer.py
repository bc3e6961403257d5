"""The state transfer that activates a spare or a formed replica: the committed state, broadcast from a donor.

Every rank of the coordinate groups takes part; the caller then agrees world-wide that every coordinate's
broadcast completed (each ends on its own, so one can complete while another lost its donor).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nanotron_recover.ft.protocol import ReplicaWorld
from nanotron_recover.run.devices import needs_host_staging
from nanotron_recover.training.training_state import TrainingState, ensure_adam_state, local_tensor, state_tensors


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
