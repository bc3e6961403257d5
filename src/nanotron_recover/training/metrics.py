"""Run metrics: one JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to wandb (offline by default).

Only the logging rank writes. After a failure the logging rank may move to another process: that process calls
``set_logging(True)`` and appends to the same JSONL; for wandb it reuses the run id kept in
the run folder's id (``run_id.txt``) so both halves belong to one run when synced.

The JSONL is the record; wandb is a copy, rebuilt from the JSONL where it may lack something. A record handed
to ``wandb.log`` is not yet on disk: wandb keeps a step's row open until a later step arrives and flushes its
transaction log every few seconds, so a SIGKILLed logging rank loses its last rows (measured: all four rows
when killed right after logging them, the last one 3 s later). Only a successful ``finish()`` makes every
logged row durable, so that is when the logging process writes the sidecar ``<run_dir>/wandb_logged_step``:
the last step the wandb copy surely holds. Whichever process starts wandb for the run next (a logging rank
that takes over, a relaunch) first re-logs every JSONL record with a step after the sidecar's (all of them when
there is no sidecar) and before the step it is about to log (:func:`wandb_replay`). After a clean handover
that is nothing; after a SIGKILL it may re-send rows the dead process did persist (wandb ignores a row whose
step is not above its run's current step when the halves are synced into one run; not checked against a
server here, this machine is offline). A row is never missing. The replay stops before the first record the new
process logs, also when wandb was started ahead of it (:meth:`MetricsLogger.start_wandb`, during set-up, in a thread
of its own: the rows logged while it starts are replayed like a dead logger's): a
relaunch from a node-local snapshot computes again the steps after the snapshot, and those rows (the same numbers:
the trajectory is kept) are logged as they come. A step below the last one this process handed to wandb is never
sent (wandb's steps only increase: it would drop the row with a warning).
The replay costs about 0.3 ms a record (10,000 records in ~3 s offline on this CPU), once per takeover.

wandb is optional at run time: it is imported lazily (the import alone costs ~0.7 s) and any wandb failure
only disables wandb, never training.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

from nanotron_recover.run import fence, run_folder
from nanotron_recover.run.run_folder import read_logged_step, read_metrics_jsonl

__all__ = ["MetricsLogger", "wandb_replay", "find_wandb_run_files"]

logger = logging.getLogger(__name__)

BACKGROUND_START_WAIT_S = 60.0  # the most a closing logger waits for wandb started in the background
_WANDB_INIT_KEYS = ("project", "entity", "name", "group", "job_type", "tags", "notes", "config", "id", "mode", "dir")


def _start_wandb_run(**kwargs: Any) -> Any:
    """``wandb.init`` with this project's settings (imported here: the import alone costs ~0.7 s)."""
    import wandb

    return wandb.init(
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, reinit="create_new",
                                init_timeout=60.0, x_transaction_log_flush_interval=2.0),
        **kwargs,
    )


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

    def __init__(self, run_dir: str | Path, enabled: bool, wandb_config: Mapping[str, Any] | None = None,
                 wandb_init: Callable[..., Any] | None = None, launch: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self._wandb_init = wandb_init or _start_wandb_run  # a seam: tests hand in a recording stand-in
        # wraps wandb's start (seconds: it spawns a service process, then replays): the trainer tells the hang
        # monitor, for a rank that becomes the logging rank mid-run starts wandb inside a step
        self.slow_io: Callable[[], AbstractContextManager[Any]] = nullcontext
        self.path = run_folder.metrics_path(self.run_dir)
        self.launch = launch  # each line names the launch (its token) that wrote it
        self.wandb_config = dict(wandb_config) if wandb_config is not None else None
        if self.wandb_config is not None and not self.wandb_config.pop("enabled", True):
            self.wandb_config = None
        self.enabled = False
        self._file: TextIO | None = None
        self._wandb_run: Any = None
        self._wandb_failed = False
        self._wandb_last_step: int | None = None  # the last step this process handed to wandb.log
        self._replay_pending = False  # wandb was started ahead of the first record: replay at that record
        self._starting: threading.Thread | None = None  # wandb being started in the background (start_wandb)
        self._background = False  # wandb was started in the background: closing replays what it missed
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

    def start_wandb(self, background: bool = False) -> bool:
        """Start wandb now (otherwise it starts on the first record); True when a run is active (or, ``background``,
        is being started). The replay of the JSONL waits for the first record, whose step bounds it: a relaunch
        computes again the steps after its snapshot, and those are then logged as they come, not replayed from the
        run before. ``background``: wandb starts in a thread of its own (its start, ~0.4-0.7 s, is then off the path
        to the job's first step); the records logged meanwhile are in the JSONL, and the first record after it
        started replays them, as a new logging rank does."""
        if not self.enabled:
            return False
        if self._starting is not None:
            return True
        if background and self.wandb_config is not None and self._wandb_run is None and not self._wandb_failed:
            self._starting = threading.Thread(target=self._start_wandb, args=(None, False), name="wandb-start",
                                              daemon=True)
            self._starting.start()  # no slow_io: the main thread goes on training, nothing waits for this one
            self._background = True
            return True
        self._ensure_wandb(replay=False)
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
        fence.guard("a metrics line")
        line = dict(record)
        line.setdefault("time", time.time())
        line.setdefault("launch", self.launch)
        self._file.write(json.dumps(line, default=_plain, allow_nan=True) + "\n")
        self._file.flush()

    # -- wandb ------------------------------------------------------------------------------------------------
    def _replay(self, run: Any, before_step: Any) -> None:
        """Re-log the JSONL records the wandb copy may lack (see the module docstring)."""
        limit = before_step if _is_step(before_step) else None
        replayed = wandb_replay(read_metrics_jsonl(self.path), read_logged_step(self.run_dir), limit)
        for step, values in replayed:
            run.log(values, step=step)
            self._sent(step)
        if replayed:
            logger.info("metrics: replayed %d records (steps %d..%d) into wandb from %s", len(replayed),
                        replayed[0][0], replayed[-1][0], self.path)

    def _sent(self, step: int) -> None:
        self._wandb_last_step = step if self._wandb_last_step is None else max(self._wandb_last_step, step)

    def _ensure_wandb(self, before_step: Any = None, replay: bool = True) -> Any:
        if self._wandb_run is not None and self._replay_pending and replay:
            with self.slow_io():
                self._replay_pending = False
                self._safe_replay(before_step)
        if self._wandb_run is not None or self._wandb_failed or self.wandb_config is None:
            return self._wandb_run
        with self.slow_io():
            return self._start_wandb(before_step, replay)

    def _safe_replay(self, before_step: Any) -> None:
        try:
            self._replay(self._wandb_run, before_step)
        except Exception as exc:  # a partial replay only leaves a gap in the wandb copy
            logger.warning("metrics: wandb replay from %s failed (%s: %s)", self.path, type(exc).__name__, exc)

    def _start_wandb(self, before_step: Any, replay: bool) -> Any:
        try:
            kwargs = {k: v for k, v in self.wandb_config.items() if k in _WANDB_INIT_KEYS}
            unknown = sorted(set(self.wandb_config) - set(_WANDB_INIT_KEYS))
            if unknown:
                logger.warning("metrics: ignoring unknown wandb options %s", unknown)
            kwargs.setdefault("project", "nanotron-recover")
            kwargs.setdefault("mode", os.environ.get("WANDB_MODE", "offline"))  # wandb's own: the user's choice wins
            kwargs.setdefault("dir", str(self.run_dir))
            if "id" not in kwargs:
                kwargs["id"] = run_folder.ensure_run_id(self.run_dir)  # wandb's run is the run folder's
            Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
            self._wandb_run = self._wandb_init(resume="allow", **kwargs)
        except Exception as exc:  # wandb must never take training down
            self._wandb_failed = True
            self._wandb_run = None
            logger.warning("metrics: wandb disabled (%s: %s); metrics still go to %s", type(exc).__name__, exc,
                           self.path)
            return None
        if replay:
            self._safe_replay(before_step)
        else:
            self._replay_pending = True  # at the first record (:meth:`start_wandb`)
        return self._wandb_run

    def _to_wandb(self, record: Mapping[str, Any]) -> None:
        if self.wandb_config is None or self._wandb_failed or self._still_starting():
            return  # still starting: the JSONL has the record, the first one after the start replays it
        data = _wandb_values(record)
        if not data:
            return
        step = record.get("step")
        run = self._ensure_wandb(before_step=step)
        if run is None or (_is_step(step) and self._wandb_last_step is not None and step < self._wandb_last_step):
            return  # wandb's steps only increase: it would drop this row (a step computed again after a relaunch)
        try:
            if _is_step(step):
                run.log(data, step=step)
                self._sent(step)
            else:
                run.log(data)
        except Exception as exc:
            self._wandb_failed = True
            logger.warning("metrics: wandb log failed (%s: %s); wandb disabled for this run", type(exc).__name__, exc)

    def _still_starting(self, wait_s: float = 0.0) -> bool:
        """A background start of wandb is still running (after ``wait_s`` for it)."""
        if self._starting is None:
            return False
        self._starting.join(wait_s)
        if self._starting.is_alive():
            return True
        self._starting = None  # started (or failed: said so): the next record replays what it missed
        return False

    # -- shutdown ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the JSONL and finish the wandb run (errors are logged, not raised)."""
        if self._still_starting(wait_s=BACKGROUND_START_WAIT_S):
            logger.warning("metrics: wandb did not start within %g s; its copy of this run may lack rows (the JSONL "
                           "has them)", BACKGROUND_START_WAIT_S)
        elif self._background and self._wandb_run is not None and self._replay_pending and self._file is not None:
            self._file.flush()
            self._ensure_wandb()  # started in the background and no record since: replay what it missed
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as exc:
                logger.warning("metrics: wandb finish failed (%s: %s)", type(exc).__name__, exc)
            else:
                if self._wandb_last_step is not None:  # every row logged so far is on disk now
                    run_folder.record_logged_step(self.run_dir, self._wandb_last_step)
            self._wandb_run = None
        self.enabled = False

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_wandb_run_files(root: str | Path) -> list[Path]:
    """``run-*.wandb`` files under ``root`` (a run folder, its ``wandb/`` folder or one run folder), oldest first."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(root.rglob("run-*.wandb"), key=lambda p: (p.stat().st_mtime, str(p)))


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


RECORD_KEYS = ("step", "time", "launch")  # where and when a line was written: wandb keeps its own


def _wandb_values(record: Mapping[str, Any]) -> dict[str, Any]:
    """What wandb gets of a record: its scalars; an event's under ``<event>/<field>``."""
    if "event" in record:
        name = str(record["event"])
        values = {f"{name}/{k}": v for k, v in record.items() if k != "event" and k not in RECORD_KEYS}
    else:
        values = {k: v for k, v in record.items() if k not in RECORD_KEYS}
    return {k: s for k, v in values.items() if (s := _scalar(v)) is not None}


def wandb_replay(
    records: Iterable[Mapping[str, Any]], logged_step: int | None, before_step: int | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """``(step, values)`` to re-log into wandb, in order: the JSONL ``records`` (steps and events) with a step
    after ``logged_step`` (the sidecar's; ``None``: from the start) and before ``before_step`` (the step about
    to be logged; ``None``: no limit). Steps never go back (wandb's steps only increase): a record with a lower
    step than one already chosen (an older copy of a replayed step) is left out, as is one with nothing wandb
    can chart."""
    first = -1 if logged_step is None else logged_step
    out: list[tuple[int, dict[str, Any]]] = []
    for record in records:
        step = record.get("step")
        if not _is_step(step) or step <= first or (before_step is not None and step >= before_step):
            continue
        if out and step < out[-1][0]:
            continue
        values = _wandb_values(record)
        if values:
            out.append((step, values))
    return out
