"""Per-rank entry point: ``mpirun ... python -m nanotron_recover.train --config-file X --run-dir D``.

Arm the start-up guard (before torch or MPI is imported), parse the config, build the data-parallel path (ReCoVer
over ULFM, or stock nanotron), train, close. Exit codes (:mod:`nanotron_recover.exit_codes`): 0 done (also for a
rank whose replica was evicted), 2 bad input, 3 not finished, relaunch to resume: fewer live replicas than
``fault_tolerance.min_replicas`` (a checkpoint was saved), a fault during start-up, or a hang no kill could end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from nanotron_recover.exit_codes import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART
from nanotron_recover.inject import FailureInjector
from nanotron_recover.run_folder import exit_record_path, record_exit
from nanotron_recover.watchdog import StartupWatchdog, end_job

# Torch, nanotron and mpi4py are imported inside the functions below: the start-up guard must be armed first.


@dataclass
class StartupGuard:
    """This rank's start-up watchdog and its start-up fault injector (``phase: startup`` entries)."""

    watchdog: StartupWatchdog
    injector: FailureInjector


def main(argv: Sequence[str] | None = None) -> int:
    from nanotron_recover.launch import add_override_args

    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.train", description=__doc__)
    add_override_args(parser)
    args = parser.parse_args(argv)
    guard = arm_startup_guard(args.config_file, args.run_dir)

    from nanotron_recover.config import ConfigError
    from nanotron_recover.launch import load_effective_config

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
    timeout_s = config.fault_tolerance.collective_timeout_s if config.fault_tolerance else 600.0
    if config.ft_enabled:
        return _run_resilient(config, run_dir, timeout_s, guard)
    return _run_stock(config, run_dir, timeout_s)


def _peek_fault_tolerance(config_file: str) -> tuple[dict, int] | None:
    """The raw ``fault_tolerance`` section and the ranks per replica, read with YAML alone (no torch yet);
    None when fault tolerance is off or the file cannot be read (the full load reports that)."""
    import yaml

    try:
        with open(config_file) as f:
            raw = yaml.safe_load(f)
        ft = raw.get("fault_tolerance")
        if not isinstance(ft, dict) or not ft.get("enabled", True):
            return None
        par = raw.get("parallelism") or {}
        rpr = ft["fsdp_shard_size"] if ft.get("replica") == "fsdp" else par.get("tp", 1) * par.get("pp", 1)
        return ft, int(rpr)
    except Exception:  # noqa: BLE001 - the real loader gives the error message
        return None


