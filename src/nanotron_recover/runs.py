"""Launch a training run through the real launcher and read its results back (tests, benchmarks).

A run is judged by what it wrote, not by mpirun's exit code: under ``--with-ft ulfm`` mpirun returns 0 even
when ranks were SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from nanotron_recover.exit_codes import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESTART
from nanotron_recover.inject import INJECTED_DIR, SIGNALS  # the injector leaves one marker per fired entry there
from nanotron_recover.metrics import read_metrics_jsonl
from nanotron_recover.train import EXITS_DIR


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    output: str
    wall_s: float
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Per-step records (deduplicated by step, last wins) and events from ``metrics.jsonl``
    (read by :func:`nanotron_recover.metrics.read_metrics_jsonl`: a torn line is skipped)."""
    steps: dict[int, dict] = {}
    events: list[dict] = []
    for record in read_metrics_jsonl(run_dir):
        if "event" in record:
            events.append(record)
        elif "step" in record:
            steps[int(record["step"])] = record
    return [steps[k] for k in sorted(steps)], events


# inject.marker_name: step{s}-replica{r}-rank{k}-{phase, or startup.<point>}[-{signal}]; later fields are ignored
_MARKER = re.compile(r"step(\d+)-replica(\d+)-rank(\d+)-([a-z_]+)(?:\.([a-z_]+))?(?:-([a-z_]+))?(?:-.*)?")


def read_kills(run_dir: Path) -> list[dict[str, Any]]:
    """The injected faults that fired in ``run_dir``, oldest first, from the injector's markers in
    ``injected/``: ``{"step", "replica", "rank", "phase", "at", "signal", "time"}``.

    ``at`` is the start-up point of a ``startup`` fault (else ``None``); ``signal`` is ``kill`` (SIGKILL, the
    default), ``stop`` or ``hang``; ``time`` is the unix time written into the marker just before the signal
    (``None`` if unreadable). A file whose name does not parse is skipped.
    """
    folder = Path(run_dir) / INJECTED_DIR
    kills = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        m = _MARKER.fullmatch(path.name)
        if m is None:
            continue
        try:
            t: float | None = float(path.read_text().strip())
        except (OSError, ValueError):
            t = None
        signal = m[6] if m[6] in SIGNALS else "kill"
        kills.append({"step": int(m[1]), "replica": int(m[2]), "rank": int(m[3]), "phase": m[4], "at": m[5],
                      "signal": signal, "time": t})
    return sorted(kills, key=lambda k: (k["time"] is None, k["time"] or 0.0, k["step"]))


def resumed_from(steps: Sequence[dict[str, Any]]) -> int:
    """The checkpoint step a job resumed from, read from the step records it logged (oldest first): one less than
    its first step (0 for a job that started fresh or logged none)."""
    return int(steps[0]["step"]) - 1 if steps else 0


def read_exits(run_dir: Path) -> dict[int, dict]:
    """How each rank ended: ``{world rank: {"code", "reason"}}`` from ``exits/``; a SIGKILLed rank leaves none."""
    out = {}
    for path in (Path(run_dir) / EXITS_DIR).glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except ValueError:  # written before records were atomic, or not by us: no record
            continue
        out[record["rank"]] = record
    return out


