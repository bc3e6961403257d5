"""The command line's overrides of a config, shared by the launcher and every rank.

The launcher validates the effective config before any process starts and forwards the same options to each
rank, which applies them again to the same file: both see one config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanotron_recover.config import RecoverConfig


def add_override_args(parser: argparse.ArgumentParser) -> None:
    """Options that both the launcher and each rank accept (the launcher forwards them)."""
    parser.add_argument("--config-file", required=True, help="nanotron YAML, optionally with fault_tolerance:")
    parser.add_argument("--run-dir", help="output folder (metrics, checkpoints); default runs/<general.run>/")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-folder", help="train on this datatrove token folder instead of the config's data")
    data.add_argument("--synthetic-data", action="store_true", help="train on the deterministic synthetic stream")
    parser.add_argument("--train-steps", type=int, help="override tokens.train_steps")
    parser.add_argument("--replicas", type=int, help="train on this many replicas (parallelism.dp), keeping the "
                        "global batch M = dp x batch_accumulation_per_replica: the accumulation becomes M / replicas "
                        "(a relaunch on fewer nodes resumes the same trajectory)")


def forwarded_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    out = ["--config-file", str(Path(args.config_file).resolve()), "--run-dir", str(run_dir.resolve())]
    if args.data_folder:
        out += ["--data-folder", str(Path(args.data_folder).resolve())]
    if args.synthetic_data:
        out.append("--synthetic-data")
    if args.train_steps:
        out += ["--train-steps", str(args.train_steps)]
    if args.replicas:
        out += ["--replicas", str(args.replicas)]
    return out


def apply_overrides(
    config: "RecoverConfig", *, data_folder: str | None, synthetic_data: bool, train_steps: int | None
) -> None:
    """``--data-folder``, ``--synthetic-data`` and ``--train-steps`` (the LR decay shortened to fit the steps)."""
    from nanotron_recover.config import ConfigError, RecoverDataArgs, TokenizedDatasetArgs

    if data_folder or synthetic_data:
        seed = config.data.seed if config.data is not None else config.general.seed
        dataset = TokenizedDatasetArgs(dataset_folder=str(data_folder)) if data_folder else None
        config.data = RecoverDataArgs(dataset=dataset, seed=seed)
    if train_steps is not None:
        if train_steps < 1:
            raise ConfigError(f"--train-steps must be >= 1, got {train_steps}")
        config.tokens.train_steps = train_steps
        lr = config.optimizer.learning_rate_scheduler if config.optimizer else None
        if lr is not None and lr.lr_decay_steps is not None \
                and lr.lr_decay_steps + (lr.lr_warmup_steps or 0) > train_steps:
            lr.lr_decay_steps = max(1, train_steps - (lr.lr_warmup_steps or 0))


def apply_replicas(config: "RecoverConfig", replicas: int) -> None:
    """``--replicas R``: ``dp = R`` and ``batch_accumulation_per_replica = M / R``, so every step still commits the
    same M global microbatches (a checkpoint resumes only with the same M). ``min_replicas`` is capped at R."""
    from nanotron_recover.config import ConfigError, validate

    m = config.microbatches_per_step
    if replicas < 1 or m % replicas:
        raise ConfigError(f"--replicas {replicas}: the global batch of M = {m} microbatches "
                          f"(dp x batch_accumulation_per_replica) must be divisible by it")
    ft = config.fault_tolerance
    if ft is not None and ft.replica_weights is not None and len(ft.replica_weights) != replicas + ft.spare_replicas:
        # the weights name the replicas of the full-size job: a relaunch on fewer must not be refused as bad input
        # (it would never be requeued); the planner measures the speeds instead
        print(f"[nanotron-recover] --replicas {replicas}: fault_tolerance.replica_weights (one per replica of the "
              "full-size job) not used: quotas follow the measured speeds", file=sys.stderr, flush=True)
        ft.replica_weights = None
    config.parallelism.dp = replicas
    config.tokens.batch_accumulation_per_replica = m // replicas
    if config.fault_tolerance is not None and config.fault_tolerance.min_replicas > replicas:
        print(f"[nanotron-recover] --replicas {replicas}: min_replicas {config.fault_tolerance.min_replicas} "
              f"lowered to {replicas}", file=sys.stderr, flush=True)
        config.fault_tolerance.min_replicas = replicas
    validate(config)


def load_effective_config(args: argparse.Namespace) -> "RecoverConfig":
    """The config with the command-line overrides applied and the run-time input checked."""
    from nanotron_recover.config import load_config
    from nanotron_recover.launcher.preflight import check_runtime_inputs

    config = load_config(args.config_file)
    apply_overrides(
        config, data_folder=args.data_folder, synthetic_data=args.synthetic_data, train_steps=args.train_steps
    )
    if getattr(args, "replicas", None):
        apply_replicas(config, args.replicas)
    run_dir = getattr(args, "run_dir", None)
    check_runtime_inputs(config, Path(run_dir) if run_dir else None)  # the run's own checkpoints are in its folder
    return config
