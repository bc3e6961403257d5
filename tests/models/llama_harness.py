"""Shared by the multi-rank Llama/engine tests: torch world setup from mpirun env, a tiny config, deterministic
data, and a launcher with a hard timeout. Imported as ``tests.models.llama_harness`` by the tests and by their
workers, which run as modules (``python -m tests.models.llama_worker``) from the repository root."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as torch_dist
from nanotron.config import LlamaConfig, ParallelismArgs

from nanotron_recover.launcher.launch import LAUNCH_RETRIES, launch_failure
from nanotron_recover.launcher.mpirun import mpirun_command
from nanotron_recover.run import devices

ROOT = Path(__file__).resolve().parents[2]  # the repository root: ``tests`` is importable from here
MBS, SEQ, VOCAB = 2, 16, 256


def init_torch_world(timeout_s: float = 60.0) -> None:
    """RANK/WORLD_SIZE from Open MPI's env (or already set), gloo/NCCL default group with a short timeout."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch_dist.init_process_group(
        backend=devices.torch_backend(),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def tiny_config(tied: bool = False, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )


def parallelism(dp: int = 1, pp: int = 1, tp: int = 1, engine: str = "afab",
                mode: str = "all_reduce") -> ParallelismArgs:
    return ParallelismArgs(dp=dp, pp=pp, tp=tp, pp_engine=engine, tp_mode=mode, tp_linear_async_communication=False)


def microbatch(step: int, index: int) -> Dict[str, torch.Tensor]:
    """Global microbatch ``index`` of ``step``: the same tensors whoever computes it."""
    gen = torch.Generator().manual_seed(1_000_003 * step + index)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
    label_mask = torch.ones(MBS, SEQ, dtype=torch.bool)
    label_mask[0, : index % 3] = False  # some masked labels, different per microbatch
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "input_mask": torch.ones(MBS, SEQ, dtype=torch.bool),
        "label_ids": tokens[:, 1:].contiguous(),
        "label_mask": label_mask,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_module(
    module: str, args: Sequence[str], n_procs: Optional[int], timeout_s: float = 240.0
) -> subprocess.CompletedProcess:
    """Run ``python -m module`` (e.g. ``tests.models.llama_worker``) from the repository root on ``n_procs`` ranks
    via mpirun (None: one plain process), hard timeout."""
    program: List[str] = [sys.executable, "-u", "-m", module, *args]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    if n_procs is None:
        cmd, full_env = program, {**os.environ, **env, "RANK": "0", "WORLD_SIZE": "1"}
    else:
        cmd, full_env = mpirun_command(n_procs, program, ulfm=False, env=env), dict(os.environ)
    for _ in range(1 + LAUNCH_RETRIES):  # PRRTE's own start-up failures, before any rank ran: launch again
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        if launch_failure(proc.returncode, (proc.stdout + proc.stderr).encode()) is None:
            break
    if proc.returncode != 0:
        raise AssertionError(f"{module} rc={proc.returncode}\nstdout:\n{proc.stdout[-6000:]}"
                             f"\nstderr:\n{proc.stderr[-6000:]}")
    return proc
