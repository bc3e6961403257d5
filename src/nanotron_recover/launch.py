"""The user command: ``nanotron-recover train --config-file X`` -> ``mpirun [--with-ft ulfm] ... train``.

Everything that can be wrong with the input is reported here, before any rank starts. Module-level imports stay
light (no torch, nanotron or mpi4py): each rank reads its options from here before its start-up guard is armed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from nanotron_recover.exit_codes import EXIT_BAD_INPUT
from nanotron_recover.mpirun import mpirun_command, python_module_command

if TYPE_CHECKING:
    from nanotron_recover.config import RecoverConfig


HOSTFILE_ENV = "NANOTRON_RECOVER_HOSTFILE"  # an Open MPI hostfile for the launch
MPIRUN_ARGS_ENV = "NANOTRON_RECOVER_MPIRUN_ARGS"  # extra mpirun options, shell-quoted (as MPIRUN_ARGS in sbatch)


def resolve_run_name(template: str | None) -> str:
    """nanotron's ``general.run`` with ``%date`` and ``%jobid`` filled in (once, here, for every rank)."""
    name = template or "%date_%jobid"
    name = name.replace("%date", datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))
    return name.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))


def default_run_dir(config: "RecoverConfig") -> Path:
    return Path("runs") / resolve_run_name(config.general.run)


def add_override_args(parser: argparse.ArgumentParser) -> None:
    """Options that both the launcher and each rank accept (the launcher forwards them)."""
    parser.add_argument("--config-file", required=True, help="nanotron YAML, optionally with fault_tolerance:")
    parser.add_argument("--run-dir", help="output folder (metrics, checkpoints); default runs/<general.run>/")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-folder", help="train on this datatrove token folder instead of the config's data")
    data.add_argument("--synthetic-data", action="store_true", help="train on the deterministic synthetic stream")
    parser.add_argument("--train-steps", type=int, help="override tokens.train_steps")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def forwarded_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    out = ["--config-file", str(Path(args.config_file).resolve()), "--run-dir", str(run_dir.resolve())]
    if args.data_folder:
        out += ["--data-folder", str(Path(args.data_folder).resolve())]
    if args.synthetic_data:
        out.append("--synthetic-data")
    if args.train_steps:
        out += ["--train-steps", str(args.train_steps)]
    return out


def load_effective_config(args: argparse.Namespace) -> "RecoverConfig":
    """The config with the command-line overrides applied and the run-time input checked."""
    from nanotron_recover.config import load_config
    from nanotron_recover.preflight import apply_overrides, check_runtime_inputs

    config = load_config(args.config_file)
    apply_overrides(
        config, data_folder=args.data_folder, synthetic_data=args.synthetic_data, train_steps=args.train_steps
    )
    check_runtime_inputs(config)
    return config


def train_command(args: argparse.Namespace) -> tuple[list[str], "RecoverConfig", Path]:
    config = load_effective_config(args)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(config)
    program = python_module_command("nanotron_recover.train", forwarded_args(args, run_dir))
    env = {"PYTHONUNBUFFERED": "1"}
    if not config.ft_enabled:
        # stock layout: one torch world, rendezvous as torchrun would do it
        env.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(_free_port()))
    hostfile = os.environ.get(HOSTFILE_ENV)
    extra = shlex.split(os.environ.get(MPIRUN_ARGS_ENV, ""))
    cmd = mpirun_command(config.world_size, program, ulfm=config.ft_enabled, env=env, hostfile=hostfile,
                         extra_args=extra)
    return cmd, config, run_dir


def _cmd_train(args: argparse.Namespace) -> int:
    cmd, config, run_dir = train_command(args)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    mode = "ReCoVer (ULFM)" if config.ft_enabled else "stock nanotron data path"
    if config.sharded_replicas:
        mode += f", HSDP replicas of {config.ranks_per_replica} FSDP shards"
    print(f"[nanotron-recover] {config.world_size} ranks, {mode}, run dir {run_dir}", flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from nanotron_recover.data.prepare import run_prepare_from_args

    return run_prepare_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanotron-recover", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="launch a training run under mpirun (ULFM when fault_tolerance is on)")
    add_override_args(train)
    train.add_argument("--dry-run", action="store_true", help="print the mpirun command line and exit")
    train.set_defaults(func=_cmd_train)
    from nanotron_recover.data.prepare import add_prepare_arguments

    prep = sub.add_parser("prepare-data", help="tokenize a corpus (default: the King James Bible) into datatrove files")
    add_prepare_arguments(prep)
    prep.set_defaults(func=_cmd_prepare_data)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from nanotron_recover.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"nanotron-recover: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
