"""One training process of a peer system, started by ``torchrun`` (``benchmarks/lib/torchft_runner.py``).

``--mode ddp``: plain torch DDP over gloo, one torch world of R processes (``torchrun --nproc_per_node R``).
``--mode torchft``: one process per replica group, each under its own ``torchrun --max_restarts K`` (the
supervisor torchft's examples use); ``torchft.Manager`` + ``torchft.DistributedDataParallel`` +
``torchft.Optimizer`` on ``torchft.ProcessGroupGloo``, quorum through the ``torchft_lighthouse`` named by
``TORCHFT_LIGHTHOUSE``. A restarted process rejoins and heals from a live peer (torchft's checkpoint transport).
``--grad-sync manager`` keeps the Manager and the optimizer wrapper but averages the gradient with
``Manager.allreduce`` after the backward instead of the DDP wrapper's comm hook: in torchft 0.2.0 on gloo the
hook itself crashes the *survivor* when a peer dies mid-allreduce (gloo's ``wait`` raises, the managed
future's chain is never built, ``DistributedDataParallel._comm_hook`` fails ``assert fut._fut``), so with the
wrapper a single SIGKILL takes every replica group down.

Both train ``benchmarks/lib/tiny_llama.py``'s model on its sample stream: step ``s`` (1-based) is global
microbatches ``s * M ... s * M + M - 1``; replica r computes its contiguous share, each microbatch's loss divided
by the share's size, and the gradient is averaged over the replicas that take part, so a full step is the mean
over M microbatches, as in ReCoVer. Under torchft the step number is ``manager.current_step() + 1``, which a
healed replica takes from its peer, so a rejoining replica computes the samples of the step it joins; a step
that a replica could not commit is computed again under the same number; the samples of a replica that is down
are not computed by anyone (torchft shrinks the step).

Each process appends JSON lines to ``<out>/replica<r>.jsonl``: ``{"event": "start"|"ready"|"done", "pid",
"restart", "time"}`` and one record per iteration: ``step`` (the step number it computed), ``committed``,
``participating``, ``participants``, ``loss_sum`` (sum of its microbatches' mean token losses),
``microbatches``, ``t0``/``time`` (wall clock at the iteration's start and end). Replica 0 saves the final
weights to ``<out>/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script by torchrun: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.lib.tiny_llama import KJVStream, TrainSpec, build_model, build_optimizer, chunk, lr_at  # noqa: E402


class Log:
    """Line-buffered JSON records of one process (flushed per line: the driver reads them while we run)."""

    def __init__(self, path: Path, replica: int) -> None:
        self.f = open(path, "a", buffering=1)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.base = {"replica": replica, "pid": os.getpid(), "restart": restart}

    def write(self, **record: Any) -> None:
        self.f.write(json.dumps({**self.base, **record, "time": record.get("time", time.time())}) + "\n")


def compute(model: torch.nn.Module, stream: KJVStream, step: int, indices: list[int],
            no_sync: Callable[[], Any]) -> float:
    """Forward/backward ``indices`` of ``step``; gradients synchronize in the last backward only."""
    total = 0.0
    for k, i in enumerate(indices):
        x, y = stream.microbatch(step, i)
        ctx = no_sync() if k < len(indices) - 1 else _null()
        with ctx:
            loss = model(x, y)
            (loss / len(indices)).backward()
        total += float(loss.detach())
    return total


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_ddp(spec: TrainSpec, out: Path) -> None:
    """Plain torch DDP: the failure-free baseline (a death ends the whole torchrun job)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(out / f"replica{rank}.jsonl", rank)
    log.write(event="start")
    model = torch.nn.parallel.DistributedDataParallel(build_model(spec), broadcast_buffers=False)
    opt = build_optimizer(model, spec)
    stream = KJVStream(spec)
    indices = chunk(spec.M, world, rank)
    dist.barrier()
    log.write(event="ready")
    for step in range(1, spec.steps + 1):
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        loss_sum = compute(model, stream, step, indices, model.no_sync)
        if spec.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, step)
        opt.step()
        log.write(step=step, committed=True, participating=True, participants=world, loss_sum=loss_sum,
                  microbatches=len(indices), t0=t0)
    if rank == 0:
        torch.save(model.module.state_dict(), out / "final.pt")
    log.write(event="done")
    dist.destroy_process_group()


def _wait_for_peers(out: Path, replica: int, replicas: int, timeout_s: float = 300) -> None:
    """First start only: every replica group has its Manager (so is heartbeating) before anyone asks for the
    first quorum; else the lighthouse may start training on the replicas that happened to be up first."""
    (out / f"manager-ready-{replica}").write_text("")
    deadline = time.time() + timeout_s
    while not all((out / f"manager-ready-{r}").exists() for r in range(replicas)):
        if time.time() > deadline:
            raise TimeoutError("the other replica groups did not start")
        time.sleep(0.05)


