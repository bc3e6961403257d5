"""The run folder: its layout, and every reader and writer of it.

One run folder (``--run-dir``) holds everything a run leaves behind, over all the launches of that run::

    metrics.jsonl        one JSON object per step and per event (any rank may append an event line)
    run_id.txt           the run's id, made by its first launch (node-local snapshots and wandb are keyed by it)
    wandb_logged_step    the last step the wandb copy holds for sure
    exits/rank-<r>.json  how each rank of the current launch ended (``code``, ``reason``); a SIGKILLed rank leaves none
    launches.jsonl       one record per launch (time, world size, M, train steps, who launched it)
    launches/<n>/exits/  the exit records of launch n, moved there when launch n + 1 begins
    .standby/<id>/       a warm standby's folder: its ranks' ready files, the launcher's go or cancel
    outcomes.jsonl       how each launch was judged (:mod:`nanotron_recover.run.outcome`), for the repeat counts
    injected/<name>      one JSON record per fired fault of the schedule, and a marker per fault sent from outside
    hangs/rank-<r>-step-<s>.txt  the threads' stacks of a rank that found itself stuck
    checkpoints/         nanotron checkpoints and ``latest.txt`` (the path is configurable)
    .launch.lock         held (flock) by the launch that writes the folder: two launches never write it at once
    launch.current       the token of the launch that owns the folder: ranks of another launch are fenced (fence.py)

Nothing is ever half written: records are written to a temporary file and renamed into place, and lines are
appended with one ``write`` on an ``O_APPEND`` descriptor. Standard library only: the start-up guard and the fault
injector use it before ``MPI_Init``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from nanotron_recover.run import fence
from nanotron_recover.run.launch_contract import TOKEN_ENV

METRICS_FILE = "metrics.jsonl"
RUN_ID_FILE = "run_id.txt"
WANDB_LOGGED_FILE = "wandb_logged_step"
EXITS_DIR = "exits"
LAUNCHES_FILE = "launches.jsonl"
LAUNCHES_DIR = "launches"
INJECTED_DIR = "injected"
HANGS_DIR = "hangs"
EXTERNAL_PREFIX = "external-"  # a marker of a fault sent from outside the run (a campaign, a test), not a schedule
HANG_SIGNALS = ("stop", "hang")  # faults that only the hang detector can end

_ID = re.compile(r"[0-9a-f]{8,64}")


# ------------------------------------------------------------------------------------------------ writing
def write_atomically(path: Path, text: str, durable: bool = False) -> None:
    """``path`` holds all of ``text`` or what it held before, never a torn file (a temporary file, then a rename).
    ``durable``: fsync the file and its folder too, for what must survive a power loss (``latest.txt``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a folder's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable."""
    fsync_path(folder)


def write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(record, default=str))


def append_line(path: Path, line: str) -> None:
    """One ``write`` of one line on an ``O_APPEND`` descriptor: never interleaves with another writer's lines. A
    writer killed mid-line left a torn line without its newline: the new line starts on a line of its own, or it
    would be lost with the torn one."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        os.write(fd, (("\n" if torn else "") + line.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ run id
def run_id(run_dir: Path) -> str | None:
    """The id that the run dir's first launch gave the run (None before it, or if the file does not hold hex
    digits: the id becomes a path component)."""
    try:
        found = (Path(run_dir) / RUN_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return found if _ID.fullmatch(found) else None


def ensure_run_id(run_dir: Path) -> str:
    """This run's id, created at its first launch. Why not the run dir's path: a new run in a run dir of the same
    path (the old one deleted, or a test bed whose temporary folders repeat) would take the old run's snapshots
    that are still in ``/dev/shm``. Every rank may call it at once: the id is written to a temporary file and
    hard-linked into place, so one wins and the others read the complete file."""
    run_dir = Path(run_dir)
    found = run_id(run_dir)
    if found is not None:
        return found
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RUN_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.write_text(secrets.token_hex(8) + "\n")
    try:
        os.link(tmp, run_dir / RUN_ID_FILE)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    found = run_id(run_dir)
    if found is None:
        raise ValueError(f"{run_dir / RUN_ID_FILE} does not hold a run id (hex digits): delete it to start a new run")
    return found


# ------------------------------------------------------------------------------------------------ metrics
def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def append_metrics_record(run_dir: Path, record: dict[str, Any], launch: str | None = None) -> None:
    """A record from a rank that is not the logging rank (a hang event), or from the launcher (its regrow
    decisions): one appended line, naming its ``launch`` (its token)."""
    fence.guard("a metrics record")
    line = {**record, "launch": launch}
    append_line(metrics_path(run_dir), json.dumps(line, default=str))


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a run folder or the file itself), in file order; ``[]`` if none.

    A line cut short by a SIGKILL of the logging process (the last line, or a line the next logging process
    appended after) does not parse and is skipped, as is anything that is not a JSON object.
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


def read_records_after(path: Path, offset: int, max_bytes: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects on the whole lines of ``path`` from byte ``offset`` on, and the offset after the last whole
    line (a line still being written waits for its end). ``max_bytes`` bounds one read, but a line longer than
    that (an event listing hundreds of files) is read whole, never left in the way of the lines after it."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(max_bytes if max_bytes is not None else -1)
            while max_bytes is not None and b"\n" not in data and (more := f.read(max_bytes)):
                data += more
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, offset + end


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-step records (deduplicated by step, last wins: a relaunch replays steps) and events."""
    steps: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for record in read_metrics_jsonl(run_dir):
        if "event" in record:
            events.append(record)
        elif isinstance(record.get("step"), int):
            steps[record["step"]] = record
    return [steps[k] for k in sorted(steps)], events


def last_logged_step(run_dir: Path) -> int:
    """The highest ``step`` of a per-step record (0 if none)."""
    steps = [r["step"] for r in read_metrics_jsonl(run_dir) if "event" not in r and isinstance(r.get("step"), int)]
    return max(steps, default=0)


def resumed_from(steps: Sequence[dict[str, Any]]) -> int:
    """The checkpoint step a job resumed from, read from the step records it logged (oldest first): one less than
    its first step (0 for a job that started fresh or logged none)."""
    return int(steps[0]["step"]) - 1 if steps else 0


def read_logged_step(run_dir: Path) -> int | None:
    """The last step a finished wandb process of this run logged, or ``None``."""
    try:
        text = (Path(run_dir) / WANDB_LOGGED_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def record_logged_step(run_dir: Path, step: int) -> None:
    fence.guard("the wandb mark")
    write_atomically(Path(run_dir) / WANDB_LOGGED_FILE, f"{step}\n")


# ------------------------------------------------------------------------------------------------ exits
def exit_record_path(run_dir: Path, rank: int | str) -> Path:
    return Path(run_dir) / EXITS_DIR / f"rank-{rank}.json"


def record_exit(run_dir: Path, rank: int, code: int, reason: str, **extra: Any) -> None:
    """How a rank ended (mpirun's own exit code says little under ULFM); empty ``extra`` values are left out."""
    fence.guard("its exit record")
    record = {"rank": rank, "code": code, "reason": reason, **{k: v for k, v in extra.items() if v}}
    write_json_atomically(exit_record_path(run_dir, rank), record)


def read_exits(run_dir: Path) -> dict[int, dict[str, Any]]:
    """How each rank ended: ``{world rank: {"code", "reason", ...}}``; a SIGKILLed rank leaves none."""
    out = {}
    for path in (Path(run_dir) / EXITS_DIR).glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # not ours, or gone: no record
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            out[record["rank"]] = record
    return out


def exit_reasons(run_dir: Path, limit: int = 5) -> list[str]:
    """The distinct reasons in the exit records, each with the ranks that gave it: ``"ranks [0, 2] (exit 3): ..."``.
    At most ``limit`` lines, the most common reasons first."""
    by_reason: dict[tuple[int, str], list[int]] = {}
    for rank, record in sorted(read_exits(run_dir).items()):
        key = (int(record.get("code", -1)), str(record.get("reason", "")).strip() or "no reason given")
        by_reason.setdefault(key, []).append(rank)
    ordered = sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[1][0]))
    return [f"rank{'s' if len(ranks) > 1 else ''} {ranks if len(ranks) > 1 else ranks[0]} (exit {code}): {reason}"
            for (code, reason), ranks in ordered[:limit]]


def ranks_wrote_since(run_dir: Path, since: float) -> bool:
    """Did a rank of the launch that began at ``since`` get far enough to write a step record or an exit record?"""
    paths = [metrics_path(run_dir), *(Path(run_dir) / EXITS_DIR).glob("rank-*.json")]
    return any(path.exists() and path.stat().st_mtime >= since for path in paths)


# ------------------------------------------------------------------------------------------------ launches
def begin_launch(run_dir: Path, record: dict[str, Any]) -> int:
    """Before a launch's ranks start: move the previous launch's exit records under ``launches/<n>/`` (the outcome of
    this launch is judged by its own records alone: a bug recorded by an earlier launch must not make a later
    launch that lost a node read as "aborted") and append this launch's record. Returns its number (1 = first)."""
    run_dir = Path(run_dir)
    number = len(read_launches(run_dir)) + 1
    exits = run_dir / EXITS_DIR
    if exits.is_dir() and any(exits.iterdir()):
        archive = run_dir / LAUNCHES_DIR / str(number - 1)
        while (archive / EXITS_DIR).exists():  # a launch whose record was torn left no number of its own
            archive = archive.with_name(f"{archive.name}+")
        archive.mkdir(parents=True, exist_ok=True)
        os.replace(exits, archive / EXITS_DIR)
    run_dir.mkdir(parents=True, exist_ok=True)
    # from here on the folder is this launch's: ranks of an earlier launch that still live are fenced (fence.py)
    write_atomically(fence.current_path(run_dir), f"{record.get('token') or fence.UNNAMED}\n")
    append_line(run_dir / LAUNCHES_FILE, json.dumps({"launch": number, "time": time.time(), **record}, default=str))
    return number


STANDBY_DIR = ".standby"  # the warm standbys' folders: ready files every node's ranks can write and the launcher read


def standby_root(run_dir: Path) -> Path:
    return Path(run_dir) / STANDBY_DIR


def read_launches(run_dir: Path) -> list[dict[str, Any]]:
    """The launch records of the run, oldest first (a torn line is skipped)."""
    return [r for r in read_metrics_jsonl(Path(run_dir) / LAUNCHES_FILE) if "launch" in r]


# ------------------------------------------------------------------------------------------------ the lock
LOCK_FILE = ".launch.lock"


def token_in(cmd: Sequence[str]) -> str | None:
    """The launch token that the launch line ``cmd`` gives its ranks (``-x NAME=token``)."""
    prefix = f"{TOKEN_ENV}="
    return next((part[len(prefix):] for part in cmd if part.startswith(prefix)), None)


class RunFolderBusy(RuntimeError):
    """Another launch holds the run folder."""


def hold_run_folder(run_dir: Path, wait_s: float = 30.0) -> int:
    """Take the run folder's lock for this launch (an exclusive ``flock``; the kernel drops it when every holder
    of the descriptor is gone, a SIGKILLed launcher included). The descriptor is passed on to ``mpirun``, so the
    lock lasts as long as the job. Waits up to ``wait_s`` (the launcher's setting,
    ``$NANOTRON_RECOVER_LOCK_WAIT_S``) for a launch that is ending; -> the descriptor. :class:`RunFolderBusy` names
    the holder."""
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    wait = wait_s
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunFolderBusy(f"{run_dir} is in use by another launch ({holder}); two launches must never "
                                    "write one run folder: wait for it to end, or end it") from None
            time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"launcher pid {os.getpid()} on {os.uname().nodename} since {time.ctime()}\n".encode(), 0)
    return fd


# ------------------------------------------------------------------------------------------------ faults
def fault_marker_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / INJECTED_DIR / name


