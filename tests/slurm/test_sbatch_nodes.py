"""``recover_multi_node.sbatch`` on a real two-node Slurm (two ``slurmd`` on this machine, ``CLUSTER_NODES=2``).

``mpirun`` in the batch script starts one ``prted`` per node through Slurm (``srun``); ranks fill the nodes with
whole replicas. Node 2's daemon and ranks are SIGKILLed after step 3: the whole job ends (mpirun returns 0), the
script's outcome helper says "restart" and requeues the job; Slurm starts it again on both nodes (node 2
"replaced": its slurmd lives on), it resumes from latest.txt, and every step's loss equals the failure-free run's.

With relaunches in place allowed (the default), the launcher's warm standby is a second job step on both nodes
(its daemons started with ``srun --overlap``); the job's own daemon on node 2 lost (the standby's lives on): the
launcher relaunches in place from the standby, no requeue, the same losses.

Node 2 really lost (its ``slurmd`` too, every process of it SIGKILLed): the launcher's probe step there fails, it
relaunches on node 1 alone with 1 replica (the same global batch); once node 2's ``slurmd`` is started again, the
launcher hears it answer and starts a standby at full width; when that is ready the job regrows at a step boundary
(a warm relaunch) and finishes on both nodes, in the same Slurm job, with the failure-free losses.

Hard timeouts on every wait (job polling, the kill watcher, ``run_training``); needs root and Debian's Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_recover.launcher.runs import run_training, write_config
from nanotron_recover.run.run_folder import read_launches, read_metrics, read_metrics_jsonl
from nanotron_recover.testbed.fake_nodes import kill_processes, process_tree
from tests.conftest import make_tiny_config
from tests.slurm.test_sbatch import CLUSTER, REPO, Cluster, _job_env, needs_slurm, wait_for_batch_standby

MULTI_NODE = REPO / "scripts" / "slurm" / "recover_multi_node.sbatch"
STEPS = 40  # the survivors of the loss must not finish the run before its teardown reaches them

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    scratch = Path(tempfile.mkdtemp(prefix="recover-slurm2-", dir="/tmp"))
    # a node whose slurmd is gone stays in the allocation for 120 s (Slurm's default: 300 s), long enough for the
    # lost-node test to bring it back before slurmctld marks it down
    env = {**os.environ, "CLUSTER_NODES": "2", "CLUSTER_SLURMD_TIMEOUT": "120"}
    try:
        subprocess.run(["bash", str(CLUSTER), "up", str(scratch)], check=True, timeout=60, env=env)
        yield Cluster(scratch)
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(scratch)], timeout=60, env=env)
        shutil.rmtree(scratch, ignore_errors=True)


LONG_STEPS = 800  # the standby tests' runs: long enough for a standby to get ready, and a lost node to come back


def _long_config(**fault_tolerance) -> dict:
    return make_tiny_config(dp=2, tp=2, steps=LONG_STEPS, accumulation=2, layers=2, checkpoint_interval=100,
                            fault_tolerance={"enabled": True, "local_snapshot_interval": 1, **fault_tolerance})


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return {}


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def slurm_node_daemons(node: str) -> list[int]:
    """The ``prted`` processes that Slurm started on ``node`` (by ``SLURMD_NODENAME`` in their environment)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _comm(int(p)) == "prted"
            and _environ(int(p)).get(b"SLURMD_NODENAME") == node.encode()]


def ranks_by_node() -> dict[str, list[int]]:
    """World ranks of the running job, by the Slurm node whose daemon started them."""
    out: dict[str, list[int]] = {}
    for node in ("n1", "n2"):
        for daemon in slurm_node_daemons(node):
            for pid in process_tree(daemon):
                rank = _environ(pid).get(b"OMPI_COMM_WORLD_RANK")
                if rank is not None:
                    out.setdefault(node, []).append(int(rank))
    return {n: sorted(set(r)) for n, r in out.items()}


