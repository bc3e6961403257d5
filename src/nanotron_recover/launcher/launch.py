"""The user command: ``nanotron-recover train --config-file X`` -> ``mpirun [--with-ft ulfm] ... train``.

Everything that can be wrong with the input is reported here, before any rank starts. Module-level imports stay
light (no torch, nanotron or mpi4py): each rank reads its options from here before its start-up guard is armed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from nanotron_recover.launcher.mpirun import (
    hostfile_slots,
    mpirun_command,
    python_module_command,
    replica_placement,
    slurm_tasks_per_node,
)
from nanotron_recover.launcher.overrides import add_override_args, forwarded_args, load_effective_config
from nanotron_recover.run.disk_space import NEARLY_FULL_BYTES, free_bytes
from nanotron_recover.run.exit_codes import EXIT_BAD_INPUT, EXIT_DONE, EXIT_NEEDS_PERSON, EXIT_RESTART
from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.run.outcome import DEFAULT_MAX_STARTUP_FAILURES, NEEDS_PERSON, OUTCOME_EXIT_CODES, judge_launch
from nanotron_recover.run.run_folder import (
    RunFolderBusy,
    begin_launch,
    checkpoints_root,
    exit_reasons,
    hold_run_folder,
    ranks_wrote_since,
    read_exits,
    remove_partial_saves,
)

if TYPE_CHECKING:
    from nanotron_recover.config import RecoverConfig
    from nanotron_recover.launcher.node_fit import NodeFit
    from nanotron_recover.launcher.relauncher import Relauncher
    from nanotron_recover.process.stop_request import LauncherStop


HOSTFILE_ENV = "NANOTRON_RECOVER_HOSTFILE"  # an Open MPI hostfile for the launch
LOCK_WAIT_ENV = "NANOTRON_RECOVER_LOCK_WAIT_S"  # how long a launch waits for the run folder's lock (default 30 s)
MAX_STARTUP_FAILURES_ENV = "NANOTRON_RECOVER_MAX_STARTUP_FAILURES"  # the same failure on N launches: exit 2
MPIRUN_ARGS_ENV = "NANOTRON_RECOVER_MPIRUN_ARGS"  # extra mpirun options, shell-quoted (as MPIRUN_ARGS in sbatch)
# PRRTE's own start-up failures, before any rank runs (each seen once in a full suite run on a loaded 2-core machine,
# exit status 213): the launch is repeated, up to LAUNCH_RETRIES times
PRRTE_STARTUP_FAILURES = (
    "The PMIx server's listener thread failed to start",
    "A daemon failed to report back after being spawned",
)
LAUNCH_RETRIES = 2
LAUNCH_RETRY_PAUSE_S = 2.0


def resolve_run_name(template: str | None) -> str:
    """nanotron's ``general.run`` with ``%date`` and ``%jobid`` filled in (once, here, for every rank)."""
    name = template or "%date_%jobid"
    name = name.replace("%date", datetime.datetime.now().strftime("%Y%m%d_%H%M%S"))
    return name.replace("%jobid", os.environ.get("SLURM_JOB_ID", "local"))


def default_run_dir(config: "RecoverConfig") -> Path:
    return Path("runs") / resolve_run_name(config.general.run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def train_command(args: argparse.Namespace) -> tuple[list[str], "RecoverConfig", Path]:
    config = load_effective_config(args)
    # resolved once, here: the ranks, the launcher's /proc watches and the run folder's readers name one path
    run_dir = (Path(args.run_dir) if args.run_dir else default_run_dir(config)).resolve()
    program = python_module_command("nanotron_recover.train", forwarded_args(args, run_dir))
    env = {"PYTHONUNBUFFERED": "1", **LaunchContract(token=secrets.token_hex(4)).as_env()}  # what each rank is told
    if not config.ft_enabled:
        # stock layout: one torch world, rendezvous as torchrun would do it
        env.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(_free_port()))
    hostfile = os.environ.get(HOSTFILE_ENV)
    from nanotron_recover.launcher.preflight import check_local_snapshot_budget

    check_local_snapshot_budget(config, ranks_per_node(config.world_size), run_dir)
    extra = shlex.split(os.environ.get(MPIRUN_ARGS_ENV, ""))
    cmd = mpirun_command(config.world_size, program, ulfm=config.ft_enabled, env=env, hostfile=hostfile,
                         extra_args=extra)
    hosts = None if hostfile else _whole_replica_hosts(config)
    return ([cmd[0], "--host", hosts, *cmd[1:]] if hosts else cmd), config, run_dir


