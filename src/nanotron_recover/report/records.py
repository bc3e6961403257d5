"""Everything the report reads from a run folder, read once and kept with what could not be read.

The layout and the readers are :mod:`nanotron_recover.run.run_folder`'s; the readers here are the few the report
needs beyond them, because the report must *say* what it skipped where ``run_folder`` skips it silently (a line of
``metrics.jsonl`` cut short by a SIGKILL, an unreadable marker) and because the run's size (M, ``train_steps``)
is not in the run folder's own records: it comes from the config (``config.yaml`` in the run dir, which
:func:`nanotron_recover.launcher.runs.run_training` writes, or ``--config-file``) or from the newest checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nanotron_recover.run import run_folder

# written into the run dir by nanotron_recover.launcher.runs.run_training (not by the launcher)
CONFIG_FILE = "config.yaml"
# nanotron_recover.training.checkpoint.STATE_FILE (holds microbatches_per_step)
CHECKPOINT_STATE_FILE = "trainer_state.json"


class ReportError(Exception):
    """The run folder cannot be reported on at all (it does not exist)."""


@dataclass(frozen=True)
class RunSize:
    """What the failure-free run would commit: ``train_steps`` steps of M microbatches of ``micro_batch_size``
    samples. Any of them may be unknown (``None``); ``source`` says where they came from."""

    train_steps: int | None = None
    microbatches_per_step: int | None = None
    micro_batch_size: int | None = None
    source: str = "unknown"


@dataclass
class RunRecords:
    """The raw material of a report, in the order the run wrote it."""

    run_dir: Path
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl objects, file order
    problems: list[str] = field(default_factory=list)  # what could not be read, one sentence each
    kills: list[dict[str, Any]] = field(default_factory=list)  # the scheduled faults that fired
    external: list[dict[str, Any]] = field(default_factory=list)  # markers of faults sent from outside
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    hang_stacks: list[Path] = field(default_factory=list)
    launches: list[dict[str, Any]] = field(default_factory=list)  # launches.jsonl (runs launched by the launcher)
    latest_checkpoint: int | None = None
    size: RunSize = field(default_factory=RunSize)


def read_metrics_lines(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every JSON object of ``metrics.jsonl`` in file order, and a sentence for each line that is not one (the
    same lines :func:`run_folder.read_metrics_jsonl` skips, but named: a report must not hide a torn record)."""
    path = run_folder.metrics_path(run_dir)
    if not path.is_file():
        return [], [f"no {run_folder.METRICS_FILE} in {run_dir}: nothing was logged (the job died before its "
                    "first step, or this is not a run folder)"]
    raw = path.read_bytes()
    lines = raw.decode("utf-8", errors="replace").split("\n")
    torn_tail = bool(lines) and lines[-1] != ""  # no newline after the last line: its writer was killed mid-write
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            problems.append(_torn_line_message(number, line, last=torn_tail and number == len(lines)))
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            problems.append(f"{run_folder.METRICS_FILE} line {number} is not a JSON object: skipped")
    return records, problems


def _torn_line_message(number: int, line: str, last: bool) -> str:
    where = "the last line" if last else f"line {number}"
    cause = ("the logging process was killed while writing it" if last else
             "a line cut short by a kill, after which the next logging process went on")
    return (f"{run_folder.METRICS_FILE}: {where} ({len(line)} characters, starting {line[:40]!r}) is cut short "
            f"({cause}): skipped")