def record_fired_fault(run_dir: Path, name: str, fault: dict[str, Any]) -> None:
    """The injector's record of a fault it is about to fire (its presence makes the fault fire once per run):
    ``fault`` holds ``step, replica, rank, phase, at, signal``; the time is added. Written durably, since the
    process signals itself right after."""
    write_atomically(fault_marker_path(run_dir, name), json.dumps({**fault, "time": time.time()}), durable=True)


def record_external_fault(run_dir: Path, what: str) -> None:
    """Leave ``injected/external-<what>`` before a signal is sent to a run from outside, so that whoever reads the
    run later knows its hang events were provoked (a frozen rank, an orphaning kill of mpirun)."""
    write_atomically(fault_marker_path(run_dir, f"{EXTERNAL_PREFIX}{what}"), json.dumps({"external": what,
                                                                                        "time": time.time()}))


def _fault_records(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    folder = Path(run_dir) / INJECTED_DIR
    out = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out.append((path.name, record))
    return out


def read_kills(run_dir: Path) -> list[dict[str, Any]]:
    """The scheduled faults that fired in ``run_dir``, oldest first: ``{"step", "replica", "rank", "phase", "at",
    "signal", "time"}`` (``at``: the start-up point of a ``startup`` fault, else ``None``; ``signal``: ``kill``,
    ``stop`` or ``hang``). Markers of faults sent from outside are not among them."""
    kills = [r for name, r in _fault_records(run_dir) if not name.startswith(EXTERNAL_PREFIX) and "step" in r]
    return sorted(kills, key=lambda k: (k.get("time") is None, k.get("time") or 0.0, k["step"]))


def hang_provoked_at(run_dir: Path) -> float | None:
    """When a fault of this run first froze or hung a rank on purpose (a scheduled stop/hang, or anything sent from
    outside): its hang events from then on are expected, earlier ones are false alarms. None: no such fault (a
    record without a time counts from the start)."""
    times = [float(r.get("time") or 0.0) for name, r in _fault_records(run_dir)
             if name.startswith(EXTERNAL_PREFIX) or r.get("signal") in HANG_SIGNALS]
    return min(times) if times else None


# ------------------------------------------------------------------------------------------------ hangs
def write_hang_stacks(run_dir: Path, rank: int, step: int, stacks: str) -> Path:
    """The stacks of a rank that found itself stuck, whole or absent (a replica-mate's kill may come any time)."""
    fence.guard("its stacks")
    path = Path(run_dir) / HANGS_DIR / f"rank-{rank}-step-{step}.txt"
    write_atomically(path, stacks)
    return path


# ------------------------------------------------------------------------------------------------ checkpoints
LATEST_FILE = "latest.txt"  # in the checkpoints folder: the step of the newest published checkpoint
PARTIAL_SAVE_PREFIX = ".tmp-step-"  # in the checkpoints folder: a save being written, renamed to its step when done


def checkpoints_root(run_dir: Path, checkpoints_path: str = "checkpoints") -> Path:
    """Where the checkpoints are: a relative ``checkpoints_path`` lives in the run dir."""
    root = Path(checkpoints_path)
    return root if root.is_absolute() else Path(run_dir) / root


def remove_partial_saves(root: Path) -> list[tuple[str, int]]:
    """Remove the unpublished partial saves in ``root`` (only when no writer of the run is alive): each one's name
    and the bytes it held. A rank that ends the job on a full disk cannot wait for a background save in flight, whose
    partial folder holds space the person must free."""
    removed = []
    for folder in sorted(Path(root).glob(f"{PARTIAL_SAVE_PREFIX}*")):
        held = sum(f.lstat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append((folder.name, held))
    return removed


def latest_step(root: Path) -> int | None:
    """The step that ``root/latest.txt`` names (None: no pointer, or not a number)."""
    try:
        text = (Path(root) / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def latest_checkpoint_step(run_dir: Path, checkpoints_path: str = "checkpoints") -> int | None:
    """The step that the run's ``latest.txt`` names, or None."""
    return latest_step(checkpoints_root(run_dir, checkpoints_path))
