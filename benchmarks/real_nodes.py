"""Multi-node scenarios on the isolated-node bed (each node its own pid, mount, UTS, IPC and network namespace, a
private /tmp and /dev/shm, one shared folder; ``nanotron_recover.testbed.isolated_nodes``), at the default settings
but for a short hang timeout. Needs root.

    .venv/bin/python benchmarks/real_nodes.py [--steps 1000] [--only SCENARIO ...]

The record goes to ``benchmarks/results/records/real_nodes_<UTC time>.json`` (``benchmarks/lib/record.py``).

Two nodes x 2 slots, 2 replicas x TP2 (M = 4), the launcher on the host reaching the nodes over the bed's ssh
stand-in (a hostfile launch: the launcher asks the nodes over ssh before a relaunch). Scenarios, each on a fresh run
folder against one failure-free run of the same config:

* ``warm_relaunch``: once the warm standby is ready, the job's daemon on n2 and its ranks are SIGKILLed (the
  standby's daemon there lives on): Open MPI ends the job, the launcher relaunches in place from the standby.
* ``node_lost_regrow``: once the standby is ready, node n2 is lost whole (every process, its memory); it is started
  again, empty, 15 s later. The launcher relaunches on n1 alone (the same global batch), hears n2 answer again and
  regrows to full width at a step boundary.
* ``partition``: n2's link is down for 2 x the hang timeout, then up again.
* ``partition_frozen``: n2's link goes down and its processes freeze; once the job runs on n1 alone, n2 is back
  (link up, processes thawed): its ranks of the first launch must be fenced before they write.
* ``slurm_warm_relaunch`` and ``slurm_node_lost_regrow``: the first two as a Slurm job
  (``scripts/slurm/recover_multi_node.sbatch``) on the same nodes, each running its own ``slurmd``
  (``nanotron_recover.testbed.isolated_slurm``): the launcher runs in the batch script on n1, its standby is a second
  job step, the lost node's ``slurmd`` goes with it and is started again with the node.

Per scenario: the launcher's exit code, each launch (warm, replicas, nodes left out), the seconds from the previous
job's end to the next launch's first committed step, the seconds from the fault to the first committed step of a
launch begun after it, max |dloss| against the failure-free run over every step, the microbatches per step, and
``fenced_writes``: what a rank wrote after its launch was replaced
(``nanotron_recover.run.fence_audit.writes_after_replacement``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest (the tiny config)

from benchmarks.lib.record import write_record  # noqa: E402
from nanotron_recover.launcher.runs import environ_of, run_training, write_config  # noqa: E402
from nanotron_recover.run.fence_audit import writes_after_replacement  # noqa: E402
from nanotron_recover.run.procfs import proc_stat  # noqa: E402
from nanotron_recover.run.run_folder import (  # noqa: E402
    read_launches,
    read_metrics,
    read_metrics_jsonl,
    record_external_fault,
)
from nanotron_recover.testbed import isolated_nodes as iso  # noqa: E402
from nanotron_recover.testbed import isolated_slurm  # noqa: E402
from tests.conftest import make_tiny_config  # noqa: E402
from tests.slurm.test_sbatch import TERMINAL, Cluster  # noqa: E402

MULTI_NODE = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "recover_multi_node.sbatch"

HANG_S = 8.0
NODE_BACK_S = 15.0
SCENARIO_TIMEOUT_S = 400.0
TOKEN_ENV = b"NANOTRON_RECOVER_LAUNCH_TOKEN="


def _config(steps: int) -> dict:
    return make_tiny_config(dp=2, tp=2, accumulation=2, steps=steps, layers=2, checkpoint_interval=1000,
                            fault_tolerance={"enabled": True, "min_replicas": 1, "hang_timeout_s": HANG_S,
                                             "collective_timeout_s": HANG_S + 20, "local_snapshot_interval": 1})


def _job_on(bed: iso.Bed, node: str, token: str) -> list[int]:
    """The ranks of launch ``token`` in ``node`` and their daemon (host pids)."""
    environs = {p: environ_of(p) or [] for p in iso.node_pids(bed.nodes[node])}
    ranks = [p for p, env in environs.items() if TOKEN_ENV + token.encode() in env
             and any(e.startswith(b"OMPI_COMM_WORLD_RANK=") for e in env)]
    return sorted(set(ranks) | {(proc_stat(p) or (0,))[0] for p in ranks} - {0})


class Scenario:
    """One launcher run on the bed, a fault acted out by ``act(scenario)`` from a polling loop."""

    def __init__(self, bed: iso.Bed, run_dir: Path, config: dict) -> None:
        self.bed, self.run_dir = bed, run_dir
        config_path = write_config(config, run_dir / "config.yaml")
        env = {**os.environ, **iso.launch_env(Path(bed.folder)), "NANOTRON_RECOVER_MAX_RESTARTS": "3",
               "NANOTRON_RECOVER_NODE_PROBE_S": "5"}
        cmd = [sys.executable, "-m", "nanotron_recover.launcher.launch", "train", "--config-file", str(config_path),
               "--run-dir", str(run_dir), "--synthetic-data"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=env, cwd=bed.shared)
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.fault_at: float | None = None  # wall clock
        self.notes: dict = {}

    def steps(self) -> list[dict]:
        return read_metrics(self.run_dir)[0]

    def node_back(self, node: str) -> None:
        """A lost node started again, empty (a machine back from repair)."""
        iso.start_node(self.bed, node)

    def standby_ready(self) -> bool:
        return any(r.get("event") == "standby_ready" for r in read_metrics_jsonl(self.run_dir))

    def run(self, act: Callable[["Scenario"], bool]) -> int:
        """Poll ``act`` until it says it is done, then wait for the launcher; -> its exit code."""
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        acting = True
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                if acting:
                    acting = not act(self)
                time.sleep(0.05)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self._reader.join(timeout=10)
        return self.proc.returncode


class SlurmScenario(Scenario):
    """The same, as a job of ``recover_multi_node.sbatch`` on the bed's Slurm (the launcher in the batch script on
    n1); the run ends when the job does, its exit code Slurm's."""

    def __init__(self, bed: iso.Bed, run_dir: Path, config: dict) -> None:
        self.bed, self.run_dir = bed, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = write_config(config, run_dir / "config.yaml")
        self.cluster = Cluster(isolated_slurm.scratch(bed))
        self.log = run_dir / "job.out"
        env = {"CONFIG": str(config_path), "RUN_DIR": str(run_dir), "TRAIN_ARGS": "--synthetic-data",
               "RECOVER_REPO": str(Path(__file__).resolve().parents[1]), "RECOVER_PYTHON": sys.executable,
               "RECOVER_RESTART": "requeue", "MAX_RESTARTS": "2", "IN_PLACE_RESTARTS": "3",
               "NANOTRON_RECOVER_NODE_PROBE_S": "5", "MPIRUN_ARGS": isolated_slurm.mpirun_args(bed)}
        self.job = self.cluster.submit(MULTI_NODE, env=env, sbatch_args=["--nodes=2", "--ntasks-per-node=2",
                                                                         f"--output={self.log}"])
        self.output = []
        self.fault_at = None
        self.notes = {}

    def node_back(self, node: str) -> None:
        super().node_back(node)
        isolated_slurm.start_slurmd(self.bed, node)

    def run(self, act: Callable[["Scenario"], bool]) -> int:
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        acting, info = True, self.cluster.job(self.job)
        while info.get("JobState") not in TERMINAL and time.monotonic() < deadline:
            if acting:
                acting = not act(self)
            time.sleep(0.05)
            info = self.cluster.job(self.job)
        if info.get("JobState") not in TERMINAL:
            subprocess.run(["scancel", str(self.job)], env=self.cluster.env, timeout=30)
        self.output = self.log.read_text(errors="replace").splitlines(keepends=True) if self.log.exists() else []
        self.notes.update(job_state=info.get("JobState"), restarts=info.get("Restarts"))
        return int(info.get("ExitCode", "1:0").split(":")[0])


