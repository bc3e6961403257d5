"""GPU-path check, for a machine with CUDA (CI has none): run it as one short script there.

    python scripts/gpu_check.py          # prints one line per check and exits non-zero on the first failure

Checks the parts that differ on GPU: flat fp32 gradient buckets on CUDA with pinned host staging for MPI,
snapshot/restore of CUDA buckets, and (HSDP) FSDP2 on NCCL accumulating its reduce-scattered gradient shards into
the CUDA buckets across two backward passes (a one-rank NCCL world), and bf16 parameters with fp32 masters on
CUDA (nanotron's mixed-precision recipe on the buckets), and the NCCL data plane (build, reduce in place, abort,
rebuild, reduce again). A training run on GPU uses the same launcher
(`nanotron-recover train --config-file ...`: NCCL inside each replica, host-staged ULFM across replicas).
"""

from __future__ import annotations

import sys

import torch

from nanotron_recover.training.buckets import GradBuckets


def check_cuda_buckets() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).cuda()
    buckets = GradBuckets(list(model.named_parameters()), 0.001, "cuda")
    model(torch.randn(4, 16, device="cuda")).pow(2).sum().backward()
    assert buckets.is_bound(), "param.grad must stay a view of the CUDA flat buffer"
    host_ptrs = [a.ctypes.data for a in buckets.numpy_views()]
    for i in range(buckets.num_buckets):
        staged = buckets.to_host(i)
        assert staged.ctypes.data == host_ptrs[i], "staging buffers are allocated once"
        assert torch.equal(torch.from_numpy(staged), buckets.bucket_views()[i].cpu())
        staged *= 2  # what an MPI reduction would write
        buckets.from_host(i)
    local = buckets.flat.clone()
    buckets.snapshot(0, 0)
    buckets.flat.normal_()
    buckets.restore(0)
    assert torch.equal(buckets.flat, local), "restore gives back the exact local sums"
    assert buckets._host.is_pinned()


def check_cuda_fsdp_buckets() -> None:
    import os

    import torch.distributed as torch_dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from nanotron_recover.training.training_state import local_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch_dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).cuda()
        sharded = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).cuda()
        sharded.load_state_dict(plain.state_dict())
        fully_shard(sharded, mesh=DeviceMesh.from_group(torch_dist.group.WORLD, device_type="cuda"))
        sharded.set_force_sum_reduction_for_comms(True)
        sharded.set_gradient_divide_factor(1.0)
        buckets = GradBuckets(list(sharded.named_parameters()), 0.001, "cuda")
        inputs = [torch.randn(4, 16, device="cuda") for _ in range(2)]
        for x in inputs:
            plain(x).pow(2).sum().backward()
            sharded(x).pow(2).sum().backward()
        assert buckets.is_bound(), "sharded .grad must stay a view of the CUDA flat buffer"
        expected = torch.cat([p.grad.reshape(-1) for p in reversed(list(plain.parameters()))])
        assert torch.allclose(buckets.flat, expected, atol=1e-6), "FSDP2 accumulated into the buckets in place"
        assert all(local_tensor(p.grad).is_cuda for p in sharded.parameters())
    finally:
        torch_dist.destroy_process_group()


def check_cuda_bf16_masters() -> None:
    """bf16 parameters on CUDA: fp32 accumulation into the CUDA buckets, AdamW on fp32 CUDA masters, bf16 refreshed."""
    from nanotron.optim.named_optimizer import NamedOptimizer
    from nanotron.optim.optimizer_from_gradient_accumulator import OptimizerFromGradientAccumulator

    from nanotron_recover.nanotron_compat.fp32_accumulator import BucketFP32GradientAccumulator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).cuda().bfloat16()
    named = list(model.named_parameters())
    GradBuckets(named, 0.001, "cuda")
    optimizer = OptimizerFromGradientAccumulator(
        gradient_accumulator_builder=BucketFP32GradientAccumulator,
        named_params_or_groups=named,
        optimizer_builder=lambda groups: NamedOptimizer(
            named_params_or_groups=groups, optimizer_builder=lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True)
        ),
    )
    for _ in range(2):
        model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().pow(2).sum().backward()
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 and p.main_grad.is_cuda for _, p in named)
    optimizer.step()
    acc = optimizer.gradient_accumulator
    for name, p in named:
        master = acc.get_parameter_for_optimizer(name)
        assert master.is_cuda and master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16)), "bf16 copy refreshed from the fp32 master"


def check_nccl_data_plane() -> None:
    """The torch data plane on NCCL (a one-member coordinate of a one-rank MPI world): reduce the CUDA buckets in
    place, close (``abort`` + destroy), rebuild and reduce again; then the same with a pending collective closed."""
    import time

    from nanotron_recover.ft import FTWorld
    from nanotron_recover.ft.data_plane import TorchDataPlane

    ft = FTWorld(watch=False)
    plane = TorchDataPlane(ft, torch.device("cuda", torch.cuda.current_device()), 60.0)
    assert plane.backend == "nccl", plane.backend
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).cuda()
    buckets = GradBuckets(list(model.named_parameters()), 1.0, "cuda")
    for attempt in range(2):
        buckets.flat.fill_(3.0)
        t0 = time.perf_counter()
        for i in range(buckets.num_buckets):
            plane.allreduce_sum_(buckets, i)
        torch.cuda.synchronize()
        assert torch.equal(buckets.flat, torch.full_like(buckets.flat, 3.0)), "a one-member SUM is the identity"
        took_ms = (time.perf_counter() - t0) * 1e3
        print(f"  nccl plane attempt {attempt}: {buckets.num_buckets} buckets in {took_ms:.1f} ms, group build "
              f"{plane.last_build}")
        plane.close()
    assert plane.builds == 2, plane.builds
    plane._work = plane._current_group().allreduce([buckets.view(0)])  # closed while (maybe) still in flight
    plane.close()
    buckets.snapshot(0, 0)
    buckets.restore(0)  # nothing of the closed collective may land after this
    torch.cuda.synchronize()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    for check in (check_cuda_buckets, check_cuda_fsdp_buckets, check_cuda_bf16_masters, check_nccl_data_plane):
        check()
        print(f"ok {check.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
