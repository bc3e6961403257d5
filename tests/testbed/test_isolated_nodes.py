"""The isolated-node bed (``nanotron_recover.testbed.isolated_nodes``): real namespaces, a real bridge, real mpirun
and training jobs; no mocks. Needs root and namespaces: skipped elsewhere, saying why.

1. Isolation: private /tmp and /dev/shm, own hostnames, own addresses (a node reaches another by name), own pid
   namespaces; the shared folder is seen by every node even under the host's /tmp (pytest's tmp_path).
2. A partition (the veth down) silences a node; healing brings it back. A killed node loses every process; a
   restarted one comes back empty. Teardown leaves no bridge, veth or process, and may run twice.
3. ``mpirun`` across two isolated nodes: each rank runs inside its node and sees its hostname.
4. ``nanotron-recover train`` on two isolated nodes (a replica per node), failure-free and with node n2 killed
   mid-run: the relaunch (n2 replaced, its memory gone) resumes from n1's node-local snapshots and every step's
   loss equals the failure-free run's.
5. n2 cut off and frozen mid-run: the launcher relaunches on n1 alone (asked over ssh), n2's ranks of the old launch
   wake up later and are fenced before they write, the job regrows once n2 answers; the same losses.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from nanotron_recover.launcher.launch import HOSTFILE_ENV, MPIRUN_ARGS_ENV
from nanotron_recover.launcher.mpirun import mpirun_command
from nanotron_recover.launcher.runs import environ_of, run_training, write_config
from nanotron_recover.run.exit_codes import EXIT_RESTART
from nanotron_recover.run.fence_audit import writes_after_replacement
from nanotron_recover.run.outcome import OUTCOMES_FILE
from nanotron_recover.run.run_folder import read_launches, read_metrics, read_metrics_jsonl, record_external_fault
from nanotron_recover.testbed import isolated_nodes as iso

REASON = iso.unavailable_reason() if sys.platform == "linux" else "Linux only"
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"isolated nodes unavailable: {REASON}")


def test_only_paths_under_the_private_mounts_are_bound_back():
    assert iso.paths_to_keep(["/tmp/a/b", "/tmp/a", "/var/tmp/x", "/dev/shm/s", "/tmpx"]) == ["/dev/shm/s", "/tmp/a"]
    assert iso.paths_to_keep(["/work/main"]) == []


def _nothing_left(bed: iso.Bed) -> list[str]:
    """What a torn-down bed left behind: links, live processes of its nodes."""
    links = [n for n in [bed.bridge, *(node.veth for node in bed.nodes.values())] if iso.link_exists(n)]
    procs = [p for node in bed.nodes.values() for p in iso.node_pids(node)]
    return links + [f"pid {p}" for p in procs]


@pytest.fixture
def bed(tmp_path):
    """Two isolated nodes x 2 slots, its folder (and so its shared folder) under pytest's /tmp; always torn down."""
    if REASON is not None:
        pytest.skip(f"isolated nodes unavailable: {REASON}")
    folder = tmp_path / "bed"
    started = iso.up(folder, [2, 2])
    try:
        yield started
    finally:
        last = iso.load(folder) or started  # restarted nodes have new pids
        iso.down(folder)
        iso.down(folder)  # twice: idempotent
        assert _nothing_left(last) == [], _nothing_left(last)


