"""The seam between the step loop and everything that crosses replicas.

:class:`~nanotron_recover.training.trainer.RecoverTrainer` runs the step loop; a :class:`DataParallelStrategy` does what
crosses replicas: the stock nanotron path (:mod:`nanotron_recover.training.stock`), ReCoVer's resilient path
(:mod:`nanotron_recover.recovery.resilient`) and its HSDP variant (:mod:`nanotron_recover.hsdp.strategy`).
A strategy never sees the trainer: it gets narrow collaborators (:class:`StepServices`: a compute callable, a
fault hook, a metrics sink) and reads training state through
:class:`~nanotron_recover.training.training_state.TrainingState`, which the trainer satisfies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

import torch

from nanotron_recover.nanotron_compat.clip import clip_grad_norm
from nanotron_recover.nanotron_compat.tied import sync_tied_gradients
from nanotron_recover.training.training_state import TrainingState, fp32_accumulator

if TYPE_CHECKING:
    from nanotron_recover.training.buckets import GradBuckets
    from nanotron_recover.training.checkpoint import CheckpointLayout


@dataclass
class LocalWork:
    """What this rank computed in a step: the loss sum (each microbatch's loss / the strategy's ``loss_divisor``:
    M, or M x F for an HSDP rank that holds 1/F of each microbatch's rows), the microbatch count, and the wall
    seconds it took (the replica's speed, for the rebalancer: :mod:`nanotron_recover.workload.rebalance`)."""

    loss_sum: float = 0.0
    microbatches: int = 0
    compute_s: float = 0.0

    def __iadd__(self, other: "LocalWork") -> "LocalWork":
        self.loss_sum += other.loss_sum
        self.microbatches += other.microbatches
        self.compute_s += other.compute_s
        return self


class StepStop(NamedTuple):
    """Why a committed step is the job's last: ``event`` names it in metrics.jsonl (``stop_signal``: a signal asked
    the job to stop; ``regrow_stop``: back to full width through a relaunch), ``reason`` is the exit record's."""

    event: str
    reason: str


@dataclass
class CommittedStep:
    """A step's result, identical on every live rank."""

    loss: float
    microbatches: int
    epoch: int = 0
    live_replicas: int = 1
    recoveries: int = 0
    quotas: dict[int, int] | None = None  # microbatches per computing replica (logged per step)
    balance: dict[str, Any] | None = None  # measured speeds per replica, drained stragglers (logged per step)
    nonfinite: str | None = None  # what was NaN or infinite (the loss, a gradient): the step must not be committed
    stop: StepStop | None = None  # why this committed step is the job's last, the same on every rank
    cadence: tuple[float | None, float | None] = (None, None)  # the ranks' mean step and last save stall, agreed


class MetricsSink(Protocol):
    """Where step records and events go (:class:`nanotron_recover.training.metrics.MetricsLogger`)."""

    enabled: bool

    def set_logging(self, enabled: bool) -> None: ...

    def start_wandb(self, background: bool = False) -> bool: ...

    def log_step(self, record: dict[str, Any]) -> None: ...

    def log_event(self, record: dict[str, Any]) -> None: ...


# compute(step, global microbatch indices, loss divisor): forward/backward them, gradients accumulate in place
ComputeFn = Callable[[int, Sequence[int], int], LocalWork]
# write(writer, barrier, publisher, extra_state, writers): save the committed state of the current step; ``writers``:
# how many ranks write it (the publisher waits for that many, not for the ones a folder listing happens to show)
CheckpointWriter = Callable[[bool, Callable[[], None], bool, "dict | None", int], None]


@dataclass
class StepServices:
    """The trainer's side of the seam, as the strategy may use it."""

    compute: ComputeFn
    fault_point: Callable[[int, str], None]  # (step, phase): progress for the hang monitor + fault injection
    metrics: MetricsSink
    last_record: Callable[[], "dict | None"]  # the last committed step's record (a new logging rank re-logs it)
    # recycling: drop the model of the replica this rank left / build its new coordinate's over a parallel context
    release_replica: Callable[[], None] = lambda: None
    rebuild_replica: Callable[[Any], None] = lambda parallel_context: None
    save_stall: Callable[[], "float | None"] = lambda: None  # this rank's wall time of its last checkpoint save


@dataclass
class AttachedModel:
    """What :meth:`DataParallelStrategy.attach_model` made of the model: the module the engine runs (e.g. DDP), the
    plain model, and the named parameters the optimizer steps (sharded ones for HSDP)."""

    model: torch.nn.Module
    unwrapped: torch.nn.Module
    named_params: list[tuple[str, torch.nn.Parameter]]


class DataParallelStrategy(ABC):
    """Everything that crosses replicas. A subclass that misses an abstract method fails at construction."""

    parallel_context: Any
    replica: int
    local_rank: int
    # a checkpoint step may copy the state and write it in the background (``checkpoints.async_save``)
    saves_in_background: bool = True
    buckets: "GradBuckets | None" = None  # the flat fp32 gradient buffer the strategy reduces (None: DDP's own)

    @abstractmethod
    def attach_model(
        self, model: torch.nn.Module, named_params: list[tuple[str, torch.nn.Parameter]], device: torch.device
    ) -> AttachedModel:
        """Wrap the model (DDP) or lay its gradients into flat buckets; return what the trainer must use."""

    @abstractmethod
    def forward_backward_reduce(self, step: int, services: StepServices) -> CommittedStep:
        """Plan, compute this rank's microbatches, reduce across replicas: the committed step."""

    @abstractmethod
    def zero_grad(self, state: TrainingState) -> None: ...

    @abstractmethod
    def is_logging_rank(self) -> bool: ...

    @abstractmethod
    def save_checkpoint(self, step: int, write: CheckpointWriter, services: StepServices,
                        extra_state: dict | None = None) -> None:
        """Save the committed state of ``step`` through ``write`` (which ranks write, publish, and agree)."""

    def after_commit(self, step: int, state: TrainingState, services: StepServices) -> None:
        """After the optimizer step (e.g. spare activation: a state transfer)."""

    def finish(self, step: int, services: StepServices) -> None:
        """Called by every rank after the last step."""

    def settle_snapshot(self) -> None:
        """Wait until the node-local snapshot of the last committed step is on disk (a graceful stop, or before a
        checkpoint's I/O, whose failure must not cost the step's snapshot)."""

    def checkpoint_at_stop(self) -> bool:
        """Whether a graceful stop also writes a disk checkpoint: asked for (``checkpoint_on_stop``), or no node-local
        snapshot would hold the step (snapshots off); never without a ``checkpoints`` section. The stock path never
        stops before its last step."""
        return False

    def resume_from_local_snapshot(self, state: TrainingState, newer_than: int | None,
                                   rolled_back: bool = False) -> int | None:
        """Collective at start-up: load the newest committed step kept in node-local snapshots if it is newer than
        ``newer_than`` (the disk checkpoint's step); return it, or None (the stock path keeps none). ``rolled_back``:
        a person set ``latest.txt`` back to that step: no snapshot is loaded, the later ones are dropped."""
        return None

    def startup_share(self) -> tuple[int, int]:
        """(this rank's index, how many ranks) among those that resume together: who verifies which files."""
        return 0, 1

    def gather_at_startup(self, obj: Any) -> list:
        """Every resuming rank's ``obj`` (small, picklable), in the same order on every rank: a start-up decision
        (which checkpoint is intact) is taken from the same findings everywhere."""
        return [obj]

    def startup_complete(self, fault_point: Callable[[], None] = lambda: None) -> None:
        """Called by every rank once it is ready to train (model built, checkpoint loaded); ``fault_point`` fires
        the ``startup:agreed`` fault right after the ranks agreed that start-up is complete."""

    def progress(self, step: int, phase: str) -> None:
        """The main thread reached ``phase`` of ``step`` (for hang detection)."""

    def slow_io(self, what: str) -> AbstractContextManager[Any]:
        """Inside: the main thread does slow I/O (e.g. starting wandb), judged by the I/O allowance, not the step's."""
        return nullcontext()

    def parameter_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the model's parameters are stored in (nanotron: the compute dtype; FSDP2 mixed precision keeps
        fp32 sharded parameters and casts to the compute dtype when it gathers them)."""
        return compute_dtype

    def computes(self) -> bool:
        """Whether this rank computes microbatches (an idle spare does not)."""
        return True

    def pool_ranks(self) -> list[int] | None:
        """The ranks waiting in the pool of recycled survivors (None: this strategy does not recycle)."""
        return None

    def update_replica(self, step: int, services: StepServices, update: Callable[[], None]) -> None:
        """Run the committed step's update (tied gradients, grad-norm clipping, the optimizer: collectives inside
        the replica). A recycling strategy keeps a rank whose replica-mate died in there, in the pool."""
        update()

    def checkpoint_layout(self) -> "CheckpointLayout | None":
        """What goes inside a checkpoint folder (None: nanotron's format)."""
        return None

    def local_rows(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows of a global microbatch that this rank feeds (all of them unless a replica splits rows)."""
        return microbatch

    def clip_grad_norm(self, state: TrainingState, max_norm: float) -> float:
        """Clip the committed gradient to ``max_norm``: nanotron's, over the replica's model-parallel group; where a
        one-rank replica's fp32 gradient is the flat buffer, one norm over it (nanotron's takes a norm per parameter
        and a collective: ~1 % of a step of ``benchmarks/vs_torchft.py``'s model, py-spy)."""
        accumulator = fp32_accumulator(state)
        if self.buckets is not None and accumulator is None and self.parallel_context.mp_pg.size() == 1:
            return self.buckets.clip_norm_(max_norm)
        return clip_grad_norm(self.parallel_context.mp_pg, state.named_params, max_norm, accumulator)

    def sync_tied_gradients(self, state: TrainingState) -> None:
        """SUM the gradients of parameters tied across the replica's ranks (nanotron's tied-weight groups)."""
        sync_tied_gradients(state.unwrapped_model, self.parallel_context, fp32_accumulator(state))
