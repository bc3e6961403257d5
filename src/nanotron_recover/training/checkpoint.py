"""Checkpoints, written atomically, and auto-resume from ``latest.txt``.

What goes inside a checkpoint folder is a :class:`CheckpointLayout`: nanotron's own format for 3D replicas
(:class:`NanotronLayout`), per-rank shard files for FSDP replicas (``nanotron_recover.hsdp.checkpoint``).
``trainer_state.json`` (written last) names the layout, the step and M.

A save goes to a hidden temporary folder. Each writer writes its files into a part folder of its own, fsyncs them,
moves them into the save's folder and records their checksums (``.writers/<id>.done``); in the background
(``checkpoints.async_save``, :mod:`nanotron_recover.training.checkpoint_background`) a thread does this from a host
copy of the state while training goes on. Once every writer is done the publisher seals the state file (the
writers' checksums), marks the folder as publishing (:data:`PUBLISHING_MARKER`), renames it into place, replaces
``latest.txt`` (write temp file, fsync, ``os.replace``; never to an older step) and then removes the marker. A
process killed mid-save leaves the previous checkpoint and ``latest.txt`` valid; one killed between the rename and
the pointer leaves a marked folder that the relaunch adopts (:mod:`nanotron_recover.training.checkpoint_resume`).
A relative ``checkpoints.checkpoints_path`` lives in the run dir.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from nanotron.serialize import load_weights, save_meta, save_weights
from nanotron.serialize.optimizer import load_lr_scheduler, load_optimizer, save_lr_scheduler, save_optimizer

from nanotron_recover.config import RecoverConfig, snapshots_on
from nanotron_recover.nanotron_compat.frozen_state import (
    FrozenModel,
    FrozenOptimizer,
    FrozenScheduler,
    host_copy,
    tensor_bytes,
)
from nanotron_recover.nanotron_compat.quiet_save import install_quiet_weight_save
from nanotron_recover.nanotron_compat.serialize import install_cpu_optimizer_check
from nanotron_recover.run import fence
from nanotron_recover.run.disk_space import DiskFull, is_disk_full, written_path
from nanotron_recover.run.exit_codes import NeedsPerson
from nanotron_recover.run.run_folder import PARTIAL_SAVE_PREFIX, fsync_dir, write_atomically
from nanotron_recover.training.checkpoint_background import (
    WRITERS,
    BackgroundSave,
    CapturedWrite,
    announce_writer,
    host_room_bytes,
    wait_for_writers,
    write_part,
    writer_id,
)
from nanotron_recover.training.checkpoint_cadence import CheckpointCadence
from nanotron_recover.training.checkpoint_integrity import (
    CHECKSUM_KIND,
    FILES_KEY,
    PUBLISHING_MARKER,
    STATE_FILE,
    sealed_state_text,
    verify_folder,
)
from nanotron_recover.training.checkpoint_resume import (  # noqa: F401 - resolve_checkpoint: the checkpoints' public helper
    DAMAGED_SUFFIX,
    LATEST,
    ROLLED_BACK_SUFFIX,
    ResumeChoice,
    StartupPeers,
    choose_intact,
    is_publishing,
    latest_step,
    numbered_checkpoints,
    resolve_checkpoint,
    set_aside,
    unmark_published,
)
from nanotron_recover.training.training_state import local_tensor

ROOM_FACTOR = 1.25  # a background save's host copy needs this much more than its bytes free (the rest of the host)
STATE_BYTES_PER_PARAM = 16  # what a copy holds per parameter at most: weights, fp32 masters, two Adam moments

install_cpu_optimizer_check()  # nanotron 0.4's load_optimizer moves state to "cuda" for a sanity check
install_quiet_weight_save()  # nanotron 0.4's save_weights draws a progress bar on every writing rank, every save

if TYPE_CHECKING:
    from nanotron_recover.training.training_state import TrainingState

LAYOUT_NANOTRON = "nanotron"  # trainer_state.json "layout" values (absent in older checkpoints: nanotron)
LAYOUT_HSDP = "hsdp"


def _fsync_folders(folder: Path) -> None:
    """The entries of every folder under ``folder``, deepest first (each writer made its own files durable)."""
    for path in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(path)
    fsync_dir(folder)



class CheckpointLayout(Protocol):
    """How model, optimizer and LR scheduler are laid out inside a checkpoint folder."""

    def write(self, trainer: "TrainingState", folder: Path, step: int) -> None:
        """This rank's files of the live state (no collective); ``folder`` exists."""

    def capture(self, trainer: "TrainingState", step: int) -> tuple[CapturedWrite, int]:
        """A host copy of this rank's committed state, and the bytes it holds; the returned callable writes exactly
        the files :meth:`write` writes, from the copy (in a background thread, while training goes on)."""

    def read(self, trainer: "TrainingState", folder: Path) -> None:
        """Load into this rank's model, optimizer and LR scheduler."""


