"""Flat fp32 gradient buckets with per-bucket snapshots keyed by (step, world epoch).

Why one flat buffer: every parameter's gradient lives in one contiguous fp32 tensor, so a bucket is a plain 1-D
slice that MPI can reduce in place (zero-copy numpy view on CPU), and a snapshot is one ``copy_`` per bucket.

Layout: parameters are laid out in **reverse** registration order (like DDP), so bucket 0 holds the last layers,
whose gradients are ready first in backward; a trainer that overlaps reduction with backward can start with
bucket 0. A bucket is closed when adding the next parameter would exceed ``bucket_cap_mb``; a parameter is never
split, so a parameter larger than the cap gets a bucket of its own.

Gradient accumulation:

* **fp32 parameters (main path)**: ``param.grad`` *is* a view into the flat buffer. Autograd's accumulator adds
  into an existing ``.grad`` in place, so several backward passes accumulate into the buffer with no copy. This
  holds only while ``.grad`` stays bound: the trainer must call :meth:`GradBuckets.zero_` instead of
  ``optimizer.zero_grad()`` (whose ``set_to_none=True`` would drop the view; :meth:`zero_` re-binds if it finds
  that happened).
* **other dtypes** (bf16/fp16 parameters): a gradient's dtype must equal its parameter's, so ``.grad`` cannot be
  an fp32 view. ``param.main_grad`` is the fp32 view instead, and a post-accumulate-grad hook adds each fresh
  low-precision ``.grad`` into it and drops ``.grad``. The optimizer must then read ``main_grad`` (e.g. fp32 master
  weights). ``main_grad`` is set for fp32 parameters too, so the trainer can always read ``main_grad``.

Sharded parameters (HSDP, torch FSDP2): a parameter that is a ``DTensor`` contributes its *local shard*; its
``.grad`` is bound as a ``DTensor`` whose local tensor is the flat-buffer view. FSDP2 accumulates each
reduce-scattered gradient into an existing sharded ``.grad`` in place, so the buffer fills with no copy.

Snapshots: ``snapshot_slots`` full-size buffers are allocated once; a step occupies one slot from its first
snapshot until :meth:`GradBuckets.release`. Nothing on the step path allocates.

Restore protocol (why it is always exact): a bucket must be snapshotted (:meth:`snapshot_bucket`) before its
reduction starts. So after a failed reduction a bucket is either snapshotted (possibly reduced or half-reduced:
restore it) or not snapshotted in this attempt (never touched: keep it). :meth:`restore` copies back exactly the
buckets snapshotted in the current attempt, then **ends the attempt** (clears the marks): the survivors now add
orphaned microbatches on top, which makes the old snapshots stale, and the retry in the new epoch snapshots each
bucket again before reducing it. Re-snapshotting a bucket within one attempt raises, because its buffer may
already hold a (partial) reduction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as torch_dist

from nanotron_recover.run.devices import needs_host_staging
from nanotron_recover.training.training_state import is_dtensor, local_tensor

_FP32_BYTES = 4
CLIP_EPS = 1.0e-6  # nanotron's (optim/clip_grads.py)


class GradBuckets:
    """All gradients of ``named_params`` in one contiguous fp32 buffer, cut into buckets.

    Args:
        named_params: ``(name, param)`` pairs in registration order; params without ``requires_grad`` are
            skipped, repeated (tied) params are kept once.
        bucket_cap_mb: maximum bucket size in MiB (> 0); one oversized param may exceed it alone.
        device: where the buffer lives; every param must be on it.
        snapshot_slots: how many steps may hold snapshots at the same time (1 = one step in flight; 0 = none, for
            a path without recovery).
        snapshot_device: where snapshots live (default ``device``; ``cpu`` trades copy speed for GPU memory).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        bucket_cap_mb: float,
        device: torch.device | str,
        *,
        snapshot_slots: int = 1,
        snapshot_device: torch.device | str | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if snapshot_slots < 0:
            raise ValueError(f"snapshot_slots must be >= 0, got {snapshot_slots}")
        self.device = torch.device(device)
        self.cap_numel = max(1, int(bucket_cap_mb * 2**20) // _FP32_BYTES)
        self._lay_out(_trainable_params(named_params, self.device))
        self._allocate_buffer()
        self._allocate_host_staging()
        self._allocate_snapshots(snapshot_slots, snapshot_device)

    def _lay_out(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Offsets of every parameter and the bucket ranges: reverse registration order (the last layers'
        gradients are ready first in backward), greedy packing under the cap, a parameter never split."""
        self._params = list(reversed(params))
        self._offsets: list[tuple[int, int]] = []
        self.bucket_ranges: list[tuple[int, int]] = []
        self._bucket_params: list[list[str]] = [[]]
        self._bucket_of: dict[str, int] = {}
        start = off = 0
        for name, p in self._params:
            n = local_tensor(p).numel()
            if off > start and off + n - start > self.cap_numel:
                self.bucket_ranges.append((start, off))
                self._bucket_params.append([])
                start = off
            self._bucket_params[-1].append(name)
            self._bucket_of[name] = len(self.bucket_ranges)
            self._offsets.append((off, off + n))
            off += n
        self.bucket_ranges.append((start, off))
        self.numel = off

    def _allocate_buffer(self) -> None:
        """The flat fp32 buffer, its bucket and parameter views, and each gradient bound to its view (once:
        nothing on the step path allocates)."""
        self.flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._views = [self.flat[a:b] for a, b in self.bucket_ranges]
        self._param_views = [
            self.flat[a:b].view(local_tensor(p).shape) for (a, b), (_, p) in zip(self._offsets, self._params)
        ]
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._bind()

    def _allocate_host_staging(self) -> None:
        """Host copies for MPI where the buffer is on a device MPI cannot read (CUDA: the Open MPI wheel is not
        CUDA-aware); on CPU the numpy views are zero-copy views of the buffer itself."""
        if needs_host_staging(self.device):
            self._host = torch.empty(self.numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())
            self._host_views = [self._host[a:b] for a, b in self.bucket_ranges]
        else:
            self._host = None
            self._host_views = self._views
        self._np_views = [v.numpy() for v in self._host_views]

    def _allocate_snapshots(self, snapshot_slots: int, snapshot_device: torch.device | str | None) -> None:
        """``snapshot_slots`` full-size snapshot buffers (pinned when a CUDA buffer snapshots to CPU) and the
        per-slot bookkeeping: which step holds the slot, its epoch, which buckets are marked in this attempt."""
        snap_dev = torch.device(snapshot_device) if snapshot_device is not None else self.device
        pin = snap_dev.type == "cpu" and self.device.type == "cuda" and torch.cuda.is_available()
        self._snaps = [
            torch.empty(self.numel, dtype=torch.float32, device=snap_dev, pin_memory=pin) for _ in range(snapshot_slots)
        ]
        self._snap_views = [[s[a:b] for a, b in self.bucket_ranges] for s in self._snaps]
        self._slot_step: list[int | None] = [None] * snapshot_slots
        self._slot_epoch: list[int] = [-1] * snapshot_slots
        self._marks: list[list[int | None]] = [[None] * self.num_buckets for _ in range(snapshot_slots)]

    # ---- layout ---------------------------------------------------------------------------------------------

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_ranges)

    def bucket_of(self, name: str) -> int:
        """Index of the bucket holding parameter ``name``."""
        return self._bucket_of[name]

    def bucket_params(self, i: int) -> list[str]:
        """Names of the parameters in bucket ``i`` (in buffer order, i.e. reverse registration order)."""
        return list(self._bucket_params[i])

    def view(self, i: int) -> torch.Tensor:
        """Bucket ``i`` itself: a 1-D fp32 slice of the flat buffer (for a data plane that reduces in place)."""
        return self._views[i]

    def bucket_views(self) -> list[torch.Tensor]:
        """1-D fp32 slices of the flat buffer, one per bucket (views, not copies)."""
        return list(self._views)

    # ---- gradient binding -----------------------------------------------------------------------------------

    def _bind(self) -> None:
        for (_, p), view in zip(self._params, self._param_views):
            if p.dtype == torch.float32:
                if p.grad is not None and local_tensor(p.grad).data_ptr() != view.data_ptr():
                    view.copy_(local_tensor(p.grad))
                p.grad = _as_grad_of(p, view)
            else:
                if is_dtensor(p):
                    raise ValueError("sharded (DTensor) parameters must be fp32")
                if p.grad is not None:
                    view.add_(p.grad)
                    p.grad = None
                self._hooks.append(p.register_post_accumulate_grad_hook(_fold_into_main_grad))
            p.main_grad = view  # type: ignore[attr-defined]

    def is_bound(self) -> bool:
        """Whether every fp32 param's ``.grad`` still points into the flat buffer."""
        return all(
            p.grad is not None and local_tensor(p.grad).data_ptr() == v.data_ptr()
            for (_, p), v in zip(self._params, self._param_views)
            if p.dtype == torch.float32
        )

    def all_finite(self) -> bool:
        """No NaN or infinity in the gradient (one sum over the flat buffer: NaN and infinities carry through it;
        no tensor of the buffer's size is allocated)."""
        return bool(torch.isfinite(self.flat.sum()))

    @torch.no_grad()
    def clip_norm_(self, max_norm: float, group: torch_dist.ProcessGroup | None = None) -> float:
        """Scale the gradient in place to an L2 norm of at most ``max_norm`` (nanotron's rule: a coefficient
        ``max_norm / (norm + 1e-6)``, at most 1); return the norm before. The buffer holds the replica's whole
        gradient (one rank, fp32 parameters), or with ``group`` this rank's shard of it (HSDP: the norm is summed
        over the shards)."""
        if group is None:
            total = torch.linalg.vector_norm(self.flat)
        else:
            norm_sq = torch.linalg.vector_norm(self.flat, dtype=torch.float32).pow(2).reshape(1)
            torch_dist.all_reduce(norm_sq, group=group)
            total = norm_sq.sqrt_()
        self.flat.mul_(torch.clamp(max_norm / (total + CLIP_EPS), max=1.0))
        return float(total)

    def zero_(self) -> None:
        """Zero all gradients in place (use instead of ``optimizer.zero_grad()``); re-binds dropped ``.grad``."""
        self.flat.zero_()
        for (_, p), v in zip(self._params, self._param_views):
            if p.dtype == torch.float32 and (p.grad is None or local_tensor(p.grad).data_ptr() != v.data_ptr()):
                p.grad = _as_grad_of(p, v)
            elif p.dtype != torch.float32:
                p.grad = None

    def close(self) -> None:
        """Remove hooks and unbind the params (their ``.grad`` / ``main_grad`` are dropped)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for _, p in self._params:
            p.grad = None
            if hasattr(p, "main_grad"):
                del p.main_grad

    # ---- host staging for MPI -------------------------------------------------------------------------------

    def numpy_views(self) -> list[np.ndarray]:
        """Zero-copy numpy views for MPI: of the buckets themselves (CPU) or of the pinned host staging (CUDA)."""
        return list(self._np_views)

    def to_host(self, i: int) -> np.ndarray:
        """Make bucket ``i``'s host view current and return it (no copy on CPU; blocking D2H copy on CUDA)."""
        if self._host is not None:
            self._host_views[i].copy_(self._views[i])
        return self._np_views[i]

    def from_host(self, i: int) -> None:
        """Copy bucket ``i``'s host view back to the device buffer (no-op on CPU)."""
        if self._host is not None:
            self._views[i].copy_(self._host_views[i])

    # ---- snapshots ------------------------------------------------------------------------------------------

    def _slot(self, step: int) -> int | None:
        for k, s in enumerate(self._slot_step):
            if s == step:
                return k
        return None

    def snapshot_bucket(self, i: int, step: int, epoch: int) -> None:
        """Save bucket ``i``'s local (pre-reduction) sum for ``step``; call right before reducing it.

        Raises:
            RuntimeError: no free slot (an older step was not released), or bucket ``i`` was already snapshotted
                in this attempt (its buffer may hold a partial reduction now).
            ValueError: ``epoch`` is older than an epoch already used for this step.
        """
        if not 0 <= i < self.num_buckets:
            raise IndexError(f"bucket {i} out of range [0, {self.num_buckets})")
        k = self._slot(step)
        if k is None:
            try:
                k = self._slot_step.index(None)
            except ValueError:
                held = [s for s in self._slot_step if s is not None]
                raise RuntimeError(f"no free snapshot slot for step {step}; steps {held} not released") from None
            self._slot_step[k] = step
            self._slot_epoch[k] = epoch
        if epoch < self._slot_epoch[k]:
            raise ValueError(f"stale epoch {epoch} for step {step} (already at epoch {self._slot_epoch[k]})")
        if self._marks[k][i] is not None:
            raise RuntimeError(
                f"bucket {i} of step {step} already snapshotted in epoch {self._marks[k][i]}; restore() first"
            )
        self._snap_views[k][i].copy_(self._views[i])
        self._marks[k][i] = epoch
        self._slot_epoch[k] = epoch

    def snapshot(self, step: int, epoch: int) -> None:
        """Snapshot every bucket (when the whole reduction starts at once)."""
        for i in range(self.num_buckets):
            self.snapshot_bucket(i, step, epoch)

    def restore(self, step: int) -> list[int]:
        """Put back the local sums of every bucket snapshotted in this attempt, then end the attempt.

        Returns:
            Indices of the restored buckets (the others were never reduced and are kept as they are).

        Raises:
            KeyError: ``step`` holds no snapshot (never taken, or released).
        """
        k = self._slot(step)
        if k is None:
            raise KeyError(f"no snapshot for step {step}")
        restored = []
        for i, mark in enumerate(self._marks[k]):
            if mark is not None:
                self._views[i].copy_(self._snap_views[k][i])
                self._marks[k][i] = None
                restored.append(i)
        return restored

    def release(self, step: int) -> bool:
        """Free ``step``'s slot after its optimizer step committed; False if it held none."""
        k = self._slot(step)
        if k is None:
            return False
        self._slot_step[k] = None
        self._slot_epoch[k] = -1
        marks = self._marks[k]
        for i in range(len(marks)):
            marks[i] = None
        return True

    def has_snapshot(self, step: int) -> bool:
        return self._slot(step) is not None

    def snapshot_epochs(self, step: int) -> dict[int, int]:
        """``{bucket: epoch}`` of the buckets snapshotted for ``step`` in the current attempt."""
        k = self._slot(step)
        if k is None:
            return {}
        return {i: e for i, e in enumerate(self._marks[k]) if e is not None}

    def snapshot_epoch(self, step: int) -> int | None:
        """Latest world epoch used for ``step``'s snapshots (kept across restores), None if it holds none."""
        k = self._slot(step)
        return None if k is None else self._slot_epoch[k]


def _trainable_params(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], device: torch.device
) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that get a gradient slot: ``requires_grad``, each (tied) parameter once, all on ``device``.

    A rank may own no trainable parameter (a pipeline stage holding only the loss): it then has one empty
    bucket, so it still takes part in every cross-replica collective of its coordinate.
    """
    seen: set[int] = set()
    params: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append((name, p))
    for name, p in params:
        t = local_tensor(p)
        if t.device != device and not (device.index is None and t.device.type == device.type):
            raise ValueError(f"param {name} is on {t.device}, buffer on {device}")
    return params


def _as_grad_of(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` in the form ``p.grad`` must take: a ``DTensor`` with ``p``'s mesh and placements for a sharded
    parameter (its local tensor *is* the view), the plain view otherwise."""
    if is_dtensor(p):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return view


def _fold_into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook for non-fp32 params: add the fresh ``.grad`` into the fp32 ``main_grad`` view."""
    p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
    p.grad = None
