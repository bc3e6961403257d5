"""Run metrics: one JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to wandb (offline by default).

Only the logging rank writes. After a failure the logging rank may move to another process: that process calls
``set_logging(True)`` and appends to the same JSONL; for wandb it reuses the run id kept in
``<run_dir>/wandb_run_id`` so both halves belong to one run when synced. wandb-core buffers the ``.wandb`` file
(15 s by default; we ask for 2 s), so a SIGKILLed logging rank loses its last records there: the process that
takes over replays from the JSONL every step the earlier ``.wandb`` files lack. wandb is optional at run time:
it is imported lazily (the import alone costs ~0.7 s) and any wandb failure only disables wandb, never training.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLogger", "read_metrics_jsonl", "find_wandb_run_files", "read_wandb_history"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
_WANDB_INIT_KEYS = ("project", "entity", "name", "group", "job_type", "tags", "notes", "config", "id", "mode", "dir")


def _plain(value: Any) -> Any:
    """Make tensors / numpy scalars / paths JSON-friendly (``json.dumps`` default hook)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _scalar(value: Any) -> float | int | bool | str | None:
    """A value wandb can chart, or None to leave it out of wandb (it stays in the JSONL)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    return None


class MetricsLogger:
    """JSONL + wandb metrics for one run; a no-op on processes that are not the logging rank.

    ``wandb_config`` is ``None`` (no wandb) or a mapping of ``wandb.init`` arguments (``project``, ``name``,
    ``entity``, ``group``, ``tags``, ``config``, ``id``, ``mode``, ``dir``) plus ``enabled: bool``. The mode is
    ``$WANDB_MODE`` when the user set it, else ``offline``; files go under ``run_dir`` unless ``dir`` is given.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, wandb_config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        if self.wandb_config is not None and not self.wandb_config.pop("enabled", True):
            self.wandb_config = None
        self.enabled = False
        self._file: TextIO | None = None
        self._wandb_run: Any = None
        self._wandb_failed = False
        self._takeover = False
        self.set_logging(enabled)

    # -- logging rank -------------------------------------------------------------------------------------------
    def set_logging(self, enabled: bool) -> None:
        """Become (or stop being) the logging process; a new logging process appends to the same files."""
        if enabled and not self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
            if self._file.tell() > 0 and not _ends_with_newline(self.path):
                self._file.write("\n")  # the previous logger died mid-line: keep its torn line off our first record
            self.enabled = True
        elif not enabled and self.enabled:
            self.close()

    @property
    def wandb_active(self) -> bool:
        return self._wandb_run is not None

    def start_wandb(self) -> bool:
        """Start wandb now (otherwise it starts on the first record); True when a run is active."""
        if self.enabled:
            self._ensure_wandb()
        return self._wandb_run is not None

    # -- records ----------------------------------------------------------------------------------------------
    def log_step(self, record: Mapping[str, Any]) -> None:
        """One training step (``step``, ``loss``, ``tokens_per_s``, ...)."""
        if not self.enabled:
            return
        self._write(record)
        self._to_wandb(record)

    def log_event(self, record: Mapping[str, Any]) -> None:
        """A run event, e.g. ``{"event": "repair", "step": 12, "world_epoch": 1, ...}``; wandb gets its numbers
        under ``<event>/<field>``."""
        if not self.enabled:
            return
        self._write({"event": "event", **record})
        self._to_wandb({"event": "event", **record})

    def _write(self, record: Mapping[str, Any]) -> None:
        assert self._file is not None
        line = dict(record)
        line.setdefault("time", time.time())
        self._file.write(json.dumps(line, default=_plain, allow_nan=True) + "\n")
        self._file.flush()

    # -- wandb ------------------------------------------------------------------------------------------------
    def _run_id(self) -> str:
        """The run id shared by every process that ever logs into ``run_dir`` (kept in a small file)."""
        id_file = self.run_dir / WANDB_ID_FILE
        if id_file.is_file():
            existing = id_file.read_text(encoding="utf-8").strip()
            if existing:
                self._takeover = True
                return existing
        self._takeover = False
        run_id = uuid.uuid4().hex[:8]
        tmp = id_file.with_name(f"{WANDB_ID_FILE}.{os.getpid()}.tmp")
        tmp.write_text(run_id + "\n", encoding="utf-8")
        tmp.replace(id_file)
        return run_id

    def _backfill(self, run: Any, wandb_dir: Path, run_id: str, before_step: Any) -> None:
        """Replay JSONL records the earlier logging processes did not get into their ``.wandb`` files."""
        persisted = -1
        for path in find_wandb_run_files(wandb_dir):
            if path.name != f"run-{run_id}.wandb" or path.parent == Path(run.dir).parent:
                continue
            try:
                steps = [row.get("_step", -1) for row in read_wandb_history(path)]
            except Exception:  # a torn file counts as empty
                steps = []
            persisted = max([persisted, *[s for s in steps if isinstance(s, int)]])
        limit = before_step if isinstance(before_step, int) else None
        last, replayed = persisted, 0
        for record in read_metrics_jsonl(self.path):
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step <= persisted or step < last or (limit is not None and step >= limit):
                continue
            values = self._wandb_values(record)
            if values:
                run.log(values, step=step)
                last, replayed = step, replayed + 1
        if replayed:
            logger.info("metrics: replayed %d records (steps %d..%d) into wandb from %s", replayed, persisted + 1, last, self.path)

    @staticmethod
    def _wandb_values(record: Mapping[str, Any]) -> dict[str, Any]:
        if "event" in record:
            name = str(record["event"])
            values = {f"{name}/{k}": v for k, v in record.items() if k not in ("event", "step", "time")}
        else:
            values = {k: v for k, v in record.items() if k not in ("step", "time")}
        return {k: s for k, v in values.items() if (s := _scalar(v)) is not None}

    def _ensure_wandb(self, before_step: Any = None) -> Any:
        if self._wandb_run is not None or self._wandb_failed or self.wandb_config is None:
            return self._wandb_run
        try:
            import wandb  # lazy: ~0.7 s

            kwargs = {k: v for k, v in self.wandb_config.items() if k in _WANDB_INIT_KEYS}
            unknown = sorted(set(self.wandb_config) - set(_WANDB_INIT_KEYS))
            if unknown:
                logger.warning("metrics: ignoring unknown wandb options %s", unknown)
            kwargs.setdefault("project", "nanotron-recover")
            kwargs.setdefault("mode", os.environ.get("WANDB_MODE", "offline"))
            kwargs.setdefault("dir", str(self.run_dir))
            if "id" not in kwargs:
                kwargs["id"] = self._run_id()
            Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
            self._wandb_run = wandb.init(
                resume="allow",
                settings=wandb.Settings(
                    console="off",
                    silent=True,
                    x_disable_stats=True,
                    reinit="create_new",
                    init_timeout=60.0,
                    x_transaction_log_flush_interval=2.0,
                ),
                **kwargs,
            )
        except Exception as exc:  # wandb must never take training down
            self._wandb_failed = True
            self._wandb_run = None
            logger.warning("metrics: wandb disabled (%s: %s); metrics still go to %s", type(exc).__name__, exc, self.path)
            return None
        if self._takeover:
            try:
                self._backfill(self._wandb_run, Path(kwargs["dir"]) / "wandb", str(kwargs["id"]), before_step)
            except Exception as exc:  # a partial backfill only leaves a gap in the wandb copy
                logger.warning("metrics: wandb backfill from %s failed (%s: %s)", self.path, type(exc).__name__, exc)
        return self._wandb_run

    def _to_wandb(self, record: Mapping[str, Any]) -> None:
        if self.wandb_config is None or self._wandb_failed:
            return
        data = self._wandb_values(record)
        if not data:
            return
        step = record.get("step")
        run = self._ensure_wandb(before_step=step)
        if run is None:
            return
        try:
            if isinstance(step, int) and step >= 0:
                run.log(data, step=step)
            else:
                run.log(data)
        except Exception as exc:
            self._wandb_failed = True
            logger.warning("metrics: wandb log failed (%s: %s); wandb disabled for this run", type(exc).__name__, exc)

    # -- shutdown ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the JSONL and finish the wandb run (errors are logged, not raised)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as exc:
                logger.warning("metrics: wandb finish failed (%s: %s)", type(exc).__name__, exc)
            self._wandb_run = None
        self.enabled = False

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a run folder or the file itself), in file order; ``[]`` if none.

    The one reader of the file (tests, benchmarks, the Slurm helper read through it). A line cut short by a
    SIGKILL of the logging process (the last line, or a line the next logging process appended after) does not
    parse and is skipped, as is anything that is not a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def find_wandb_run_files(root: str | Path) -> list[Path]:
    """``run-*.wandb`` files under ``root`` (a run folder, its ``wandb/`` folder or one run folder), oldest first."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(root.rglob("run-*.wandb"), key=lambda p: (p.stat().st_mtime, str(p)))


def read_wandb_history(run_file: str | Path) -> list[dict[str, Any]]:
    """History rows of a wandb transaction log (``run-<id>.wandb``), read without wandb's service.

    The file is a 7-byte header (``:W&B`` + magic + version) followed by LevelDB-log style records in 32 KiB
    blocks (4-byte checksum, 2-byte length, 1-byte type: full/first/middle/last); each payload is a
    ``wandb_internal_pb2.Record``. Checksums are not verified.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a wandb transaction log")
    block, header = 32768, 7
    pos, pending, rows = 7, b"", []
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        pos += header
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows
