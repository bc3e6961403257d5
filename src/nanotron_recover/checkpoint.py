"""Checkpoints, written atomically, and auto-resume from ``latest.txt``.

What goes inside a checkpoint folder is a :class:`CheckpointLayout`: nanotron's own format for 3D replicas
(:class:`NanotronLayout`), per-rank shard files for FSDP replicas (``nanotron_recover.hsdp.checkpoint``).
``trainer_state.json`` (written last) names the layout, the step and M.

A save goes to a hidden temporary folder, every file is fsynced, then one rank renames the folder into place
and replaces ``latest.txt`` (write temp file, fsync, ``os.replace``). A process killed mid-save leaves the
previous checkpoint and ``latest.txt`` valid. A relative ``checkpoints.checkpoints_path`` lives in the run dir.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from nanotron.serialize import load_weights, save_meta, save_weights
from nanotron.serialize.optimizer import load_lr_scheduler, load_optimizer, save_lr_scheduler, save_optimizer

from nanotron_recover.config import RecoverConfig
from nanotron_recover.nanotron_compat.serialize import install_cpu_optimizer_check
from nanotron_recover.run_folder import fsync_dir, write_atomically

install_cpu_optimizer_check()  # nanotron 0.4's load_optimizer moves state to "cuda" for a sanity check

if TYPE_CHECKING:
    from nanotron_recover.training_state import TrainingState

LATEST = "latest.txt"
STATE_FILE = "trainer_state.json"
LAYOUT_NANOTRON = "nanotron"  # trainer_state.json "layout" values (absent in older checkpoints: nanotron)
LAYOUT_HSDP = "hsdp"


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(folder)



def resolve_checkpoint(path: Path) -> Path | None:
    """A checkpoint folder, or a folder holding ``latest.txt`` -> the checkpoint it names (None if none).

    A ``latest.txt`` that names no complete checkpoint is an error: silently starting from step 0 would lose data.
    """
    if (path / LATEST).is_file():
        named = path / (path / LATEST).read_text().strip()
        if not (named / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path / LATEST} names {named}, which is not a complete checkpoint")
        return named
    return path if (path / STATE_FILE).is_file() else None


class CheckpointLayout(Protocol):
    """How model, optimizer and LR scheduler are laid out inside a checkpoint folder."""

    def write(self, trainer: "TrainingState", folder: Path, step: int) -> None:
        """Collective over the writing replica's ranks; ``folder`` exists."""

    def read(self, trainer: "TrainingState", folder: Path) -> None:
        """Load into this rank's model, optimizer and LR scheduler."""


class NanotronLayout:
    """nanotron 0.4's ``serialize`` format (weights as safetensors per TP/PP shard, optimizer, LR scheduler)."""

    def write(self, trainer: "TrainingState", folder: Path, step: int) -> None:
        pc = trainer.parallel_context
        save_weights(trainer.unwrapped_model, pc, folder)
        save_optimizer(trainer.optimizer, pc, folder)
        save_lr_scheduler(trainer.lr_scheduler, pc, folder)
        samples = step * trainer.M * trainer.config.tokens.micro_batch_size
        save_meta(pc, folder, {"last_train_step": step, "consumed_train_samples": samples})

    def read(self, trainer: "TrainingState", folder: Path) -> None:
        pc = trainer.parallel_context
        load_weights(trainer.unwrapped_model, pc, folder)
        load_optimizer(trainer.optimizer, pc, folder, map_location=str(trainer.device))
        load_lr_scheduler(trainer.lr_scheduler, folder)


def layout_state(config: RecoverConfig) -> dict:
    """The ``trainer_state.json`` keys that say which runs can resume a checkpoint (besides M)."""
    if config.sharded_replicas:
        return {"layout": LAYOUT_HSDP, "fsdp_shard_size": config.fault_tolerance.fsdp_shard_size}
    return {"layout": LAYOUT_NANOTRON}


def dtype_name(config: RecoverConfig) -> str:
    return str(config.model.dtype).removeprefix("torch.")


