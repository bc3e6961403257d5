"""Small helpers for the sbatch scripts in this folder (run with the project's venv Python).

``info``     prints the run's shape as shell assignments, from the config with the same overrides the trainer
             applies::

                 eval "$(python scripts/slurm/recover_job.py info --config-file X --synthetic-data)"
                 # -> RECOVER_WORLD_SIZE=4 RECOVER_FT_ENABLED=1 RECOVER_TRAIN_STEPS=10 ...

``outcome``  after ``mpirun`` returned: was the run finished, or must it be relaunched (it resumes from
             ``latest.txt``)?  Prints one word and exits with a matching code:

                 done      0   metrics.jsonl has the last step (train_steps)
                 restart   3   not finished: the trainer stopped below min_replicas (mpirun rc 3) or the whole
                               job died (every replica lost, a crash); a relaunch resumes from the checkpoint
                 badinput  2   the trainer rejected its input (rc 2): relaunching cannot help

The run is judged by what it wrote, not by ``mpirun``'s exit code alone: under ``--with-ft ulfm`` mpirun may
return 0 although ranks were SIGKILLed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

# light modules only (no torch, no nanotron): this runs between two mpirun jobs
from nanotron_recover.exit_codes import EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART
from nanotron_recover.metrics import read_metrics_jsonl


def last_logged_step(run_dir: Path) -> int:
    """The highest ``step`` of a per-step record in ``<run_dir>/metrics.jsonl`` (0 if none; a torn line is skipped)."""
    steps = [int(r["step"]) for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    return max(steps, default=0)


def latest_checkpoint_step(run_dir: Path, checkpoints_path: str) -> int | None:
    """The step that ``latest.txt`` names, or None."""
    root = Path(checkpoints_path)
    root = root if root.is_absolute() else run_dir / root
    latest = root / "latest.txt"
    if not latest.is_file():
        return None
    text = latest.read_text(encoding="utf-8").strip()
    return int(text) if text.isdigit() else None


def _info(argv: Sequence[str]) -> int:
    from nanotron_recover.config import ConfigError
    from nanotron_recover.launch import add_override_args, load_effective_config

    parser = argparse.ArgumentParser(prog="recover_job.py info")
    add_override_args(parser)
    args = parser.parse_args(argv)
    try:
        config = load_effective_config(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"recover_job.py: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
    }
    for key, value in values.items():
        print(f"{key}={shlex.quote(str(value))}")
    return 0


def _outcome(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="recover_job.py outcome")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--train-steps", required=True, type=int)
    parser.add_argument("--mpirun-rc", required=True, type=int)
    parser.add_argument("--checkpoints-path", default="checkpoints")
    args = parser.parse_args(argv)
    last = last_logged_step(args.run_dir)
    ckpt = latest_checkpoint_step(args.run_dir, args.checkpoints_path)
    detail = f"last logged step {last}/{args.train_steps}, mpirun rc {args.mpirun_rc}, latest checkpoint {ckpt}"
    if last >= args.train_steps:
        print("done", detail)
        return EXIT_DONE
    if args.mpirun_rc == EXIT_BAD_INPUT:
        print("badinput", detail)
        return EXIT_BAD_INPUT
    print("restart", detail)
    return EXIT_RESTART


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("info", "outcome"):
        print("usage: recover_job.py info|outcome ...", file=sys.stderr)
        return EXIT_BAD_INPUT
    return _info(argv[1:]) if argv[0] == "info" else _outcome(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
