"""``RecoverConfig``: nanotron's ``Config`` plus an optional ``fault_tolerance:`` section.

A stock nanotron 0.4 YAML loads unchanged (no section means fault tolerance off: the stock data path).
Everything that can be checked without starting a process is checked by :func:`validate`, so a bad config
fails in the launcher with a message naming the key, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Union

import dacite
import yaml
from nanotron.config import (
    CheckpointsArgs,
    Config,
    DataArgs,
    LlamaConfig,
    PretrainDatasetsArgs,
    get_config_from_dict,
)
from nanotron.parallel.tensor_parallel.nn import TensorParallelLinearMode

from nanotron_recover.process.inject import FailureSpec

REPLICA_3D = "3d"
REPLICA_FSDP = "fsdp"
REPLICA_KINDS = (REPLICA_3D, REPLICA_FSDP)
DATA_PLANES = ("auto", "mpi", "torch")
MPI_WAITS = ("auto", "block", "poll")
STRAGGLER_ACTIONS = ("drain", "evict")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def snapshots_on(interval: int | str) -> bool:
    """Whether ``fault_tolerance.local_snapshot_interval`` turns node-local snapshots on: the one place that reads
    0 as off (through the snapshot store's settings, which the schedule and the graceful stop's checkpoint ask)."""
    return interval != 0


@dataclass
class FaultToleranceArgs:
    """The ``fault_tolerance:`` section.

    Args:
        enabled: ReCoVer path (ULFM cross-replica reduction). False: stock nanotron data path (where an
            ``inject`` schedule kills the whole job, as stock nanotron would die: the checkpoint-restart baseline).
        min_replicas: below this many live replicas the run saves a checkpoint and stops (exit code 3).
        spare_replicas: idle replicas that replace failed ones before quotas grow on the survivors.
        collective_timeout_s: timeout of every torch process group inside a replica (safety net).
        reduce_bucket_mb: size of the flat fp32 gradient buckets reduced across replicas.
        keep_global_batch: True (ReCoVer): every step commits all M microbatches. False: the shrinking-batch
            baseline (torchft-style): a failed replica's microbatches are dropped, the batch shrinks.
        inject: a deterministic fault schedule (tests, benchmarks): real SIGKILL / SIGSTOP / a hung main thread,
            see :class:`nanotron_recover.process.inject.FailureSpec`.
        hang_monitor: the heartbeat thread behind ``hang_timeout_s`` (on by default). False only to measure what it
            costs (``benchmarks/overhead.py --breakdown``): a frozen rank then blocks the job until
            ``collective_timeout_s`` or for ever.
        hang_timeout_s: a rank that stays silent (a frozen process), or whose main thread makes no progress outside
            a cross-replica wait (stuck in a kernel or an intra-replica collective), for this long is SIGKILLed, so
            that recovery runs as for a crash. None (default): ``max(30 s, 5 x the longest step so far)``,
            60 s before the first step was measured (see :mod:`nanotron_recover.ft.hang`).
        startup_timeout_s: every rank must be ready to train (imports, ``MPI_Init``, torch rendezvous, model build,
            checkpoint load) within this long, else the whole job ends with the restart outcome (exit 3). Also the
            allowance for one checkpoint save.
        startup_peer_wait_floor_s: a rank that waits for its peers in start-up (inside ``MPI_Init``, in the start-up
            agreement) waits at most 3 x its own start-up so far, and at least this long: a peer frozen in start-up
            costs about this, not ``startup_timeout_s``. Lower it where every rank starts in a few seconds.
        finalize_timeout_s: a rank that has finished (or is leaving) ends within this long even when its MPI
            daemon is frozen or gone (``MPI_Finalize`` then waits on it for ever): it is SIGKILLed after its exit
            record was written, so a finished run always ends and a relaunch never competes with orphaned ranks.
        replica: what one replica is. ``3d``: a ``parallelism.tp`` x ``parallelism.pp`` grid of nanotron ranks.
            ``fsdp`` (HSDP): ``fsdp_shard_size`` ranks that shard parameters, gradients and optimizer state with
            torch FSDP2 (tp = pp = 1); each microbatch's rows are split over them.
        fsdp_shard_size: ranks per replica in ``fsdp`` mode (F); world = (dp + spare_replicas) x F.
        local_snapshot_interval: every this many committed steps each rank writes its state to node-local
            memory-backed storage, so that a relaunch (node loss, too few replicas) continues from the newest
            committed step instead of the last disk checkpoint (:mod:`nanotron_recover.snapshots.local_snapshot`).
            0 turns it off. ``auto`` (default): every step until a write was measured, then Young's rule from the
            measured write cost, step time and ``relaunch_mtbf_h``, at most ``local_snapshot_max_interval``
            (:mod:`nanotron_recover.snapshots.schedule`).
        local_snapshot_max_interval: with ``auto``, the most committed steps between two snapshots: the most steps
            a relaunch recomputes.
        relaunch_mtbf_h: with ``auto``, the expected hours between faults that end the job (a lost node): the
            rarer they are, the longer the interval that pays for itself.
        local_snapshot_dir: where (memory: ``/dev/shm/nanotron-recover-<uid>`` by default); one folder per run and
            node inside it. Private to the user: a folder owned by another user is refused (snapshots off).
        local_snapshot_max_gb: the most the snapshots of one node may take (up to three copies per rank: two complete,
            one being written); None: half the free space of ``local_snapshot_dir``. Checked before launch.
        recycle: the healthy ranks of a failed replica stay, in a pool, instead of leaving; once the pool holds a
            replica's worth of ranks they form a new replica at a step boundary, which enters like a spare
            (:mod:`nanotron_recover.workload.recycle`). 3D and HSDP replicas. Null (default): on when
            ``keep_global_batch`` is (a formed replica computes the samples of a slot) and a replica is one
            pipeline stage (``pp`` 1: with TP x PP, a pooled rank can stay blocked in gloo's pipeline traffic
            until the hang monitor kills it; docs/limits.md), off otherwise. Resolved by :func:`validate`.
        rebalance: quotas follow each replica's measured compute speed (stragglers get fewer microbatches of the
            same M; :mod:`nanotron_recover.workload.rebalance`). Off by default: the split then depends on timing,
            so two runs of one config are no longer bit-identical (each replica's summation order follows its
            quota); the trajectory is the same samples either way. Speeds are measured and logged regardless.
        replica_weights: fixed relative speeds by replica id (``dp + spare_replicas`` entries, > 0), for known
            heterogeneous hardware: the plan with ``rebalance`` off, the prior before the first measurement with
            it on. Null: all equal.
        rebalance_smoothing: the EWMA weight of the newest step's speed, in (0, 1].
        rebalance_hysteresis: the weights in use change only when the new quotas would shorten the predicted
            step by more than this fraction, in [0, 1).
        straggler_factor: a replica slower than this factor x the median replica for ``straggler_steps``
            consecutive steps is drained (quota 0 for the rest of the run). Null (default): never drained.
        straggler_steps: how many consecutive slow steps make a replica a persistent straggler.
        straggler_action: what happens to a persistent straggler. ``drain`` (default): quota 0, it stays in its slot.
            ``evict``: it leaves the job as a failed replica would and an idle spare (configured, or formed by
            recycling) takes its slot at full speed; drained as before while no spare is idle.
        data_plane: what carries the cross-replica gradient bytes. ``mpi``: the ULFM communicators themselves
            (host-staged on GPU). ``torch``: a torch process group per coordinate (gloo on CPU, NCCL on GPU, in place
            on the device buffers), rebuilt after every repair; ULFM still detects, agrees and commits
            (:mod:`nanotron_recover.ft.data_plane`). ``auto`` (default): ``mpi`` on CPU, ``torch`` on GPU
            (docs/data-plane.md says why).
        mpi_wait: how a rank waits for its peers in a cross-replica MPI collective. ``block``: inside MPI (Open
            MPI polls, the fastest with a core per rank). ``poll``: asleep until every peer has arrived, so that a
            waiting rank leaves the CPU to the ranks it waits for. ``auto`` (default): ``poll`` when the node holds
            more ranks than cores, else ``block`` (:mod:`nanotron_recover.ft.waiting`).
        stop_grace_s: after a stop signal (SIGTERM, SIGINT or SIGUSR1 to the launcher or to the ranks), the job has
            this long to commit the step in flight, snapshot it and exit 3
            (:mod:`nanotron_recover.process.stop_request`); then the launcher ends it at once. Keep it below the
            scheduler's grace (Slurm: ``KillWait``, 30 s).
        standby: ``auto`` (default): while a job trains, the launcher keeps the next one ready beside it (its ranks
            imported and waiting before MPI is initialized), so that an in-place relaunch starts seconds sooner;
            only where memory allows (:mod:`nanotron_recover.launcher.relauncher`). ``after_loss``: the launcher
            starts it only when a replica is lost, and a regrow waits until it is ready: its start-up then runs on
            what the lost replica freed instead of beside the full-width job (the better choice where every core
            trains, as on a CPU-only node). ``off``: every relaunch is cold.
        regrow: ``auto`` (default): after replicas are lost, the launcher stops the job at a step boundary (its
            snapshot written) and relaunches it at full width, when the relaunch costs less than the full-width
            training that staying degraded gives away until the next failure (``relaunch_mtbf_h``); only where the
            launcher relaunches in place (``--max-restarts`` > 0). ``off``: degraded until the job ends
            (:mod:`nanotron_recover.launcher.regrow`).
        checkpoint_on_stop: also write a disk checkpoint of the last step at a graceful stop (the node-local
            snapshot is written either way; with ``local_snapshot_interval: 0`` the checkpoint is written instead).
    """

    enabled: bool = True
    min_replicas: int = 1
    spare_replicas: int = 0
    collective_timeout_s: float = 60.0
    reduce_bucket_mb: float = 4.0
    keep_global_batch: bool = True
    inject: List[FailureSpec] = field(default_factory=list)
    hang_monitor: bool = True
    hang_timeout_s: Optional[float] = None
    startup_timeout_s: float = 600.0
    startup_peer_wait_floor_s: float = 60.0
    finalize_timeout_s: float = 60.0
    replica: str = REPLICA_3D
    fsdp_shard_size: Optional[int] = None
    local_snapshot_interval: Union[int, str] = "auto"
    local_snapshot_max_interval: int = 10
    relaunch_mtbf_h: float = 2.0
    local_snapshot_dir: str = field(default_factory=lambda: f"/dev/shm/nanotron-recover-{os.getuid()}")
    local_snapshot_max_gb: Optional[float] = None
    recycle: Optional[bool] = None
    rebalance: bool = False
    replica_weights: Optional[List[float]] = None
    rebalance_smoothing: float = 0.3
    rebalance_hysteresis: float = 0.1
    straggler_factor: Optional[float] = None
    straggler_steps: int = 10
    straggler_action: str = "drain"
    data_plane: str = "auto"
    mpi_wait: str = "auto"
    stop_grace_s: float = 25.0
    checkpoint_on_stop: bool = False
    standby: str = "auto"
    regrow: str = "auto"


@dataclass
class TokenizedDatasetArgs:
    """A folder of datatrove token files (``*.ds``), as written by ``nanotron-recover prepare-data``."""

    dataset_folder: str
    shuffle: bool = True


@dataclass
class RecoverDataArgs(DataArgs):
    """nanotron's ``data:`` section; ``dataset`` may also be a datatrove folder, or null for synthetic tokens."""

    dataset: Optional[Union[TokenizedDatasetArgs, PretrainDatasetsArgs]] = None
    seed: Optional[int] = None


