"""Letting go of a torch world that nanotron has seen.

nanotron 0.4 memoises ``nanotron.distributed.get_global_rank`` (``functools.cache``) and ``get_rank``
(``functools.lru_cache``) with process groups as keys, so every group it was ever asked about stays referenced
for the life of the process. A gloo group closes its connections only when its last reference goes: a rank that
leaves its replica for the pool (``fault_tolerance.recycle``) must clear those caches, or a replica-mate blocked
on it in torch traffic waits for its timeout instead of getting an error at once.
"""

from __future__ import annotations

import gc

import torch.distributed as torch_dist
from nanotron import distributed as nanotron_dist


def forget_process_groups() -> None:
    """Destroy this process's torch world and drop nanotron's references to its groups (the caller drops its own:
    the model, the optimizer, the parallel context)."""
    try:
        torch_dist.destroy_process_group()
    finally:
        nanotron_dist.get_global_rank.cache_clear()
        nanotron_dist.get_rank.cache_clear()
        gc.collect()
