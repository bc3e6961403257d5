"""Launch the peer systems of ``benchmarks/vs_torchft.py`` as their users do, and read their runs back.

* plain torch DDP: one ``torchrun --nproc_per_node R`` job (no restarts: a death ends it);
* torchft: ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`` (the command of
  torchft's own README; heartbeat timeout left at its default, 5 s) and, per replica group, one
  ``torchrun --nproc_per_node 1 --max_restarts K`` (the supervisor torchft's TorchX component uses: a killed
  worker is started again by its agent, rejoins the quorum and heals from a live peer).

The worker is ``benchmarks/lib/torchft_worker.py``. Every process gets ``OMP_NUM_THREADS`` from the caller's
environment (the benchmark pins it for every system alike). Everything started here is in its own session and is
SIGKILLed as a group when the run ends, fails or times out: no lighthouse or agent outlives a run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.outside_faults import Fault, FaultDriver, pid_alive
from benchmarks.lib.side_by_side import SystemRun
from benchmarks.lib.tiny_llama import TrainSpec

WORKER = Path(__file__).resolve().parent / "torchft_worker.py"
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
SAME_COMMIT_S = 1.0  # records of one step number further apart than this belong to different incarnations
DONE_GRACE_S = 3.0  # after the first group finished, the others get this long to finish their last step
INSTALL_HINT = ("torchft is not installed: `pip install -e .[peers]` (or `.venv/bin/pip install torchft==0.2.0`; "
                "it needs torch >= 2.7 and runs on CPU with gloo)")


_VERSIONS = """
import importlib.metadata as m, json, torch, torchft
name = next(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].lower().startswith("torchft"))
print(json.dumps({"torch_version": torch.__version__, "torchft_version": f"{name} {m.version(name)}",
                  "in_place": hasattr(torch.distributed.ProcessGroup, "reconfigure")}))
"""


def peer_versions(python: str = sys.executable) -> dict[str, Any] | None:
    """What the peer's interpreter runs: ``torch_version``, ``torchft_version`` (the distribution's name and
    version: ``torchft 0.2.0``, ``torchft-nightly 2026.10.26``) and ``in_place`` (torch's own process groups can be
    reconfigured in place: torch >= 2.14); None where torchft is not installed there."""
    proc = subprocess.run([python, "-c", _VERSIONS], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None


def torchft_available(python: str = sys.executable) -> bool:
    return peer_versions(python) is not None and lighthouse_binary(python) is not None


def lighthouse_binary(python: str = sys.executable) -> str | None:
    here = Path(python).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError("torchft_lighthouse did not listen")


def _popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _torchrun(nproc: int, port: int, restarts: int, mode: str, spec_path: Path, out: Path,
              grad_sync: str = "ddp", python: str = sys.executable, pg: str = "torchft") -> list[str]:
    return [python, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            f"--master_port={port}", f"--max_restarts={restarts}", "--monitor_interval=0.1", str(WORKER),
            "--mode", mode, "--spec", str(spec_path), "--out", str(out), "--grad-sync", grad_sync, "--pg", pg]


_STORE_HOST = """
import time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(1e9)
"""


def _native_store(python: str, out: Path) -> tuple[subprocess.Popen, int]:
    """The bootstrap store that torch's reconfigurable gloo groups are built on (``--pg native``): hosted by a
    process of its own, so that it outlives any replica group's restart."""
    with open(out / "store.log", "ab") as err:
        proc = subprocess.Popen([python, "-c", _STORE_HOST], stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.strip().isdigit():
        _kill_group(proc)
        raise RuntimeError(f"the native store did not start:\n{_tail(out / 'store.log')}")
    return proc, int(line)


class Records:
    """Incremental reader of the workers' JSON-lines files (a torn last line is read on the next poll)."""

    def __init__(self, out: Path, replicas: int) -> None:
        self.paths = [out / f"replica{r}.jsonl" for r in range(replicas)]
        self.offsets = [0] * replicas
        self.lines: list[list[dict[str, Any]]] = [[] for _ in range(replicas)]
        self.committed = 0
        self.first_done: float | None = None  # the job's work is complete when the first replica finished

    def poll(self) -> None:
        for r, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[r])
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[r] += end
            for line in data[:end].splitlines():
                rec = json.loads(line)
                self.lines[r].append(rec)
                if rec.get("event") == "done" and self.first_done is None:
                    self.first_done = rec["time"]
                if rec.get("committed"):
                    self.committed = max(self.committed, int(rec["step"]))

    def live_pids(self) -> dict[int, int]:
        """Replica -> pid of its newest worker process, if it runs and has not finished."""
        out = {}
        for r, recs in enumerate(self.lines):
            events = [x for x in recs if "event" in x]
            if events and events[-1]["event"] != "done" and pid_alive(events[-1]["pid"]):
                out[r] = events[-1]["pid"]
        return out