@needs_slurm
@pytest.mark.timeout(420)
def test_a_lost_node_requeues_the_multi_node_job_and_it_resumes_the_same_trajectory(two_nodes, tmp_path):
    # 2 replicas x TP2 on 2 nodes x 2 task slots; checkpoints every 2 steps
    config = make_tiny_config(dp=2, tp=2, steps=STEPS, accumulation=2, layers=2, checkpoint_interval=2,
                              fault_tolerance={"enabled": True, "local_snapshot_interval": 1})  # every step:
    # the survivors may commit steps after the loss, before the teardown reaches them; all of those are kept
    config_path = write_config(config, tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(config_path, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="2", IN_PLACE_RESTARTS="0",
                   # both "nodes" are this machine: TCP between them (no shared memory), over loopback; their
                   # ranks share its cores, so they yield while waiting in MPI (as the fake-node bed's do)
                   MPIRUN_ARGS="--mca btl tcp,self --mca btl_tcp_if_include lo --mca mpi_yield_when_idle 1")
    job = two_nodes.submit(MULTI_NODE, env=env, sbatch_args=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])

    placement, killed_at, killed_after_step, deadline = {}, None, 0, time.monotonic() + 200
    while time.monotonic() < deadline and killed_at is None:
        steps, _ = read_metrics(run_dir)
        if steps and steps[-1]["step"] >= 2:
            placement, killed_after_step = ranks_by_node(), steps[-1]["step"]
            daemons = slurm_node_daemons("n2")
            # node 2: its prted and its ranks
            kill_processes(dict.fromkeys(p for d in daemons for p in process_tree(d)))
            killed_at = time.time()
        elif two_nodes.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.05)
    assert killed_at is not None, (two_nodes.job(job), log.read_text(errors="replace")[-4000:] if log.exists() else "")
    assert placement == {"n1": [0, 1], "n2": [2, 3]}, placement  # whole replicas per node

    reference: dict = {}
    thread = threading.Thread(target=lambda: reference.update(result=run_training(
        config, tmp_path / "reference", timeout_s=150, extra_args=["--synthetic-data"])), daemon=True)
    thread.start()  # while the job waits to be requeued
    info = two_nodes.wait(job, timeout_s=240)
    thread.join(timeout=160)
    output = log.read_text(errors="replace") if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "1", (info, output[-4000:])
    assert "lost communication with a remote daemon" in output or "failed to report back" in output, output[-4000:]
    assert "launcher exit 3 -> restart" in output and "requeueing job" in output, output[-4000:]

    lines = read_metrics_jsonl(run_dir)
    launches = [i for i, r in enumerate(lines) if r.get("event") == "startup"]
    assert len(launches) == 2, lines
    records = [r for r in lines if "event" not in r and "step" in r]
    before = [r for r in lines[:launches[1]] if "event" not in r and "step" in r]
    after = [r for r in lines[launches[1]:] if "event" not in r and "step" in r]  # logged by the requeued job
    assert before[-1]["step"] < STEPS, before  # the loss ended the first job before its last step
    resumed = after[0]["step"] - 1
    lost = before[-1]["step"] - resumed
    assert 0 <= lost <= 2 and after[-1]["step"] == STEPS, records  # at most a checkpoint interval
    want = {s["step"]: s["loss"] for s in reference["result"].steps}
    for r in records:
        assert abs(r["loss"] - want[r["step"]]) <= 1e-5, (r["step"], r["loss"], want[r["step"]])
    print(f"\nSlurm, 2 nodes: node 2 lost after step {killed_after_step}; requeued, resumed from step {resumed} "
          f"({lost} step(s) lost), training again {after[0]['time'] - killed_at:.1f} s after the loss")


def _holds_standby(daemon: int) -> bool:
    return any(b"NANOTRON_RECOVER_STANDBY" in _environ(pid) for pid in process_tree(daemon))


@needs_slurm
@pytest.mark.timeout(420)
def test_on_two_nodes_the_standby_is_a_second_job_step_and_a_lost_daemon_costs_a_warm_relaunch(
        two_nodes, failure_free_run, tmp_path):
    steps = LONG_STEPS  # the standby gets ready within ~150 of them here (a standby whose daemon step failed: replaced)
    config = _long_config()
    # first, and alone: a reference run beside the job (two trainings on the 2 CI cores) stalled a rank past the hang
    # timeout
    reference = {s["step"]: s["loss"] for s in failure_free_run(config, timeout_s=300).steps}
    config_path = write_config(config, tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(config_path, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="2",
                   MPIRUN_ARGS="--mca btl tcp,self --mca btl_tcp_if_include lo --mca mpi_yield_when_idle 1")
    job = two_nodes.submit(MULTI_NODE, env=env, sbatch_args=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])
    wait_for_batch_standby(two_nodes, job, run_dir, ranks=4, timeout_s=200)  # on both nodes
    on_n2 = slurm_node_daemons("n2")
    standby_daemons = [d for d in on_n2 if _holds_standby(d)]
    assert standby_daemons and len(standby_daemons) < len(on_n2), on_n2  # node 2: the job's daemon and the standby's
    kill_processes(dict.fromkeys(p for d in on_n2 if d not in standby_daemons for p in process_tree(d)))

    info = two_nodes.wait(job, timeout_s=240)
    output = log.read_text(errors="replace") if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "0" and "requeueing" not in output, (info, output[-4000:])
    assert "relaunching in place from the warm standby" in output, output[-4000:]
    assert [launch.get("warm") for launch in read_launches(run_dir)] == [False, True]
    records = [r for r in read_metrics_jsonl(run_dir) if "event" not in r and "step" in r]
    assert records[-1]["step"] == steps
    for r in records:  # replays included
        assert abs(r["loss"] - reference[r["step"]]) <= 1e-5, (r["step"], r["loss"], reference[r["step"]])


def _node_processes(node: str) -> list[int]:
    """Every process of a "node" of the test cluster: its slurmd, and each job step's slurmstepd with the
    processes it started there (``SLURMD_NODENAME=node`` in their environment)."""
    pids = {int(p) for p in os.listdir("/proc") if p.isdigit() and _environ(int(p)).get(b"SLURMD_NODENAME")
            == node.encode()}
    for pid in list(pids):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if _comm(parent) == "slurmstepd":
            pids.add(parent)
    return sorted({p for pid in pids for p in process_tree(pid)})


