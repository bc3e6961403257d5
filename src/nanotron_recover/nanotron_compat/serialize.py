"""Optimizer checkpoint loading without CUDA.

nanotron 0.4's ``serialize.optimizer.load_optimizer`` ends with ``sanity_checks.check_optim_state_in_sync``, which
moves each ``step`` tensor to ``"cuda"`` before comparing it across the data-parallel group: a CPU-only host cannot
resume. The same check here, on the project's compute device, installed where ``load_optimizer`` looks it up.
"""

from __future__ import annotations

import nanotron.serialize.optimizer as _optimizer_module
from nanotron import distributed as dist
from nanotron.sanity_checks import assert_tensor_synced_across_pg

from nanotron_recover.run import devices


def check_optim_state_in_sync(optimizer, pg: dist.ProcessGroup) -> None:
    """Every optimizer state tensor equals the one of ``pg``'s rank 0 (trivially true on a group of one)."""
    if dist.get_world_size(pg) == 1:
        return
    device = devices.compute_device()
    for index, state in sorted(optimizer.state_dict()["state"].items(), key=lambda item: item[0]):
        for name, tensor in state.items():
            assert_tensor_synced_across_pg(
                tensor=tensor.to(device), pg=pg, msg=lambda err, n=name, i=index: f"optimizer state {i}/{n}: {err}"
            )


def install_cpu_optimizer_check() -> None:
    """Make ``nanotron.serialize.optimizer.load_optimizer`` use :func:`check_optim_state_in_sync` above."""
    _optimizer_module.check_optim_state_in_sync = check_optim_state_in_sync