def _once_ready(min_steps: int = 10) -> Callable[[Scenario], bool]:
    return lambda s: len(s.steps()) >= min_steps and s.standby_ready()


def warm_relaunch(s: Scenario) -> bool:
    if not _once_ready()(s):
        return False
    token = read_launches(s.run_dir)[-1]["token"]
    pids = _job_on(s.bed, "n2", token)
    record_external_fault(s.run_dir, "kill-job-daemon-n2")
    s.fault_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    s.notes["killed"] = len(pids)
    return True


def _fault_once(s: Scenario, ready: bool, name: str, act: Callable[[], None]) -> bool:
    """Act out the fault ``name`` the first time ``ready`` holds (recorded first, its time kept); -> whether it has
    happened by now."""
    if s.fault_at is None and ready:
        record_external_fault(s.run_dir, name)
        s.fault_at = time.time()
        act()
    return s.fault_at is not None


def node_lost_regrow(s: Scenario) -> bool:
    if not _fault_once(s, _once_ready()(s), "lose-node-n2",
                       lambda: iso.kill_node(s.bed, "n2")) or time.time() - s.fault_at < NODE_BACK_S:
        return False
    s.node_back("n2")
    s.notes["node_back_after_s"] = round(time.time() - s.fault_at, 2)
    return True