def native_group(replica: int, replicas: int, timeout: timedelta) -> dist.ProcessGroup:
    """torch's own gloo group made with ``enable_reconfigure`` (torch >= 2.14): torchft's Manager reconfigures it in
    place at each quorum change, where its own gloo wrapper builds a new group. It connects nothing when made; its
    bootstrap store is the runner's (``VS_TORCHFT_NATIVE_STORE``), and it is built as torchft's own integration test
    builds it (one process per replica group: initial rank = the replica group)."""
    host, port = os.environ["VS_TORCHFT_NATIVE_STORE"].rsplit(":", 1)
    store = dist.PrefixStore("native/0", dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False))
    pg = dist.ProcessGroup(store, replica, replicas)
    backend = dist.ProcessGroupGloo(store, replica, replicas, timeout=timeout, enable_reconfigure=True)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def build_torchft(spec: TrainSpec, replica: int, grad_sync: str, pg_kind: str = "torchft",
                  replicas: int = 1) -> tuple[Any, torch.nn.Module, Any]:
    """Manager, wrapped model and wrapped optimizer, as torchft's DDP example builds them (gloo, HTTP transport).

    The state a healing replica receives is the model and the optimizer; the optimizer's LR in it is the one
    its peer set for the previous step, so after loading it the LR of the step being committed is set again
    (the manager's step is the peer's by then)."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    model = build_model(spec)
    opt = build_optimizer(model, spec)
    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, holder["manager"].current_step() + 1)

    pg_timeout = timedelta(seconds=float(os.environ.get("VS_TORCHFT_PG_TIMEOUT_S", 5)))
    manager = Manager(
        pg=native_group(replica, replicas, pg_timeout) if pg_kind == "native" else ProcessGroupGloo(timeout=pg_timeout),
        min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"vs_torchft_{replica}", timeout=timedelta(seconds=30),
        init_sync=False,  # every replica draws the same seeded init (torchft's documented option for this)
    )
    holder["manager"] = manager
    wrapped = DistributedDataParallel(manager, model) if grad_sync == "ddp" else model
    return manager, wrapped, Optimizer(manager, opt)


def allreduce_grads(manager: Any, model: torch.nn.Module) -> None:
    """The gradient average through ``Manager.allreduce`` (torchft's public fault-tolerant collective: an error
    is reported to the manager, which then refuses the commit, instead of being raised): one flat buffer."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters()]
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def run_torchft(spec: TrainSpec, out: Path, replica: int, replicas: int, grad_sync: str,
                pg_kind: str = "torchft") -> None:
    """torchft's DDP loop: zero_grad (starts the quorum), forward/backward (allreduce in the DDP comm hook, or
    after the backward through ``Manager.allreduce``), step (commits only if the replica group can); the step
    number and LR follow ``current_step()``."""
    log = Log(out / f"replica{replica}.jsonl", replica)
    log.write(event="start", pg=pg_kind)  # the versions that ran: the runner's record (peer_versions)
    manager, model, opt = build_torchft(spec, replica, grad_sync, pg_kind, replicas)
    no_sync = model.no_sync if grad_sync == "ddp" else _null
    stream = KJVStream(spec)
    indices = chunk(spec.M, replicas, replica)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        _wait_for_peers(out, replica, replicas)
    log.write(event="ready")
    while manager.current_step() < spec.steps:
        t0 = time.time()
        opt.zero_grad(set_to_none=True)  # starts the (async) quorum; a healing replica learns its step here
        step = manager.current_step() + 1
        loss_sum = compute(model, stream, step, indices, no_sync)
        if grad_sync == "manager":
            allreduce_grads(manager, model)
        participating, participants = manager.is_participating(), manager.num_participants()
        if spec.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, manager.current_step() + 1)  # a healed replica has its peer's step now
        before = manager.current_step()
        opt.step()
        log.write(step=before + 1, computed_step=step, committed=manager.current_step() > before,
                  participating=participating, participants=participants, loss_sum=loss_sum,
                  microbatches=len(indices), t0=t0)
    if replica == 0:
        torch.save(getattr(model, "module", model).state_dict(), out / "final.pt")
    log.write(event="done")
    manager.shutdown(wait=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=["ddp", "torchft"], required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--grad-sync", choices=["ddp", "manager"], default="ddp",
                    help="torchft only: its DDP wrapper, or Manager.allreduce after the backward")
    ap.add_argument("--pg", choices=["torchft", "native"], default="torchft",
                    help="torchft only: its gloo wrapper, or torch's own gloo group reconfigured in place")
    args = ap.parse_args()
    spec, out = TrainSpec.load(Path(args.spec)), Path(args.out)
    torch.manual_seed(spec.seed)
    if args.mode == "ddp":
        run_ddp(spec, out)
    else:
        replica, replicas = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
        run_torchft(spec, out, replica, replicas, args.grad_sync, args.pg)


if __name__ == "__main__":
    main()