@needs_slurm
@pytest.mark.timeout(600)
def test_a_node_really_lost_costs_a_relaunch_on_the_other_and_the_job_regrows_once_it_is_back(
        two_nodes, failure_free_run, tmp_path):
    steps = LONG_STEPS  # long enough for the narrower launch to hear node 2 back, get a standby at full width, regrow
    config = _long_config(min_replicas=1)
    # the other test's reference: min_replicas acts on a loss only, the failure-free trajectory is the same
    reference = {s["step"]: s["loss"] for s in failure_free_run(_long_config(), timeout_s=300).steps}
    config_path = write_config(config, tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(config_path, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="2", IN_PLACE_RESTARTS="3",
                   # the dead node's probe bounds the narrower relaunch: 5 s instead of the default 10 s keeps node 2
                   # out of slurmctld's sight for less time before the test starts its slurmd again (same path)
                   NANOTRON_RECOVER_NODE_PROBE_S="5",
                   MPIRUN_ARGS="--mca btl tcp,self --mca btl_tcp_if_include lo --mca mpi_yield_when_idle 1")
    job = two_nodes.submit(MULTI_NODE, env=env, sbatch_args=["--nodes=2", "--ntasks-per-node=2", f"--output={log}"])
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and not (read_metrics(run_dir)[0] and read_metrics(run_dir)[0][-1]["step"] >= 3):
        time.sleep(0.05)
    slurmd = int((two_nodes.scratch / "run" / "slurmd-n2.pid").read_text())
    node = [slurmd, *_node_processes("n2")]
    assert slurm_node_daemons("n2"), node
    kill_processes(dict.fromkeys(node))  # node 2 is gone: its slurmd, its job steps, its daemons and ranks
    killed_at = time.time()

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not [r for r in read_launches(run_dir) if r.get("nodes_out")]:
        time.sleep(0.1)
    narrower = [r for r in read_launches(run_dir) if r.get("nodes_out")]
    assert narrower and narrower[0]["nodes_out"] == ["n2"] and narrower[0]["replicas"] == 1, read_launches(run_dir)
    subprocess.run(["slurmd", "-f", str(two_nodes.scratch / "slurm.conf"), "-N", "n2"], env=two_nodes.env,
                   check=True, timeout=60)  # node 2 is back, still in the allocation

    info = two_nodes.wait(job, timeout_s=360)
    output = log.read_text(errors="replace") if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "0" and "requeueing" not in output, (info, output[-4000:])
    assert "n2 did not run a job step" in output and "n2 answer again" in output, output[-4000:]
    # full width, node 2 out, full width again (and on this loaded 2-core machine maybe more relaunches at full
    # width: a rank stalled past the hang timeout is evicted in-step, and the job regrows again)
    shapes = [(r["replicas"], r["nodes_out"]) for r in read_launches(run_dir)]
    assert shapes[:3] == [(2, []), (1, ["n2"]), (2, [])] and all(s == (2, []) for s in shapes[3:]), shapes
    assert read_launches(run_dir)[2]["warm"], output[-4000:]  # the regrow: from a standby started at full width
    lines = read_metrics_jsonl(run_dir)
    back = [r for r in lines if r.get("event") == "regrow" and r.get("nodes_back") and r["decision"] == "regrow"]
    stops = [r for r in lines if r.get("event") == "regrow_stop"]
    # node 2 back: the narrower job's regrow (the survivors of the loss may have stopped to regrow first), decided by
    # the launcher on a step's record; the job stopped after a later step (the graceful stop's signal)
    stopped_after = {r.get("decided_at_step"): r["step"] for r in stops}
    assert back and back[0]["step"] in stopped_after, output[-4000:]
    regrow_step = stopped_after[back[0]["step"]]
    records = [r for r in lines if "event" not in r and "step" in r]
    logged = [r["step"] for r in records]
    assert sorted(set(logged)) == list(range(1, steps + 1)) and len(logged) - steps <= 2, logged  # replays: the loss
    for stop in stops:  # no step computed twice at a regrow
        assert logged.count(stop["step"]) == 1 and logged.count(stop["step"] + 1) == 1, (stop, logged)
    assert all(r["microbatches"] == 4 for r in records)  # M every step, narrower or not
    widths = {r["step"]: r["live_replicas"] for r in records}
    assert widths[regrow_step] == 1 and widths[steps] == 2
    for r in records:
        assert abs(r["loss"] - reference[r["step"]]) <= 1e-5, (r["step"], r["loss"], reference[r["step"]])
    narrow_first = next(r["time"] for r in records if r["time"] > read_launches(run_dir)[1]["time"])
    stop_at = next(r["time"] for r in records if r["step"] == regrow_step)
    wide_first = next(r["time"] for r in records if r["time"] > stop_at)
    print(f"\nSlurm, 2 nodes: node 2 lost (slurmd too): training on node 1 alone {narrow_first - killed_at:.1f} s "
          f"later (probe timeout {env['NANOTRON_RECOVER_NODE_PROBE_S']} s); node 2 back: regrow after step "
          f"{regrow_step}, training on both nodes {wide_first - stop_at:.1f} s after that step")
