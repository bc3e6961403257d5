"""The launcher's in-place relaunch and its warm standby, with real jobs (``mpirun --with-ft ulfm``, 2 replicas).

* A replica SIGKILLed (from outside) with ``min_replicas: 2``: the job ends with the restart outcome, the launcher
  relaunches it in place from the warm standby (the launch record says ``warm``), and the relaunched job trains on,
  every step logged once (the test then stops it: a run long enough for a standby to get ready at any load would
  take minutes to finish).
* The launcher SIGKILLed while its standby waits: no standby process is left within 5 s.
* A standby SIGKILLed while it waits (its mpirun and ranks): the launcher starts another, and the relaunch is warm.
* A rank SIGKILLed at a random moment of the first seconds (start-up included), at the default settings: the run
  finishes (in-step, or after an in-place relaunch within 30 s of the kill) with the failure-free losses.
* A rank SIGKILLed before its start-up guard is armed: the launcher sees it gone and the relaunch comes in seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import pytest

from nanotron_recover.launcher.relauncher import with_launch_token
from nanotron_recover.launcher.runs import kill_run_processes, rank_pids, run_training, write_config
from nanotron_recover.launcher.standby import standby_fits
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.launch_contract import LAUNCHER_PID_ENV, STANDBY_ENV
from nanotron_recover.run.launch_contract import TOKEN_ENV as LAUNCH_TOKEN_ENV
from nanotron_recover.run.procfs import proc_stat
from nanotron_recover.run.run_folder import read_launches, read_metrics, read_metrics_jsonl
from tests.conftest import make_tiny_config

TIMEOUT_S = 300


def config(tmp_path: Path, steps: int, **ft) -> dict:
    return make_tiny_config(dp=2, accumulation=2, steps=steps, layers=2,
                            fault_tolerance={"enabled": True, "local_snapshot_dir": str(tmp_path / "shm"), **ft})


def launch(config_path: Path, run_dir: Path, log: Path, restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data", "--max-restarts", str(restarts)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def launched(config_path: Path, run_dir: Path, log: Path, restarts: int) -> Iterator[subprocess.Popen]:
    """A launcher running the job; whatever happens inside, nothing of the job outlives the block."""
    proc = launch(config_path, run_dir, log, restarts)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_run_processes(run_dir, proc)


def kill_and_wait(launcher: subprocess.Popen, victim: int) -> float:
    """SIGKILL ``victim`` (a rank), then wait for the launcher to end; -> when the kill was sent."""
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    launcher.wait(timeout=TIMEOUT_S)
    return killed


def relaunch_trained(run_dir: Path, steps: int) -> bool:
    """The second launch of ``run_dir`` has logged ``steps`` steps."""
    launches = read_launches(run_dir)
    return len(launches) >= 2 and sum(s["time"] > launches[1]["time"] for s in read_metrics(run_dir)[0]) >= steps


def stop_once_the_relaunch_trains(launcher: subprocess.Popen, run_dir: Path, steps: int = 3) -> None:
    """Once the second launch has logged ``steps`` steps, SIGTERM to the launcher (a scheduler's stop: the job ends
    at a step boundary, exit 3) and wait for it to end. The relaunch has shown what these tests look at; the rest of
    a run long enough for a standby to get ready would only cost the suite a minute."""
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline and not relaunch_trained(run_dir, steps):
        time.sleep(0.05)
    assert launcher.poll() is None, "the run ended before its relaunch trained: make it longer"
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=TIMEOUT_S)


def standby_ranks(launcher_pid: int) -> dict[int, Path]:
    """``{pid: standby folder}`` of the live standby ranks (and their mpirun) that ``launcher_pid`` started."""
    mine = f"{LAUNCHER_PID_ENV}={launcher_pid}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        folder = next((v.split(b"=", 1)[1] for v in environ if v.startswith(f"{STANDBY_ENV}=".encode())), None)
        if mine in environ and folder is not None and state != "Z":
            out[int(entry)] = Path(folder.decode())
    return out


def standby_ready(launcher_pids: Iterable[int], ranks: int) -> bool:
    """A standby of these launchers is up and each of its ``ranks`` ranks has imported and waits."""
    folders = {f for pid in launcher_pids for f in standby_ranks(pid).values()}
    return bool(folders) and all(len(list(f.glob("ready-*"))) == ranks for f in folders)


def wait_for_ready_standby(launcher: subprocess.Popen, ranks: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and launcher.poll() is None:
        if standby_ready([launcher.pid], ranks):
            return
        time.sleep(0.05)
    raise AssertionError("no warm standby got ready")


# ------------------------------------------------------------------------------------------------ pure parts
def test_a_relaunch_gets_a_fresh_launch_token():
    cmd = ["mpirun", "-x", f"{LAUNCH_TOKEN_ENV}=aaaa", "-x", "PYTHONUNBUFFERED=1", "python"]
    assert with_launch_token(cmd, "bbbb") == ["mpirun", "-x", f"{LAUNCH_TOKEN_ENV}=bbbb", "-x", "PYTHONUNBUFFERED=1",
                                             "python"]


def test_auto_starts_a_standby_only_where_memory_allows(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")  # 16 GiB available
    assert standby_fits(2, meminfo) and not standby_fits(64, meminfo)
    assert not standby_fits(2, tmp_path / "missing")


# ------------------------------------------------------------------------------------------------ real jobs
@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_job_below_min_replicas_is_relaunched_in_place_from_the_warm_standby(tmp_path):
    steps = 20000  # never reached (the test stops the relaunched job): the standby gets ready at any load, then a
    # kill from outside. The losses across such a relaunch are the failure-free ones: tests/slurm/test_sbatch.py
    # (the same relaunch inside an allocation) and tests/launcher/test_regrow.py check them
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path, steps, min_replicas=2), run_dir / "config.yaml")
    with launched(config_path, run_dir, tmp_path / "launcher.log", restarts=1) as proc:
        wait_for_ready_standby(proc, ranks=2)
        os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
        stop_once_the_relaunch_trains(proc, run_dir, steps=20)
    output = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]  # the test's stop, after the relaunch trained
    assert "relaunching in place from the warm standby" in output, output[-3000:]
    assert [launch.get("warm") for launch in read_launches(run_dir)] == [False, True]
    startups = [r for r in read_metrics_jsonl(run_dir) if r.get("event") == "startup"]
    assert len(startups) == 2, startups  # each launch says what its start-up was made of
    for record in startups:
        assert {"MPI_Init", "FT world", "model and optimizer", "state load"} <= set(record["phases_s"]), record
        assert abs(sum(record["phases_s"].values()) - record["seconds"]) < 1e-3, record
    assert startups[1]["step"] > 0  # the relaunch resumed
    logged = [r["step"] for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    assert logged == list(range(1, logged[-1] + 1)), "a step logged twice, or one missing"
    assert logged[-1] >= startups[1]["step"] + 20, logged[-1]  # the relaunch trained


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_a_sigkilled_launcher_leaves_no_standby_behind(tmp_path):
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path, 6000), run_dir / "config.yaml")
    proc = launch(config_path, run_dir, tmp_path / "launcher.log", restarts=1)
    try:
        wait_for_ready_standby(proc, ranks=2)
        assert standby_ranks(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while standby_ranks(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = standby_ranks(proc.pid)
        assert not left, f"standby processes left 5 s after the launcher's SIGKILL: {sorted(left)}"
    finally:
        kill_run_processes(run_dir, proc)  # the job itself outlives its launcher on purpose (it holds the lock)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_a_standby_that_died_while_waiting_is_replaced_and_the_relaunch_is_still_warm(tmp_path):
    steps = 20000  # never reached (the test stops the relaunched job): time for two standbys to get ready
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path, steps, min_replicas=2), run_dir / "config.yaml")
    with launched(config_path, run_dir, tmp_path / "launcher.log", restarts=1) as proc:
        wait_for_ready_standby(proc, ranks=2)
        first = standby_ranks(proc.pid)
        for pid in first:  # the standby's mpirun and ranks, as a failed node step would leave them: gone
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (set(standby_ranks(proc.pid).values()) - set(first.values())):
            time.sleep(0.05)
        wait_for_ready_standby(proc, ranks=2)
        assert not set(standby_ranks(proc.pid).values()) & set(first.values()), "the dead standby was not replaced"
        os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
        stop_once_the_relaunch_trains(proc, run_dir)
    output = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == EXIT_RESTART, output[-3000:]  # the test's stop, after the relaunch trained
    assert "the warm standby ended while waiting" in output and "starting another" in output, output[-3000:]
    assert [launch.get("warm") for launch in read_launches(run_dir)] == [False, True]
    logged = [r["step"] for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    assert logged == list(range(1, logged[-1] + 1)), "a step logged twice, or one missing"


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_rank_killed_at_a_random_moment_of_the_first_seconds_costs_no_finished_run(tmp_path):
    steps = 200
    reference = run_training(config(tmp_path, steps), tmp_path / "reference", timeout_s=TIMEOUT_S,
                             extra_args=["--synthetic-data"])
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path, steps), run_dir / "config.yaml")
    delay = random.Random(os.getpid()).uniform(0.5, 6.0)
    with launched(config_path, run_dir, tmp_path / "launcher.log", restarts=2) as proc:
        time.sleep(delay)  # start-up included, its guard armed or not yet
        killed = None
        while killed is None:  # the rank 1 alive now (a pid read a moment ago may be a start-up watchdog's, gone)
            victim = rank_pids(run_dir).get(1)
            try:
                killed = kill_and_wait(proc, victim) if victim is not None else None
            except ProcessLookupError:
                pass
            assert proc.poll() is None or killed is not None, "the run ended before rank 1 could be killed"
            time.sleep(0.01)
    output = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    for got, want in zip([s["loss"] for s in read_metrics(run_dir)[0]], reference.losses, strict=True):
        assert abs(got - want) <= 1e-5
    launches = read_launches(run_dir)
    assert all(later["time"] - killed <= 30 for later in launches[1:]), (killed, launches)  # relaunched within 30 s
    print(f"\nrank 1 killed {delay:.1f} s after launch: {len(launches)} launch(es)")


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_rank_killed_before_its_startup_guard_is_armed_costs_seconds(tmp_path):
    """At the default startup_timeout_s (600 s): rank 1 SIGKILLed as soon as its process exists, before it forked
    its start-up watchdog. The launcher sees it gone, records it and ends the job; the in-place relaunch finishes."""
    steps = 20
    run_dir = tmp_path / "run"
    config_path = write_config(config(tmp_path, steps), run_dir / "config.yaml")
    with launched(config_path, run_dir, tmp_path / "launcher.log", restarts=1) as proc:
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline:
            victim = rank_pids(run_dir).get(1)
            time.sleep(0.002)
        assert victim is not None and not children_of(victim), "rank 1 had forked its watchdog already"
        killed = kill_and_wait(proc, victim)
    output = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    launches = read_launches(run_dir)
    assert len(launches) == 2 and launches[1]["time"] - killed <= 30, (killed, launches, output[-3000:])
    record = json.loads((run_dir / "launches" / "1" / "exits" / "rank-1.json").read_text())
    assert record["code"] == EXIT_RESTART and "by the launcher" in record["reason"], record
    assert [s["step"] for s in read_metrics(run_dir)[0]] == list(range(1, steps + 1))
    print(f"\nrank 1 killed before its guard was armed: relaunched {launches[1]['time'] - killed:.1f} s later")


def children_of(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (proc_stat(int(e)) or (0,))[0] == pid]


def test_the_launchers_metrics_reader_passes_a_line_longer_than_its_read_size(tmp_path):
    """A ``checkpoint_damaged`` event listing hundreds of files is longer than one read of the launcher's: the
    degraded step logged after it is still seen (it starts the standby of ``after_loss``)."""
    from nanotron_recover.launcher.relauncher import READ_BYTES, JobSpec, Relauncher

    spec = JobSpec(["mpirun"], tmp_path, 2, (), 10.0, 25.0, 1, False, standby_after_loss=True, replicas=2)
    relauncher = Relauncher(spec, judge=lambda rc: rc, begin=lambda record: None, launch_cold=lambda *a: 0)
    relauncher._mark_start()
    long_event = {"event": "checkpoint_damaged", "files": ["x" * 100] * (2 * READ_BYTES // 100)}
    lines = [json.dumps(long_event), json.dumps({"step": 5, "live_replicas": 1})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for _ in range(4):  # a few ticks
        relauncher._tick()
    assert relauncher._job_degraded


def test_a_narrower_launchs_standby_waits_for_the_narrower_launchs_ranks(tmp_path, monkeypatch):
    """A launch run on fewer nodes (one replica of two out, 2 ranks a replica): its standby, started from the
    narrower launch line, has 2 ranks, and must be ready when those 2 are (not the full job's 4: seen, 60 s of waiting,
    then a cold launch). A standby for the regrow, at full width, waits for all 4."""
    from nanotron_recover.launcher import relauncher as module
    from nanotron_recover.launcher.relauncher import JobSpec, Relauncher

    started: list[int] = []

    class RecordedStandby:  # the launcher's own part, recorded: what it would start
        def __init__(self, cmd, world_size, **kwargs):
            started.append(world_size)

    monkeypatch.setattr(module, "Standby", RecordedStandby)
    spec = JobSpec(["mpirun"], tmp_path, 4, (), 10.0, 25.0, 1, True, replicas=2, ranks_per_replica=2)
    relauncher = Relauncher(spec, judge=lambda rc: rc, begin=lambda record: None, launch_cold=lambda *a: 0)
    relauncher.replicas = 1  # the node fit relaunched it narrower
    relauncher._job_trained = True
    relauncher._keep_standby()
    assert started == [2]
    assert relauncher._new_standby(["mpirun"], (), spec.world_size) and started == [2, 4]


def test_a_node_that_goes_silent_while_the_relaunch_waits_for_its_standby_is_left_out(tmp_path):
    """The nodes are asked when the job ends; when the relaunch then waits for its standby, a node may go silent
    meanwhile (seen on the isolated-node bed: the launch at full width hung on it, costing a launch). The nodes are
    asked again after the wait, so the relaunch is narrower and cold (the standby was shaped for both nodes)."""
    from nanotron_recover.launcher.node_fit import NodeFit
    from nanotron_recover.launcher.relauncher import JobSpec, Relauncher
    from nanotron_recover.launcher.slurm_nodes import Allocation, Node

    class Answers(Allocation):  # the nodes answer as the test says (no ssh, no Slurm here)
        def still_allocated(self) -> list[Node]:
            return list(self.nodes)

        def answers(self, node: str) -> bool:
            return node not in silent

    class ImportingStandby:  # the launcher's view of a standby whose n2 ranks froze with their node while it waited
        nodes_out, waited, cancelled = (), False, False
        looks = 0

        def look_now(self) -> None:
            pass

        def ready(self) -> bool:
            self.looks += 1
            if self.looks >= 3:
                silent.add("n2")  # the node went silent during the wait
            return self.looks >= 5

        def ended(self) -> bool:
            return False

        def broken(self) -> None:
            return None

        def why_not(self) -> str:
            return "rank(s) [2, 3] still importing"

        def cancel(self) -> None:
            self.cancelled = True

    silent: set[str] = set()
    standby = ImportingStandby()
    fit = NodeFit(Answers("7", [Node("n1", 2), Node("n2", 2)], batch_node="n1"), ranks_per_replica=2, replicas=2,
                  spares=0, microbatches=4, min_replicas=1, full_cmd=["mpirun", "-n", "4", "train"],
                  reshape=lambda r, hosts: ["mpirun", "--host", hosts, "-n", str(2 * r), "train"])
    spec = JobSpec(["mpirun", "-n", "4", "train"], tmp_path, 4, (), 10.0, 25.0, 2, False, replicas=2,
                   ranks_per_replica=2, nodes=fit)
    records: list[dict] = []
    launched: list[list[str]] = []

    def cold(cmd, stop, tick) -> int:
        launched.append(cmd)
        if len(launched) == 1:
            relauncher.standby = standby  # started beside launch 1 (it trained), importing when launch 1 ends
            return EXIT_RESTART
        return 0

    relauncher = Relauncher(spec, judge=lambda rc: rc, begin=records.append, launch_cold=cold)
    assert relauncher.run() == 0
    assert [(r["warm"], r["replicas"], r["nodes_out"]) for r in records] == [(False, 2, []), (False, 1, ["n2"])]
    assert launched[1] == ["mpirun", "--host", "n1:2", "-n", "2", "train"] and standby.cancelled
    assert standby.waited  # it was waited for once, not again by the launch
