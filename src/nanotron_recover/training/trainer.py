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
import math
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
from nanotron.helpers import lr_scheduler_builder
from nanotron.optim.named_optimizer import NamedOptimizer
from nanotron.optim.optimizer_from_gradient_accumulator import OptimizerFromGradientAccumulator

from nanotron_recover.config import RecoverConfig
from nanotron_recover.data import build_dataset
from nanotron_recover.models.llama import build_llama, init_weights
from nanotron_recover.nanotron_compat.fp32_accumulator import BucketFP32GradientAccumulator, has_low_precision_params
from nanotron_recover.process.inject import FailureInjector
from nanotron_recover.process.startup_clock import STARTUP
from nanotron_recover.process.startup_guard import waiting_for_peers
from nanotron_recover.process.stop_request import StopRequested
from nanotron_recover.run import devices
from nanotron_recover.run.exit_codes import NeedsPerson
from nanotron_recover.run.launch_contract import LaunchContract
from nanotron_recover.run.phases import Phase
from nanotron_recover.training.checkpoint import CheckpointManager
from nanotron_recover.training.checkpoint_resume import settle_root
from nanotron_recover.training.eager_adamw import EagerAdamW
from nanotron_recover.training.engines import build_engine, place_microbatch, summed_loss
from nanotron_recover.training.memory import training_state_bytes
from nanotron_recover.training.metrics import MetricsLogger
from nanotron_recover.training.seam import CommittedStep, DataParallelStrategy, LocalWork, StepServices, StepStop
from nanotron_recover.training.training_state import is_dtensor

logger = logging.getLogger(__name__)
# a graceful stop waits at most this long for a background save, within its grace (stop_grace_s, 25 s by default);
# the relaunch resumes from the stop's node-local snapshot either way
STOP_SETTLE_S = 10.0


