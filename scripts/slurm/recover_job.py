"""Small helpers for the sbatch scripts in this folder (run with the project's venv Python).

``info``     prints the run's shape as shell assignments, from the config with the same overrides the trainer
             applies (and warns on stderr when, with SLURM_TASKS_PER_NODE, a replica would span two nodes)::

                 eval "$(python scripts/slurm/recover_job.py info --config-file X --synthetic-data)"
                 # -> RECOVER_WORLD_SIZE=4 RECOVER_FT_ENABLED=1 RECOVER_TRAIN_STEPS=10 ...

``begin``    before each ``mpirun``: the run folder's launch record (the previous launch's exit records move to
             ``launches/<n>/``, so that the outcome judges this launch's records alone).
``outcome``  after ``mpirun`` returned: was the run finished, or must it be relaunched (it resumes from
             ``latest.txt``)?  Prints one word and exits with a matching code:

                 done      0   metrics.jsonl has the last step (train_steps)
                 restart   3   not finished: the trainer stopped below min_replicas (mpirun rc 3) or the whole
                               job died (every replica lost, a lost node's daemon: mpirun rc 0, a crash); a
                               relaunch resumes from the checkpoint
                 needs_person  2   a person must act: bad input, damaged state with no intact
                               fallback, a full disk, a non-finite step, or the same start-up failure on
                               $NANOTRON_RECOVER_MAX_STARTUP_FAILURES (3) launches in a row
                 aborted   2   a rank recorded that it aborted the job on an error (a bug): relaunching
                               would meet it again

The run is judged by what it wrote, not by ``mpirun``'s exit code alone: under ``--with-ft ulfm`` mpirun may
return 0 although ranks were SIGKILLed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from nanotron_recover.launcher.launch import max_startup_failures_setting
from nanotron_recover.launcher.mpirun import replica_placement, slurm_tasks_per_node

# light modules only (no torch, no nanotron): this runs between two mpirun jobs
from nanotron_recover.run.exit_codes import EXIT_BAD_INPUT
from nanotron_recover.run.launch_contract import TOKEN_ENV
from nanotron_recover.run.outcome import OUTCOME_EXIT_CODES, judge_launch
from nanotron_recover.run.run_folder import begin_launch


def _load_config(argv: Sequence[str], command: str):
    """(the trainer's options, the effective config) as the ranks will see them, or None after the error."""
    from nanotron_recover.config import ConfigError
    from nanotron_recover.launcher.overrides import add_override_args, load_effective_config

    parser = argparse.ArgumentParser(prog=f"recover_job.py {command}")
    add_override_args(parser)
    args = parser.parse_args(argv)
    try:
        return args, load_effective_config(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"recover_job.py: error: {e}", file=sys.stderr)
        return None


def _info(argv: Sequence[str]) -> int:
    loaded = _load_config(argv, "info")
    if loaded is None:
        return EXIT_BAD_INPUT
    config = loaded[1]
    ft = config.fault_tolerance if config.ft_enabled else None
    checkpoints = config.checkpoints.checkpoints_path if config.checkpoints is not None else "checkpoints"
    values = {
        "RECOVER_WORLD_SIZE": config.world_size,
        "RECOVER_FT_ENABLED": int(config.ft_enabled),
        "RECOVER_TRAIN_STEPS": config.tokens.train_steps,
        "RECOVER_RANKS_PER_REPLICA": config.ranks_per_replica,
        "RECOVER_REPLICAS": config.parallelism.dp + config.spare_replicas,
        "RECOVER_MIN_REPLICAS": ft.min_replicas if ft is not None else config.parallelism.dp,
        "RECOVER_CHECKPOINTS_PATH": str(checkpoints),
        "RECOVER_NEEDS_FINAL_CHECKPOINT": int(config.saves_final_checkpoint),
    }
    for key, value in values.items():
        print(f"{key}={shlex.quote(str(value))}")
    tasks = os.environ.get("SLURM_TASKS_PER_NODE")
    if tasks and config.ft_enabled:
        for warning in replica_placement(slurm_tasks_per_node(tasks), config.world_size, config.ranks_per_replica):
            print(f"[recover-sbatch] warning: {warning}", file=sys.stderr)
    return 0


def _begin(argv: Sequence[str]) -> int:
    """Before each mpirun: the run folder's launch record (the previous launch's exit records move aside)."""
    from nanotron_recover.launcher.launch import launch_record

    loaded = _load_config(argv, "begin")
    if loaded is None:
        return EXIT_BAD_INPUT
    args, config = loaded
    token = os.environ.get(TOKEN_ENV)  # the script's launch token, which its ranks get too: the folder is theirs
    print(f"launch {begin_launch(Path(args.run_dir), {**launch_record(config, by='sbatch'), 'token': token})}")
    return 0


def _outcome(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="recover_job.py outcome")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--train-steps", required=True, type=int)
    parser.add_argument("--mpirun-rc", required=True, type=int)
    parser.add_argument("--checkpoints-path", default="checkpoints")
    parser.add_argument("--needs-final-checkpoint", type=int, choices=(0, 1), default=0,
                        help="1: done only once the last step is checkpointed (the run has a checkpoints section)")
    args = parser.parse_args(argv)
    verdict, detail = judge_launch(args.run_dir, args.train_steps, args.mpirun_rc, args.checkpoints_path,
                                   needs_final_checkpoint=bool(args.needs_final_checkpoint),
                                   max_startup_failures=max_startup_failures_setting())
    print(verdict, detail)
    return OUTCOME_EXIT_CODES[verdict]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"info": _info, "begin": _begin, "outcome": _outcome}
    if not argv or argv[0] not in commands:
        print("usage: recover_job.py info|begin|outcome ...", file=sys.stderr)
        return EXIT_BAD_INPUT
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