def _whole_replica_hosts(config: "RecoverConfig") -> str | None:
    """In a Slurm allocation of several nodes whose slots are not whole replicas: ``--host`` with each node's slots
    rounded down to whole replicas, where those still hold the job (a replica never spans two nodes)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return None
    from nanotron_recover.launcher.slurm_nodes import Allocation, whole_replica_hosts

    allocation = Allocation.from_environment()
    return None if allocation is None else whole_replica_hosts(allocation.nodes, config.ranks_per_replica,
                                                               config.world_size)


def ranks_per_node(world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """The most ranks of a ``world_size`` job that one node holds: by the slots of ``NANOTRON_RECOVER_HOSTFILE``, or
    of the Slurm allocation (``SLURM_TASKS_PER_NODE``), else all of them (one node). What a node must hold (its
    snapshots, a standby beside the job) is checked for these, not for the whole job."""
    hostfile = environ.get(HOSTFILE_ENV)
    if hostfile and Path(hostfile).is_file():
        found = hostfile_slots(hostfile)
        slots = found[1] if found else []
    elif environ.get("SLURM_JOB_ID") and environ.get("SLURM_TASKS_PER_NODE"):
        slots = slurm_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
    else:
        slots = []
    return min(world_size, max(slots)) if slots else world_size


def placement_warnings(config: "RecoverConfig", cmd: Sequence[str] = ()) -> list[str]:
    """Where replicas land on the nodes of ``NANOTRON_RECOVER_HOSTFILE`` or of the Slurm allocation (empty: one
    node each, no hostfile, or the launch line names whole-replica slots with ``--host``)."""
    hostfile = os.environ.get(HOSTFILE_ENV)
    found = hostfile_slots(hostfile) if hostfile and Path(hostfile).is_file() else None
    if found is None and "--host" not in cmd and os.environ.get("SLURM_JOB_ID"):
        from nanotron_recover.launcher.slurm_nodes import Allocation

        allocation = Allocation.from_environment()
        if allocation is not None:
            found = [n.name for n in allocation.nodes], [n.slots for n in allocation.nodes]
    if found is None:
        return []
    names, slots = found
    return replica_placement(slots, config.world_size, config.ranks_per_replica, names)


def _cmd_train(args: argparse.Namespace) -> int:
    cmd, config, run_dir = train_command(args)
    for warning in placement_warnings(config, cmd):
        print(f"[nanotron-recover] warning: {warning}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    try:
        lock = hold_run_folder(run_dir, float(os.environ.get(LOCK_WAIT_ENV, "30")))
    except RunFolderBusy as e:
        print(f"nanotron-recover: error: {e}", file=sys.stderr, flush=True)
        return EXIT_NEEDS_PERSON
    mode = "ReCoVer (ULFM)" if config.ft_enabled else "stock nanotron data path"
    if config.sharded_replicas:
        mode += f", HSDP replicas of {config.ranks_per_replica} FSDP shards"
    print(f"[nanotron-recover] {config.world_size} ranks, {mode}, run dir {run_dir}", flush=True)
    return _relauncher(args, cmd, config, run_dir, lock).run()


def _relauncher(args: argparse.Namespace, cmd: list[str], config: "RecoverConfig", run_dir: Path,
                lock: int) -> "Relauncher":
    """The launches of this command (:mod:`nanotron_recover.launcher.relauncher`)."""
    from nanotron_recover.config import FaultToleranceArgs  # the config module is loaded by now
    from nanotron_recover.launcher.relauncher import JobSpec, Relauncher, max_restarts_setting
    from nanotron_recover.launcher.standby import standby_fits

    ft = config.fault_tolerance or FaultToleranceArgs()
    grace = ft.stop_grace_s if config.ft_enabled else None
    restarts = args.max_restarts if args.max_restarts is not None else max_restarts_setting()
    # the standby's ranks on this node beside the job's: the node's share of it, not the whole job
    standby = config.ft_enabled and restarts > 0 and ft.standby != "off" \
        and standby_fits(ranks_per_node(config.world_size))
    spec = JobSpec(cmd, run_dir, config.world_size, (lock,), ft.finalize_timeout_s, grace, restarts, standby,
                   standby_after_loss=ft.standby == "after_loss", replicas=config.parallelism.dp,
                   ranks_per_replica=config.ranks_per_replica,
                   regrow=ft.regrow if config.ft_enabled else "off", relaunch_mtbf_h=ft.relaunch_mtbf_h,
                   nodes=_node_fit(args, cmd, config, run_dir) if restarts > 0 else None)

    def begin(extra: dict) -> None:
        begin_launch(run_dir, {**launch_record(config, by="nanotron-recover train"), **extra})

    def cold(launch_cmd: list[str], stop: "LauncherStop", on_tick: Callable[[], None]) -> int:
        return launch_with_retries(launch_cmd, run_dir, finalize_timeout_s=ft.finalize_timeout_s, pass_fds=(lock,),
                                   stop_grace_s=grace, stop=stop, on_tick=on_tick)

    return Relauncher(spec, judge=lambda rc: _judge(run_dir, config, rc, args.max_startup_failures), begin=begin,
                      launch_cold=cold)


def _node_fit(args: argparse.Namespace, cmd: list[str], config: "RecoverConfig", run_dir: Path) -> "NodeFit | None":
    """On a hostfile of several nodes (asked over ssh), or in a Slurm allocation of several nodes (asked with a job
    step): relaunches fitted to the nodes that answer (:mod:`nanotron_recover.launcher.node_fit`)."""
    from nanotron_recover.launcher.hostfile_nodes import HostfileNodes
    from nanotron_recover.launcher.node_fit import NodeFit
    from nanotron_recover.launcher.slurm_nodes import Allocation

    if not config.ft_enabled:
        return None
    hostfile = os.environ.get(HOSTFILE_ENV)
    if hostfile and os.environ.get("SLURM_JOB_ID"):
        return None  # in an allocation PRRTE starts its daemons with srun, not ssh: no probe that says the same
    if hostfile:
        allocation = HostfileNodes.from_environment(hostfile, shlex.split(os.environ.get(MPIRUN_ARGS_ENV, "")))
    else:
        allocation = Allocation.from_environment()
        # every launch's daemons start as a job step that shares the allocation's CPUs (srun --overlap): the step
        # of a job whose node was lost stays behind until Slurm gives up on that node, and a relaunch's step would
        # wait for it (seen on the test cluster: the relaunch on the remaining node hung in srun)
        if allocation is not None:
            os.environ["SLURM_OVERLAP"] = "1"
    if allocation is None:
        return None

    def reshape(replicas: int, hosts: str) -> list[str]:
        narrow = argparse.Namespace(**{**vars(args), "replicas": replicas, "run_dir": str(run_dir)})
        line = train_command(narrow)[0]
        if line[1:2] == ["--host"]:  # the allocation's whole-replica slots: replaced by the nodes that answer
            line = [line[0], *line[3:]]
        return [line[0], "--host", hosts, *line[1:]]

    return NodeFit(allocation, config.ranks_per_replica, config.parallelism.dp, config.spare_replicas,
                   config.microbatches_per_step, config.fault_tolerance.min_replicas, cmd, reshape)


def launch_record(config: "RecoverConfig", by: str) -> dict:
    """What a launch record says about the job (the run folder keeps one per launch)."""
    return {"by": by, "world_size": config.world_size, "replicas": config.parallelism.dp,
            "spare_replicas": config.spare_replicas, "ranks_per_replica": config.ranks_per_replica,
            "microbatches_per_step": config.microbatches_per_step, "train_steps": config.tokens.train_steps,
            "micro_batch_size": config.tokens.micro_batch_size, "checkpoints_path": _checkpoints_path(config),
            "fault_tolerance": config.ft_enabled, "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT")}


def launch_with_retries(cmd: list[str], run_dir: Path, retries: int = LAUNCH_RETRIES,
                        finalize_timeout_s: float = 60.0, pass_fds: tuple[int, ...] = (),
                        stop_grace_s: float | None = None, stop: "LauncherStop | None" = None,
                        on_tick: "Callable[[], None] | None" = None) -> int:
    """Run ``cmd`` (mpirun, :class:`~nanotron_recover.launcher.mpirun_job.MpirunJob`); launch it again when PRRTE
    itself failed to start and no rank wrote anything. ``stop_grace_s``: how long a stop signal leaves the job to
    stop by itself (None: the stock path); ``stop``: the launcher's stop handling (made here if None)."""
    from nanotron_recover.launcher.mpirun_job import MpirunJob
    from nanotron_recover.process.stop_request import LauncherStop

    if stop is None:
        stop = LauncherStop(None, stop_grace_s, say=lambda line: print(f"[nanotron-recover] {line}",
                                                                       file=sys.stderr, flush=True))
        stop.install()
    for attempt in range(1 + retries):
        started = time.time()
        # the run folder's lock goes with mpirun: held while the job lives, even if the launcher is killed
        job = MpirunJob(cmd, graceful=stop_grace_s is not None, pass_fds=pass_fds)
        stop.attach(job)
        rc = job.wait(run_dir, finalize_timeout_s, stop, on_tick)
        failure = None if ranks_wrote_since(run_dir, started) else launch_failure(rc, job.tail())
        if failure is None or attempt == retries or stop.requested:
            return rc
        print(f"[nanotron-recover] mpirun failed before any rank started ({failure!r}): launching again "
              f"({attempt + 1}/{retries})", file=sys.stderr, flush=True)
        time.sleep(LAUNCH_RETRY_PAUSE_S)
    return rc


