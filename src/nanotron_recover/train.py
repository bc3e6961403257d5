"""Per-rank entry point: ``mpirun ... python -m nanotron_recover.train --config-file X --run-dir D``.

Parse the config, build the data-parallel path (ReCoVer over ULFM, or stock nanotron), train, close.
Exit codes: 0 done (also for a rank whose replica was evicted), 2 bad input, 3 fewer live replicas than
``fault_tolerance.min_replicas`` (a checkpoint was saved; relaunching resumes from it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Sequence

from nanotron_recover.config import ConfigError
from nanotron_recover.launch import add_override_args, load_effective_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanotron_recover.train", description=__doc__)
    add_override_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_effective_config(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"nanotron-recover: error: {e}", file=sys.stderr)
        return 2
    if not args.run_dir:
        # every rank must write into the same folder: a run name with %date would differ between ranks
        print("nanotron-recover: error: --run-dir is required when ranks are started directly", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    timeout_s = config.fault_tolerance.collective_timeout_s if config.fault_tolerance else 600.0
    if config.ft_enabled:
        return _run_resilient(config, run_dir, timeout_s)
    return _run_stock(config, run_dir, timeout_s)


def record_exit(run_dir: Path, rank: int, code: int, reason: str) -> None:
    """``<run_dir>/exits/rank-<r>.json``: how each rank ended (mpirun's own exit code says little under ULFM)."""
    folder = run_dir / "exits"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "code": code, "reason": reason}))


def _run_stock(config, run_dir: Path, timeout_s: float) -> int:
    import torch.distributed as torch_dist

    from nanotron_recover.stock import StockDataParallel
    from nanotron_recover.trainer import RecoverTrainer
    from nanotron_recover.world import init_stock_torch_world

    init_stock_torch_world(timeout_s)
    trainer = RecoverTrainer(config, run_dir, StockDataParallel(config, timeout_s))
    trainer.train()
    torch_dist.barrier()
    record_exit(run_dir, torch_dist.get_rank(), 0, "finished")
    torch_dist.destroy_process_group()
    return 0


def _run_resilient(config, run_dir: Path, timeout_s: float) -> int:
    from nanotron_recover.ft import FailureDetected, ReplicaEvicted
    from nanotron_recover.recovery.resilient import (
        EXIT_BELOW_MIN_REPLICAS,
        BelowMinimumReplicas,
        ResilientDataParallel,
    )
    from nanotron_recover.trainer import RecoverTrainer

    if config.sharded_replicas:
        from nanotron_recover.hsdp.strategy import ShardedReplicaDataParallel

        dp = ShardedReplicaDataParallel(config, timeout_s)
    else:
        dp = ResilientDataParallel(config, timeout_s)
    dp.on_exit = lambda code, reason: record_exit(run_dir, dp.ft.rank, code, reason)
    code, reason = 0, "finished"
    try:
        trainer = RecoverTrainer(config, run_dir, dp)
        trainer.train()
    except ReplicaEvicted as e:
        reason = f"evicted: {e}"
        print(f"[nanotron-recover] rank {dp.ft.rank} (replica {dp.replica}) leaves: {e}", flush=True)
    except BelowMinimumReplicas as e:
        print(f"[nanotron-recover] stopping: {e}; saving a checkpoint of step {e.last_committed_step}", flush=True)
        if e.last_committed_step > 0:  # collective over the live ranks: the lowest computing replica writes
            try:
                dp.save_checkpoint(trainer, e.last_committed_step, extra_state={"stopped": "below_min_replicas"})
            except (BelowMinimumReplicas, FailureDetected) as again:  # another death during the fallback save
                print(f"[nanotron-recover] fallback checkpoint not saved: {again}", flush=True)
        trainer.metrics.log_event({"event": "stopped", "reason": str(e), "step": e.last_committed_step})
        trainer.metrics.close()
        code, reason = EXIT_BELOW_MIN_REPLICAS, str(e)
    except Exception as error:
        try:
            dp.join_repair_after_error()  # a dead replica-mate broke our torch traffic: leave with the repair
        except ReplicaEvicted as e:
            code, reason = 0, f"evicted after {type(error).__name__}: {e}"
            print(f"[nanotron-recover] rank {dp.ft.rank} (replica {dp.replica}) leaves: {e}", flush=True)
        else:
            # A bug, not a fault: the same error would hit every replica. Abort the whole job at once instead of
            # leaving the other ranks to wait out their torch timeouts.
            traceback.print_exc()
            sys.stderr.flush()
            dp.on_exit(1, f"aborted: {type(error).__name__}: {error}")
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
    dp.on_exit(code, reason)
    sys.stdout.flush()
    dp.shutdown(code=code)
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