@dataclass
class RecoverCheckpointsArgs(CheckpointsArgs):
    """nanotron's ``checkpoints:`` section, plus ``async_save`` and the ``auto`` cadence.

    checkpoint_interval: every this many steps, or ``auto`` (the default with fault tolerance on; the stock path is
        nanotron's and takes a number): the cadence from what a relaunch reads
        (:mod:`nanotron_recover.training.checkpoint_cadence`): Young/Daly on the expected time between losses that
        a disk checkpoint alone repairs (``all_snapshots_lost_h`` with node-local snapshots on, else
        ``fault_tolerance.relaunch_mtbf_h``) and the measured stall of a save, within
        ``[checkpoint_min_interval_s, checkpoint_max_interval_h]``.

    async_save: a checkpoint step copies the committed state to host memory and the training goes on while a
        background thread per writing rank writes it (nanotron's format, the same files as a save in the step);
        the folder is published (manifest, rename, ``latest.txt``) once every writer is done. At most one save is
        in flight: the next checkpoint step, a graceful stop and the run's end wait for it. Default true (where the
        host has room for the copy; else the save is written in the step, said in the log). The final save and a
        graceful stop's save are written in the step. The stock path always saves in the step, as nanotron does.
    """

    checkpoint_interval: Union[int, str] = "auto"
    async_save: bool = True
    checkpoint_min_interval_s: float = 60.0
    checkpoint_max_interval_h: float = 1.0
    all_snapshots_lost_h: float = 168.0


@dataclass
class RecoverConfig(Config):
    checkpoints: Optional[RecoverCheckpointsArgs] = None
    data: Optional[RecoverDataArgs] = None
    fault_tolerance: Optional[FaultToleranceArgs] = None

    @property
    def ft_enabled(self) -> bool:
        return self.fault_tolerance is not None and self.fault_tolerance.enabled

    @property
    def sharded_replicas(self) -> bool:
        """HSDP: each replica is an FSDP shard group (``fault_tolerance.replica: fsdp``)."""
        return self.fault_tolerance is not None and self.fault_tolerance.replica == REPLICA_FSDP

    @property
    def ranks_per_replica(self) -> int:
        if self.sharded_replicas:
            return self.fault_tolerance.fsdp_shard_size
        return self.parallelism.tp * self.parallelism.pp

    @property
    def spare_replicas(self) -> int:
        return self.fault_tolerance.spare_replicas if self.ft_enabled else 0

    @property
    def world_size(self) -> int:
        return (self.parallelism.dp + self.spare_replicas) * self.ranks_per_replica

    @property
    def saves_final_checkpoint(self) -> bool:
        """A run with a ``checkpoints`` section ends with its last step on disk, whatever the interval: the trainer
        writes it, and the launcher calls the run done only once it is there."""
        return self.checkpoints is not None

    @property
    def microbatches_per_step(self) -> int:
        """M: global microbatches committed by every step (the failure-free run's count)."""
        return self.parallelism.dp * self.tokens.batch_accumulation_per_replica


