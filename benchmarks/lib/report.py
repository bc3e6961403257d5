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