def last_logged_step(run_dir: Path) -> int:
    """The highest ``step`` of a per-step record in ``<run_dir>/metrics.jsonl`` (0 if none; a torn line is skipped)."""
    steps = [int(r["step"]) for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    return max(steps, default=0)


def latest_checkpoint_step(run_dir: Path, checkpoints_path: str = "checkpoints") -> int | None:
    """The step that ``latest.txt`` names (a relative ``checkpoints_path`` lives in the run dir), or None."""
    root = Path(checkpoints_path)
    root = root if root.is_absolute() else Path(run_dir) / root
    latest = root / "latest.txt"
    if not latest.is_file():
        return None
    text = latest.read_text(encoding="utf-8").strip()
    return int(text) if text.isdigit() else None


def run_outcome(run_dir: Path, train_steps: int, mpirun_rc: int,
                checkpoints_path: str = "checkpoints") -> tuple[str, str]:
    """Was a job finished, or must it be relaunched? ``("done" | "restart" | "badinput" | "aborted", detail)``.

    ``done``: the last step (``train_steps``) was logged or checkpointed. ``badinput``: mpirun returned 2 (the
    trainer rejected its input; relaunching cannot help). ``aborted``: a rank's exit record says it aborted the
    job on a bug (exit 1: the same error would come back). Else ``restart``: the trainer stopped below
    ``min_replicas`` (rc 3), a start-up fault or an unresolvable hang ended the job (rc 3), or the job was torn
    down from outside with mpirun returning 0: a lost node's daemon ends every rank on this Open MPI, and those
    ranks leave no exit record (the detail counts the records).
    """
    last = last_logged_step(run_dir)
    ckpt = latest_checkpoint_step(run_dir, checkpoints_path)
    exits = read_exits(run_dir)
    codes = sorted({int(e.get("code", -1)) for e in exits.values()})
    detail = (f"last logged step {last}/{train_steps}, mpirun rc {mpirun_rc}, latest checkpoint {ckpt}, "
              f"exit records {len(exits)} (codes {codes})")
    if last >= train_steps or (ckpt is not None and ckpt >= train_steps):
        return "done", detail
    if mpirun_rc == EXIT_BAD_INPUT or EXIT_BAD_INPUT in codes:
        return "badinput", detail
    if EXIT_ABORTED in codes:
        return "aborted", detail
    return "restart", detail


OUTCOME_EXIT_CODES = {"done": EXIT_DONE, "badinput": EXIT_BAD_INPUT, "aborted": EXIT_ABORTED, "restart": EXIT_RESTART}


def write_config(config: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_training(
    config: dict | Path,
    run_dir: Path,
    *,
    timeout_s: float = 600,
    extra_args: Sequence[str] = (),
    check: bool = True,
) -> RunResult:
    """``nanotron-recover train`` on ``config`` (a dict is written to ``run_dir/config.yaml``), killed at timeout."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_config(config, run_dir / "config.yaml") if isinstance(config, dict) else Path(config)
    cmd = [sys.executable, "-m", "nanotron_recover.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), *extra_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        raise TimeoutError(f"run did not finish in {timeout_s} s:\n{output[-6000:]}") from None
    wall = time.perf_counter() - t0
    (run_dir / "output.log").write_text(output)
    steps, events = read_metrics(run_dir)
    result = RunResult(run_dir, proc.returncode, output, wall, steps, events)
    if check and proc.returncode not in (0,):
        raise RuntimeError(f"run failed with exit code {proc.returncode}:\n{output[-6000:]}")
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def max_loss_diff(a: RunResult, b: RunResult) -> float:
    """Largest per-step |loss difference| (the runs must have logged the same steps)."""
    steps_a, steps_b = [s["step"] for s in a.steps], [s["step"] for s in b.steps]
    if steps_a != steps_b:
        raise ValueError(f"the runs logged different steps: {steps_a[:5]}... vs {steps_b[:5]}...")
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


def final_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint of a run (``latest.txt`` in a relative ``checkpoints`` folder)."""
    from nanotron_recover.checkpoint import resolve_checkpoint

    found = resolve_checkpoint(Path(run_dir) / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {run_dir}/checkpoints")
    return found


def max_relative_param_diff(checkpoint_a: Path, checkpoint_b: Path) -> float:
    """max over weight tensors of max|a - b| / max|a|: the worst difference relative to each tensor's scale.

    Two nanotron-format checkpoints must come from the same TP x PP layout (shard files are compared by path);
    an HSDP checkpoint compares by parameter name with another HSDP or an unsharded (TP1 PP1) one.
    """
    weights_a, weights_b = _weights_by_key(Path(checkpoint_a)), _weights_by_key(Path(checkpoint_b))
    if not weights_a or weights_a.keys() != weights_b.keys():
        raise ValueError(f"checkpoints hold different tensors: {sorted(weights_a.keys() ^ weights_b.keys())[:4]}")
    worst = 0.0
    for key, a in weights_a.items():
        a, b = a.double(), weights_b[key].double()
        scale = a.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / scale)
    return worst


def _weights_by_key(checkpoint: Path) -> dict:
    """HSDP: full tensors by parameter name. nanotron format: shards by file path, or by parameter name when
    the other side may be HSDP, i.e. when every file holds a whole (TP1 PP1) tensor."""
    from safetensors.torch import load_file

    from nanotron_recover.hsdp.checkpoint import FOLDER, read_full_weights

    if (checkpoint / FOLDER).is_dir():
        return read_full_weights(checkpoint)
    files = sorted((checkpoint / "model").rglob("*.safetensors"))
    if any(int(n) > 1 for p in files for n in re.findall(r"-of-(\d+)", p.name)):  # TP or PP shards
        return {str(p.relative_to(checkpoint)): load_file(p)["data"] for p in files}
    return {_param_name(p.relative_to(checkpoint / "model")): load_file(p)["data"] for p in files}


def _param_name(relative: Path) -> str:
    """``model/decoder/0/.../model_weight[_pp-rank-0-of-1_tp-rank-0-of-1].safetensors`` -> ``model.decoder.0....weight``
    (nanotron's file naming)."""
    leaf = relative.name.split(".")[0].removeprefix("model_").split("_pp-rank-")[0]
    return ".".join((*relative.parent.parts, leaf))


def _proc_stat(pid: int) -> tuple[int, str, str]:
    """(parent pid, name, state) of a process, from ``/proc/<pid>/stat``."""
    text = Path(f"/proc/{pid}/stat").read_text()
    name = text[text.index("(") + 1:text.rindex(")")]
    state, ppid = text[text.rindex(")") + 2:].split()[:2]
    return int(ppid), name, state


def rank_processes(run_dir: Path) -> dict[int, int]:
    """``{pid: world rank}`` of every live process of this run's ranks: a rank, and during start-up its watchdog
    (a fork of it). mpirun's own command line names the run dir too and does not count; nor do zombies."""
    from nanotron_recover.watchdog import MPI_DAEMONS

    needle = str(run_dir).encode()
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"nanotron_recover.train" not in cmdline or needle not in cmdline:
                continue
            _, name, state = _proc_stat(int(entry))
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if state == "Z" or name in MPI_DAEMONS or Path(cmdline[0].decode(errors="replace")).name in MPI_DAEMONS:
            continue
        rank = next((int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None:
            out[int(entry)] = rank
    return out


def rank_pids(run_dir: Path) -> dict[int, int]:
    """``{world rank: pid}`` of this run's live ranks (the rank itself, not its start-up watchdog)."""
    processes = rank_processes(run_dir)
    out: dict[int, int] = {}
    for pid, rank in processes.items():
        try:
            parent = _proc_stat(pid)[0]
        except (OSError, ValueError):
            continue
        if processes.get(parent) != rank:  # the watchdog's parent is its rank
            out[rank] = pid
    return out


def mpirun_pid(launcher_pid: int) -> int | None:
    """The pid of the ``mpirun`` (PRRTE's ``prterun``) that the launcher ``launcher_pid`` started, if it runs."""
    from nanotron_recover.watchdog import MPI_DAEMONS

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid, name, _ = _proc_stat(int(entry))
            except (OSError, ValueError):
                continue
            if ppid == launcher_pid and name in MPI_DAEMONS:
                return int(entry)
    return None


def kill_run_processes(run_dir: Path, launcher: subprocess.Popen) -> None:
    """SIGKILL a launched job whole, as a lost node does to an ``mpirun`` here: the launcher's process group and
    every process naming ``run_dir`` (Open MPI puts its ranks in groups of their own); wait until none is left."""
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=60)
    needle = str(run_dir).encode()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if needle in (entry / "cmdline").read_bytes():
                        left.append(int(entry.name))
                except OSError:
                    continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes of {run_dir} survived SIGKILL")