def launch_failure(mpirun_rc: int, output_tail: bytes) -> str | None:
    """The PRRTE start-up failure that ended this launch, if any: the runtime itself did not come up (seen on a
    loaded machine), no rank ran, and the same command is expected to work a moment later."""
    if mpirun_rc in (EXIT_DONE, EXIT_BAD_INPUT):
        return None
    text = output_tail.decode(errors="replace")
    return next((m for m in PRRTE_STARTUP_FAILURES if m in text), None)


def _judge(run_dir: Path, config: "RecoverConfig", mpirun_rc: int, max_startup_failures: int | None = None) -> int:
    """The launcher's exit code, from what the run wrote, never from mpirun's code alone: under ``--with-ft ulfm``
    mpirun returns 0 when the whole job was torn down (a node's daemon lost) and 1 when a rank
    ended the job with the restart outcome (a start-up timeout). Any run that did not reach its last step and
    whose ranks recorded nothing a person must fix exits 3, so that a wrapper or ``sbatch --requeue`` relaunches it;
    the same start-up failure, or a crash at the same step, on ``max_startup_failures`` launches in a row exits 2
    instead (:mod:`nanotron_recover.run.outcome`)."""
    limit = max_startup_failures if max_startup_failures is not None else max_startup_failures_setting()
    verdict, detail = judge_launch(run_dir, config.tokens.train_steps, mpirun_rc, _checkpoints_path(config),
                                   needs_final_checkpoint=config.saves_final_checkpoint, max_startup_failures=limit)
    if verdict == "restart":
        print(f"[nanotron-recover] the job ended before its last step ({detail}): exit {EXIT_RESTART}, relaunch to "
              "resume from latest.txt", file=sys.stderr, flush=True)
    elif verdict == "aborted":
        print(f"[nanotron-recover] a rank aborted the job on an error ({detail}): exit {EXIT_NEEDS_PERSON}, a person "
              "must look (a relaunch would meet the same error)", file=sys.stderr, flush=True)
    elif verdict == NEEDS_PERSON:
        print(f"[nanotron-recover] the job cannot go on until a person acts ({detail}): exit {EXIT_NEEDS_PERSON}, "
              "not requeued", file=sys.stderr, flush=True)
        free = free_bytes(run_dir)
        if any(record.get("disk_full") for record in read_exits(run_dir).values()) or (
                free is not None and free < NEARLY_FULL_BYTES):  # a disk too full even for the exit records
            _free_partial_saves(checkpoints_root(run_dir, _checkpoints_path(config)))
    if verdict != "done":
        _say_why(run_dir)
    return OUTCOME_EXIT_CODES[verdict]


