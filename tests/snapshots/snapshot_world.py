"""Helpers for the node-local snapshot tests: a small config and training state (no model), files of one history
written as a replica-mate would, and a digest of a rank's state."""

from __future__ import annotations

import hashlib
import subprocess
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from nanotron_recover.snapshots.local_snapshot import _group_settings
from nanotron_recover.snapshots.settings import SnapshotSettings
from nanotron_recover.snapshots.store import private_tree, snapshot_folder
from nanotron_recover.snapshots.writer import SnapshotWriter
from nanotron_recover.training.training_state import ensure_adam_state, state_tensors


@contextmanager
def mounted_tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A real tmpfs at ``mount`` (as root), e.g. ``size=256k``; the test is skipped where mounting is refused."""
    import pytest

    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def config(store: Path, ranks_per_replica: int = 1) -> types.SimpleNamespace:
    ns = types.SimpleNamespace
    return ns(fault_tolerance=ns(local_snapshot_interval=1, local_snapshot_dir=str(store), replica="3d",
                                 fsdp_shard_size=None),
              ranks_per_replica=ranks_per_replica, model=ns(model_config="m", dtype="float32"), optimizer="adamw",
              general=ns(seed=1), data="d", microbatches_per_step=2,
              tokens=ns(micro_batch_size=1, sequence_length=4), parallelism=ns(tp=1, pp=1))


def training_state(value: float, numel: int = 6) -> types.SimpleNamespace:
    """A parameter, AdamW (its state created) and an LR schedule: what ``state_tensors`` and the extras read."""
    param = torch.nn.Parameter(torch.full((numel,), value))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    ensure_adam_state(optimizer)
    for t in optimizer.state[param].values():
        t.fill_(value / 2)
    return types.SimpleNamespace(named_params=[("w", param)], optimizer=optimizer,
                                 lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))


def write_line(folder: Path, run_id: str, config_hash: str, coord: int, history: str, steps: list[int],
               value: float | None = None) -> None:
    """Snapshot files of ``coord`` in ``history`` at ``steps`` (state value ``value``, default the step)."""
    writer = SnapshotWriter(folder, f"r{coord}-c{coord}", run_id=run_id, config_hash=config_hash, coord=coord,
                            history=history)
    for step in steps:
        state = training_state(float(step) if value is None else value)
        writer.write(step, list(state_tensors(state)), {"lr_scheduler": state.lr_scheduler.state_dict(),
                                                        "param_groups": _group_settings(state.optimizer)})
    writer.close()


def node_folder(cfg: types.SimpleNamespace, run_id: str, node: str, monkeypatch=None) -> Path:
    """Node ``node``'s private snapshot folder of the run (made as that node's ranks would)."""
    folder = snapshot_folder(SnapshotSettings.of(cfg, node=node), run_id)
    private_tree(Path(cfg.fault_tolerance.local_snapshot_dir), run_id, node)
    return folder


def state_digest(state: types.SimpleNamespace) -> str:
    h = hashlib.sha256()
    for t in state_tensors(state):
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