class RecoverTrainer:
    """Builds model, optimizer, data and engine for one rank and runs the step loop.

    ``data_parallel`` is the strategy for everything that crosses replicas (:mod:`nanotron_recover.training.seam`): the
    stock path (:class:`nanotron_recover.training.stock.StockDataParallel`) or ReCoVer's
    (:class:`nanotron_recover.recovery.resilient.ResilientDataParallel`). The trainer is the
    :class:`~nanotron_recover.training.seam.TrainingState` it reads and hands it :class:`StepServices`.
    """

    def __init__(self, config: RecoverConfig, run_dir: Path, data_parallel: DataParallelStrategy,
                 launch: LaunchContract | None = None) -> None:
        self.config = config
        self.launch = launch if launch is not None else LaunchContract()  # what the launcher told this rank
        self.run_dir = Path(run_dir)
        self.dp = data_parallel
        self.parallel_context = data_parallel.parallel_context
        self.device = devices.compute_device()
        self.M = config.microbatches_per_step
        # the schedule also applies with fault tolerance off: the stock path then dies (checkpoint-restart baseline)
        self.injector = FailureInjector(
            config.fault_tolerance.inject if config.fault_tolerance else [],
            data_parallel.replica, data_parallel.local_rank, run_dir=self.run_dir, launch_token=self.launch.token,
        )
        self._current_step = 0  # read by the phase hooks
        self._nonfinite_microbatch: int | None = None  # this step's first microbatch whose loss was NaN or inf here

        self._build_replica_state()
        STARTUP.mark("model and optimizer")
        self.engine = build_engine(config.parallelism.pp_engine)
        self.dataset = build_dataset(
            config.data, config.tokens, microbatches_per_step=self.M,
            model_vocab_size=config.model.model_config.vocab_size
        )
        STARTUP.mark("data")
        self.metrics = MetricsLogger(self.run_dir, enabled=self.dp.is_logging_rank(),
                                     wandb_config=_wandb_config(config), launch=self.launch.token)
        self.metrics.slow_io = lambda: self.dp.slow_io(Phase.METRICS_IO)  # a new logging rank starts wandb mid-step
        if self.metrics.enabled:
            self.metrics.start_wandb(background=True)  # beside the set-up and the first steps, not before them
        STARTUP.mark("metrics")
        self.checkpoints = CheckpointManager(config, self.run_dir, layout=self.dp.checkpoint_layout(),
                                             launch_token=self.launch.token)
        self.step = 0
        self.services = StepServices(
            compute=self.compute, fault_point=self._fault_point, metrics=self.metrics,
            last_record=lambda: self.last_record, release_replica=self._release_replica_state,
            rebuild_replica=self._rebuild_replica_state, save_stall=lambda: self._last_save_s,
        )
        self._last_save_s: float | None = None  # this rank's wall time of its last save (the auto cadence's stall)
        self.grad_norm: float | None = None
        self.last_record: dict | None = None  # re-logged by a new logging rank if the old one died

    # ----------------------------------------------------------------------------------------------- building
    def _build_replica_state(self) -> None:
        """Model, gradient layout, optimizer and LR schedule of this rank's coordinate, over ``parallel_context``."""
        config = self.config
        self.model = build_llama(
            config.model.model_config,
            parallel_context=self.parallel_context,
            parallel_config=config.parallelism,
            dtype=self.dp.parameter_dtype(config.model.dtype),
            device=self.device,
        )
        init_weights(self.model, std=_init_std(config), seed=config.general.seed)
        self.injector.maybe_fail(0, "startup:model_build")
        attached = self.dp.attach_model(  # may wrap the model (DDP), shard it, or lay gradients into buckets
            self.model, list(self.model.get_named_params_with_correct_tied()), self.device
        )
        self.engine_model, self.unwrapped_model = attached.model, attached.unwrapped
        self.named_params = attached.named_params
        self.optimizer = self._build_optimizer()
        self.lr_scheduler = lr_scheduler_builder(
            self.optimizer, config.optimizer.learning_rate_scheduler, total_training_steps=config.tokens.train_steps
        )
        self._install_phase_hooks()

    def _release_replica_state(self) -> None:
        """This rank left its replica for the pool (recycling): drop everything built over the replica's torch
        world, so that the world's sockets close and a replica-mate still waiting on us gets an error at once
        (gloo closes a connection only when the last reference to its process group is gone)."""
        self.model = self.engine_model = self.unwrapped_model = None  # type: ignore[assignment]
        self.optimizer = self.lr_scheduler = None
        self.named_params = []
        self.parallel_context = None

    def _rebuild_replica_state(self, parallel_context) -> None:
        """This pool rank joined a new replica: build its coordinate's model over the new torch world, and bring
        the LR schedule to the current step (parameters and optimizer state then come from a live replica)."""
        self.parallel_context = parallel_context
        layout = self.dp.checkpoint_layout()  # HSDP: the shard index it now holds (3D: nanotron's, unchanged)
        if layout is not None:
            self.checkpoints.layout = layout
        self._build_replica_state()
        with warnings.catch_warnings():  # torch warns of a schedule stepped before its optimizer: here on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            for _ in range(self._current_step):  # formed after the commit of this step, whose LR step is done
                self.lr_scheduler.step()

    def _build_optimizer(self) -> NamedOptimizer | OptimizerFromGradientAccumulator:
        """AdamW over the parameters (fp32), or nanotron's mixed-precision recipe (bf16): AdamW over fp32 masters
        whose gradients are the fp32 buckets' ``main_grad`` views, the bf16 parameters refreshed after each step."""
        args = self.config.optimizer
        fused = bool(args.torch_adam_is_fused) and self.device.type == "cuda"

        def adamw(groups):
            return EagerAdamW(  # torch's AdamW, less its compiler's import (eager_adamw.py)
                groups,
                lr=args.learning_rate_scheduler.learning_rate,
                weight_decay=args.weight_decay,
                eps=args.adam_eps,
                betas=(args.adam_beta1, args.adam_beta2),
                fused=fused,
            )

        if not (has_low_precision_params(self.named_params) and args.accumulate_grad_in_fp32):
            # fp32, or bf16 without fp32 accumulation (stock path only, as nanotron: AdamW on the bf16 parameters)
            return NamedOptimizer(named_params_or_groups=self.named_params, optimizer_builder=adamw)
        return OptimizerFromGradientAccumulator(
            gradient_accumulator_builder=BucketFP32GradientAccumulator,
            named_params_or_groups=self.named_params,
            optimizer_builder=lambda groups: NamedOptimizer(named_params_or_groups=groups, optimizer_builder=adamw),
        )

    def _at(self, phase: str) -> None:
        """A point of the current step: progress for the hang monitor, and where a scheduled fault fires."""
        self._fault_point(self._current_step, phase)

    def _fault_point(self, step: int, phase: str) -> None:
        self.dp.progress(step, phase)
        if self.dp.replica is not None and self.dp.replica != self.injector.my_replica:
            self.injector.retarget(self.dp.replica, self.dp.local_rank)  # recycled: faults name the new replica
        self.injector.maybe_fail(step, phase)

    def _install_phase_hooks(self) -> None:
        """Progress and fault injection inside the real computation: a forward pre-hook and a gradient hook, once
        per microbatch (a microbatch is the unit of progress the hang monitor waits for)."""
        local_params = [p for p in self.unwrapped_model.parameters() if p.requires_grad]
        if not local_params:
            return
        self.unwrapped_model.register_forward_pre_hook(
            lambda *_: self._at(Phase.FORWARD) or self._slow_microbatch() or self._maybe_poison())
        if is_dtensor(local_params[0]):
            # FSDP2: autograd sees only the unsharded copies; a sharded parameter's post-accumulate hooks run when
            # its layer's gradient was reduce-scattered. A middle layer's: the shard group is still mid-backward.
            middle = local_params[len(local_params) // 2]
            middle.register_post_accumulate_grad_hook(lambda p: self._at(Phase.BACKWARD))
            return
        local_params[0].register_hook(lambda g: self._at(Phase.BACKWARD) or g)

    def _maybe_poison(self) -> None:
        """A ``signal: nan`` entry fired for this microbatch: the first floating-point output of a layer in its
        forward on this rank becomes NaN (a real non-finite activation: the loss and the gradients follow)."""
        if not self.injector.take_poison():
            return
        handles: list = []

        def poison(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                for handle in handles:
                    handle.remove()
                return output * float("nan")
            return None

        handles.extend(m.register_forward_hook(poison) for m in self.unwrapped_model.modules()
                       if next(m.children(), None) is None)

    def _slow_microbatch(self) -> None:
        """A ``signal: slow`` entry for this rank: this microbatch takes its factor times as long."""
        self.injector.slowdown.microbatch(self._current_step)

    # ----------------------------------------------------------------------------------------------- compute
    def compute(self, step: int, indices: Sequence[int], loss_divisor: int) -> LocalWork:
        """Forward/backward the given global microbatches of ``step``; gradients accumulate in place. The wall
        time goes with the work: it is this replica's measured speed (the rebalancer's input)."""
        if len(indices) == 0:
            return LocalWork()
        started = time.perf_counter()
        self.injector.slowdown.begin()
        self._at(Phase.DATALOAD)
        unwrapped, pc = self.unwrapped_model, self.parallel_context
        batch = [
            place_microbatch(self.dp.local_rows(self.dataset.microbatch(step, i)), unwrapped, pc, self.device)
            for i in indices
        ]
        outputs = self.engine.train_batch_iter(
            self.engine_model,
            pg=self.parallel_context.pp_pg,
            batch=batch,
            nb_microbatches=len(batch),
            grad_accumulator=None,
            loss_divisor=loss_divisor,
        )
        loss = summed_loss(outputs)  # each microbatch's loss / loss_divisor, on the last stage only
        loss_sum = float(loss) if loss is not None else 0.0
        if not math.isfinite(loss_sum) and self._nonfinite_microbatch is None:
            self._nonfinite_microbatch = next(
                i for i, out in zip(indices, outputs) if isinstance(out["loss"], torch.Tensor)
                and not torch.isfinite(out["loss"]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the measured time is the kernels', not their launches'
        self.injector.slowdown.end(step, len(indices))
        return LocalWork(loss_sum=loss_sum, microbatches=len(indices),
                         compute_s=time.perf_counter() - started)

    # ----------------------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        self.step = self._resume()
        if self.dp.saves_in_background:  # room for a background save's copy, on every rank
            self.checkpoints.agree_on_background(self, self.dp)
        STARTUP.mark("state load")
        first_step = self.step + 1
        self.injector.maybe_fail(0, "startup:checkpoint_load")
        # every rank ready: from here on a fault is recovered, not a restart (a peer frozen before: a bounded wait)
        with waiting_for_peers("the start-up agreement"):
            self.dp.startup_complete(fault_point=lambda: self.injector.maybe_fail(0, "startup:agreed"))
        if self.metrics.enabled and STARTUP.seconds is not None:  # what this start-up (a relaunch's cost) was made of
            self.metrics.log_event({"event": "startup", "step": self.step, "seconds": STARTUP.seconds,
                                    "phases_s": STARTUP.phases_s()})
        total = self.config.tokens.train_steps
        tokens_per_microbatch = self.config.tokens.micro_batch_size * self.config.tokens.sequence_length
        saved, epoch = None, 0
        while self.step < total:
            step = self.step + 1
            t0 = time.perf_counter()
            result = self.train_step(step)
            elapsed = time.perf_counter() - t0
            self.step = step
            self.log_step(result, elapsed, result.microbatches * tokens_per_microbatch)
            if step == first_step:
                self._log_training_state(step)  # after the first optimizer step: Adam's state exists
            # a background save: ended (its error raised: after the step's line, since the step is committed), or
            # given up
            self.checkpoints.poll(result.epoch)
            if self.checkpoints.due(step, result.cadence):
                self.dp.settle_snapshot()  # the step's snapshot whole before any checkpoint I/O: a failed save keeps it
                self._at(Phase.CHECKPOINT)
                if self.checkpoints.cadence is not None and self.metrics.enabled:
                    self.metrics.log_event(self.checkpoints.cadence.event(step))
                self.save_checkpoint(step, background=step < total)  # the last step's: written before the exit
                saved = step
            if result.stop is not None:
                self._stop(step, result.stop, saved == step, result.epoch)
            epoch = result.epoch
        if self.config.saves_final_checkpoint and saved != self.step:
            # the trained model is the job's product: the launcher calls a run done only once it is on disk, so a
            # run killed in this save (or resumed at its last step from node-local snapshots) writes it here
            self.save_checkpoint(self.step)
        self.checkpoints.settle(epoch)
        self.dp.finish(self.step, self.services)
        self.metrics.close()

    def _stop(self, step: int, stop: StepStop, saved: bool, epoch: int) -> None:
        """``step`` is the job's last (a stop signal, or a regrow; every rank knows it in the same step). Its
        node-local snapshot is being written (and a checkpoint where the config asks): wait for it, then end."""
        self.dp.settle_snapshot()
        if self.dp.checkpoint_at_stop() and not saved:
            self._at(Phase.CHECKPOINT)
            self.save_checkpoint(step, extra_state={"stopped": stop.event})
        # a background save of this step (or an earlier one) on disk, but within the stop's grace: the relaunch
        # reads the snapshot anyway
        self._at(Phase.CHECKPOINT)
        self.checkpoints.settle(epoch, within_s=STOP_SETTLE_S)
        if self.metrics.enabled:
            self.metrics.log_event({"event": stop.event, "step": step, "reason": stop.reason})
        raise StopRequested(stop.reason)

    def _resume(self) -> int:
        """The step to continue after (0: from scratch). The newest intact checkpoint is chosen on every rank alike
        (damaged ones are reported and set aside); the newest committed step held in this run's node-local
        snapshots wins when it is newer. A checkpoint that existed with none intact and no snapshot to take over
        ends the job for a person."""
        choice = self.checkpoints.choose(self.dp)
        self.checkpoints.start_cadence(choice.step)
        if self.dp.startup_share()[0] == 0:
            settle_root(self.checkpoints.root, choice, say=lambda line: print(f"[nanotron-recover] {line}", flush=True))
        if choice.damaged and self.metrics.enabled:
            self.metrics.log_event({"event": "checkpoint_damaged", "problems": choice.damaged,
                                    "resumed_from": str(choice.path) if choice.path else None})
        # this run's own, if any; none after a person set latest.txt back (the same answer on every rank)
        local = self.dp.resume_from_local_snapshot(self, newer_than=choice.step, rolled_back=bool(choice.rolled_back))
        if local is not None:
            if choice.step is not None and self.metrics.enabled:
                print(f"[nanotron-recover] the node-local snapshot of step {local} is newer than the checkpoint of "
                      f"step {choice.step} ({choice.path}): resuming from the snapshot. To resume from an older "
                      "checkpoint, write its step into latest.txt and relaunch (docs/operations.md, rolling back)",
                      flush=True)
            return local
        if choice.path is None:
            if choice.damaged:
                raise NeedsPerson("damaged checkpoint", f"no intact checkpoint to fall back to: {choice.damaged[0]}",
                                  file=choice.damaged[0].split(":")[0])
            return 0
        return self.checkpoints.load(self, choice, self.dp)

    def _log_training_state(self, step: int) -> None:
        """Bytes of training state per parameter on the logging rank (``benchmarks/precision_bench.py``)."""
        if self.metrics.enabled:
            state = training_state_bytes(self.named_params, self.optimizer, getattr(self.dp, "buckets", None))
            self.metrics.log_event({"event": "training_state", "step": step, "dtype": str(self.config.model.dtype),
                                    **state})

    def train_step(self, step: int) -> CommittedStep:
        self._current_step, self._nonfinite_microbatch = step, None
        result = self.dp.forward_backward_reduce(step, self.services)  # plan -> compute -> reduce (with recovery)
        if result.nonfinite is not None:  # the same on every rank: never committed, saved or snapshotted
            self.checkpoints.settle(result.epoch, within_s=STOP_SETTLE_S)  # the last finite state's save: on disk
            raise self._nonfinite_step(step, result.nonfinite)
        self._at(Phase.OPTIMIZER)
        if self.dp.computes():  # an idle spare only keeps its LR schedule in step
            self.dp.update_replica(step, self.services, self._update_weights)
        if self.lr_scheduler is not None:  # None: a rank in the pool (recycling) holds no model
            self.lr_scheduler.step()
        self.dp.zero_grad(self)
        self.dp.after_commit(step, self, self.services)  # e.g. spare activation, state transfer
        return result

    def _nonfinite_step(self, step: int, what: str) -> NeedsPerson:
        """The error that ends the run at a non-finite step; a rank whose own microbatch's loss was non-finite
        names it (the launcher repeats the lowest one)."""
        found = self._nonfinite_microbatch
        where = "" if found is None else f"; global microbatch {found} (replica {self.dp.replica}) was non-finite here"
        return NeedsPerson("non-finite step", f"step {step} was not committed: {what}{where}; the state of step "
                           f"{step - 1} is kept (latest.txt, node-local snapshots)", nonfinite_step=step,
                           nonfinite_microbatch=None if found is None else {"microbatch": found,
                                                                            "replica": self.dp.replica})

    def _update_weights(self) -> None:
        self.dp.sync_tied_gradients(self)
        self.grad_norm = self._clip()
        self.optimizer.step()

    def save_checkpoint(self, step: int, extra_state: dict | None = None, background: bool = False) -> None:
        """Save the committed state of ``step``; the strategy decides who writes and publishes. ``background``:
        where the config and the strategy allow, the files are written while training goes on."""
        # a save may take up to startup_timeout_s (the hang monitor's allowance)
        self.dp.progress(step, Phase.CHECKPOINT)
        background = background and self.checkpoints.background and self.dp.saves_in_background

        def write(writer: bool, barrier: Callable[[], None], publisher: bool, extra: dict | None, writers: int) -> None:
            self.checkpoints.save(self, step, writer=writer, barrier=barrier, publisher=publisher, extra_state=extra,
                                  writers=writers,
                                  fault_point=lambda phase: self._fault_point(step, phase), background=background,
                                  background_fault=lambda phase: self.injector.maybe_fail(step, phase))

        started = time.perf_counter()
        self.dp.save_checkpoint(step, write, self.services, extra_state=extra_state)
        self._last_save_s = time.perf_counter() - started  # what the save cost the training (the cadence's stall)

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
            "lr": self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else None,
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
        pool = self.dp.pool_ranks()
        if pool is not None:
            record["pool_ranks"] = pool
        if result.quotas is not None:
            record["quotas"] = {str(r): n for r, n in sorted(result.quotas.items())}
        record.update(result.balance or {})  # speeds per replica (resilient path), drained stragglers
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


def _init_std(config: RecoverConfig) -> float:
    init = config.model.init_method
    return float(getattr(init, "std", 0.02))


def _wandb_config(config: RecoverConfig) -> dict:
    return {"project": config.general.project, "name": config.general.run}