def partition(s: Scenario) -> bool:
    if not _fault_once(s, len(s.steps()) >= 10, "partition-n2", lambda: iso.partition(s.bed, "n2")) \
            or time.time() - s.fault_at < 2 * HANG_S:
        return False
    iso.partition(s.bed, "n2", connected=True)
    s.notes["partitioned_s"] = round(time.time() - s.fault_at, 2)
    return True


def _cut_and_freeze(s: Scenario) -> None:
    iso.partition(s.bed, "n2")
    s.notes["frozen"] = [p for p in iso.node_pids(s.bed.nodes["n2"]) if p != s.bed.nodes["n2"].init]
    for pid in s.notes["frozen"]:
        os.kill(pid, signal.SIGSTOP)
    s.notes["cut_after_step"] = s.steps()[-1]["step"]


def partition_frozen(s: Scenario) -> bool:
    if not _fault_once(s, len(s.steps()) >= 10, "partition-and-freeze-n2", lambda: _cut_and_freeze(s)) \
            or len(read_launches(s.run_dir)) < 2 or len(s.steps()) < s.notes["cut_after_step"] + 15:
        return False
    iso.partition(s.bed, "n2", connected=True)
    for pid in s.notes.pop("frozen"):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    s.notes["back_after_s"] = round(time.time() - s.fault_at, 2)
    return True


SCENARIOS = {"warm_relaunch": warm_relaunch, "node_lost_regrow": node_lost_regrow, "partition": partition,
             "partition_frozen": partition_frozen, "slurm_warm_relaunch": warm_relaunch,
             "slurm_node_lost_regrow": node_lost_regrow}


