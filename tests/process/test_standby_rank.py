"""A standby rank's imports at idle priority, on real processes: where a core is idle they finish in the idle class;
where a busy process holds the only core the rank may use, the idle class gets no CPU, and the rank climbs to the
normal class after its bound and gets ready all the same. Its ready file says the class it got ready at."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.process.priority import can_idle
from nanotron_recover.process.standby_rank import RELEASE, ready_file

RANK = """
import os, sys, time
from pathlib import Path
from nanotron_recover.process import standby_rank
standby_rank.IDLE_IMPORT_S = float(sys.argv[2])
cpu_s = float(sys.argv[3])

def prepare():  # the imports: CPU work
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass

launcher = int(sys.argv[4]) if len(sys.argv) > 4 else None
standby_rank.wait_until_released(Path(sys.argv[1]), launcher, sys.argv[5] if len(sys.argv) > 5 else None, prepare)
print("released", os.sched_getscheduler(0), flush=True)
"""

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not can_idle(), reason="this user may not leave the idle class again")]


def start_rank(folder: Path, idle_bound_s: float, cpu_s: float, cpu: int,
               launcher: tuple[int, str] | None = None) -> subprocess.Popen:
    """A standby rank waiting in ``folder``; ``launcher``: (pid, node) of the launcher it must not outlive."""
    said = [str(launcher[0]), launcher[1]] if launcher else []
    return subprocess.Popen([sys.executable, "-c", RANK, str(folder), str(idle_bound_s), str(cpu_s), *said],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMPI_COMM_WORLD_RANK": "0"},
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


def ready_within(folder: Path, seconds: float) -> str | None:
    """The rank's ready file (its "pid node class"), once written within ``seconds``; None otherwise."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = ready_file(folder, 0).read_text() if ready_file(folder, 0).exists() else ""
        if len(text.split()) == 3:
            return text
        time.sleep(0.02)
    return None


def release(rank: subprocess.Popen, folder: Path) -> str:
    (folder / RELEASE).touch()
    out, _ = rank.communicate(timeout=20)
    return out


def test_with_a_core_idle_the_rank_gets_ready_in_the_idle_class(tmp_path):
    rank = start_rank(tmp_path, idle_bound_s=30, cpu_s=0.1, cpu=0)
    try:
        said = ready_within(tmp_path, 20)
        assert said is not None and said.split()[2] == "idle", said
        assert release(rank, tmp_path) == f"released {os.SCHED_OTHER}\n"  # trains at normal priority
    finally:
        rank.kill()


def test_with_no_core_idle_the_rank_climbs_to_normal_priority_and_gets_ready(tmp_path):
    """A busy-looping process (as a training rank polling inside MPI) holds the rank's only core: in the idle
    class a rank's 0.3 s of imports do not finish (a second rank, bound far off, shows it); after its 1 s bound
    the first climbs and is ready."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    starved_folder = tmp_path / "starved"
    starved_folder.mkdir()
    ranks = []
    try:
        time.sleep(0.3)  # the busy process runs
        ranks.append(start_rank(starved_folder, idle_bound_s=1000, cpu_s=0.3, cpu=0))
        ranks.append(start_rank(tmp_path, idle_bound_s=1.0, cpu_s=0.3, cpu=0))
        started = time.monotonic()
        said = ready_within(tmp_path, 20)
        took = time.monotonic() - started
        assert said is not None and said.split()[2] == "normal", said
        assert took >= 1.0, f"ready {took:.2f} s after its start: before the bound"
        assert not ready_file(starved_folder, 0).exists(), "the rank that stayed idle got ready: no core was busy"
        assert release(ranks[1], tmp_path) == f"released {os.SCHED_OTHER}\n"
    finally:
        busy.kill()
        for rank in ranks:
            rank.kill()


def a_gone_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_rank_on_the_launchers_node_leaves_once_the_launcher_is_gone(tmp_path):
    rank = start_rank(tmp_path, idle_bound_s=30, cpu_s=0.0, cpu=0, launcher=(a_gone_pid(), socket.gethostname()))
    try:
        assert rank.wait(timeout=20) == 0
        assert rank.stdout.read() == ""  # it left without starting the job
    finally:
        rank.kill()


def test_a_rank_on_another_node_does_not_look_up_the_launchers_pid_in_its_own_pid_space(tmp_path):
    """On a real node the launcher's pid names nothing (or another process): the rank must keep waiting, and
    starts the job once released."""
    rank = start_rank(tmp_path, idle_bound_s=30, cpu_s=0.0, cpu=0, launcher=(a_gone_pid(), "another-node"))
    try:
        assert ready_within(tmp_path, 20) is not None
        time.sleep(0.5)  # it looks for its launcher every 0.1 s
        assert rank.poll() is None, "the rank left: it took a pid of another node for its launcher's"
        assert release(rank, tmp_path).startswith("released")
    finally:
        rank.kill()