def check_resumable(source: Path, config: RecoverConfig) -> None:
    """Same M, the same model dtype (a bf16 checkpoint holds fp32 masters, a float32 one does not), and a layout
    this run reads: nanotron (3D replicas) or HSDP shards of the same shard size."""
    check_same_microbatches(source, config.microbatches_per_step)
    saved = json.loads((source / STATE_FILE).read_text())
    saved_dtype = saved.get("dtype", "float32")  # older checkpoints: float32 runs
    if saved_dtype != dtype_name(config):
        raise ValueError(
            f"{source} was trained with model.dtype: {saved_dtype}, this run has {dtype_name(config)}: "
            "resume with the same dtype"
        )
    saved_layout = {"layout": saved.get("layout", LAYOUT_NANOTRON), "fsdp_shard_size": saved.get("fsdp_shard_size")}
    wanted = {"fsdp_shard_size": None, **layout_state(config)}
    if saved_layout != wanted:
        raise ValueError(f"{source} holds {_describe(saved_layout)}; this run needs {_describe(wanted)}")


def _describe(layout: dict) -> str:
    if layout["layout"] == LAYOUT_HSDP:
        return f"HSDP shards of fsdp_shard_size={layout['fsdp_shard_size']}"
    return f"the {layout['layout']} format (3D replicas)"


def check_same_microbatches(source: Path, microbatches_per_step: int) -> None:
    """A checkpoint continues only a run with the same global microbatch count M (else each step's samples differ)."""
    saved = json.loads((source / STATE_FILE).read_text()).get("microbatches_per_step")
    if saved != microbatches_per_step:
        raise ValueError(
            f"{source} was trained with {saved} microbatches per step, this run has {microbatches_per_step} "
            "(dp x batch_accumulation_per_replica): the samples of each step would differ"
        )


class CheckpointManager:
    def __init__(self, config: RecoverConfig, run_dir: Path, layout: CheckpointLayout | None = None) -> None:
        self.config = config
        self.layout = layout if layout is not None else NanotronLayout()
        args = config.checkpoints
        self.interval = args.checkpoint_interval if args is not None else None
        root = Path(args.checkpoints_path) if args is not None else Path("checkpoints")
        self.root = root if root.is_absolute() else Path(run_dir) / root
        self.resume_path = Path(args.resume_checkpoint_path) if args and args.resume_checkpoint_path else None

    def due(self, step: int) -> bool:
        return self.interval is not None and step % self.interval == 0

    def latest(self) -> Path | None:
        return resolve_checkpoint(self.root) if self.root.is_dir() else None

    def save(
        self,
        trainer: "TrainingState",
        step: int,
        *,
        writer: bool,
        barrier: Callable[[], None],
        publisher: bool,
        extra_state: dict | None = None,
    ) -> None:
        """Collective over the writing ranks (one full model copy); ``publisher`` renames it into place."""
        if not writer:
            return
        tmp = self.root / f".tmp-step-{step}"
        final = self.root / str(step)
        if (final / STATE_FILE).is_file():
            return  # this step is saved already (e.g. the fallback save right after an interval save)
        if publisher:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        self.layout.write(trainer, tmp, step)
        barrier()  # every part written
        if not publisher:
            return
        _fsync_tree(tmp)
        state = {
            "step": step,
            "microbatches_per_step": trainer.M,
            "dtype": dtype_name(self.config),
            **layout_state(self.config),
            **(extra_state or {}),
        }
        write_atomically(tmp / STATE_FILE, json.dumps(state, indent=2), durable=True)
        shutil.rmtree(final, ignore_errors=True)  # a partial folder can only be a leftover; the state file was absent
        os.replace(tmp, final)
        fsync_dir(self.root)
        write_atomically(self.root / LATEST, f"{step}\n", durable=True)

    def resume_source(self) -> Path | None:
        """The explicit ``resume_checkpoint_path`` if set, else this run's own latest checkpoint (auto-resume)."""
        if self.resume_path is not None:
            found = resolve_checkpoint(self.resume_path)
            if found is None:
                raise FileNotFoundError(f"checkpoints.resume_checkpoint_path: no checkpoint at {self.resume_path}")
            return found
        return self.latest()

    def source_step(self) -> int | None:
        """The step of the checkpoint :meth:`maybe_resume` would load (None: it would start from scratch)."""
        source = self.resume_source()
        return None if source is None else int(json.loads((source / STATE_FILE).read_text())["step"])

    def maybe_resume(self, trainer: "TrainingState") -> int:
        """Load model, optimizer and LR scheduler from the resume source; return the step to continue after."""
        source = self.resume_source()
        if source is None:
            return 0
        check_resumable(source, self.config)
        self.layout.read(trainer, source)
        state = json.loads((source / STATE_FILE).read_text())
        print(f"[nanotron-recover] resumed from {source} at step {state['step']}", flush=True)
        return int(state["step"])
