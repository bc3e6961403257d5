"""The Slurm launch on a real (throwaway, one-node) Slurm, and the fallback when too few replicas survive.

1. ``recover_single_node.sbatch`` under ``sbatch`` trains through one injected SIGKILL: job COMPLETED, every step
   logged, the repair event in metrics.jsonl.
2. Below ``min_replicas``: survivors checkpoint + exit 3, the script runs ``scontrol requeue``, Slurm starts the
   job again, it resumes from latest.txt (replaying the failed step) and its losses equal a failure-free run's.
   With relaunches in place allowed (the default), the launcher relaunches the job inside the allocation from
   its warm standby (a second mpirun in the allocation) instead: no requeue, the same losses.
3. (plain launcher, no Slurm: Slurm adds nothing to it) The whole job SIGKILLed in the middle of a checkpoint
   save: latest.txt still names the previous checkpoint, the relaunch loads it and finishes.

Hard timeouts: every wait has its own deadline (job polling, ``run_training``, the kill loop); a job that
overruns is scancelled. The cluster comes up once for the module (scripts/slurm/cluster.sh, everything under a scratch
folder) and is torn down at the end, also on failure. Needs root and Debian's slurmctld/slurmd/slurm-client/munge
(scripts/ci_install_slurm.sh); skipped without them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from nanotron_recover.launcher.runs import rank_pids, run_training, write_config
from nanotron_recover.run.run_folder import read_launches, read_metrics, read_metrics_jsonl, resumed_from
from tests.conftest import make_tiny_config
from tests.launcher.test_relaunch import relaunch_trained, standby_ready

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm" / "cluster.sh"
SINGLE_NODE = REPO / "scripts" / "slurm" / "recover_single_node.sbatch"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}

pytestmark = pytest.mark.slow  # every wait has its own deadline (above); the default test timeout covers their sum
needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")),
    reason="needs root and Debian's slurmctld slurmd slurm-client munge (scripts/ci_install_slurm.sh)",
)


# ------------------------------------------------------------------------------------------------ the cluster
class Cluster:
    """A running throwaway cluster: submit a script, wait for the job by polling ``scontrol`` (sacct is off)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.env = {**os.environ, "SLURM_CONF": str(scratch / "slurm.conf")}

    def submit(self, script: Path, *, env: dict[str, str], sbatch_args: list[str]) -> int:
        out = subprocess.run(
            ["sbatch", "--parsable", *sbatch_args, str(script)],
            env={**self.env, **env}, cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
        )
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=self.env, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", str(job_id)], env=self.env, timeout=30)
        raise TimeoutError(f"job {job_id} not finished after {timeout_s} s: {self.job(job_id)}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # /tmp, not pytest's tmp_path: the munge user must be able to walk into the scratch folder
    scratch = Path(tempfile.mkdtemp(prefix="recover-slurm-", dir="/tmp"))
    try:
        subprocess.run(["bash", str(CLUSTER), "up", str(scratch)], check=True, timeout=60)
        yield Cluster(scratch)
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(scratch)], timeout=60)
        shutil.rmtree(scratch, ignore_errors=True)


def _job_env(config: Path, run_dir: Path, **extra: str) -> dict[str, str]:
    return {"CONFIG": str(config), "RUN_DIR": str(run_dir), "TRAIN_ARGS": "--synthetic-data",
            "RECOVER_REPO": str(REPO), "RECOVER_PYTHON": sys.executable, **extra}


def _ft_config(**ft: object) -> dict:
    """2 replicas x TP1 (2 ranks), 8 steps, M = 4 microbatches."""
    return make_tiny_config(dp=2, steps=8, accumulation=2, layers=2, checkpoint_interval=2,
                            fault_tolerance={"enabled": True, **ft})


# ------------------------------------------------------------------------------------------------ 1. sbatch
@needs_slurm
def test_sbatch_single_node_survives_a_replica_loss(cluster: Cluster, tmp_path: Path) -> None:
    config = write_config(_ft_config(min_replicas=1,
                                     inject=[{"step": 4, "replica": 1, "rank": 0, "phase": "backward"}]),
                          tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(SINGLE_NODE, env=_job_env(config, run_dir, RECOVER_RESTART="none"),
                         sbatch_args=["--ntasks=2", f"--output={log}"])
    info = cluster.wait(job, timeout_s=180)
    output = log.read_text() if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert "ReCoVer (ULFM)" in output and "--max-restarts 0" in output, output[-4000:]
    steps, events = read_metrics(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 9)), output[-4000:]
    repairs = [e for e in events if e.get("event") == "repair"]
    assert len(repairs) == 1 and repairs[0]["step"] == 4 and repairs[0]["failed_replicas"] == [1], events
    assert [s["live_replicas"] for s in steps] == [2, 2, 2, 1, 1, 1, 1, 1]
    assert all(s["microbatches"] == 4 for s in steps)  # the global batch is kept after the loss


