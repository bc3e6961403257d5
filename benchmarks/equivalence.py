"""Run a config with its failure schedule and the same config failure-free; compare losses and final weights.

    python benchmarks/equivalence.py --config-file configs/tiny_llama.yaml --out runs/equivalence

The reference is the config with ``fault_tolerance.inject`` emptied (``--reference stock``: fault tolerance off,
the stock nanotron data path; ``--reference-dp K``: K replicas with M kept by raising the accumulation, which
measures the floating-point noise floor of a different split). Both runs save a checkpoint at the last step.
Prints, last: ``max_abs_loss_diff=<float> max_rel_param_diff=<float> steps=<n> failures=<k>``; writes
``equivalence.json`` and ``equivalence.png`` (both loss curves) in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Sequence

import yaml

if __package__ in (None, ""):  # run as ``python benchmarks/X.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.record import write_record  # noqa: E402
from benchmarks.lib.report import command_line  # noqa: E402
from nanotron_recover.launcher.runs import (  # noqa: E402
    RunResult,
    final_checkpoint,
    max_loss_diff,
    max_relative_param_diff,
    run_training,
)


def reference_config(config: dict, kind: str, reference_dp: int | None) -> dict:
    ref = copy.deepcopy(config)
    ft = ref.setdefault("fault_tolerance", {}) or {}
    ref["fault_tolerance"] = ft
    ft["inject"] = []
    if kind == "stock":
        ft["enabled"] = False
    if reference_dp is not None:
        par, tok = ref["parallelism"], ref["tokens"]
        M = par["dp"] * tok["batch_accumulation_per_replica"]
        if M % reference_dp:
            raise SystemExit(f"--reference-dp {reference_dp} does not divide M={M}")
        par["dp"] = reference_dp
        tok["batch_accumulation_per_replica"] = M // reference_dp
        ft["spare_replicas"] = 0
    return ref


def with_final_checkpoint(config: dict, steps: int) -> dict:
    config = copy.deepcopy(config)
    config["tokens"]["train_steps"] = steps
    config.setdefault("checkpoints", {}).update(checkpoints_path="checkpoints", checkpoint_interval=steps)
    config["checkpoints"].setdefault("save_initial_state", False)
    return config


def plot(reference: RunResult, failed: RunResult, path: Path, failures: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s["step"] for s in reference.steps], reference.losses, label="failure-free reference", lw=3, alpha=0.5)
    ax.plot([s["step"] for s in failed.steps], failed.losses, label=f"with {failures} failure(s)", lw=1.2)
    for e in failed.events_of("repair"):
        ax.axvline(e["step"], color="red", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.set_title("Per-step loss: failures change nothing but summation order")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", required=True, help="config with a fault_tolerance.inject schedule")
    parser.add_argument("--out", default="runs/equivalence", help="output folder")
    parser.add_argument("--train-steps", type=int, help="override tokens.train_steps")
    parser.add_argument("--synthetic-data", action="store_true", help="train on the synthetic token stream")
    parser.add_argument("--reference", choices=["recover", "stock"], default="recover")
    parser.add_argument("--reference-dp", type=int, help="reference with this many replicas (M kept)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)

    config = yaml.safe_load(Path(args.config_file).read_text())
    steps = args.train_steps or config["tokens"]["train_steps"]
    failed_cfg = with_final_checkpoint(config, steps)
    ref_cfg = with_final_checkpoint(reference_config(config, args.reference, args.reference_dp), steps)
    extra = ["--synthetic-data"] if args.synthetic_data else []
    out = Path(args.out)
    reference = run_training(ref_cfg, out / "reference", timeout_s=args.timeout, extra_args=extra)
    failed = run_training(failed_cfg, out / "with_failures", timeout_s=args.timeout, extra_args=extra)

    loss_diff = max_loss_diff(reference, failed)
    param_diff = max_relative_param_diff(final_checkpoint(reference.run_dir), final_checkpoint(failed.run_dir))
    failures = len({r for e in failed.events_of("repair") for r in e["failed_replicas"]})
    summary = {
        "config": str(args.config_file),
        "reference": args.reference,
        "reference_dp": args.reference_dp,
        "steps": len(failed.steps),
        "failures": failures,
        "max_abs_loss_diff": loss_diff,
        "max_rel_param_diff": param_diff,
        "committed_microbatches": sorted({s["microbatches"] for s in failed.steps}),
        "repairs": failed.events_of("repair"),
        "wall_s": {"reference": reference.wall_s, "with_failures": failed.wall_s},
    }
    (out / "equivalence.json").write_text(json.dumps(summary, indent=2))
    write_record("equivalence", argv=argv, command=command_line(argv, "benchmarks/equivalence.py"), args=args,
                 samples=summary, figures={k: summary[k] for k in ("max_abs_loss_diff", "max_rel_param_diff",
                                                                   "steps", "failures")})
    plot(reference, failed, out / "equivalence.png", failures)
    print(
        f"max_abs_loss_diff={loss_diff:.3e} max_rel_param_diff={param_diff:.3e} "
        f"steps={len(failed.steps)} failures={failures}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
