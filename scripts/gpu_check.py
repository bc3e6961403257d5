"""GPU-path check, for a machine with CUDA (CI has none): run it as one short script there.

    python scripts/gpu_check.py          # prints one line per check and exits non-zero on the first failure

Checks the parts that differ on GPU: flat fp32 gradient buckets on CUDA with pinned host staging for MPI, and
snapshot/restore of CUDA buckets. A training run on GPU uses the same launcher
(`nanotron-recover train --config-file ...`: NCCL inside each replica, host-staged ULFM across replicas).
"""

from __future__ import annotations

import sys

import torch

from nanotron_recover.recovery.buckets import GradBuckets


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


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    for check in (check_cuda_buckets,):
        check()
        print(f"ok {check.__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
