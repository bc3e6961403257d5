"""The committed state of a step, held on the host, in the shape nanotron 0.4's savers read.

nanotron 0.4's ``save_weights``, ``save_optimizer`` and ``save_lr_scheduler`` take the live model, optimizer and
scheduler and read their state while they write: a save cannot run beside the next step, which changes that state.
These stand-ins hold a copy taken at the checkpoint step and answer the few calls the savers make
(``state_dict``, and for the model the module and parameter lookups that give each file its name and sharding
metadata, which never change), so a background thread writes the very files a save in the step writes.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory (pinned when it comes from a GPU), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        return out.copy_(t, non_blocking=True)  # the caller synchronizes once, after every copy was queued
    if isinstance(value, dict):
        return type(value)((k, host_copy(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return copy.deepcopy(value)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (what :func:`host_copy` allocates)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class FrozenModel:
    """The model's weights as they were; names and metadata from the live model (fixed for the run)."""

    def __init__(self, live: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self._live, self._weights = live, weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._weights

    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]:
        return self._live.named_modules()

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        return self._live.get_parameter(name)


class FrozenOptimizer:
    """The optimizer's state as it was; everything else (its kind, ZeRO's offsets) from the live optimizer. It
    passes for the live optimizer's class: the saver writes that class's name and checks it for ZeRO."""

    def __init__(self, live: Any, state: dict) -> None:
        self._live, self._state = live, state

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        return type(self._live)

    def state_dict(self) -> dict:
        return self._state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._live, name)


class FrozenScheduler:
    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state