def _free_partial_saves(root: Path) -> None:
    """A rank ended the job on a full disk: the partial folder of a save in flight (written in the background, its
    writer ended with the job) holds space the person must free. No writer of this node is alive now (a rank on
    another node that outlived mpirun could still write; the next launch's publisher fences and sweeps as ever):
    remove it, say so. A failure here is said, never raised: the run's judgement stands."""
    try:
        removed = remove_partial_saves(root)
    except OSError as e:
        print(f"[nanotron-recover] the unpublished partial saves in {root} could not be removed: {e}", file=sys.stderr,
              flush=True)
        return
    for name, held in removed:
        print(f"[nanotron-recover] removed the unpublished partial save {root / name} ({held / 2**20:.1f} MiB)",
              file=sys.stderr, flush=True)


def max_startup_failures_setting() -> int:
    """``NANOTRON_RECOVER_MAX_STARTUP_FAILURES`` (default 3; 0: never stop requeueing)."""
    value = os.environ.get(MAX_STARTUP_FAILURES_ENV, "")
    return int(value) if value.strip().isdigit() else DEFAULT_MAX_STARTUP_FAILURES


def _say_why(run_dir: Path) -> None:
    """Repeat the ranks' own reasons from their exit records: a rank's last stderr line can be lost when its
    daemon is torn down right after it (the daemon forwards the rank's output), its exit record cannot."""
    for line in exit_reasons(run_dir):
        print(f"[nanotron-recover] why: {line}", file=sys.stderr, flush=True)