class NanotronLayout:
    """nanotron 0.4's ``serialize`` format (weights as safetensors per TP/PP shard, optimizer, LR scheduler)."""

    def capture(self, trainer: "TrainingState", step: int) -> tuple[CapturedWrite, int]:
        weights = host_copy(trainer.unwrapped_model.state_dict())
        optimizer = host_copy(trainer.optimizer.state_dict())
        scheduler = copy.deepcopy(trainer.lr_scheduler.state_dict())
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)  # the pinned copies were queued without waiting
        frozen = (FrozenModel(trainer.unwrapped_model, weights), FrozenOptimizer(trainer.optimizer, optimizer),
                  FrozenScheduler(scheduler))
        meta, pc = self._meta(trainer, step), trainer.parallel_context  # read now, not when the thread runs
        return (lambda folder: self._save(pc, *frozen, folder, meta)), tensor_bytes([weights, optimizer])

    def write(self, trainer: "TrainingState", folder: Path, step: int) -> None:
        self._save(trainer.parallel_context, trainer.unwrapped_model, trainer.optimizer, trainer.lr_scheduler, folder,
                   self._meta(trainer, step))

    @staticmethod
    def _meta(trainer: "TrainingState", step: int) -> dict:
        return {"last_train_step": step,
                "consumed_train_samples": step * trainer.M * trainer.config.tokens.micro_batch_size}

    @staticmethod
    def _save(pc: Any, model: Any, optimizer: Any, scheduler: Any, folder: Path, meta: dict) -> None:
        save_weights(model, pc, folder)
        save_optimizer(optimizer, pc, folder)
        save_lr_scheduler(scheduler, pc, folder)
        save_meta(pc, folder, meta)

    def read(self, trainer: "TrainingState", folder: Path) -> None:
        pc = trainer.parallel_context
        load_weights(trainer.unwrapped_model, pc, folder)
        load_optimizer(trainer.optimizer, pc, folder, map_location=str(trainer.device))
        load_lr_scheduler(trainer.lr_scheduler, folder)


def layout_state(config: RecoverConfig) -> dict:
    """The ``trainer_state.json`` keys that say which runs can resume a checkpoint (besides M)."""
    if config.sharded_replicas:
        return {"layout": LAYOUT_HSDP, "fsdp_shard_size": config.fault_tolerance.fsdp_shard_size}
    return {"layout": LAYOUT_NANOTRON}


def dtype_name(config: RecoverConfig) -> str:
    return str(config.model.dtype).removeprefix("torch.")


