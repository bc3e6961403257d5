"""Bytes of training state held by one rank, measured from its tensors (not computed from dtypes).

Each storage is counted once, under the first role it is found in: parameters (bf16 or fp32), fp32 master weights
(mixed precision), gradient buffers (the flat fp32 buckets, or ``param.grad``), gradient snapshots (in-step
recovery) and optimizer state (Adam's moments and step). Logged once per run as a ``training_state`` event.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from nanotron_recover.training.training_state import local_tensor, torch_optimizer

ROLES = ("params", "masters", "grads", "snapshots", "optimizer")


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = local_tensor(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def training_state_bytes(named_params: list[tuple[str, torch.nn.Parameter]], optimizer: Any, buckets: Any) -> dict:
    """``{"params": n, "bytes": {role: bytes}, "bytes_per_param": {role: bytes / n, "total": ...}}``."""
    by_role: dict[str, Iterable[torch.Tensor]] = {
        "params": [p for _, p in named_params],
        "masters": [],
        "grads": [],
        "snapshots": list(getattr(buckets, "_snaps", [])),
        "optimizer": [],
    }
    accumulator = getattr(optimizer, "gradient_accumulator", None)
    if accumulator is not None:
        by_role["masters"] = [accumulator.get_parameter_for_optimizer(name) for name, _ in named_params]
    grads = [buckets.flat] if buckets is not None else []
    grads += [g for _, p in named_params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    by_role["grads"] = grads
    inner = torch_optimizer(optimizer)
    by_role["optimizer"] = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
    seen: set[int] = set()
    totals = {role: 0 for role in ROLES}
    for role in ROLES:
        for tensor in by_role[role]:
            ptr, nbytes = _storage(tensor)
            if ptr in seen or nbytes == 0:
                continue
            seen.add(ptr)
            totals[role] += nbytes
    n = sum(local_tensor(p).numel() for _, p in named_params)
    per = {role: totals[role] / n for role in ROLES} if n else {}
    if n:
        per["total"] = sum(totals.values()) / n
    return {"params": n, "bytes": totals, "bytes_per_param": per}


def estimate_llama_params(model_config: Any) -> int:
    """Parameters of the whole (unsharded) Llama of a config: embeddings, attention, MLP, norms, LM head."""
    h, i, v = model_config.hidden_size, model_config.intermediate_size, model_config.vocab_size
    kv = h // model_config.num_attention_heads * model_config.num_key_value_heads
    per_layer = h * (h + 2 * kv) + h * h + 2 * h * i + i * h + 2 * h
    head = 0 if model_config.tie_word_embeddings else v * h
    return v * h + model_config.num_hidden_layers * per_layer + h + head


def snapshot_bytes_per_rank(config: Any) -> int:
    """What one rank's node-local snapshot holds: its share of the parameters x (the parameter itself, an fp32
    master in bf16, Adam's two fp32 moments)."""
    per_param = 4 + 8 if config.model.dtype == torch.float32 else torch.finfo(config.model.dtype).bits // 8 + 4 + 8
    shards = config.ranks_per_replica
    return -(-estimate_llama_params(config.model.model_config) // shards) * per_param