def _fault_tolerance_from_dict(section: Any) -> Optional[FaultToleranceArgs]:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"fault_tolerance: expected a mapping, got {type(section).__name__}")
    try:
        return dacite.from_dict(FaultToleranceArgs, section, config=dacite.Config(strict=True))
    except dacite.UnexpectedDataError as e:
        allowed = ", ".join(f.name for f in dataclasses.fields(FaultToleranceArgs))
        inject = ", ".join(f.name for f in dataclasses.fields(FailureSpec))
        raise ConfigError(f"fault_tolerance: unknown key(s) {sorted(e.keys)}; allowed: {allowed} "
                          f"(inject entries: {inject})") from None
    except dacite.WrongTypeError as e:
        raise ConfigError(f"fault_tolerance.{e.field_path}: expected {e.field_type}, got {e.value!r}") from None
    except dacite.MissingValueError as e:
        raise ConfigError(f"fault_tolerance.{e.field_path}: missing value") from None


def _dataclass_of(hint: Any) -> Any:
    """The dataclass inside ``X`` or ``Optional[X]`` (None if there is none)."""
    candidates = [hint, *typing.get_args(hint)]
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def _check_section_keys(raw: dict) -> None:
    """An unknown top-level section, or an unknown key in one, is named with every key that is allowed there
    (nanotron's own loader says only 'can not match "x" to any data class field')."""
    hints = typing.get_type_hints(RecoverConfig)
    sections = [f.name for f in dataclasses.fields(RecoverConfig)]
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; allowed: {', '.join(sections)}")
    for name in sections:
        kind = _dataclass_of(hints[name])
        if name == "fault_tolerance" or kind is None or not isinstance(raw.get(name), dict):
            continue
        allowed = [f.name for f in dataclasses.fields(kind)]
        extra = sorted(set(raw[name]) - set(allowed))
        if extra:
            raise ConfigError(f"{name}: unknown key(s) {extra}; allowed: {', '.join(allowed)}")


