"""Run-time input checks, applied before any rank starts (and again on each rank).

Stock nanotron YAMLs may ask for what this project cannot give offline (a hub dataset, float16 without a loss scaler,
nanotron 0.4's async REDUCE_SCATTER TP, which computes wrong input gradients: upstream bug #46, fixed after 0.4).
Each gets either a clear error naming the key and the way out, or a documented, logged adjustment.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from nanotron.config import PretrainDatasetsArgs
from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode

from nanotron_recover.config import ConfigError, RecoverConfig, TokenizedDatasetArgs
from nanotron_recover.training.checkpoint import check_resumable, own_root, resolve_checkpoint, resumes_own_checkpoints

logger = logging.getLogger(__name__)


def check_runtime_inputs(config: RecoverConfig, run_dir: Path | None = None) -> list[str]:
    """Raise :class:`ConfigError` on input that cannot work here; return the adjustments made (also logged).
    ``run_dir``: where a relative ``checkpoints_path`` lives (None: unknown; ``resume_checkpoint_path`` is then
    checked whenever it is set, unless an absolute checkpoint root shows the run has checkpoints of its own)."""
    notes: list[str] = []
    if config.optimizer is None:
        raise ConfigError("optimizer: section is required for training")
    dataset = config.data.dataset if config.data is not None else None
    if isinstance(dataset, PretrainDatasetsArgs):
        raise ConfigError(
            f"data.dataset.hf_dataset_or_datasets={dataset.hf_dataset_or_datasets!r} needs the Hugging Face hub, "
            "which training never contacts. Tokenize a local corpus with `nanotron-recover prepare-data` and set "
            "data.dataset.dataset_folder (or pass --data-folder DIR), or pass --synthetic-data."
        )
    if isinstance(dataset, TokenizedDatasetArgs):
        _check_token_folder(Path(dataset.dataset_folder), config)
    _check_resume_source(config, run_dir)
    par = config.parallelism
    if par.tp_mode is TensorParallelLinearMode.REDUCE_SCATTER and par.tp_linear_async_communication:
        par.tp_linear_async_communication = False
        notes.append(
            "parallelism.tp_linear_async_communication: turned off (nanotron 0.4 computes wrong input gradients "
            "with async REDUCE_SCATTER, upstream bug #46)"
        )
    _check_precision(config)
    for note in notes:
        logger.warning(note)
    return notes


def _check_precision(config: RecoverConfig) -> None:
    """float32, or bfloat16 with nanotron's mixed-precision recipe (fp32 masters and fp32 gradient accumulation;
    without fp32 accumulation only on the stock path, where nanotron supports it). float16 needs a loss scaler."""
    dtype = config.model.dtype
    if dtype == torch.float32:
        return
    if dtype != torch.bfloat16:
        raise ConfigError(f"model.dtype: {dtype} is not supported (it needs loss scaling): use bfloat16 or float32")
    if config.ft_enabled and not config.optimizer.accumulate_grad_in_fp32:
        raise ConfigError(
            "optimizer.accumulate_grad_in_fp32: false is not supported with fault_tolerance and model.dtype: "
            "bfloat16 (the cross-replica reduction and its snapshots work on fp32 gradient buckets, which are the fp32 "
            "accumulation): set it to true"
        )


def check_local_snapshot_budget(config: RecoverConfig, ranks_per_node: int, run_dir: Path) -> None:
    """Before launch: three snapshots per rank (two complete, one being written) of this node must fit
    ``local_snapshot_max_gb`` and the free space of ``local_snapshot_dir`` (this run's own older snapshots there count
    as free: they are replaced)."""
    from nanotron_recover.snapshots.settings import SnapshotSettings

    settings = SnapshotSettings.of(config) if config.ft_enabled else None
    if settings is None or not settings.enabled:
        return
    from nanotron_recover.run.run_folder import run_id
    from nanotron_recover.snapshots.store import reserved_bytes, snapshot_folder
    from nanotron_recover.training.memory import snapshot_bytes_per_rank

    folder = settings.folder
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"fault_tolerance.local_snapshot_dir: {folder} cannot be created here (no write access "
                          f"to {existing}); set another folder, or local_snapshot_interval: 0")
    run = run_id(run_dir)
    ours = None if run is None else snapshot_folder(settings, run)
    reusable = sum(f.stat().st_size for f in ours.glob("*") if f.is_file()) if ours and ours.is_dir() else 0
    free = shutil.disk_usage(existing).free + reusable
    # at most 3 files a rank: two complete snapshots, and the next one being written (an old one goes only after
    # the new one is complete); never all of the folder's space (Open MPI and NCCL shared memory live there too)
    need = 3 * ranks_per_node * snapshot_bytes_per_rank(config)
    usable = free - reserved_bytes(existing)
    limit = free / 2 if settings.max_gb is None else min(usable, settings.max_gb * 2**30)
    if need > limit:
        raise ConfigError(
            f"fault_tolerance.local_snapshot_*: three snapshots for each of {ranks_per_node} rank(s) per node need "
            f"{need / 2**30:.2f} GiB, more than {limit / 2**30:.2f} GiB (local_snapshot_max_gb "
            f"{settings.max_gb}, {free / 2**30:.2f} GiB free in {existing}): raise local_snapshot_max_gb, "
            "point local_snapshot_dir at a larger node-local folder, or set local_snapshot_interval: 0"
        )


def _check_resume_source(config: RecoverConfig, run_dir: Path | None) -> None:
    """An explicit ``resume_checkpoint_path`` must hold a checkpoint of the same global microbatch count M, in a
    layout this run reads (3D: nanotron's; HSDP: shards of the same ``fsdp_shard_size``). Checked only where the
    runtime reads it: once the run has checkpoints of its own, it resumes from those (verified, with a fallback to an
    older intact one), so a source moved away, or the run's own root (nanotron's requeue idiom) with a damaged
    newest folder, is no reason to refuse the launch."""
    args = config.checkpoints
    if args is None or not args.resume_checkpoint_path or resumes_own_checkpoints(own_root(config, run_dir)):
        return
    key = "checkpoints.resume_checkpoint_path"
    try:
        source = resolve_checkpoint(Path(args.resume_checkpoint_path))
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from None
    if source is None:
        raise ConfigError(f"{key}: no checkpoint at {args.resume_checkpoint_path}")
    try:
        check_resumable(source, config)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_token_folder(folder: Path, config: RecoverConfig) -> None:
    key = "data.dataset.dataset_folder"
    if not folder.is_dir():
        raise ConfigError(
            f"{key}: {folder} does not exist. Create it with `nanotron-recover prepare-data --output {folder}`."
        )
    if not any(folder.rglob("*.ds")):
        raise ConfigError(f"{key}: {folder} holds no datatrove token files (*.ds); run `nanotron-recover prepare-data`")
    manifest = folder / "dataset.json"
    if manifest.is_file():
        meta = json.loads(manifest.read_text())
        vocab = meta.get("vocab_size")
        model_vocab = config.model.model_config.vocab_size
        if vocab is not None and vocab > model_vocab:
            raise ConfigError(
                f"model.model_config.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({vocab}) "
                f"of {folder}: raise vocab_size to at least {vocab}"
            )
