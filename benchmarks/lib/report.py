"""Benchmark reports: statistics, JSON and Markdown output, the machine and command lines a report names."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def finite_positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if not math.isfinite(v):
                return "n/a"
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "n/a" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line() -> str:
    import os
    import platform

    return (f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, CPU only, "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def command_line(argv: Sequence[str] | None, script: str) -> str:
    import shlex

    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([".venv/bin/python", script, *args])


# ------------------------------------------------------------------------------------------------ figures
# The benchmarks draw with the run report's panels (nanotron_recover.report.figure): the same loss and |Δloss|
# panels, the same Agg canvas without pyplot, PNG or self-contained HTML by the file's suffix.
def plot_loss_and_progress(curves: dict[str, tuple[dict[int, float], list]], path: Path, title: str = "") -> None:
    """``curves``: name -> ({step: loss}, [(process-seconds, committed tokens), ...]). Three panels: loss,
    |loss - reference loss| (when a run is named ``reference``), committed tokens vs process-seconds."""
    import textwrap

    from nanotron_recover.report.figure import new_figure, plot_loss_curves, plot_loss_differences, save_figure

    fig, (ax_loss, ax_delta, ax_progress) = new_figure(1, 3, width=16, row_height=5)
    losses = {name: loss for name, (loss, _) in curves.items()}
    plot_loss_curves(ax_loss, losses, title="loss (final trajectory)")
    if "reference" in losses and len(losses) > 1:
        plot_loss_differences(ax_delta, losses, reference="reference")
        ax_delta.set_title("difference to the failure-free reference (1e-12: identical)")
        ax_delta.legend(fontsize=8)
    else:
        ax_delta.text(0.5, 0.5, "no failure-free reference in this run", ha="center", transform=ax_delta.transAxes)
    for name, (_, progress) in curves.items():
        ax_progress.step([p[0] for p in progress], [p[1] for p in progress], where="post", label=name)
    ax_progress.set(xlabel="process-seconds", ylabel="committed tokens", title="tokens vs process-seconds")
    for ax in (ax_loss, ax_progress):
        ax.legend(fontsize=8)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9)
    save_figure(fig, path)