def config_from_dict(raw: dict) -> RecoverConfig:
    """Load a nanotron YAML dict (optionally with ``fault_tolerance:``) and validate it."""
    if not isinstance(raw, dict):
        raise ConfigError("the config file must hold a YAML mapping")
    raw = dict(raw)
    _check_section_keys(raw)
    ft = _fault_tolerance_from_dict(raw.pop("fault_tolerance", None))
    config = get_config_from_dict(raw, config_class=RecoverConfig)
    if isinstance(config.model.model_config, dict):
        config.model.model_config = LlamaConfig(**config.model.model_config)
    config.fault_tolerance = ft
    validate(config)
    return config


def load_config(path: str | os.PathLike) -> RecoverConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            # one line: file, line and column (1-based) of the problem, and what YAML expected there
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            what = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"{where}: not valid YAML: {what}") from None
    try:
        return config_from_dict(raw)
    except ConfigError:
        raise
    except (dacite.DaciteError, TypeError, KeyError, ValueError, AssertionError) as e:
        raise ConfigError(f"{path}: {e}") from e


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def validate(config: RecoverConfig) -> None:
    """Checks that need no process: sizes, the failure schedule, the fault-tolerance settings."""
    par, tok = config.parallelism, config.tokens
    _check(tok is not None, "tokens", "section is required for training")
    for key in ("dp", "tp", "pp"):
        _check(getattr(par, key) >= 1, f"parallelism.{key}", f"must be >= 1, got {getattr(par, key)}")
    _check(tok.micro_batch_size >= 1, "tokens.micro_batch_size", "must be >= 1")
    _check(tok.batch_accumulation_per_replica >= 1, "tokens.batch_accumulation_per_replica", "must be >= 1")
    _check(tok.train_steps >= 1, "tokens.train_steps", "must be >= 1")
    _check(tok.sequence_length >= 2, "tokens.sequence_length", "must be >= 2")
    model = config.model.model_config
    _check(model.num_attention_heads % par.tp == 0, "model.model_config.num_attention_heads",
           f"{model.num_attention_heads} is not divisible by parallelism.tp={par.tp}")
    _check(model.num_key_value_heads % par.tp == 0, "model.model_config.num_key_value_heads",
           f"{model.num_key_value_heads} is not divisible by parallelism.tp={par.tp}")
    _check(model.num_hidden_layers >= par.pp, "parallelism.pp",
           f"{par.pp} pipeline stages for {model.num_hidden_layers} layers")
    if par.tp_mode is TensorParallelLinearMode.REDUCE_SCATTER:
        _check(tok.micro_batch_size * tok.sequence_length % par.tp == 0, "tokens.sequence_length",
               "micro_batch_size * sequence_length must be divisible by tp in REDUCE_SCATTER mode")
    if config.checkpoints is not None:
        _validate_cadence(config)
    if config.optimizer is not None:
        _check(config.optimizer.zero_stage == 0, "optimizer.zero_stage",
               f"{config.optimizer.zero_stage} is not supported (optimizer states are replicated: use 0)")
    if config.fault_tolerance is not None:
        _validate_fault_tolerance(config)
        _validate_inject(config)


