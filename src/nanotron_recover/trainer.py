"""``RecoverTrainer``: the step loop.

One step reads like a paragraph: plan which global microbatches this replica computes -> forward/backward
them through the pipeline engine (loss / M) -> reduce the gradient across replicas (with in-step recovery) ->
sync tied weights -> clip -> optimizer step -> log.

nanotron 0.4's ``DistributedTrainer`` cannot be imported here (``trainer.py`` imports flash_attn through its
models and hard-codes CUDA), so this trainer reuses its parts instead: ``NamedOptimizer``, the LR scheduler
builder, ``clip_grad_norm``, ``sync_tied_weights_gradients`` and the ``serialize`` checkpoint format.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nanotron_recover.nanotron_compat  # noqa: F401  (nanotron import order)
import torch
from nanotron.helpers import lr_scheduler_builder
from nanotron.optim.clip_grads import clip_grad_norm
from nanotron.optim.named_optimizer import NamedOptimizer
from torch.distributed.tensor import DTensor

from nanotron_recover import devices
from nanotron_recover.checkpoint import CheckpointLayout, CheckpointManager
from nanotron_recover.config import RecoverConfig
from nanotron_recover.data import build_dataset
from nanotron_recover.engines import build_engine, place_microbatch, summed_loss
from nanotron_recover.inject import INJECTED_DIR, FailureInjector
from nanotron_recover.metrics import MetricsLogger
from nanotron_recover.models.llama import build_llama, init_weights
from nanotron_recover.nanotron_compat.tied import sync_tied_gradients

logger = logging.getLogger(__name__)


@dataclass
class LocalWork:
    """What this rank computed in a step: the loss sum (each microbatch's loss / the strategy's ``loss_divisor``:
    M, or M x F for an HSDP rank that holds 1/F of each microbatch's rows) and the microbatch count."""

    loss_sum: float = 0.0
    microbatches: int = 0

    def __iadd__(self, other: "LocalWork") -> "LocalWork":
        self.loss_sum += other.loss_sum
        self.microbatches += other.microbatches
        return self


@dataclass
class CommittedStep:
    """A step's result, identical on every live rank."""

    loss: float
    microbatches: int
    epoch: int = 0
    live_replicas: int = 1
    recoveries: int = 0


class RecoverTrainer:
    """Builds model, optimizer, data and engine for one rank and runs the step loop.

    ``data_parallel`` is the strategy for everything that crosses replicas: the stock path
    (:class:`nanotron_recover.stock.StockDataParallel`) or ReCoVer's
    (:class:`nanotron_recover.recovery.resilient.ResilientDataParallel`).
    """

    def __init__(self, config: RecoverConfig, run_dir: Path, data_parallel: "DataParallelStrategy") -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.dp = data_parallel
        self.parallel_context = data_parallel.parallel_context
        self.device = devices.compute_device()
        self.M = config.microbatches_per_step
        # the schedule also applies with fault tolerance off: the stock path then dies (checkpoint-restart baseline)
        self.injector = FailureInjector(
            config.fault_tolerance.inject if config.fault_tolerance else [],
            data_parallel.replica, data_parallel.local_rank, fired_dir=self.run_dir / INJECTED_DIR,
        )
        self._current_step = 0  # read by the phase hooks

        self.model = build_llama(
            config.model.model_config,
            parallel_context=self.parallel_context,
            parallel_config=config.parallelism,
            dtype=config.model.dtype,
            device=self.device,
        )
        init_weights(self.model, std=_init_std(config), seed=config.general.seed)
        self.injector.maybe_fail(0, "startup:model_build")
        self.named_params = list(self.model.get_named_params_with_correct_tied())
        self.dp.attach_model(self)  # may wrap the model (DDP) or lay gradients into flat buckets
        self.optimizer = self._build_optimizer()
        self.lr_scheduler = lr_scheduler_builder(
            self.optimizer, config.optimizer.learning_rate_scheduler, total_training_steps=config.tokens.train_steps
        )
        self.engine = build_engine(config.parallelism.pp_engine)
        self.dataset = build_dataset(
            config.data, config.tokens, microbatches_per_step=self.M, model_vocab_size=config.model.model_config.vocab_size
        )
        self._install_phase_hooks()
        self.metrics = MetricsLogger(self.run_dir, enabled=self.dp.is_logging_rank(), wandb_config=_wandb_config(config))
        if self.metrics.enabled:
            self.metrics.start_wandb()  # during setup, not as a gap between the first steps
        self.checkpoints = CheckpointManager(config, self.run_dir, layout=self.dp.checkpoint_layout())
        self.step = 0
        self.grad_norm: float | None = None
        self.last_record: dict | None = None  # re-logged by a new logging rank if the old one died

    # ----------------------------------------------------------------------------------------------- building
    def _build_optimizer(self) -> NamedOptimizer:
        args = self.config.optimizer
        fused = bool(args.torch_adam_is_fused) and self.device.type == "cuda"
        return NamedOptimizer(
            named_params_or_groups=self.named_params,
            optimizer_builder=lambda groups: torch.optim.AdamW(
                groups,
                lr=args.learning_rate_scheduler.learning_rate,
                weight_decay=args.weight_decay,
                eps=args.adam_eps,
                betas=(args.adam_beta1, args.adam_beta2),
                fused=fused,
            ),
        )

    def _at(self, phase: str) -> None:
        """A point of the step: progress for the hang monitor, and where a scheduled fault fires."""
        self.dp.progress(self._current_step, phase)
        self.injector.maybe_fail(self._current_step, phase)

    def _install_phase_hooks(self) -> None:
        """Progress and fault injection inside the real computation: a forward pre-hook and a gradient hook, once
        per microbatch (a microbatch is the unit of progress the hang monitor waits for)."""
        local_params = [p for p in self.dp.unwrapped_model.parameters() if p.requires_grad]
        if not local_params:
            return
        self.dp.unwrapped_model.register_forward_pre_hook(lambda *_: self._at("forward"))
        if isinstance(local_params[0], DTensor):
            # FSDP2: autograd sees only the unsharded copies; a sharded parameter's post-accumulate hooks run when
            # its layer's gradient was reduce-scattered. A middle layer's: the shard group is still mid-backward.
            middle = local_params[len(local_params) // 2]
            middle.register_post_accumulate_grad_hook(lambda p: self._at("backward"))
            return
        local_params[0].register_hook(lambda g: self._at("backward") or g)

    # ----------------------------------------------------------------------------------------------- compute
    def compute(self, step: int, indices: Sequence[int], loss_divisor: int) -> LocalWork:
        """Forward/backward the given global microbatches of ``step``; gradients accumulate in place."""
        if len(indices) == 0:
            return LocalWork()
        self._at("dataload")
        unwrapped, pc = self.dp.unwrapped_model, self.parallel_context
        batch = [
            place_microbatch(self.dp.local_rows(self.dataset.microbatch(step, i)), unwrapped, pc, self.device)
            for i in indices
        ]
        outputs = self.engine.train_batch_iter(
            self.dp.model,
            pg=self.parallel_context.pp_pg,
            batch=batch,
            nb_microbatches=len(batch),
            grad_accumulator=None,
            loss_divisor=loss_divisor,
        )
        loss = summed_loss(outputs)  # each microbatch's loss / loss_divisor, on the last stage only
        return LocalWork(loss_sum=float(loss) if loss is not None else 0.0, microbatches=len(indices))

    # ----------------------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        self.step = self.checkpoints.maybe_resume(self)
        self.injector.maybe_fail(0, "startup:checkpoint_load")
        self.dp.startup_complete(self)  # every rank ready: from here on a fault is recovered, not a restart
        total = self.config.tokens.train_steps
        tokens_per_microbatch = self.config.tokens.micro_batch_size * self.config.tokens.sequence_length
        while self.step < total:
            step = self.step + 1
            t0 = time.perf_counter()
            result = self.train_step(step)
            elapsed = time.perf_counter() - t0
            self.step = step
            self.log_step(result, elapsed, result.microbatches * tokens_per_microbatch)
            if self.checkpoints.due(step):
                self._at("checkpoint")
                self.dp.save_checkpoint(self, step)
        self.dp.finish(self)
        self.metrics.close()

    def train_step(self, step: int) -> CommittedStep:
        self._current_step = step
        result = self.dp.forward_backward_reduce(self, step)  # plan -> compute -> reduce (with recovery)
        self._at("optimizer")
        if self.dp.computes():  # an idle spare only keeps its LR schedule in step
            self.dp.sync_tied_gradients(self)
            self.grad_norm = self._clip()
            self.optimizer.step()
        self.lr_scheduler.step()
        self.dp.zero_grad(self)
        self.dp.after_commit(self, step)  # e.g. spare activation, state transfer
        return result

    def _clip(self) -> float | None:
        max_norm = self.config.optimizer.clip_grad
        if max_norm is None:
            return None
        return self.dp.clip_grad_norm(self, max_norm)

    def log_step(self, result: CommittedStep, elapsed: float, tokens_per_step: int) -> None:
        live_procs = result.live_replicas * self.config.ranks_per_replica
        record = {
            "step": self.step,
            "time": time.time(),  # when the step was committed (to line up with fault times)
            "loss": result.loss,
            "lr": self.lr_scheduler.get_last_lr()[0],
            "grad_norm": self.grad_norm,
            "microbatches": result.microbatches,
            "tokens": tokens_per_step,
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_step / elapsed,
            "tokens_per_s_per_process": tokens_per_step / elapsed / live_procs,
            "live_replicas": result.live_replicas,
            "epoch": result.epoch,
            "recoveries": result.recoveries,
        }
        self.last_record = record
        self.metrics.set_logging(self.dp.is_logging_rank())
        if not self.dp.is_logging_rank():
            return
        self.metrics.log_step(record)
        print(
            f"[step {self.step:>5}] loss {result.loss:.6f} lr {record['lr']:.3e} mb {result.microbatches} "
            f"replicas {result.live_replicas} epoch {result.epoch} {elapsed * 1000:.0f} ms",
            flush=True,
        )


class DataParallelStrategy:
    """Everything that crosses replicas. Implemented by the stock path and by ReCoVer's resilient path."""

    parallel_context: object
    model: torch.nn.Module
    unwrapped_model: torch.nn.Module
    replica: int
    local_rank: int

    def attach_model(self, trainer: RecoverTrainer) -> None: ...

    def computes(self) -> bool:
        """Whether this rank computes microbatches (an idle spare does not)."""
        return True

    def startup_complete(self, trainer: RecoverTrainer) -> None:
        """Called by every rank once it is ready to train (model built, checkpoint loaded)."""

    def progress(self, step: int, phase: str) -> None:
        """The main thread reached ``phase`` of ``step`` (for hang detection)."""

    def checkpoint_layout(self) -> "CheckpointLayout | None":
        """What goes inside a checkpoint folder (None: nanotron's format)."""
        return None

    def local_rows(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows of a global microbatch that this rank feeds (all of them unless a replica splits rows)."""
        return microbatch

    def clip_grad_norm(self, trainer: RecoverTrainer, max_norm: float) -> float:
        """Clip the committed gradient to ``max_norm`` (nanotron's, over the replica's model-parallel group)."""
        norm = clip_grad_norm(
            mp_pg=self.parallel_context.mp_pg,
            named_parameters=trainer.named_params,
            max_norm=max_norm,
            grad_accumulator=None,
        )
        return float(norm)

    def sync_tied_gradients(self, trainer: RecoverTrainer) -> None:
        """SUM the gradients of parameters tied across the replica's ranks (nanotron's tied-weight groups)."""
        sync_tied_gradients(self.unwrapped_model, self.parallel_context)

    def forward_backward_reduce(self, trainer: RecoverTrainer, step: int) -> CommittedStep: ...

    def zero_grad(self, trainer: RecoverTrainer) -> None: ...

    def after_commit(self, trainer: RecoverTrainer, step: int) -> None: ...

    def is_logging_rank(self) -> bool: ...

    def save_checkpoint(self, trainer: RecoverTrainer, step: int) -> None: ...

    def finish(self, trainer: RecoverTrainer) -> None:
        """Called by every rank after the last step."""


def _init_std(config: RecoverConfig) -> float:
    init = config.model.init_method
    return float(getattr(init, "std", 0.02))


def _wandb_config(config: RecoverConfig) -> dict:
    return {"project": config.general.project, "name": config.general.run}