def read_external_faults(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The markers of faults sent from outside the run (``injected/external-*``), oldest first."""
    folder = Path(run_dir) / run_folder.INJECTED_DIR
    out, problems = [], []
    for path in sorted(folder.glob(f"{run_folder.EXTERNAL_PREFIX}*")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            problems.append(f"{run_folder.INJECTED_DIR}/{path.name} cannot be read: skipped")
            continue
        if isinstance(record, dict):
            out.append({"name": path.name.removeprefix(run_folder.EXTERNAL_PREFIX), **record})
    return sorted(out, key=lambda r: r.get("time") or 0.0), problems


def read_hang_stacks(run_dir: Path) -> list[Path]:
    """The stack files of ranks that found themselves stuck."""
    folder = Path(run_dir) / run_folder.HANGS_DIR
    return sorted(folder.glob("rank-*-step-*.txt")) if folder.is_dir() else []


def read_run_size(run_dir: Path, config_file: Path | None = None) -> tuple[RunSize, str, list[str]]:
    """The run's size from its config (``config_file``, else ``config.yaml`` in the run dir), else M alone from
    the newest checkpoint; -> (size, the checkpoints path the config names, problems)."""
    path = Path(config_file) if config_file is not None else Path(run_dir) / CONFIG_FILE
    problems: list[str] = []
    if path.is_file():
        try:
            raw = yaml.safe_load(path.read_text())
            return _size_from_config(raw, str(path)), _checkpoints_path(raw), problems
        except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError) as e:
            problems.append(f"config {path} cannot be read ({type(e).__name__}: {e}): M and train_steps unknown")
    elif config_file is not None:
        problems.append(f"config {path} does not exist: M and train_steps unknown")
    launches = run_folder.read_launches(run_dir)
    if launches and _int(launches[-1].get("microbatches_per_step")):
        last = launches[-1]
        size = RunSize(train_steps=_int(last.get("train_steps")),
                       microbatches_per_step=_int(last["microbatches_per_step"]),
                       micro_batch_size=_int(last.get("micro_batch_size")),
                       source=f"{run_folder.LAUNCHES_FILE} (last launch)")
        return size, str(last.get("checkpoints_path") or "checkpoints"), problems
    m = _checkpoint_microbatches(run_dir, "checkpoints")
    if m is not None:
        return RunSize(microbatches_per_step=m, source="the newest checkpoint (M only)"), "checkpoints", problems
    problems.append(f"no config ({CONFIG_FILE} in the run dir, or --config-file) and no checkpoint: the "
                    "failure-free sample count assumes M = the most common microbatch count of a step")
    return RunSize(), "checkpoints", problems


def _size_from_config(raw: dict[str, Any], source: str) -> RunSize:
    tokens, par = raw.get("tokens") or {}, raw.get("parallelism") or {}
    dp, acc = par.get("dp"), tokens.get("batch_accumulation_per_replica")
    return RunSize(train_steps=_int(tokens.get("train_steps")),
                   microbatches_per_step=_int(dp) * _int(acc) if _int(dp) and _int(acc) else None,
                   micro_batch_size=_int(tokens.get("micro_batch_size")), source=source)


def _checkpoints_path(raw: dict[str, Any]) -> str:
    return str((raw.get("checkpoints") or {}).get("checkpoints_path") or "checkpoints")


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _checkpoint_microbatches(run_dir: Path, checkpoints_path: str) -> int | None:
    step = run_folder.latest_checkpoint_step(run_dir, checkpoints_path)
    if step is None:
        return None
    state = run_folder.checkpoints_root(run_dir, checkpoints_path) / str(step) / CHECKPOINT_STATE_FILE
    try:
        return _int(json.loads(state.read_text()).get("microbatches_per_step"))
    except (OSError, ValueError, AttributeError):
        return None


def read_run_records(run_dir: Path, config_file: Path | None = None) -> RunRecords:
    """Read all of a run folder the report uses. ``ReportError`` only when there is no folder at all; anything
    else missing or torn becomes a sentence in ``problems``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder: no run to report on")
    records, problems = read_metrics_lines(run_dir)
    external, more = read_external_faults(run_dir)
    size, checkpoints_path, size_problems = read_run_size(run_dir, config_file)
    if not (run_dir / run_folder.EXITS_DIR).is_dir():
        problems.append(f"no {run_folder.EXITS_DIR}/ in {run_dir}: how the ranks ended is unknown (the job was "
                        "killed as a whole, or it is still running)")
    exits = _exits(run_dir, problems)
    return RunRecords(run_dir=run_dir, records=records, problems=problems + more + size_problems,
                      kills=run_folder.read_kills(run_dir), external=external, exits=exits,
                      hang_stacks=read_hang_stacks(run_dir), launches=run_folder.read_launches(run_dir),
                      latest_checkpoint=run_folder.latest_checkpoint_step(run_dir, checkpoints_path), size=size)


def _exits(run_dir: Path, problems: list[str]) -> dict[int, dict[str, Any]]:
    """``run_folder.read_exits`` (which skips what is not one of ours), and a sentence naming what it skipped."""
    exits = run_folder.read_exits(run_dir)
    files = sorted((Path(run_dir) / run_folder.EXITS_DIR).glob("rank-*.json"))
    skipped = [f.name for f in files if f.stem.removeprefix("rank-") not in {str(r) for r in exits}]
    if skipped:
        problems.append(f"{run_folder.EXITS_DIR}/ holds records that cannot be read: {', '.join(skipped)}")
    return exits