def check_resumable(source: Path, config: RecoverConfig) -> None:
    """Same M, the same model dtype (a bf16 checkpoint holds fp32 masters, a float32 one does not), and a layout
    this run reads: nanotron (3D replicas) or HSDP shards of the same shard size."""
    check_same_microbatches(source, config.microbatches_per_step)
    saved = json.loads((source / STATE_FILE).read_text())
    saved_dtype = saved.get("dtype", "float32")  # older checkpoints: float32 runs
    if saved_dtype != dtype_name(config):
        raise ValueError(
            f"{source} was trained with model.dtype: {saved_dtype}, this run has {dtype_name(config)}: "
            "resume with the same dtype"
        )
    saved_layout = {"layout": saved.get("layout", LAYOUT_NANOTRON), "fsdp_shard_size": saved.get("fsdp_shard_size")}
    wanted = {"fsdp_shard_size": None, **layout_state(config)}
    if saved_layout != wanted:
        raise ValueError(f"{source} holds {_describe(saved_layout)}; this run needs {_describe(wanted)}")


def _describe(layout: dict) -> str:
    if layout["layout"] == LAYOUT_HSDP:
        return f"HSDP shards of fsdp_shard_size={layout['fsdp_shard_size']}"
    return f"the {layout['layout']} format (3D replicas)"


def check_same_microbatches(source: Path, microbatches_per_step: int) -> None:
    """A checkpoint continues only a run with the same global microbatch count M (else each step's samples differ)."""
    saved = json.loads((source / STATE_FILE).read_text()).get("microbatches_per_step")
    if saved != microbatches_per_step:
        raise ValueError(
            f"{source} was trained with {saved} microbatches per step, this run has {microbatches_per_step} "
            "(dp x batch_accumulation_per_replica): the samples of each step would differ"
        )


def own_root(config: RecoverConfig, run_dir: Path | None) -> Path | None:
    """The run's own checkpoint root (None only for a relative ``checkpoints_path`` with no run dir to put it in)."""
    path = Path(config.checkpoints.checkpoints_path) if config.checkpoints is not None else Path("checkpoints")
    if path.is_absolute():
        return path
    return None if run_dir is None else Path(run_dir) / path


def resumes_own_checkpoints(root: Path | None) -> bool:
    """Whether a launch resumes from the run's own checkpoints rather than from ``resume_checkpoint_path``: once the
    run has any. The one rule for :meth:`CheckpointManager.choose` and the launcher's preflight."""
    return root is not None and bool(numbered_checkpoints(root))