def _validate_fault_tolerance(config: RecoverConfig) -> None:
    """The ``fault_tolerance`` settings, each against its range."""
    ft, par = config.fault_tolerance, config.parallelism
    _check(ft.spare_replicas >= 0, "fault_tolerance.spare_replicas", f"must be >= 0, got {ft.spare_replicas}")
    _check(1 <= ft.min_replicas <= par.dp, "fault_tolerance.min_replicas",
           f"must be between 1 and parallelism.dp={par.dp}, got {ft.min_replicas}")
    _check(ft.collective_timeout_s > 0, "fault_tolerance.collective_timeout_s", "must be > 0")
    _check(ft.reduce_bucket_mb > 0, "fault_tolerance.reduce_bucket_mb", "must be > 0")
    _check(ft.hang_timeout_s is None or ft.hang_timeout_s >= 1, "fault_tolerance.hang_timeout_s",
           f"must be >= 1 second (or null for the default), got {ft.hang_timeout_s}")
    _check(ft.finalize_timeout_s >= 1, "fault_tolerance.finalize_timeout_s",
           f"must be >= 1 second, got {ft.finalize_timeout_s}")
    _check(ft.standby in ("auto", "after_loss", "off"), "fault_tolerance.standby",
           f"must be auto, after_loss or off, got {ft.standby!r}")
    _check(ft.regrow in ("auto", "off"), "fault_tolerance.regrow", f"must be auto or off, got {ft.regrow!r}")
    _check(ft.stop_grace_s >= 1, "fault_tolerance.stop_grace_s", f"must be >= 1 second, got {ft.stop_grace_s}")
    _check(ft.startup_timeout_s >= 10, "fault_tolerance.startup_timeout_s",
           f"must be >= 10 seconds, got {ft.startup_timeout_s}")
    _check(ft.startup_peer_wait_floor_s >= 1, "fault_tolerance.startup_peer_wait_floor_s",
           f"must be >= 1 second, got {ft.startup_peer_wait_floor_s}")
    interval = ft.local_snapshot_interval
    _check(interval == "auto" or (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 0),
           "fault_tolerance.local_snapshot_interval", f"must be auto or an integer >= 0 (0: off), got {interval!r}")
    _check(ft.local_snapshot_max_interval >= 1, "fault_tolerance.local_snapshot_max_interval",
           f"must be >= 1, got {ft.local_snapshot_max_interval}")
    _check(math.isfinite(ft.relaunch_mtbf_h) and ft.relaunch_mtbf_h > 0, "fault_tolerance.relaunch_mtbf_h",
           f"must be a finite number of hours > 0 (a large one for rare faults), got {ft.relaunch_mtbf_h}")
    _check(ft.local_snapshot_max_gb is None or ft.local_snapshot_max_gb > 0, "fault_tolerance.local_snapshot_max_gb",
           f"must be > 0 (or null: half the free space), got {ft.local_snapshot_max_gb}")
    _check(ft.data_plane in DATA_PLANES, "fault_tolerance.data_plane",
           f"must be one of {', '.join(DATA_PLANES)}, got {ft.data_plane!r}")
    _check(ft.mpi_wait in MPI_WAITS, "fault_tolerance.mpi_wait",
           f"must be one of {', '.join(MPI_WAITS)}, got {ft.mpi_wait!r}")
    _validate_replica_kind(config)
    _validate_rebalance(config)
    if ft.recycle is None:
        ft.recycle = ft.keep_global_batch and config.parallelism.pp == 1
    if ft.recycle:
        _check(ft.keep_global_batch, "fault_tolerance.recycle",
               "needs keep_global_batch: true (a recycled replica computes the samples of a slot)")
    _check(ft.straggler_action != "evict" or ft.spare_replicas > 0 or (ft.recycle and config.ranks_per_replica > 1),
           "fault_tolerance.straggler_action", "evict needs a spare to take the straggler's slot: spare_replicas "
           "> 0, or recycle with more than one rank per replica (a one-rank replica leaves nobody to recycle)")


