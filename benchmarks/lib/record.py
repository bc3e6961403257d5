"""One JSON record per benchmark run (issue #41): what ran (the command and its arguments), on what (the git commit,
the machine), when (ISO dates, UTC), what it measured (the raw samples) and the figures it reports.
``benchmarks/pages.py`` writes the figures tables of ``benchmarks/RESULTS.md`` and README from the newest record
of each benchmark.

Where: ``benchmarks/results/records/<benchmark>_<UTC time>.json``, or the folder ``NANOTRON_RECOVER_BENCH_RECORDS``
names. A script run from the command line (``main()`` without ``argv``) always writes its record; called from
Python with an explicit ``argv`` (a test, another script), or at a smoke test's size (``--quick``), it writes one
only where that variable names a folder, so that no test run lands among the measurements.

The schema (``SCHEMA``): ``schema``, ``benchmark``, ``command``, ``commit`` (40 hex digits or ``"unknown"``),
``dirty`` (the code differed from the commit: true / false / null when not known), ``date`` (when the record was
written, the run's end), ``started``, ``machine`` (``summary``, ``cpu``, ``cores``, ``memory_gib``, ``os``,
``python``, ``torch``, ``gpus``, the 1-min load average at the start and at the end), ``args``, ``figures`` (name ->
number or short text) and ``samples`` (whatever the script measured, raw).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "results" / "records"
RECORDS_ENV = "NANOTRON_RECOVER_BENCH_RECORDS"
SCHEMA = 1
# the code a run measures: a change under these paths (untracked files too) marks the record dirty
CODE_PATHS = ("src", "benchmarks/lib", ":(glob)benchmarks/*.py", "configs", "pyproject.toml")
# this module is imported as a benchmark script starts: its start and the machine's load then, near enough
_STARTED = time.time()
_LOAD_AT_START = os.getloadavg()[0]

Figures = Mapping[str, "float | int | str | None"]


def iso(t: float) -> str:
    """``t`` (seconds since the epoch) as an ISO 8601 UTC time to the second."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit(root: Path = ROOT) -> tuple[str, bool | None]:
    """(HEAD's hash, whether the code under :data:`CODE_PATHS` differs from it); ``("unknown", None)`` where git
    cannot say (no checkout, no git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60,
                              check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--", *CODE_PATHS).strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return head, bool(changed)


def code_commit() -> tuple[str, bool | None]:
    """:func:`git_commit` of the checkout whose ``nanotron_recover`` the runs import (an editable install can point
    at another checkout than this script's); dirty too where this script's checkout is not that same clean code."""
    spec = importlib.util.find_spec("nanotron_recover")
    root = Path(spec.origin).resolve().parents[2] if spec and spec.origin else ROOT
    commit, dirty = git_commit(root)
    if root != ROOT and git_commit(ROOT) != (commit, False):
        dirty = True
    return commit, dirty


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file (None where there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    """The GPUs nvidia-smi lists (none where it is not installed)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What this machine is: CPU model, cores, memory, OS, Python, torch, GPUs; and its load now and at the start."""
    cpu = _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    gib = round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None
    gpus = _gpus()
    summary = f"{os.cpu_count()} cores ({cpu}), {gib if gib is not None else '?'} GiB, " + (
        ", ".join(gpus) if gpus else "no GPU")
    return {"summary": summary, "cpu": cpu, "cores": os.cpu_count(), "memory_gib": gib, "os": platform.platform(),
            "python": platform.python_version(), "torch": _version("torch"), "gpus": gpus,
            "load_avg_1min_at_start": round(_LOAD_AT_START, 2), "load_avg_1min_at_end": round(os.getloadavg()[0], 2)}


def _plain(args: Any) -> Any:
    """An argparse namespace as its dict; anything else as it is (written with ``default=str``)."""
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else args


def record_path(folder: Path, name: str, t: float) -> Path:
    """``<folder>/<name>_<UTC time>.json``, with a counter where two records share the second."""
    stamp = datetime.fromtimestamp(t, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = folder / f"{name}_{stamp}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{name}_{stamp}-{n}.json"
    return path


def write_record(name: str, *, argv: Sequence[str] | None, command: str, args: Any, samples: Any,
                 figures: Figures) -> Path | None:
    """Write the record of this run of benchmark ``name`` (see the module doc for where, and when not); returns
    its path, or None where none was written. Says where on stderr (the last stdout line is the script's own)."""
    where = os.environ.get(RECORDS_ENV)
    if argv is not None and not where:
        return None
    if getattr(args, "quick", False) and not where:  # a smoke test's size: nothing the pages should take as newest
        print(f"no record: a --quick run lands among the measurements only where {RECORDS_ENV} names a folder",
              file=sys.stderr, flush=True)
        return None
    folder = Path(where) if where else RECORDS
    commit, dirty = code_commit()
    now = time.time()
    record = {"schema": SCHEMA, "benchmark": name, "command": command, "commit": commit, "dirty": dirty,
              "date": iso(now), "started": iso(_STARTED), "machine": machine(), "args": _plain(args),
              "figures": dict(figures), "samples": samples}
    folder.mkdir(parents=True, exist_ok=True)
    path = record_path(folder, name, now)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"record: {path}", file=sys.stderr, flush=True)
    return path
