"""Every device choice of the project, in one place.

CPU (CI, this machine): compute on ``cpu``, replica torch groups on gloo, cross-replica MPI on the tensors'
own memory. GPU: compute on ``cuda:<local rank>``, replica torch groups on NCCL, and gradients staged through
host memory for the ULFM reduction (the PyPI Open MPI is not CUDA-aware).
"""

from __future__ import annotations

import os

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def local_rank() -> int:
    """The process's rank on its node, as the launcher tells it (mpirun or torchrun)."""
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID"):
        if key in os.environ:  # the launcher's (Open MPI, torchrun or Slurm) local rank
            return int(os.environ[key])  # the launcher's local rank
    return 0


def compute_device() -> torch.device:
    if cuda_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def torch_backend() -> str:
    """Backend of a replica's torch process groups (intra-replica TP/PP traffic)."""
    return "nccl" if cuda_available() else "gloo"


def set_current_device() -> torch.device:
    device = compute_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def needs_host_staging(device: torch.device) -> bool:
    """Whether MPI must see a host copy of a tensor living on ``device``."""
    return device.type != "cpu"


def default_data_plane(device: torch.device) -> str:
    """``fault_tolerance.data_plane: auto``: MPI on CPU (its in-place reduction beats gloo's at every bucket size
    measured), a torch group on GPU (NCCL keeps the bytes on the device and on NVLink / InfiniBand, where the
    PyPI Open MPI stages them through host memory over TCP). docs/data-plane.md has the numbers."""
    return "torch" if device.type == "cuda" else "mpi"


def data_plane_backend(device: torch.device) -> str:
    """The torch backend of the cross-replica data plane for buffers on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