def _validate_rebalance(config: RecoverConfig) -> None:
    """Rebalancing, fixed weights and draining: their ranges, and what they need."""
    ft = config.fault_tolerance
    n_replicas = config.parallelism.dp + ft.spare_replicas
    _check(0 < ft.rebalance_smoothing <= 1, "fault_tolerance.rebalance_smoothing",
           f"must be in (0, 1] (the weight of the newest step), got {ft.rebalance_smoothing}")
    _check(0 <= ft.rebalance_hysteresis < 1, "fault_tolerance.rebalance_hysteresis",
           f"must be in [0, 1) (a fraction of the step time), got {ft.rebalance_hysteresis}")
    _check(ft.straggler_factor is None or (math.isfinite(ft.straggler_factor) and ft.straggler_factor > 1),
           "fault_tolerance.straggler_factor",
           f"must be > 1 (slower than this factor x the median replica), or null: off; got {ft.straggler_factor}")
    _check(ft.straggler_steps >= 1, "fault_tolerance.straggler_steps", f"must be >= 1, got {ft.straggler_steps}")
    _check(ft.straggler_action in STRAGGLER_ACTIONS, "fault_tolerance.straggler_action",
           f"must be one of {', '.join(STRAGGLER_ACTIONS)}, got {ft.straggler_action!r}")
    _check(ft.straggler_action == "drain" or ft.straggler_factor is not None, "fault_tolerance.straggler_action",
           "evict needs fault_tolerance.straggler_factor (what makes a replica a persistent straggler)")
    if ft.replica_weights is not None:
        weights = ft.replica_weights
        _check(len(weights) == n_replicas, "fault_tolerance.replica_weights",
               f"needs one weight per replica id, dp + spare_replicas = {n_replicas}, got {len(weights)}")
        _check(all(math.isfinite(w) and w > 0 for w in weights), "fault_tolerance.replica_weights",
               f"every weight must be finite and > 0, got {weights}")
    for key in ("rebalance", "replica_weights", "straggler_factor"):
        if getattr(ft, key) not in (None, False):
            _check(ft.enabled and ft.keep_global_batch, f"fault_tolerance.{key}",
                   "needs enabled: true and keep_global_batch: true (it moves work between the replicas "
                   "that compute a step's M microbatches)")


def _validate_inject(config: RecoverConfig) -> None:
    """The fault schedule: every entry names a step, a replica and a rank the run has, and leaves a replica alive."""
    ft, tok = config.fault_tolerance, config.tokens
    n_replicas = config.parallelism.dp + ft.spare_replicas
    # a replica formed from recycled ranks gets the next id: faults may be scheduled for it too. Each formation
    # (one that completes or one that a fault breaks) needs a fault before it, so at most len(inject) ids are formed
    fault_ids = n_replicas + len(ft.inject) if ft.recycle else n_replicas
    for i, inj in enumerate(ft.inject):
        key = f"fault_tolerance.inject[{i}]"
        for name, message in inj.problems():
            raise ConfigError(f"{key}.{name}: {message}")
        if inj.phase != "startup":
            _check(1 <= inj.step <= tok.train_steps, f"{key}.step", f"{inj.step} is outside 1..{tok.train_steps}")
        _check(0 <= inj.replica < fault_ids, f"{key}.replica",
               f"{inj.replica} is outside 0..{fault_ids - 1} "
               f"(dp + spare_replicas{', + formed replicas' if ft.recycle else ''})")
        _check(0 <= inj.rank < config.ranks_per_replica, f"{key}.rank",
               f"{inj.rank} is outside 0..{config.ranks_per_replica - 1} (ranks per replica)")
        if inj.phase in ("checkpoint", "checkpoint-background"):  # the others: in a final or a fallback save too
            interval = config.checkpoints.checkpoint_interval if config.checkpoints is not None else None
            _check(isinstance(interval, int), f"{key}.phase",
                   f"a '{inj.phase}' failure needs a fixed checkpoints.checkpoint_interval (auto's steps are not known "
                   "before the run)")
            _check(inj.step % interval == 0, f"{key}.step", f"a '{inj.phase}' failure needs a step at which a "
                   "checkpoint is saved")
    if ft.enabled and ft.inject:
        # a startup fault ends the job; with recycling, a formed replica's id names no launched replica
        killed = {inj.replica for inj in ft.inject
                  if inj.phase != "startup" and inj.signal != "slow" and inj.replica < n_replicas}
        if len(killed) > n_replicas - 1:
            raise ConfigError("fault_tolerance.inject: the schedule kills every replica; none would be left")


