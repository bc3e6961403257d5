"""Benchmark configs: the project's stock-format tiny Llama, resized, and the process counts a layout needs."""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The project's stock-format tiny Llama (the same fields as tests/fixtures/stock_nanotron.yaml; benchmark configs
# do not import from tests/). Sizes are overridden by ``make_config``.
_BASE: dict[str, Any] = {
    "checkpoints": {
        "checkpoint_interval": 1000,
        "checkpoints_path": "checkpoints",
        "checkpoints_path_is_shared_file_system": False,
        "resume_checkpoint_path": None,
        "save_initial_state": False,
    },
    "data": {"dataset": None, "num_loading_workers": 1, "seed": 7},
    "general": {
        "benchmark_csv_path": None,
        "consumed_train_samples": None,
        "ignore_sanity_checks": True,
        "project": "benchmarks",
        "run": "bench",
        "seed": 7,
        "step": None,
    },
    "lighteval": None,
    "logging": {"iteration_step_info_interval": 1, "log_level": "warning", "log_level_replica": "warning"},
    "model": {
        "ddp_bucket_cap_mb": 25,
        "dtype": "float32",
        "init_method": {"std": 0.02},
        "make_vocab_size_divisible_by": 1,
        "model_config": {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 32,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "is_llama_config": True,
            "max_position_embeddings": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "pad_token_id": None,
            "pretraining_tp": 1,
            "rms_norm_eps": 1.0e-05,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "use_cache": False,
            "vocab_size": 128,
        },
    },
    "optimizer": {
        "accumulate_grad_in_fp32": True,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": 1.0e-08,
        "clip_grad": 1.0,
        "learning_rate_scheduler": {
            "learning_rate": 0.001,
            "lr_decay_starting_step": None,
            "lr_decay_steps": 8,
            "lr_decay_style": "cosine",
            "lr_warmup_steps": 2,
            "lr_warmup_style": "linear",
            "min_decay_lr": 1.0e-05,
        },
        "torch_adam_is_fused": False,
        "weight_decay": 0.01,
        "zero_stage": 0,
    },
    "parallelism": {
        "dp": 2,
        "pp": 1,
        "pp_engine": "afab",
        "tp": 1,
        "tp_linear_async_communication": False,
        "tp_mode": "ALL_REDUCE",
    },
    "profiler": None,
    "tokenizer": {"tokenizer_max_length": None, "tokenizer_name_or_path": None, "tokenizer_revision": None},
    "tokens": {
        "batch_accumulation_per_replica": 2,
        "limit_test_batches": 0,
        "limit_val_batches": 0,
        "micro_batch_size": 2,
        "sequence_length": 16,
        "train_steps": 10,
        "val_check_interval": -1,
    },
}


@dataclass
class ModelSize:
    hidden: int = 32
    intermediate: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    seq: int = 16
    micro_batch: int = 2

    def describe(self) -> str:
        return (f"Llama hidden {self.hidden}, ffn {self.intermediate}, {self.layers} layers, {self.heads} heads "
                f"({self.kv_heads} kv), vocab {self.vocab}, seq {self.seq}, micro-batch {self.micro_batch}")


def add_size_args(ap) -> None:
    d = ModelSize()
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--intermediate", type=int, default=d.intermediate)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--seq", type=int, default=d.seq)
    ap.add_argument("--micro-batch", type=int, default=d.micro_batch)
    ap.add_argument("--vocab", type=int, default=d.vocab)


HEADLINE_MODEL = dict(hidden=128, intermediate=512, layers=4, seq=128, micro_batch=2)  # the headline model's size


def add_headline_run_args(ap, out: str) -> None:
    """``--out`` (default ``out``), ``--timeout-s`` and the model-size flags, defaulting to the headline model."""
    ap.add_argument("--out", default=out)
    ap.add_argument("--timeout-s", type=float, default=900)
    add_size_args(ap)
    ap.set_defaults(**HEADLINE_MODEL)


def parse_sized(ap, argv, quick: dict, **defaults):
    """The model-size flags added (the headline model's size, ``defaults`` over it), ``argv`` parsed; with
    ``--quick``, every setting of ``quick`` over what was parsed (a smoke test's size)."""
    add_size_args(ap)
    ap.set_defaults(**{**HEADLINE_MODEL, **defaults})
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in quick.items():
            setattr(args, k, v)
    return args


def fresh_out_dir(args) -> Path:
    """``--out`` as an absolute path, emptied (a benchmark's folder holds one run of it)."""
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    return out


def size_from_args(args) -> ModelSize:
    return ModelSize(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, seq=args.seq,
                     micro_batch=args.micro_batch, vocab=args.vocab)


def make_config(
    *,
    dp: int,
    accumulation: int,
    steps: int,
    size: ModelSize = ModelSize(),
    tp: int = 1,
    pp: int = 1,
    fault_tolerance: dict | None = None,
    checkpoint_interval: int = 100000,
    checkpoints_path: str = "checkpoints",
) -> dict:
    """A stock-format tiny Llama config; M = dp * accumulation global microbatches per step."""
    c = copy.deepcopy(_BASE)
    c["parallelism"].update(dp=dp, tp=tp, pp=pp)
    c["tokens"].update(batch_accumulation_per_replica=accumulation, train_steps=steps,
                       sequence_length=size.seq, micro_batch_size=size.micro_batch)
    mc = c["model"]["model_config"]
    mc.update(hidden_size=size.hidden, intermediate_size=size.intermediate, num_hidden_layers=size.layers,
              num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
              max_position_embeddings=max(64, size.seq))
    c["checkpoints"].update(checkpoint_interval=checkpoint_interval, checkpoints_path=checkpoints_path)
    c["optimizer"]["learning_rate_scheduler"].update(lr_warmup_steps=2, lr_decay_steps=max(1, steps - 2))
    if fault_tolerance is not None:
        c["fault_tolerance"] = fault_tolerance
    return c


def tokens_per_microbatch(config: dict) -> int:
    return config["tokens"]["micro_batch_size"] * config["tokens"]["sequence_length"]


def ranks_per_replica(config: dict) -> int:
    ft = config.get("fault_tolerance") or {}
    if ft.get("replica") == "fsdp":
        return ft["fsdp_shard_size"]
    return config["parallelism"]["tp"] * config["parallelism"]["pp"]


def n_processes(config: dict) -> int:
    ft = config.get("fault_tolerance") or {}
    spares = ft.get("spare_replicas", 0) if ft.get("enabled") else 0
    return (config["parallelism"]["dp"] + spares) * ranks_per_replica(config)