def committed_steps(records: Records) -> dict[int, dict[str, Any]]:
    """Per committed step number: the microbatches whose gradients it used (participants x the replicas' equal
    share: a replica killed after its allreduce contributed but left no record), the mean loss over the
    microbatches of the records we have (``loss_partial`` when some participant left none), the commit time,
    the start (earliest participant) and the step time (the slowest participant's iteration)."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for r, recs in enumerate(records.lines):
        late = {x["restart"] for x in recs if x.get("event") == "start" and records.first_done is not None
                and x["time"] > records.first_done}  # came up after the job was done: no peer to heal from
        for x in recs:
            if x.get("committed") and x.get("participating") and x["restart"] not in late:
                last[(r, int(x["step"]))] = x  # a step number committed again (a full restart): the newest
    by_step: dict[int, list[dict[str, Any]]] = {}
    for (_, s), x in sorted(last.items(), key=lambda kv: kv[0][1]):
        by_step.setdefault(s, []).append(x)
    for s, xs in by_step.items():  # only the newest commit of a step number: replicas commit it within ms
        newest = max(x["time"] for x in xs)
        by_step[s] = [x for x in xs if x["time"] > newest - SAME_COMMIT_S]
    steps: dict[int, dict[str, Any]] = {}
    for s, xs in by_step.items():
        participants = max(x["participants"] for x in xs)
        steps[s] = {"loss": sum(x["loss_sum"] for x in xs) / sum(x["microbatches"] for x in xs),
                    "microbatches": participants * xs[0]["microbatches"], "participants": participants,
                    "loss_partial": len(xs) < participants, "time": max(x["time"] for x in xs),
                    "t_start": min(x["t0"] for x in xs), "step_time_s": max(x["time"] - x["t0"] for x in xs)}
    return steps


def _env(extra: dict[str, str]) -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **extra}
    # the benchmark's library and the project's sample stream (numpy and torch only): importable from a peer's own
    # virtual environment too, where the project is not installed
    paths = os.pathsep.join([str(root), str(root / "src")])
    env["PYTHONPATH"] = paths + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _finish(name: str, out: Path, records: Records, t0: float, replicas: int, procs: int,
            driver: FaultDriver | None, launches: int = 1) -> SystemRun:
    records.poll()
    final = out / "final.pt"
    return SystemRun(name=name, t0=t0, end_t=time.time(), replicas=replicas, processes=procs,
                     steps=committed_steps(records), kills=list(driver.sent) if driver else [], launches=launches,
                     final_weights=final if final.exists() else None,
                     extra={"restarts": sum(1 for recs in records.lines for x in recs if x.get("event") == "start")
                            - replicas, "clock_t0": driver.t0 if driver else None})


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def run_ddp(spec: TrainSpec, out: Path, replicas: int, timeout_s: float) -> SystemRun:
    """Plain torch DDP, failure-free: one torchrun job of ``replicas`` processes."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec.dump(out / "spec.json")
    t0 = time.time()
    proc = _popen(_torchrun(replicas, free_port(), 0, "ddp", out / "spec.json", out), out / "torchrun.log", _env({}))
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise TimeoutError(f"plain DDP did not finish in {timeout_s} s:\n{_tail(out / 'torchrun.log')}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"plain DDP failed (exit {proc.returncode}):\n{_tail(out / 'torchrun.log')}")
    return _finish("ddp", out, Records(out, replicas), t0, replicas, replicas, None)


def run_torchft(spec: TrainSpec, out: Path, replicas: int, faults: list[Fault], timeout_s: float,
                grad_sync: str = "ddp", max_restarts: int = 1000, name: str = "torchft",
                python: str = sys.executable, pg: str = "torchft") -> SystemRun:
    """torchft: a lighthouse and one restarting torchrun agent per replica group; ``faults`` sent from outside
    to the groups' worker processes. Returns when every group's worker finished its last step, or
    ``DONE_GRACE_S`` after the first one did (then the job's work is done; a group that was still restarting
    would find no live peer to heal from and start again from step 0, so it is stopped and its records of
    that incarnation are ignored). ``max_restarts`` per agent: as many as ReCoVer's launcher gets in the
    Clockwork (``--max-restarts 1000``); with 20, a 2-core AMD EPYC machine at T = 10 s (a kill every 10 s, 30 in
    a run of 300 s) used up one agent's restarts and the run failed. ``python``: the peer's interpreter (its own
    virtual environment: ``scripts/setup_peer_venv.sh``); ``pg``: ``torchft`` (torchft's gloo wrapper, rebuilt at
    each quorum change) or ``native`` (torch's own gloo group made with ``enable_reconfigure``, which the Manager
    reconfigures in place: torch >= 2.14)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec.dump(out / "spec.json")
    port = free_port()
    lighthouse = _popen([lighthouse_binary(python) or "torchft_lighthouse", *LIGHTHOUSE_ARGS, "--bind",
                         f"[::]:{port}"], out / "lighthouse.log",
                        _env({"RUST_LOG": os.environ.get("RUST_LOG", "warn")}))
    agents: list[subprocess.Popen] = []
    store = _native_store(python, out) if pg == "native" else None
    native = {"VS_TORCHFT_NATIVE_STORE": f"127.0.0.1:{store[1]}"} if store is not None else {}
    try:
        _wait_port(port, lighthouse)
        t0 = time.time()
        for r in range(replicas):
            env = _env({"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "REPLICA_GROUP_ID": str(r),
                        "NUM_REPLICA_GROUPS": str(replicas), **native})
            agents.append(_popen(_torchrun(1, free_port(), max_restarts, "torchft", out / "spec.json", out, grad_sync,
                                           python, pg), out / f"torchrun{r}.log", env))
        records, driver = Records(out, replicas), FaultDriver(faults)
        while any(a.poll() is None for a in agents):
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"torchft did not finish in {timeout_s} s:\n{_tail(out / 'torchrun0.log')}")
            records.poll()
            if records.first_done is not None and time.time() - records.first_done > DONE_GRACE_S:
                break  # a group still restarting would find no peer and train from step 0 again: stop it
            driver.poll(lambda: records.committed, records.live_pids)
            time.sleep(0.02)
        bad = {r: a.returncode for r, a in enumerate(agents) if a.poll() not in (0, None)}
        if bad and records.first_done is None:
            raise RuntimeError(f"torchft agents failed {bad}:\n{_tail(out / f'torchrun{min(bad)}.log')}")
        driver.release()
        return _finish(name, out, records, t0, replicas, replicas, driver)
    finally:
        for a in agents:
            _kill_group(a)
        _kill_group(lighthouse)
        if store is not None:
            _kill_group(store[0])