def _validate_cadence(config: RecoverConfig) -> None:
    """``checkpoints.checkpoint_interval`` (a number of steps or ``auto``) and the ``auto`` cadence's bounds."""
    ck = config.checkpoints
    interval = ck.checkpoint_interval
    if isinstance(interval, bool) or not isinstance(interval, (int, str)) or (
            isinstance(interval, str) and interval != "auto"):
        raise ConfigError(f"checkpoints.checkpoint_interval: a number of steps or 'auto', got {interval!r}")
    if isinstance(interval, int):
        _check(interval >= 1, "checkpoints.checkpoint_interval", "must be >= 1")
        return
    _check(config.ft_enabled, "checkpoints.checkpoint_interval", "'auto' (the default) needs fault_tolerance.enabled; "
           "the stock path is nanotron's, which takes a number of steps")
    for key in ("checkpoint_min_interval_s", "checkpoint_max_interval_h", "all_snapshots_lost_h"):
        value = getattr(ck, key)
        _check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"checkpoints.{key}",
               f"must be a finite number > 0, got {value!r}")
    _check(ck.checkpoint_min_interval_s <= ck.checkpoint_max_interval_h * 3600, "checkpoints.checkpoint_min_interval_s",
           f"{ck.checkpoint_min_interval_s:g} s is more than checkpoint_max_interval_h "
           f"({ck.checkpoint_max_interval_h:g} h)")


def _validate_replica_kind(config: RecoverConfig) -> None:
    """``fault_tolerance.replica`` / ``fsdp_shard_size``: what an HSDP replica needs."""
    ft, par, tok = config.fault_tolerance, config.parallelism, config.tokens
    _check(ft.replica in REPLICA_KINDS, "fault_tolerance.replica",
           f"{ft.replica!r} is not one of {', '.join(REPLICA_KINDS)}")
    if ft.replica != REPLICA_FSDP:
        _check(ft.fsdp_shard_size is None, "fault_tolerance.fsdp_shard_size", "is only used with replica: fsdp")
        return
    F = ft.fsdp_shard_size
    _check(F is not None, "fault_tolerance.fsdp_shard_size", "is required with replica: fsdp")
    _check(F >= 1, "fault_tolerance.fsdp_shard_size", f"must be >= 1, got {F}")
    _check(ft.enabled, "fault_tolerance.replica",
           "fsdp replicas need enabled: true (the stock data path has no HSDP mode)")
    for key in ("tp", "pp"):
        _check(getattr(par, key) == 1, f"parallelism.{key}",
               f"must be 1 with fault_tolerance.replica: fsdp (a replica is one FSDP shard group), "
               f"got {getattr(par, key)}")
    _check(tok.micro_batch_size % F == 0, "tokens.micro_batch_size",
           f"{tok.micro_batch_size} is not divisible by fault_tolerance.fsdp_shard_size={F} "
           "(each microbatch's rows are split over the shard group)")
    _check(not config.model.model_config.tie_word_embeddings, "model.model_config.tie_word_embeddings",
           "tied embeddings are not supported with fault_tolerance.replica: fsdp")
