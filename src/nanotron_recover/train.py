"""Per-rank entry point: ``mpirun ... python -m nanotron_recover.train --config-file X --run-dir D``.

Arm the start-up guard (before torch or MPI is imported), parse the config, build the data-parallel path (ReCoVer
over ULFM, or stock nanotron), train, close. Exit codes (:mod:`nanotron_recover.run.exit_codes`): 0 done (also for a
rank whose replica was evicted), 2 a person must act (bad input, damaged state with no intact fallback, a full
disk, a non-finite step), 3 not finished, relaunch to resume: fewer live replicas than
``fault_tolerance.min_replicas`` (a checkpoint was saved), a fault during start-up, or a hang no kill could end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from nanotron_recover.launcher.overrides import add_override_args
from nanotron_recover.process.standby_rank import wait_until_released
from nanotron_recover.process.startup_guard import StartupGuard, arm_startup_guard, waiting_for_peers
from nanotron_recover.process.stop_request import STOP
from nanotron_recover.run import fence
from nanotron_recover.run.exit_codes import EXIT_BAD_INPUT
from nanotron_recover.run.launch_contract import LaunchContract

# Torch, nanotron and mpi4py are imported inside the functions below: the start-up guard must be armed first.


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.train", description=__doc__)
    add_override_args(parser)
    args = parser.parse_args(argv)
    STOP.install()  # a stop signal from now on ends the job at a step boundary (stop_request.py)
    launch = LaunchContract.read(os.environ)  # what the launcher tells this rank, read here once, handed down
    if launch.standby_folder is not None:  # a warm standby: the imports now, MPI and the rest once released
        wait_until_released(launch.standby_folder, launch.launcher_pid, launch.launcher_node,
                            prepare=lambda: _import_training_stack(args))
    if args.run_dir:  # before the start-up guard forks its watchdog: the watchdog's exit record is fenced too
        fence.arm(Path(args.run_dir), launch.token)
    guard = arm_startup_guard(args.config_file, args.run_dir, launch.token)

    from nanotron_recover.config import ConfigError
    from nanotron_recover.launcher.overrides import load_effective_config

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_effective_config(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"nanotron-recover: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.run_dir:
        # every rank must write into the same folder: a run name with %date would differ between ranks
        print("nanotron-recover: error: --run-dir is required when ranks are started directly", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fence.arm(run_dir, launch.token)  # every write to the run folder from here on is this launch's, or none
    timeout_s = config.fault_tolerance.collective_timeout_s if config.fault_tolerance else 600.0
    if config.ft_enabled:
        return _run_resilient(config, run_dir, timeout_s, guard, launch)
    from nanotron_recover.training.stock import run_stock

    return run_stock(config, run_dir, timeout_s, launch)


def _import_training_stack(args: argparse.Namespace) -> None:
    """What a rank imports before it trains, less MPI's initialization (a warm standby's head start): the strategy
    its config runs (HSDP's imports FSDP, ~0.4 s of CPU), and wandb with its service started on the rank that will
    log (world rank 0 of a new launch). A standby's imports share the cores of the job it stands beside."""
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI  # noqa: F401 - loaded, not initialized

    from nanotron_recover.config import ConfigError
    from nanotron_recover.launcher.overrides import load_effective_config

    try:
        config = load_effective_config(args)
    except (ConfigError, FileNotFoundError):
        config = None  # reported once released, as a cold start reports it
    import nanotron_recover.recovery.lifecycle  # noqa: F401
    import nanotron_recover.training.trainer  # noqa: F401

    if config is None or config.sharded_replicas:
        import nanotron_recover.hsdp.strategy  # noqa: F401
    else:
        import nanotron_recover.recovery.resilient  # noqa: F401
    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0" and os.environ.get("WANDB_MODE") != "disabled":
        import wandb

        wandb.setup()  # its service process, which the logging rank's wandb.init then joins


def _run_resilient(config, run_dir: Path, timeout_s: float, guard: StartupGuard | None,
                   launch: LaunchContract) -> int:
    with waiting_for_peers("MPI_Init"):  # a peer frozen or dead before it: a bounded wait
        from mpi4py import MPI  # MPI_Init, unless a warm standby imported it uninitialized

        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if guard is not None:
        guard.injector.maybe_fail(0, "startup:after_mpi_init")
    from nanotron_recover.recovery.lifecycle import run_resilient
    from nanotron_recover.training.trainer import RecoverTrainer

    if config.sharded_replicas:
        from nanotron_recover.hsdp.strategy import ShardedReplicaDataParallel as Strategy
    else:
        from nanotron_recover.recovery.resilient import ResilientDataParallel as Strategy
    return run_resilient(Strategy, RecoverTrainer, config, run_dir, timeout_s, launch,
                         on_started=guard.watchdog.disarm if guard is not None else None)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
