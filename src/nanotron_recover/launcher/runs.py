"""Launch a training run through the real launcher and measure it (tests, benchmarks); the run's files are read
through :mod:`nanotron_recover.run.run_folder`.

A run is judged by what it wrote, not by mpirun's exit code: under ``--with-ft ulfm`` mpirun returns 0 even
when ranks were SIGKILLed.
"""

from __future__ import annotations

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

from nanotron_recover.run.procfs import in_my_pid_namespace, proc_stat
from nanotron_recover.run.run_folder import read_metrics


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
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
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
    try:
        (run_dir / "output.log").write_text(output)
    except OSError:  # the run folder is full (a test of exactly that): the output is still returned
        pass
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
    from nanotron_recover.training.checkpoint import resolve_checkpoint

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


def rank_processes(run_dir: Path) -> dict[int, int]:
    """``{pid: world rank}`` of every live process of this run's ranks: a rank, and during start-up its watchdog
    (a fork of it). mpirun's own command line names the run dir too and does not count; nor do zombies. The ranks
    name the resolved folder (:func:`~nanotron_recover.launcher.overrides.forwarded_args`): a relative path or one
    through a symlink is resolved here too, or no rank would ever match."""
    from nanotron_recover.process.watchdog import MPI_DAEMONS

    needle = str(Path(run_dir).resolve()).encode()
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"nanotron_recover.train" not in cmdline or needle not in cmdline:
                continue
            _, name, state = proc_stat(int(entry)) or (0, "", "Z")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if state == "Z" or name in MPI_DAEMONS or Path(cmdline[0].decode(errors="replace")).name in MPI_DAEMONS:
            continue
        if not in_my_pid_namespace(int(entry)):  # another node's (a test bed's host sees them all)
            continue
        rank = next((int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None and not _waiting_standby(environ):
            out[int(entry)] = rank
    return out


def environ_of(pid: int) -> list[bytes] | None:
    """The environment ``pid`` was started with (``NAME=value`` entries), or None when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def _waiting_standby(environ: list[bytes]) -> bool:
    """A rank of a warm standby not released yet (not a rank of the job, though its command line is the same)."""
    from nanotron_recover.process.standby_rank import RELEASE
    from nanotron_recover.run.launch_contract import STANDBY_ENV

    prefix = f"{STANDBY_ENV}=".encode()
    folder = next((v[len(prefix):] for v in environ if v.startswith(prefix)), None)
    return folder is not None and not (Path(folder.decode(errors="replace")) / RELEASE).exists()


def standby_ready(launcher_pid: int, world_size: int) -> bool:
    """Whether the warm standby that the launcher ``launcher_pid`` started has every rank ready (its ranks name
    their folder and their launcher in their environment)."""
    from nanotron_recover.process.standby_rank import ready_file
    from nanotron_recover.run.launch_contract import LAUNCHER_PID_ENV, STANDBY_ENV

    mine, prefix = f"{LAUNCHER_PID_ENV}={launcher_pid}".encode(), f"{STANDBY_ENV}=".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        folder = next((v[len(prefix):] for v in environ if v.startswith(prefix)), None)
        if mine in environ and folder is not None:
            return all(ready_file(Path(folder.decode()), r).exists() for r in range(world_size))
    return False


def rank_pids(run_dir: Path) -> dict[int, int]:
    """``{world rank: pid}`` of this run's live ranks (the rank itself, not its start-up watchdog)."""
    return ranks_and_watchdogs(run_dir)[0]


def ranks_and_watchdogs(run_dir: Path) -> tuple[dict[int, int], dict[int, int]]:
    """``({world rank: pid} of this run's live ranks, {world rank: pid} of their start-up watchdogs)``: a watchdog
    is a fork of its rank (its parent is a process of the same rank)."""
    processes = rank_processes(run_dir)
    ranks: dict[int, int] = {}
    watchdogs: dict[int, int] = {}
    for pid, rank in processes.items():
        stat = proc_stat(pid)
        if stat is None:
            continue
        (watchdogs if processes.get(stat[0]) == rank else ranks)[rank] = pid
    return ranks, watchdogs


def mpirun_pid(launcher_pid: int) -> int | None:
    """The pid of the ``mpirun`` (PRRTE's ``prterun``) that the launcher ``launcher_pid`` started, if it runs."""
    from nanotron_recover.process.watchdog import MPI_DAEMONS

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[0] == launcher_pid and stat[1] in MPI_DAEMONS:
                return int(entry)
    return None


def kill_run_processes(run_dir: Path, launcher: subprocess.Popen) -> None:
    """SIGKILL a launched job whole, as a lost node does to an ``mpirun`` here: the launcher's process group and
    every process naming ``run_dir`` (Open MPI puts its ranks in groups of their own); wait until none is left."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:  # the launcher and its group ended already: what names the run dir may not have
        pass
    launcher.wait(timeout=60)
    needle = str(Path(run_dir).resolve()).encode()
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