def _in(bed: iso.Bed, node: str, script: str) -> str:
    """Run a shell script inside ``node``; its stdout."""
    done = iso.in_node(bed, node, ["bash", "-c", script], timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_namespaces
@pytest.mark.timeout(60)
def test_nodes_have_private_tmp_and_shm_and_their_own_names_and_pid_spaces(bed, tmp_path):
    mark = f"nr-iso-{os.getpid()}"
    _in(bed, "n1", f"echo x > /tmp/{mark} && echo x > /dev/shm/{mark}")
    assert _in(bed, "n1", f"cat /tmp/{mark} /dev/shm/{mark}") == "x\nx"
    assert _in(bed, "n2", f"ls /tmp/{mark} /dev/shm/{mark} 2>/dev/null | wc -l") == "0"
    assert not Path(f"/tmp/{mark}").exists() and not Path(f"/dev/shm/{mark}").exists()
    assert [_in(bed, n, "hostname") for n in ("n1", "n2")] == ["n1", "n2"]
    pidns = {n: _in(bed, n, "readlink /proc/self/ns/pid") for n in ("n1", "n2")}
    assert len({*pidns.values(), os.readlink("/proc/self/ns/pid")}) == 3, pidns
    assert _in(bed, "n1", "echo $$") != str(os.getpid())  # a pid of the node's own space
    addresses = {n: _in(bed, n, "ip -4 -o addr show eth0 | awk '{print $4}'") for n in ("n1", "n2")}
    assert addresses == {"n1": f"{bed.nodes['n1'].ip}/24", "n2": f"{bed.nodes['n2'].ip}/24"}
    # the shared folder (under the host's /tmp here) is one folder for the host and every node
    Path(bed.shared, "from-host").write_text("h")
    assert _in(bed, "n2", f"cat {bed.shared}/from-host && echo n2 > {bed.shared}/from-n2") == "h"
    assert Path(bed.shared, "from-n2").read_text() == "n2\n"
    assert _in(bed, "n1", f"ls {tmp_path} | wc -l") == "1"  # of the host's /tmp, only the kept paths


def _serve_hostname(bed: iso.Bed, node: str, port: int) -> subprocess.Popen:
    """A one-connection TCP server inside ``node`` that answers with its hostname; started once it listens."""
    server = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', %d)); s.listen(); print('up', flush=True); "
              "c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()") % port
    node_init = str(bed.nodes[node].init)
    proc = subprocess.Popen(["nsenter", "-t", node_init, "-m", "-u", "-i", "-n", "-p", "--", sys.executable, "-c",
                             server], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _ask(bed: iso.Bed, node: str, target: str, port: int, timeout_s: float) -> str:
    """Connect from ``node`` to ``target`` by name: the answer, or the name of the error."""
    client = ("import socket\ntry:\n    c = socket.create_connection((%r, %d), timeout=%s)\n"
              "    print(c.recv(100).decode())\nexcept OSError as e:\n    print(type(e).__name__)"
              ) % (target, port, timeout_s)
    done = iso.in_node(bed, node, [sys.executable, "-c", client], timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_namespaces
@pytest.mark.timeout(60)
def test_a_node_reaches_another_by_name_until_it_is_partitioned(bed):
    server = _serve_hostname(bed, "n2", 7001)
    try:
        iso.partition(bed, "n2")
        assert _ask(bed, "n1", "n2", 7001, 1.0) in ("TimeoutError", "timeout")  # silence, not a refusal
        iso.partition(bed, "n2", connected=True)
        assert _ask(bed, "n1", "n2", 7001, 5.0) == "n2"
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@needs_namespaces
@pytest.mark.timeout(60)
def test_a_killed_node_loses_every_process_and_restarts_empty(bed):
    _in(bed, "n2", "echo x > /tmp/state && echo x > /dev/shm/state")
    node = bed.nodes["n2"]
    sleeper = subprocess.Popen(["nsenter", "-t", str(node.init), "-m", "-u", "-i", "-n", "-p", "--", "sleep", "600"])
    deadline = time.monotonic() + 10
    while len(iso.node_pids(node)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    inside = iso.node_pids(node)
    assert len(inside) == 2, inside  # the init and the sleep
    assert sorted(iso.kill_node(bed, "n2")) == inside
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # what ran in the node went with it
    assert not iso.node_alive(node) and iso.node_pids(node) == []
    assert iso.node_alive(bed.nodes["n1"])
    with pytest.raises(ProcessLookupError):
        iso.kill_node(bed, "n2")
    iso.start_node(bed, "n2")  # a replaced machine: same name and address, empty memory
    assert _in(bed, "n2", "hostname; ls /tmp /dev/shm | grep -c state || true") == "n2\n0"
    assert _ask(bed, "n1", "n2", 7002, 1.0) == "ConnectionRefusedError"  # reachable again (nothing listens)


@needs_namespaces
@pytest.mark.timeout(60)
def test_a_nodes_processes_killed_leave_the_node_and_its_memory_which_the_host_reads_through_its_root(bed):
    _in(bed, "n2", "mkdir -p /dev/shm/kept && echo x > /dev/shm/kept/f")
    assert iso.node_path(bed, "n2", "/dev/shm/kept/f").read_text() == "x\n"  # the node's own tmpfs, from the host
    assert not iso.node_path(bed, "n1", "/dev/shm/kept").exists()
    node = bed.nodes["n2"]
    sleeper = subprocess.Popen(["nsenter", "-t", str(node.init), "-m", "-u", "-i", "-n", "-p", "--", "sleep", "600"])
    deadline = time.monotonic() + 10
    while len(iso.node_pids(node)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    inside = [p for p in iso.node_pids(node) if p != node.init]  # the sleep (nsenter itself stays on the host)
    assert len(inside) == 1 and iso.kill_processes(bed, "n2") == inside
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert iso.node_alive(node) and iso.node_pids(node) == [node.init]
    assert _in(bed, "n2", "cat /dev/shm/kept/f") == "x"  # a crashed process, not a lost machine


def test_a_launch_on_some_nodes_gets_a_hostfile_of_those(bed):
    env = iso.launch_env(Path(bed.folder), ["n2"])
    assert Path(env[HOSTFILE_ENV]).read_text() == "n2 slots=2\n"
    assert env[MPIRUN_ARGS_ENV] == iso.launch_env(Path(bed.folder))[MPIRUN_ARGS_ENV]
    with pytest.raises(KeyError):
        iso.launch_env(Path(bed.folder), ["n3"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nanotron_recover.testbed.isolated_nodes", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@needs_namespaces
@pytest.mark.timeout(120)
def test_the_command_line_starts_shows_kills_and_tears_down_a_bed(tmp_path):
    folder = tmp_path / "clibed"
    try:
        started = _cli("up", str(folder), "--nodes", "2", "--slots", "1")
        assert started.returncode == 0, started.stderr
        exports = dict(re.findall(r"^export (\w+)=(.*)$", started.stdout, re.M))
        assert set(exports) == {HOSTFILE_ENV, MPIRUN_ARGS_ENV}, started.stdout
        assert Path(shlex.split(exports[HOSTFILE_ENV])[0]).read_text() == "n1 slots=1\nn2 slots=1\n"
        assert re.findall(r"^(n\d) up ", _cli("ps", str(folder)).stdout, re.M) == ["n1", "n2"]
        assert _cli("partition", str(folder), "n2").returncode == 0
        assert " link DOWN " in _cli("ps", str(folder)).stdout
        assert _cli("heal", str(folder), "n2").returncode == 0
        assert _cli("kill", str(folder), "n2").returncode == 0
        assert re.findall(r"^(n\d) (\w+) ", _cli("ps", str(folder)).stdout, re.M) == [("n1", "up"), ("n2", "lost")]
        assert _cli("kill", str(folder), "n2").returncode == 1  # nothing left to kill: said, not a traceback
    finally:
        bed = iso.load(folder)
        assert _cli("down", str(folder)).returncode == 0
        assert _cli("down", str(folder)).returncode == 0
    assert bed is not None and _nothing_left(bed) == [], _nothing_left(bed)


HELLO = """import os, socket
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank)
print(f"rank {comm.rank} of {comm.size} on {socket.gethostname()} sum {total} in {os.readlink('/proc/self/ns/pid')}")
"""


@needs_namespaces
@pytest.mark.timeout(120)
def test_mpirun_runs_each_rank_inside_its_node(bed):
    program = Path(bed.shared) / "hello.py"
    program.write_text(HELLO)
    env = iso.launch_env(Path(bed.folder))
    cmd = mpirun_command(4, [sys.executable, str(program)], hostfile=env[HOSTFILE_ENV],
                         extra_args=shlex.split(env[MPIRUN_ARGS_ENV]))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=bed.shared)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(re.findall(r"rank (\d) of 4 on (\S+) sum (\d+) in (\S+)", done.stdout))
    print(done.stdout)
    ns = {name: node.pidns for name, node in bed.nodes.items()}
    assert lines == [("0", "n1", "6", ns["n1"]), ("1", "n1", "6", ns["n1"]), ("2", "n2", "6", ns["n2"]),
                     ("3", "n2", "6", ns["n2"])], done.stdout  # each rank inside its node's pid namespace


# ------------------------------------------------------------------------- 4. training on isolated nodes
TIMEOUT_S = 300
STEPS = 14
LOSE_AFTER = 5
TOL = 1e-5


def _train_config(tiny_config) -> dict:
    """A replica (TP2) per node; node-local snapshots every step in the default folder (/dev/shm: each node's own),
    no disk checkpoint before the end, so a relaunch can only resume from a node's memory (or from scratch)."""
    return tiny_config(dp=2, tp=2, accumulation=2, steps=STEPS, layers=2, checkpoint_interval=1000,
                       fault_tolerance={"enabled": True, "min_replicas": 1, "reduce_bucket_mb": 0.01,
                                        "collective_timeout_s": 120, "local_snapshot_interval": 1})


class Placement:
    """Polls in a thread which world ranks run inside which node until all ``world`` were seen at once."""

    def __init__(self, bed: iso.Bed, world: int) -> None:
        self.seen: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(bed, world), daemon=True)
        self._thread.start()

    def _poll(self, bed: iso.Bed, world: int) -> None:
        while not self._stop.is_set():
            now = {name: iso.node_ranks(node) for name, node in bed.nodes.items()}
            if sum(map(len, now.values())) == world:
                self.seen = now
                return
            time.sleep(0.2)

    def stop(self) -> dict[str, list[int]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.seen


def _launch_and_kill(config_path: Path, run_dir: Path, bed: iso.Bed, node: str, replace: bool = False,
                     env: dict[str, str] | None = None) -> tuple[int, str, dict, dict]:
    """``nanotron-recover train`` on the bed; once it logged LOSE_AFTER steps, kill ``node`` whole (and start it
    again at once, empty, with ``replace``). -> (the launcher's exit code, its output, the placement seen before
    the kill, when: the step logged last at the kill, the seconds from the kill to the launcher's exit)."""
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **iso.launch_env(Path(bed.folder)), **(env or {})}, cwd=bed.shared)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    watch, killed, when = Placement(bed, 4), False, {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            steps = read_metrics(run_dir)[0]
            if not killed and len(steps) >= LOSE_AFTER:
                iso.kill_node(bed, node)
                killed, when = True, {"step": steps[-1]["step"], "at": time.monotonic()}
                if replace:
                    iso.start_node(bed, node)
            time.sleep(0.05)
        when["ended_s"] = time.monotonic() - when.get("at", time.monotonic())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        placement = watch.stop()
    text = "".join(output)
    assert killed, f"the job ended before step {LOSE_AFTER}:\n{text[-4000:]}"
    return proc.returncode, text, placement, when


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_training_on_two_isolated_nodes(bed, tiny_config, failure_free_run, monkeypatch):
    config = _train_config(tiny_config)
    reference = failure_free_run(config, timeout_s=TIMEOUT_S)
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    watch = Placement(bed, 4)
    try:
        result = run_training(config, Path(bed.shared) / "run", timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    finally:
        placement = watch.stop()
    assert placement == {"n1": [0, 1], "n2": [2, 3]}, placement  # every rank ran inside its node
    assert [s["step"] for s in result.steps] == list(range(1, STEPS + 1)), result.output[-4000:]
    diff = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert diff <= TOL, diff
    print(f"\n2 isolated nodes x 2 ranks: {STEPS} steps in {result.wall_s:.1f} s (failure-free on the host "
          f"{reference.wall_s:.1f} s), max |dloss| vs the host's run {diff:.1e}")


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_a_node_killed_mid_run_is_survived_with_the_same_losses(bed, tiny_config, failure_free_run, monkeypatch):
    config = _train_config(tiny_config)
    want = {s["step"]: s["loss"] for s in failure_free_run(config, timeout_s=TIMEOUT_S).steps}
    run_dir = Path(bed.shared) / "run"
    config_path = write_config(config, run_dir / "config.yaml")
    code, out, placement, when = _launch_and_kill(config_path, run_dir, bed, "n2")
    assert placement == {"n1": [0, 1], "n2": [2, 3]}, placement
    assert code == EXIT_RESTART, out[-4000:]  # this Open MPI ends the job with a lost node: a relaunch
    last = read_metrics(run_dir)[0][-1]["step"]
    iso.start_node(bed, "n2")  # the node replaced: same name and address, nothing in its /tmp or /dev/shm
    for key, value in iso.launch_env(Path(bed.folder)).items():
        monkeypatch.setenv(key, value)
    relaunched = time.time()
    result = run_training(config_path, run_dir, timeout_s=TIMEOUT_S, extra_args=["--synthetic-data"])
    resumed = re.findall(r"resumed from the local snapshot of step (\d+)", result.output)
    after = [s for s in result.steps if s["time"] >= relaunched]
    records = [r for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    diff = max(abs(r["loss"] - want[r["step"]]) for r in records)
    print(f"\nn2 killed after step {when['step']}; the job logged steps up to {last} and its launcher exited "
          f"{when['ended_s']:.1f} s after the kill, code {code}; relaunch resumed from "
          f"{'the local snapshot of step ' + resumed[0] if resumed else 'no local snapshot'}, steps "
          f"{after[0]['step'] if after else None}..{after[-1]['step'] if after else None}; max |dloss| {diff:.1e}")
    assert resumed and int(resumed[0]) >= last - 1, result.output[-4000:]  # n1's memory, not a restart from 0
    # n2's memory went with it: its ranks got their state from n1's over MPI
    assert "rank 2 received from rank" in result.output and "rank 3 received from rank" in result.output
    assert [s["step"] for s in after] == list(range(int(resumed[0]) + 1, STEPS + 1)), after
    assert all(s["live_replicas"] == 2 and s["microbatches"] == 4 for s in after), after
    assert diff <= TOL, [(r["step"], r["loss"], want[r["step"]]) for r in records]


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_a_node_lost_while_its_ssh_ends_at_once_is_relaunched_in_place(bed, tiny_config):
    """The ssh that started a node's daemon ends as soon as the node is gone (here at once): Open MPI then says a
    daemon "failed to report back", not that it "lost communication". The teardown's SIGTERM to the ranks is still
    the runtime's, not a scheduler's: the launcher relaunches in place (the node was replaced meanwhile) and the
    run finishes (seen before: "the job's ranks were asked to stop", exit 3 for the scheduler)."""
    config = _train_config(tiny_config)
    run_dir = Path(bed.shared) / "run"
    config_path = write_config(config, run_dir / "config.yaml")
    code, out, _, when = _launch_and_kill(config_path, run_dir, bed, "n2", replace=True,
                                          env={"NANOTRON_RECOVER_BED_SSH_GIVES_UP_S": "0",
                                               "NANOTRON_RECOVER_MAX_RESTARTS": "1"})
    assert "asked to stop" not in out, out[-4000:]
    assert code == 0 and len(read_launches(run_dir)) == 2, out[-4000:]
    steps = [s["step"] for s in read_metrics(run_dir)[0]]
    assert steps[-1] == STEPS, out[-4000:]
    print(f"\nn2 lost after step {when['step']} (its ssh ended at once), replaced; relaunched in place, finished")


# ------------------------------------------------------------------------- 5. a node cut off, frozen, and back
PARTITION_STEPS = 500
HANG_S = 8.0


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 120)
def test_a_node_cut_off_and_frozen_is_fenced_the_job_goes_on_without_it_and_regrows(bed, tiny_config,
                                                                                    failure_free_run):
    """n2's link goes down after step 5 and its processes freeze (a node that hangs and drops off the network).
    Its ranks' peers find them silent past the hang timeout, cannot reach them to kill them, and end the job; the
    launcher asks the nodes over ssh, relaunches on n1 alone with the same global batch, and fences the cut launch:
    the folder is the narrower launch's. Once that one has run a while, n2 comes back (link up, processes thawed): its
    ranks of the cut launch wake up believing a step is in flight and try to report the hang; the fence ends them
    before they write. The launcher hears n2 answer, starts a standby at full width and regrows. Every step has the
    failure-free loss and all M microbatches; nothing of a replaced launch is written after its successor began.
    (The cut launch is launch 1 unless launch 1 ended on its own before step 5: a CI run once saw that, its reason
    unknown; the outcomes of the launches before the cut are warned of, and a hang among them fails the session.)"""
    config = tiny_config(dp=2, tp=2, accumulation=2, steps=PARTITION_STEPS, layers=2, checkpoint_interval=1000,
                         fault_tolerance={"enabled": True, "min_replicas": 1, "reduce_bucket_mb": 0.01,
                                          "hang_timeout_s": HANG_S, "collective_timeout_s": HANG_S + 20,
                                          "local_snapshot_interval": 1})
    want = {s["step"]: s["loss"] for s in failure_free_run(config, timeout_s=TIMEOUT_S).steps}
    run_dir = Path(bed.shared) / "run"
    config_path = write_config(config, run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    env = {**os.environ, **iso.launch_env(Path(bed.folder)), "NANOTRON_RECOVER_MAX_RESTARTS": "3",
           "NANOTRON_RECOVER_NODE_PROBE_S": "5"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env, cwd=bed.shared)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    frozen: list[int] = []
    cut = healed = None
    cut_launch = 0  # the launch running when n2 was cut (1-based)
    deadline = time.monotonic() + 2 * TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            steps = read_metrics(run_dir)[0]
            if cut is None and len(steps) >= 5:
                record_external_fault(run_dir, "partition-and-freeze-n2")  # its hang events are expected
                iso.partition(bed, "n2")
                frozen = [p for p in iso.node_pids(bed.nodes["n2"]) if p != bed.nodes["n2"].init]
                for pid in frozen:
                    os.kill(pid, signal.SIGSTOP)
                cut, cut_launch = (steps[-1]["step"], time.monotonic()), len(read_launches(run_dir))
            if cut and healed is None and len(read_launches(run_dir)) > cut_launch and len(steps) >= cut[0] + 15:
                iso.partition(bed, "n2", connected=True)
                for pid in frozen:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                healed = (steps[-1]["step"], time.monotonic() - cut[1])
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    out = "".join(output)
    launches = read_launches(run_dir)
    outcomes = read_metrics_jsonl(run_dir / OUTCOMES_FILE)
    print(f"\nn2 cut off and frozen after step {cut and cut[0]} (launch {cut_launch}); back "
          f"{healed and healed[1]:.1f} s later (step {healed and healed[0]}); launches: "
          + "; ".join(f"{r['launch']} warm {r['warm']} replicas {r['replicas']} out {r.get('nodes_out')}"
                      for r in launches))
    for o in outcomes:  # not this test's subject, but worth seeing in every suite's summary
        if o["launch"] < cut_launch:
            warnings.warn(f"launch {o['launch']} ended before n2 was cut: {o['verdict']}, {o['reasons']}")
    assert cut and healed, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert "n2 did not answer over ssh" in out, out[-4000:]
    shapes = [(r["replicas"], r.get("nodes_out")) for r in launches]
    assert shapes[:cut_launch] == [(2, [])] * cut_launch, (launches, out[-6000:])
    assert shapes[cut_launch] == (1, ["n2"]) and not launches[cut_launch]["warm"], (launches, out[-6000:])
    assert launches[-1]["replicas"] == 2 and launches[-1]["warm"] and launches[-1].get("regrow"), launches
    assert writes_after_replacement(run_dir) == []
    steps = read_metrics(run_dir)[0]
    assert [s["step"] for s in steps] == list(range(1, PARTITION_STEPS + 1))
    assert {s["microbatches"] for s in steps} == {4} and {s["live_replicas"] for s in steps} == {1, 2}
    diff = max(abs(s["loss"] - want[s["step"]]) for s in steps)
    assert diff <= TOL, diff
    old = launches[cut_launch - 1]["token"]
    assert not [p for p in iso.node_pids(bed.nodes["n2"])
                if any(old.encode() in e for e in environ_of(p) or [])]  # no zombie left