class CheckpointManager:
    def __init__(self, config: RecoverConfig, run_dir: Path, layout: CheckpointLayout | None = None,
                 launch_token: str = "0") -> None:
        self.config = config
        # a temporary folder is named for its launch (and world epoch): a writer of another launch (a frozen node
        # that thaws) or of an earlier attempt at this step can never publish what this one wrote
        self.launch_token = launch_token
        self.layout = layout if layout is not None else NanotronLayout()
        args = config.checkpoints
        self.interval = args.checkpoint_interval if args is not None else None  # steps, or "auto" (cadence)
        self.cadence = _cadence_of(config) if self.interval == "auto" else None
        root = own_root(config, Path(run_dir))
        assert root is not None  # a run dir is given
        self.root = root
        self.resume_path = Path(args.resume_checkpoint_path) if args and args.resume_checkpoint_path else None
        self.background = bool(getattr(args, "async_save", False))  # the strategy may still save in the step
        self._pending: BackgroundSave | None = None

    def due(self, step: int, cadence_inputs: tuple[float | None, float | None] = (None, None)) -> bool:
        """Whether committed ``step`` is saved: every ``interval`` steps, or as the ``auto`` cadence decides from
        the step's agreed (step time, save stall) (the same answer on every rank)."""
        if self.cadence is not None:
            self.cadence.observe(*cadence_inputs)
            return self.cadence.due(step)
        return isinstance(self.interval, int) and step % self.interval == 0

    def start_cadence(self, newest: int | None) -> None:
        """The ``auto`` cadence counts from ``newest``, the step of the newest checkpoint on disk (agreed at resume;
        None: none): a relaunch does not restart its clock."""
        if self.cadence is not None:
            self.cadence.last_saved = newest or 0

    def latest(self) -> Path | None:
        return resolve_checkpoint(self.root) if self.root.is_dir() else None

    def save(
        self,
        trainer: "TrainingState",
        step: int,
        *,
        writer: bool,
        barrier: Callable[[], None],
        publisher: bool,
        extra_state: dict | None = None,
        writers: int = 1,
        fault_point: Callable[[str], None] = lambda phase: None,
        background: bool = False,
        background_fault: Callable[[str], None] = lambda phase: None,
    ) -> None:
        """Collective over the ``writers`` writing ranks (one full model copy); ``publisher`` renames it into place.
        ``fault_point(phase)``: progress and the fault schedule inside the save (``checkpoint-write`` once this
        rank's part is written, ``checkpoint-publish`` between the rename and ``latest.txt``). ``background``: copy
        the state and return; a thread writes it (:mod:`nanotron_recover.training.checkpoint_background`), where
        ``background_fault`` gives the fault schedule its points (``checkpoint-background`` once the part is
        written, ``checkpoint-publish``). At most one save is in flight: an earlier one is finished first."""
        if not writer:
            return
        fence.guard(f"checkpoint {step}")  # before _saved_already, which may move latest.txt or set a folder aside
        epoch = int((extra_state or {}).get("epoch", 0))
        self.settle(epoch)  # this writer's earlier save finished (or given up): the leftovers below are dead
        barrier()  # every writer's: a publisher's thread may still be publishing this step (a save retried after a
        # repair), and the verdict below must be read from the same files by every writer
        tmp = self.root / f"{PARTIAL_SAVE_PREFIX}{step}-{self.launch_token}-e{epoch}"
        if self._saved_already(step, publisher):
            return
        me = writer_id()
        try:
            captured = self.layout.capture(trainer, step)[0] if background else None
            announce_writer(tmp, me)
            barrier()  # every writer announced (and holds its copy): the publisher knows whom to wait for
            if publisher:
                for leftover in self.root.glob(f"{PARTIAL_SAVE_PREFIX}*"):  # dead writers' (the lock is ours)
                    if leftover != tmp:
                        shutil.rmtree(leftover, ignore_errors=True)
            if captured is not None:
                work = self._background_work(captured, tmp, me, step, trainer.M, publisher, writers, extra_state,
                                             background_fault)
                self._pending = BackgroundSave(step, epoch, tmp, work)
                return
            write_part(lambda folder: self.layout.write(trainer, folder, step), tmp, me)
            fault_point("checkpoint-write")
            barrier()  # every part written
            if publisher:
                files = wait_for_writers(tmp, threading.Event(), writers)  # done: the barrier said so
                assert files is not None
                self._publish(tmp, step, trainer.M, extra_state, files, fault_point)
        except Exception as e:
            if not is_disk_full(e, self.root):
                raise
            raise self._disk_full(e, tmp) from e

    def _disk_full(self, error: BaseException, tmp: Path) -> DiskFull:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing partial stays: it holds the space a person must free
        return DiskFull(written_path(error, tmp), error)

    def agree_on_background(self, trainer: "TrainingState", peers: StartupPeers) -> None:
        """At start-up, every rank alike: whether this run's checkpoints are written in the background. Each rank
        needs host memory for its copy (its weights, fp32 masters and Adam moments, for every rank of its node at
        once); where one lacks it, the whole run saves in the step (said once). Agreed so that every writer of a
        save takes the same path."""
        if not self.background:  # the config's: the same on every rank
            return
        params = sum(local_tensor(p).numel() for _, p in trainer.named_params)  # this rank's shard (HSDP)
        node_ranks = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))  # Open MPI's: this node's ranks
        need = params * STATE_BYTES_PER_PARAM * node_ranks
        room = host_room_bytes()
        fits = room is None or need * ROOM_FACTOR <= room
        verdicts = peers.gather_at_startup((fits, need, room))
        if not all(v[0] for v in verdicts):
            self.background = False
            _, need, room = next(v for v in verdicts if not v[0])
            if peers.startup_share()[0] == 0:
                print(f"[nanotron-recover] checkpoints are written in the step, not in the background: a node's ranks "
                      f"need {need / 2**20:.0f} MiB for their copies, {room / 2**20:.0f} MiB of host memory are "
                      "available", flush=True)

    def _background_work(self, captured: CapturedWrite, tmp: Path, me: str, step: int, microbatches: int,
                         publisher: bool, writers: int, extra_state: dict | None,
                         fault: Callable[[str], None]) -> Callable[[threading.Event], None]:
        def work(given_up: threading.Event) -> None:
            try:
                write_part(captured, tmp, me, before_done=lambda: fault("checkpoint-background"))
                if not publisher:
                    return
                files = wait_for_writers(tmp, given_up, writers)
                if files is not None:  # None: given up (the world changed); the folder is a leftover
                    self._publish(tmp, step, microbatches, extra_state, files, fault)
            except Exception as e:
                if is_disk_full(e, self.root):  # at once: the partial folder holds the space that the run's next
                    raise self._disk_full(e, tmp) from e  # write (a metrics line, an exit record) needs
                raise
        return work

    def poll(self, epoch: int) -> None:
        """At a step boundary: a save in flight is given up once the world changed (a new ``epoch``); one that
        ended is cleared, and its error raised (a full disk ends the job as in the step)."""
        pending = self._pending
        if pending is None:
            return
        if epoch != pending.epoch:
            pending.give_up()
        if not pending.done():
            return
        self._pending = None
        error = pending.error()
        if error is not None:
            raise error  # a full disk is a DiskFull already (its folder removed by the thread)

    def settle(self, epoch: int, within_s: float | None = None) -> None:
        """Wait for the save in flight (given up first if the world changed since it began), then :meth:`poll`.
        ``within_s``: give it up once this long has passed (its own files are still written)."""
        pending = self._pending
        if pending is None:
            return
        if epoch != pending.epoch:
            pending.give_up()
        elif not pending.done():
            print(f"[nanotron-recover] waiting for the background save of step {pending.step}", flush=True)
        pending.wait(within_s)
        if not pending.done():
            print(f"[nanotron-recover] the background save of step {pending.step} is given up: not done within "
                  f"{within_s:g} s", flush=True)
            pending.give_up()
            pending.wait()
        self.poll(epoch)

    def _saved_already(self, step: int, publisher: bool) -> bool:
        """Whether ``root/step`` is this run's intact save of ``step`` (the fallback save right after an interval
        save; the writer's own publish that died before the pointer, which the pointer then follows). Every writer
        reaches the same verdict from the files alone: the marker is read before the pointer (the publisher writes
        the pointer, then removes the marker). A folder that is not (damaged: ``N.damaged``; past a pointer moved
        back by hand: ``N.rolled-back``) is set aside by the publisher and the step written anew."""
        folder = self.root / str(step)
        if not (folder / STATE_FILE).is_file():
            return False
        own = is_publishing(folder) or (latest_step(self.root) or 0) >= step
        problems = verify_folder(folder) if own else []  # the whole check on each writer: a rare path
        if own and not problems:
            if publisher:
                self._point_at(step)
            return True
        if publisher:
            target = set_aside(folder, DAMAGED_SUFFIX if own else ROLLED_BACK_SUFFIX)
            why = problems[0] if problems else f"newer than {self.root / LATEST}, which a person moved back"
            print(f"[nanotron-recover] {folder} is not this run's save of step {step} ({why}): set aside as "
                  f"{target.name}, saving anew", flush=True)
        return False

    def _point_at(self, step: int) -> None:
        """``latest.txt`` names ``step`` (never moved back), then the publish is finished: the marker goes."""
        if (latest_step(self.root) or 0) < step:
            write_atomically(self.root / LATEST, f"{step}\n", durable=True)
        unmark_published(self.root, latest_step(self.root) or step)

    def _publish(self, tmp: Path, step: int, microbatches: int, extra_state: dict | None,
                 files: dict[str, dict], fault_point: Callable[[str], None]) -> None:
        """Every writer is done (``files``: what they wrote, with checksums): seal the state, rename into place,
        point ``latest.txt`` at it."""
        final = self.root / str(step)
        shutil.rmtree(tmp / WRITERS, ignore_errors=True)
        _fsync_folders(tmp)  # the writers' files are durable; the folders holding them, now
        state = {
            "step": step,
            "microbatches_per_step": microbatches,
            "dtype": dtype_name(self.config),
            **layout_state(self.config),
            **(extra_state or {}),
            "checksum": CHECKSUM_KIND,
            FILES_KEY: files,
        }
        write_atomically(tmp / STATE_FILE, sealed_state_text(state), durable=True)
        fence.guard(f"the publish of checkpoint {step}")  # the write took long: the launch may be another now
        write_atomically(tmp / PUBLISHING_MARKER, f"{tmp.name}\n", durable=True)  # until the pointer names it
        shutil.rmtree(final, ignore_errors=True)  # a partial folder can only be a leftover; the state file was absent
        os.replace(tmp, final)
        fsync_dir(self.root)
        fault_point("checkpoint-publish")
        self._point_at(step)  # never back: a given-up save of an older step that still finished cannot win

    def choose(self, peers: StartupPeers) -> ResumeChoice:
        """Collective at start-up: the newest intact checkpoint (:mod:`nanotron_recover.training.checkpoint_resume`). An
        explicit ``resume_checkpoint_path`` starts a run; once the run has checkpoints of its own, its relaunches
        resume from those (and from its node-local snapshots), as the launcher says, not from that path again."""
        source = self.resume_path
        if source is not None and resumes_own_checkpoints(self.root):
            if peers.startup_share()[0] == 0:
                print(f"[nanotron-recover] this run has checkpoints of its own in {self.root}: resuming from them "
                      f"(checkpoints.resume_checkpoint_path {source} started the run)", flush=True)
            source = None
        return choose_intact(self.root, source, peers)

    def load(self, trainer: "TrainingState", choice: ResumeChoice, peers: StartupPeers) -> int:
        """Collective: load the chosen checkpoint into model, optimizer and LR scheduler; return its step. A read
        that fails on any rank (an older checkpoint without checksums, damaged) ends the job for a person."""
        source = choice.path
        assert source is not None and choice.step is not None
        check_resumable(source, self.config)
        try:
            self.layout.read(trainer, source)
            error = None
        except Exception as e:  # noqa: BLE001 - whatever the format's reader raises on a damaged file
            error = f"{source} cannot be loaded: {type(e).__name__}: {e}"
        errors = [e for e in peers.gather_at_startup(error) if e]
        if errors:
            raise NeedsPerson("damaged checkpoint", errors[0], file=str(source))
        if peers.startup_share()[0] == 0:  # every rank loaded; one says so
            print(f"[nanotron-recover] resumed from {source} at step {choice.step}", flush=True)
        return choice.step


def _cadence_of(config: RecoverConfig) -> CheckpointCadence:
    """The ``auto`` cadence's MTBF: with node-local snapshots on, a disk checkpoint is read only once every copy of
    the committed step is lost; with them off, after every fault that ends the job."""
    ck, ft = config.checkpoints, config.fault_tolerance
    mtbf_h = ck.all_snapshots_lost_h if snapshots_on(ft.local_snapshot_interval) else ft.relaunch_mtbf_h
    return CheckpointCadence(mtbf_s=mtbf_h * 3600.0, min_s=ck.checkpoint_min_interval_s,
                             max_s=ck.checkpoint_max_interval_h * 3600.0)
