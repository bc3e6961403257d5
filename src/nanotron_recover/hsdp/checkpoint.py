"""The HSDP checkpoint format: one file per shard, written by the F ranks of one replica.

Inside a checkpoint folder (``<checkpoints_path>/<step>/``, published atomically like every checkpoint)::

    trainer_state.json              {"step", "microbatches_per_step", "layout": "hsdp", "fsdp_shard_size": F, ...}
    hsdp/manifest.json              format, F, the shard dimension (0) and every parameter's full shape
    hsdp/shard-<f>-of-<F>.pt        torch.save of {"model": {name: shard}, "optimizer": {name: {"step", "exp_avg",
                                    "exp_avg_sq"}}, "param_groups": [hyper-parameters, no params]}
    hsdp/lr_scheduler.pt            the LR scheduler's state_dict

Shard ``f`` of a parameter is FSDP2's: rows ``[f * ceil(n / F), (f + 1) * ceil(n / F))`` of dim 0 (the last shards
may be shorter or empty). Concatenating the shards of a name along dim 0 in shard order gives the full tensor, so
the format is readable without torch.distributed. A run resumes it with the same F.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from nanotron_recover.nanotron_compat.frozen_state import host_copy, tensor_bytes
from nanotron_recover.training.training_state import ensure_adam_state, local_tensor

if TYPE_CHECKING:
    from nanotron_recover.training.training_state import TrainingState

FORMAT = "nanotron-recover-hsdp"
VERSION = 1
FOLDER = "hsdp"
HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad")


def shard_file(folder: Path, shard: int, num_shards: int) -> Path:
    return folder / FOLDER / f"shard-{shard:05d}-of-{num_shards:05d}.pt"


class ShardedLayout:
    """Every rank of the writing replica saves its own shard; shard 0 also writes the manifest and scheduler."""

    def __init__(self, shard: int, num_shards: int) -> None:
        self.shard = shard
        self.num_shards = num_shards

    def write(self, trainer: "TrainingState", folder: Path, step: int) -> None:
        ensure_adam_state(trainer.optimizer)
        payload = self._payload(trainer, lambda t: local_tensor(t).clone())
        self._write(folder, payload, trainer.lr_scheduler.state_dict(), self._manifest(trainer, step))

    def capture(self, trainer: "TrainingState", step: int) -> tuple[Callable[[Path], None], int]:
        ensure_adam_state(trainer.optimizer)
        payload = self._payload(trainer, lambda t: host_copy(local_tensor(t)))
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)  # the pinned copies were queued without waiting
        scheduler, manifest = copy.deepcopy(trainer.lr_scheduler.state_dict()), self._manifest(trainer, step)
        return (lambda folder: self._write(folder, payload, scheduler, manifest)), tensor_bytes(payload)

    @staticmethod
    def _payload(trainer: "TrainingState", take: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        inner = trainer.optimizer.optimizer
        return {
            "model": {name: take(p.detach()) for name, p in trainer.named_params},
            "optimizer": {
                name: {key: take(value) for key, value in inner.state[p].items()} for name, p in trainer.named_params
            },
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        }

    def _manifest(self, trainer: "TrainingState", step: int) -> dict | None:
        if self.shard != 0:
            return None
        return {
            "format": FORMAT,
            "version": VERSION,
            "fsdp_shard_size": self.num_shards,
            "shard_dim": 0,
            "step": step,
            "params": {name: list(p.shape) for name, p in trainer.named_params},
        }

    def _write(self, folder: Path, payload: dict, scheduler: dict, manifest: dict | None) -> None:
        (folder / FOLDER).mkdir(exist_ok=True)
        torch.save(payload, shard_file(folder, self.shard, self.num_shards))
        if manifest is not None:  # shard 0 also writes the manifest and the scheduler
            (folder / FOLDER / "manifest.json").write_text(json.dumps(manifest, indent=2))
            torch.save(scheduler, folder / FOLDER / "lr_scheduler.pt")

    @torch.no_grad()
    def read(self, trainer: "TrainingState", folder: Path) -> None:
        manifest = json.loads((folder / FOLDER / "manifest.json").read_text())
        if manifest.get("format") != FORMAT or manifest.get("fsdp_shard_size") != self.num_shards:
            raise ValueError(
                f"{folder}: not an HSDP checkpoint of fsdp_shard_size={self.num_shards} "
                f"(manifest: {manifest.get('format')}, fsdp_shard_size={manifest.get('fsdp_shard_size')})"
            )
        payload = torch.load(shard_file(folder, self.shard, self.num_shards), map_location=trainer.device)
        names = [name for name, _ in trainer.named_params]
        missing = sorted(set(names) ^ set(payload["model"]))
        if missing:
            raise ValueError(f"{folder}: parameters differ from the model's: {missing[:5]}")
        inner = trainer.optimizer.optimizer
        if len(payload["param_groups"]) != len(inner.param_groups):
            raise ValueError(f"{folder}: {len(payload['param_groups'])} optimizer param groups saved, "
                             f"the optimizer has {len(inner.param_groups)}")
        ensure_adam_state(trainer.optimizer)
        for name, p in trainer.named_params:
            _copy_shard(local_tensor(p.detach()), payload["model"][name], f"{folder}: {name}")
            for key, value in payload["optimizer"][name].items():
                _copy_shard(local_tensor(inner.state[p][key]), value, f"{folder}: {name} optimizer {key}")
        for group, saved in zip(inner.param_groups, payload["param_groups"]):
            # hyper-parameters only: the implementation flags (fused, foreach, ...) belong to this run's device
            group.update({k: v for k, v in saved.items() if k in HYPERPARAMETERS})
        trainer.lr_scheduler.load_state_dict(torch.load(folder / FOLDER / "lr_scheduler.pt"))


def _copy_shard(into: torch.Tensor, saved: torch.Tensor, what: str) -> None:
    """Copy a saved shard in place; shapes must match exactly (``copy_`` would broadcast a wrong one)."""
    if saved.shape != into.shape:
        raise ValueError(f"{what}: saved shard {tuple(saved.shape)}, this rank's is {tuple(into.shape)}")
    into.copy_(saved)


def read_full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of an HSDP checkpoint, by parameter name, read on one process."""
    folder = Path(folder)
    manifest = json.loads((folder / FOLDER / "manifest.json").read_text())
    num_shards = manifest["fsdp_shard_size"]
    shards = [torch.load(shard_file(folder, f, num_shards), map_location="cpu")["model"] for f in range(num_shards)]
    full = {}
    for name, shape in manifest["params"].items():
        full[name] = torch.cat([shard[name] for shard in shards], dim=manifest["shard_dim"])
        if list(full[name].shape) != shape:
            raise ValueError(f"{folder}: shards of {name} make {list(full[name].shape)}, manifest says {shape}")
    return full