# ------------------------------------------------------------------------------------- 2. requeue + resume
@needs_slurm
def test_below_min_replicas_requeues_and_resumes_on_the_same_trajectory(cluster: Cluster, tmp_path: Path) -> None:
    # min_replicas = 2 and one replica dies in step 5: the survivor checkpoints step 4 and exits 3; the script
    # requeues the job through Slurm; the new instance resumes from step 4 and replays step 5.
    config = write_config(_ft_config(min_replicas=2,
                                     inject=[{"step": 5, "replica": 1, "rank": 0, "phase": "backward"}]),
                          tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(SINGLE_NODE, env=_job_env(config, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="2",
                                                   IN_PLACE_RESTARTS="0"),
                         sbatch_args=["--ntasks=2", f"--output={log}"])
    reference = run_training(_ft_config(min_replicas=2), tmp_path / "reference", timeout_s=150,
                             extra_args=["--synthetic-data"])  # runs while the job waits in the queue
    info = cluster.wait(job, timeout_s=200)
    output = log.read_text() if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "1", (info, output[-4000:])
    assert "launcher exit 3 -> restart" in output and "requeueing job" in output, output[-4000:]
    records = read_metrics_jsonl(run_dir)
    stop = next(i for i, r in enumerate(records) if r.get("event") == "stopped")
    assert resumed_from([r for r in records[stop + 1:] if "event" not in r]) == 4, output[-4000:]  # the requeued job
    steps, events = read_metrics(run_dir)
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["step"] == 4, events
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert len(reference.losses) == 8
    for step, (got, want) in enumerate(zip([s["loss"] for s in steps], reference.losses), start=1):
        assert abs(got - want) <= 1e-5, f"step {step}: {got} vs failure-free {want}"


@needs_slurm
def test_inside_the_allocation_the_launcher_relaunches_in_place_from_its_warm_standby(cluster: Cluster,
                                                                                     tmp_path: Path) -> None:
    """A kill once the standby is ready: the launcher relaunches in place from it; once the relaunch has trained,
    the time-limit warning ends the job at a step (no requeue left: exit 3). The steps before that stop are the
    failure-free ones (a reference of that many steps, the same schedule)."""
    steps = 20000  # never reached: the standby gets ready at any load (5 s at idle priority where no core is idle,
    # then its imports beside the training), then a kill from outside; the test stops the job after the relaunch
    raw = make_tiny_config(dp=2, steps=steps, accumulation=2, layers=2,
                           fault_tolerance={"enabled": True, "min_replicas": 2, "local_snapshot_dir": str(tmp_path)})
    config = write_config(raw, tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(SINGLE_NODE, env=_job_env(config, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="0"),
                         sbatch_args=["--ntasks=2", f"--output={log}"])
    wait_for_batch_standby(cluster, job, run_dir, ranks=2, timeout_s=150, log=log)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)  # below min_replicas: the launcher relaunches in place
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not relaunch_trained(run_dir, steps=20):
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", "-b", str(job)], env=cluster.env, timeout=30, check=True)
    info = cluster.wait(job, timeout_s=120)
    output = log.read_text() if log.exists() else ""
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", (info, output[-4000:])  # stopped, no requeue
    assert info["Restarts"] == "0" and "requeueing" not in output, (info, output[-4000:])
    assert "relaunching in place from the warm standby" in output, output[-4000:]
    assert [launch.get("warm") for launch in read_launches(run_dir)] == [False, True]
    assert relaunch_trained(run_dir, steps=20), output[-4000:]
    logged = [r["step"] for r in read_metrics_jsonl(run_dir) if "event" not in r]
    assert logged == list(range(1, logged[-1] + 1)), "a step logged twice, or one missing"
    # the failure-free run of those steps: the same config and LR schedule, train_steps cut to where the job stopped
    raw["tokens"]["train_steps"] = logged[-1]
    reference = run_training(raw, tmp_path / "reference", timeout_s=300, extra_args=["--synthetic-data"])
    for got, want in zip([s["loss"] for s in read_metrics(run_dir)[0]], reference.losses, strict=True):
        assert abs(got - want) <= 1e-5


def wait_for_batch_standby(cluster: Cluster, job: int, run_dir: Path, ranks: int, timeout_s: float,
                           log: Path) -> None:
    """Until the standby of the batch script's launcher is ready: every one of its ``ranks`` ranks imported."""
    deadline, checked = time.monotonic() + timeout_s, 0.0
    while time.monotonic() < deadline:
        if standby_ready(_launchers(run_dir), ranks):
            return
        if time.monotonic() - checked > 2.0:  # a job that ended has no standby to wait for
            checked = time.monotonic()
            if cluster.job(job).get("JobState") in TERMINAL:
                break
        time.sleep(0.05)
    said = [line for line in (log.read_text() if log.exists() else "").splitlines() if "[step" not in line]
    raise AssertionError(f"no warm standby got ready: {cluster.job(job)}\n" + "\n".join(said[-40:]))


def _launchers(run_dir: Path) -> list[int]:
    """The pids of the launchers running ``run_dir`` (started by the batch script)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if b"nanotron_recover.launcher.launch" in cmdline and str(run_dir).encode() in cmdline:
            found.append(int(entry))
    return found


# -------------------------------------------------------------------- 2b. the time-limit warning (SIGUSR1)
@needs_slurm
def test_the_time_limit_warning_stops_the_job_at_a_step_and_the_requeued_job_computes_no_step_twice(
        cluster: Cluster, tmp_path: Path) -> None:
    """What ``#SBATCH --signal=B:USR1@60`` does a minute before the time limit: SIGUSR1 to the batch script, which
    passes it on to mpirun and the ranks; the job stops after a step with its snapshot, exit 3, and is requeued."""
    steps = 1500  # ~7 ms each: ~10 s of training, time enough to signal in the middle (with 400, a loaded machine
    # delivered the signal after the last step)
    raw = make_tiny_config(dp=2, steps=steps, accumulation=2, layers=2,
                           fault_tolerance={"enabled": True, "local_snapshot_dir": str(tmp_path / "shm")})
    reference = run_training(raw, tmp_path / "reference", timeout_s=150, extra_args=["--synthetic-data"])  # alone
    config = write_config(raw, tmp_path / "config.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = cluster.submit(SINGLE_NODE, env=_job_env(config, run_dir, RECOVER_RESTART="requeue", MAX_RESTARTS="2"),
                         sbatch_args=["--ntasks=2", f"--output={log}"])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not [s for s in read_metrics(run_dir)[0] if s["step"] >= 20]:
        time.sleep(0.02)
    subprocess.run(["scancel", "--signal=USR1", "-b", str(job)], env=cluster.env, timeout=30, check=True)
    info = cluster.wait(job, timeout_s=240)
    output = log.read_text() if log.exists() else ""
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "1" and "SIGUSR1: the job stops" in output, (info, output[-4000:])
    records = read_metrics_jsonl(run_dir)
    stops = [r["step"] for r in records if r.get("event") == "stop_signal"]
    assert len(stops) == 1 and 20 <= stops[0] < steps, (stops, output[-4000:])
    assert [r["step"] for r in records if "event" not in r] == list(range(1, steps + 1)), "a step computed twice"
    assert [s["loss"] for s in read_metrics(run_dir)[0]] == reference.losses


# ------------------------------------------------------------------------ 3. killed in the middle of a save
def test_kill_during_checkpoint_save_resumes_from_the_previous_one(tmp_path: Path) -> None:
    config = _ft_config(min_replicas=1)
    config["fault_tolerance"]["local_snapshot_interval"] = 0  # what is tested: the disk checkpoint's atomicity
    model = config["model"]["model_config"]
    # big enough that a save (weights + Adam state, fsynced) takes long enough to be caught in the middle
    model.update(hidden_size=384, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    run_dir = tmp_path / "run"
    config_path = write_config(config, run_dir / "config.yaml")
    ckpts = run_dir / "checkpoints"
    cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
           "--run-dir", str(run_dir), "--synthetic-data"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    caught = False
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if any(ckpts.glob(".tmp-step-4-*")):  # the step-4 save began (its name: launch token, epoch)
                os.killpg(first.pid, signal.SIGKILL)  # mpirun and every rank: the job is gone mid-save
                caught = True
                break
            time.sleep(0.001)
    finally:
        if first.poll() is None and not caught:
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
    _kill_leftover_ranks(run_dir)
    assert caught, "the run never started the step-4 save"
    assert not (ckpts / "4").exists(), "the save finished before the kill: the test did not hit a partial save"
    assert (ckpts / "latest.txt").read_text().strip() == "2"
    assert (ckpts / "2" / "trainer_state.json").is_file()
    killed_steps, _ = read_metrics(run_dir)
    assert [s["step"] for s in killed_steps][:4] == [1, 2, 3, 4]

    relaunched_at = time.time()
    second = run_training(config_path, run_dir, timeout_s=150, extra_args=["--synthetic-data"])
    assert resumed_from([s for s in second.steps if s["time"] >= relaunched_at]) == 2, second.output[-4000:]
    assert [s["step"] for s in second.steps] == list(range(1, 9))
    # steps 3 and 4 ran twice (before the kill, and replayed after the resume): same losses
    for before, after in zip(killed_steps[2:4], second.steps[2:4]):
        assert abs(before["loss"] - after["loss"]) <= 1e-5, (before, after)
    assert (ckpts / "latest.txt").read_text().strip() == "8"
    assert not list(ckpts.glob(".tmp-step-*")), "a half-written save was left behind"


def _kill_leftover_ranks(run_dir: Path) -> None:
    """SIGKILL ranks of this run that outlived their mpirun (they are ours: their command line names run_dir)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "nanotron_recover.train" in cmdline and str(run_dir) in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