def _checkpoints_path(config: "RecoverConfig") -> str:
    return str(config.checkpoints.checkpoints_path) if config.checkpoints is not None else "checkpoints"


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from nanotron_recover.data.prepare_cli import run_prepare_from_args

    return run_prepare_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanotron-recover", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="launch a training run under mpirun (ULFM when fault_tolerance is on)")
    add_override_args(train)
    train.add_argument("--dry-run", action="store_true", help="print the mpirun command line and exit")
    train.add_argument("--max-startup-failures", type=int, default=None, metavar="N",
                       help="exit 2 (not 3: no requeue) once the same start-up failure, or a crash at the same step, "
                            "ended N launches of this run folder in a row (default: "
                            "$NANOTRON_RECOVER_MAX_STARTUP_FAILURES or 3; 0: never)")
    train.add_argument("--max-restarts", type=int, default=None, metavar="N",
                       help="relaunch in place (from a warm standby when one is ready) up to N times when the job "
                            "ends with the restart outcome, then exit 3 for the scheduler (default: "
                            "$NANOTRON_RECOVER_MAX_RESTARTS or 3; 0: exit 3 at once)")
    train.set_defaults(func=_cmd_train)
    from nanotron_recover.data.prepare_cli import add_prepare_arguments

    prep = sub.add_parser("prepare-data", help="tokenize a corpus (default: the King James Bible) into datatrove files")
    add_prepare_arguments(prep)
    prep.set_defaults(func=_cmd_prepare_data)
    from nanotron_recover.sim.plan import add_plan_arguments, run_plan  # pure Python, no torch / MPI

    plan = sub.add_parser("plan", help="simulate failures on a cluster: ETTR per policy, recommended settings")
    add_plan_arguments(plan)
    plan.set_defaults(func=run_plan)
    from nanotron_recover.report.cli import add_report_arguments, run_report  # matplotlib only when drawing

    report = sub.add_parser("report", help="what happened to a run: a summary on stdout and a figure")
    add_report_arguments(report)
    report.set_defaults(func=run_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from nanotron_recover.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"nanotron-recover: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