def arm_startup_guard(config_file: str, run_dir: str | None) -> StartupGuard | None:
    """Under mpirun with fault tolerance on: fork the start-up watchdog, then fire a ``before_mpi_init`` fault."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    peek = _peek_fault_tolerance(config_file) if rank is not None else None
    if peek is None:
        return None
    ft, rpr = peek
    record = exit_record_path(Path(run_dir), rank) if run_dir else None
    watchdog = StartupWatchdog(float(ft.get("startup_timeout_s", 600.0)), label=f"rank {rank}", exit_record=record)
    try:
        injector = FailureInjector(ft.get("inject") or [], int(rank) // rpr, int(rank) % rpr, run_dir=run_dir)
    except (ValueError, TypeError, KeyError):  # a bad schedule: the config loader names the key
        injector = FailureInjector([], 0, 0)
    injector.maybe_fail(0, "startup:before_mpi_init")
    return StartupGuard(watchdog, injector)


def _run_stock(config, run_dir: Path, timeout_s: float) -> int:
    import torch.distributed as torch_dist

    from nanotron_recover.stock import StockDataParallel
    from nanotron_recover.trainer import RecoverTrainer
    from nanotron_recover.world import init_stock_torch_world

    init_stock_torch_world(timeout_s)
    trainer = RecoverTrainer(config, run_dir, StockDataParallel(config, timeout_s))
    trainer.train()
    torch_dist.barrier()
    record_exit(run_dir, torch_dist.get_rank(), EXIT_DONE, "finished")
    torch_dist.destroy_process_group()
    return EXIT_DONE


def _run_resilient(config, run_dir: Path, timeout_s: float, guard: StartupGuard | None) -> int:
    from mpi4py import MPI  # MPI_Init

    from nanotron_recover.ft import FailureDetected, ReplicaEvicted
    from nanotron_recover.recovery.resilient import (
        EXIT_BELOW_MIN_REPLICAS,
        BelowMinimumReplicas,
        ResilientDataParallel,
    )
    from nanotron_recover.trainer import RecoverTrainer

    rank = MPI.COMM_WORLD.Get_rank()
    if guard is not None:
        guard.injector.maybe_fail(0, "startup:after_mpi_init")
    try:
        if config.sharded_replicas:
            from nanotron_recover.hsdp.strategy import ShardedReplicaDataParallel

            dp = ShardedReplicaDataParallel(config, timeout_s, end_job=end_job)
        else:
            dp = ResilientDataParallel(config, timeout_s, end_job=end_job)
    except Exception as error:  # a peer died or hung while the worlds were built: nothing to recover yet
        traceback.print_exc()
        reason = f"start-up failed: {type(error).__name__}: {error}"
        record_exit(run_dir, rank, EXIT_RESTART, reason)
        end_job(reason)
        return EXIT_RESTART
    dp.run_dir = run_dir
    dp.on_exit = lambda code, reason: record_exit(run_dir, rank, code, reason, hang_margin=dp.hang_margin())
    if guard is not None:
        dp.on_started = guard.watchdog.disarm
    code, reason = EXIT_DONE, "finished"
    try:
        trainer = RecoverTrainer(config, run_dir, dp)
        trainer.train()
    except ReplicaEvicted as e:
        reason = f"evicted: {e}"
        print(f"[nanotron-recover] rank {dp.ft.rank} (replica {dp.replica}) leaves: {e}", flush=True)
    except BelowMinimumReplicas as e:
        if not dp.can_checkpoint():  # writing would publish a state that was never committed under the step's name
            print(f"[nanotron-recover] stopping: {e}; no checkpoint is written (a relaunch resumes from the newest "
                  "committed snapshot or checkpoint)", flush=True)
        elif e.last_committed_step > 0:
            print(f"[nanotron-recover] stopping: {e}; saving a checkpoint of step {e.last_committed_step}", flush=True)
        if e.last_committed_step > 0 and dp.can_checkpoint():  # collective over the live ranks: a holder writes
            try:
                trainer.save_checkpoint(e.last_committed_step, extra_state={"stopped": "below_min_replicas"})
            except (BelowMinimumReplicas, FailureDetected) as again:  # another death during the fallback save
                print(f"[nanotron-recover] fallback checkpoint not saved: {again}", flush=True)
        trainer.metrics.log_event({"event": "stopped", "reason": str(e), "step": e.last_committed_step})
        trainer.metrics.close()
        code, reason = EXIT_BELOW_MIN_REPLICAS, str(e)
    except Exception as error:
        if dp.ft.starting:  # before every rank was ready there is no recovery: the job restarts
            traceback.print_exc()
            reason = f"start-up failed: {type(error).__name__}: {error}"
            dp.on_exit(EXIT_RESTART, reason)
            end_job(reason)
        try:
            dp.join_repair_after_error()  # a dead replica-mate broke our torch traffic: leave with the repair
        except ReplicaEvicted as e:
            code, reason = EXIT_DONE, f"evicted after {type(error).__name__}: {e}"
            print(f"[nanotron-recover] rank {dp.ft.rank} (replica {dp.replica}) leaves: {e}", flush=True)
        else:
            if dp.ft.pooled:  # recycling: moved to the pool at a point it cannot rejoin from; the others see it go
                code, reason = EXIT_DONE, f"left the pool after {type(error).__name__}: {error}"
                print(f"[nanotron-recover] rank {dp.ft.rank}: {reason}; raised at:\n"
                      + "".join(traceback.format_tb(error.__traceback__)[-4:]), flush=True)
                dp.ft.leave()
                dp.on_exit(code, reason)
                dp.shutdown(code=code)
                return code
            # A bug, not a fault: the same error would hit every replica. Abort the whole job at once instead of
            # leaving the other ranks to wait out their torch timeouts.
            traceback.print_exc()
            sys.stderr.flush()
            dp.on_exit(EXIT_ABORTED, f"aborted: {type(error).__name__}: {error}")
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(EXIT_ABORTED)
    dp.on_exit(code, reason)
    sys.stdout.flush()
    dp.shutdown(code=code)
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