def measure(s: Scenario, code: int, reference: dict[int, float], started: float) -> dict:
    launches = read_launches(s.run_dir)
    records = [r for r in read_metrics_jsonl(s.run_dir) if "step" in r and "loss" in r and "event" not in r]
    steps = read_metrics(s.run_dir)[0]
    relaunches = []
    for launch in launches[1:]:
        first = min((r["time"] for r in records if r.get("launch") == launch["token"]), default=None)
        ended = launch.get("previous_job_ended")
        relaunches.append({"warm": launch.get("warm"), "replicas": launch.get("replicas"),
                           "nodes_out": launch.get("nodes_out"), "regrow": bool(launch.get("regrow")),
                           "previous_end_to_first_step_s": round(first - ended, 3) if first and ended else None})
    # the survivors may still commit steps of the old launch after the fault (in-step) before its teardown: the
    # figure is the first step of a launch begun after the fault
    later = {r["token"] for r in launches if s.fault_at and r["time"] > s.fault_at}
    after = [r["time"] for r in records if r.get("launch") in later]
    return {
        "exit_code": code,
        "wall_s": round(time.time() - started, 1),
        "launches": len(launches),
        "warm": [r["warm"] for r in relaunches],
        "relaunches": relaunches,
        "fault_to_next_launch_step_s": round(min(after) - s.fault_at, 3) if after else None,
        "steps": len(steps),
        "last_step": steps[-1]["step"] if steps else None,
        "microbatches_per_step": sorted({r["microbatches"] for r in steps}),
        "live_replicas": sorted({r["live_replicas"] for r in steps}),
        "max_abs_dloss": max((abs(r["loss"] - reference[r["step"]]) for r in records), default=None),
        "fenced_writes": writes_after_replacement(s.run_dir),
        "notes": {k: v for k, v in s.notes.items() if k != "frozen"},
        "launcher_lines": [line.rstrip() for line in s.output if line.startswith("[nanotron-recover]")
                           and "hang_detected" not in line][:40],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run these scenarios only")
    args = parser.parse_args(argv)
    reason = iso.unavailable_reason()
    if reason:
        print(f"real_nodes: the isolated-node bed is not available here: {reason}", file=sys.stderr)
        return 2
    os.environ.setdefault("NANOTRON_RECOVER_MAX_RESTARTS", "3")
    scratch = Path(tempfile.mkdtemp(prefix="real-nodes-", dir="/var/tmp"))
    config = _config(args.steps)
    record: dict = {"what": "benchmarks/real_nodes.py: multi-node scenarios on the isolated-node bed",
                    "command": " ".join([".venv/bin/python", "benchmarks/real_nodes.py", *sys.argv[1:]]),
                    "machine": f"{platform.node()} {os.cpu_count()} cores",
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                             cwd=Path(__file__).resolve().parents[1]).stdout.strip(),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "nodes": "2 x 2 slots", "model": "tiny Llama, 2 layers, 2 replicas x TP2, M = 4",
                    "steps": args.steps, "hang_timeout_s": HANG_S, "scenarios": {}}
    try:
        reference = run_training(config, scratch / "reference", timeout_s=SCENARIO_TIMEOUT_S,
                                 extra_args=["--synthetic-data"])
        want = {s["step"]: s["loss"] for s in reference.steps}
        record["failure_free_wall_s"] = round(reference.wall_s, 1)
        scratch.chmod(0o755)  # the munge user of the Slurm scenarios walks into the cluster's folder
        for name in args.only or list(SCENARIOS):
            slurm = name.startswith("slurm_")
            bed = isolated_slurm.up(scratch / "bed", 2, 2) if slurm else iso.up(scratch / "bed", [2, 2])
            try:
                started = time.time()
                scenario = (SlurmScenario if slurm else Scenario)(bed, Path(bed.shared) / name, config)
                code = scenario.run(SCENARIOS[name])
                record["scenarios"][name] = measure(scenario, code, want, started)
            finally:
                isolated_slurm.down(scratch / "bed")
            summary = {k: record["scenarios"][name][k] for k in ("exit_code", "warm", "fault_to_next_launch_step_s",
                                                                 "max_abs_dloss", "microbatches_per_step")}
            print(f"{name}: {json.dumps(summary)}; fenced writes {len(record['scenarios'][name]['fenced_writes'])}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_record("real_nodes", argv=argv, command=record["command"], args=args, samples=record,
                 figures=figures_of(record))
    return 0


def figures_of(record: dict) -> dict:
    """Per scenario: exit code, whether each relaunch was warm, the seconds from the fault (and from the previous
    job's end) to the next launch's first step, max |dloss|, the microbatches per step, the fenced writes."""
    figures: dict = {}
    for name, s in record["scenarios"].items():
        first = s["relaunches"][0] if s["relaunches"] else {}
        figures.update({f"{name}_exit_code": s["exit_code"], f"{name}_warm": ",".join(map(str, s["warm"])),
                        f"{name}_fault_to_next_launch_step_s": s.get("fault_to_next_launch_step_s"),
                        f"{name}_previous_end_to_first_step_s": first.get("previous_end_to_first_step_s"),
                        f"{name}_max_abs_dloss": s["max_abs_dloss"],
                        f"{name}_microbatches": ",".join(map(str, s["microbatches_per_step"])),
                        f"{name}_fenced_writes": len(s["fenced_writes"])})
    return figures


if __name__ == "__main__":
    sys.exit(main())
