"""The project's tiny Llama, its KJV sample stream and its optimizer schedule, in plain PyTorch.

Why a second copy: the peer systems of ``benchmarks/vs_torchft.py`` (plain torch DDP and torchft) run under
``torchrun``, not under the project's launcher, and must train *the same* model on *the same* samples with
*the same* optimizer as a ReCoVer run, so that step times and trajectories compare. Importing the project's
model, data and trainer modules would tie this benchmark to internal module names (they move), so this file
re-states their math from what they document:

* model (the project's ``models/llama.py``): pre-norm decoder layers, RMSNorm in fp32, fused q|k|v projection,
  GQA by repeating kv heads, interleaved (GPT-J) RoPE with theta 10000, causal SDPA, fused gate|up SiLU MLP,
  untied LM head; the parameters carry the project's TP1 x PP1 names, and each is drawn from a generator seeded
  by sha256(f"{seed}:{name}") (normal(0, std), row linears std / sqrt(2 L), norms 1), so the initial weights are
  bit-identical to a ReCoVer run's;
* data (the project's datatrove token stream): global microbatch ``g = step * M + i`` holds stream positions
  ``g * mbs ...``; a position maps to a sample through a per-epoch SplitMix64-keyed permutation; a sample is a
  window of ``seq + 1`` consecutive tokens of the sorted ``*.ds`` files (tail of each file dropped);
* optimizer: AdamW over all parameters in one group, global L2 clipping, nanotron's warmup + cosine schedule
  (step ``s`` uses the schedule's value at ``s - 1``).

The benchmark checks the claim instead of trusting it: it reports the largest per-step loss difference between
the failure-free torchft run and the failure-free ReCoVer run (same samples, same init: ~1e-6 is float
summation order; a mismatch would be ~1e-1).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROPE_THETA = 10000.0


# ------------------------------------------------------------------------------------------------ spec
@dataclass
class TrainSpec:
    """Everything a peer-system worker needs to train exactly what a ReCoVer config trains."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    micro_batch: int
    M: int
    steps: int
    seed: int
    data_seed: int
    data_folder: str
    init_std: float
    rms_eps: float
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip: float | None

    @classmethod
    def from_config(cls, config: dict[str, Any], data_folder: str) -> "TrainSpec":
        """Read the spec from a nanotron-format config dict (the one the ReCoVer run gets)."""
        mc, tok, opt = config["model"]["model_config"], config["tokens"], config["optimizer"]
        lr = opt["learning_rate_scheduler"]
        if lr.get("lr_decay_starting_step") not in (None, lr["lr_warmup_steps"]):
            raise ValueError("lr_decay_starting_step is not supported by the peer-system workers")
        if lr["lr_warmup_style"] != "linear" or lr["lr_decay_style"] != "cosine":
            raise ValueError("the peer-system workers implement linear warmup + cosine decay only")
        if mc.get("tie_word_embeddings"):
            raise ValueError("tied embeddings are not supported by the peer-system workers")
        return cls(
            hidden=mc["hidden_size"], intermediate=mc["intermediate_size"], layers=mc["num_hidden_layers"],
            heads=mc["num_attention_heads"], kv_heads=mc["num_key_value_heads"], vocab=mc["vocab_size"],
            seq=tok["sequence_length"], micro_batch=tok["micro_batch_size"],
            M=config["parallelism"]["dp"] * tok["batch_accumulation_per_replica"], steps=tok["train_steps"],
            seed=config["general"]["seed"], data_seed=config["data"]["seed"], data_folder=data_folder,
            init_std=config["model"]["init_method"]["std"], rms_eps=mc["rms_norm_eps"], lr=lr["learning_rate"],
            min_lr=lr["min_decay_lr"], warmup_steps=lr["lr_warmup_steps"], decay_steps=lr["lr_decay_steps"],
            weight_decay=opt["weight_decay"], betas=(opt["adam_beta1"], opt["adam_beta2"]), eps=opt["adam_eps"],
            clip=opt.get("clip_grad"),
        )

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> "TrainSpec":
        data = json.loads(Path(path).read_text())
        data["betas"] = tuple(data["betas"])
        return cls(**data)


# ------------------------------------------------------------------------------------------------ model
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class _Block(nn.Module):
    """Holds one module as ``pp_block`` so that parameter names match the project's pipeline blocks."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.pp_block = module


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on ``[batch, heads, seq, d]``: pairs (x[2i], x[2i+1]) rotate by position * theta^(-2i/d)."""
    seq, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos, sin = ang.cos(), ang.sin()
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: TrainSpec) -> None:
        super().__init__()
        self.d, self.nq, self.nkv = s.hidden // s.heads, s.heads, s.kv_heads
        self.qkv_proj = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * self.d, bias=False)
        self.o_proj = nn.Linear(s.heads * self.d, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], -1)
        q, k, v = (z.reshape(b, t, -1, self.d).transpose(1, 2) for z in (q, k, v))
        q, k = _rope(q), _rope(k)
        if self.nq != self.nkv:
            k = k.repeat_interleave(self.nq // self.nkv, dim=1)
            v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nq * self.d))


class MLP(nn.Module):
    def __init__(self, s: TrainSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(s.hidden, 2 * s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, s: TrainSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, s: TrainSpec) -> None:
        super().__init__()
        emb = nn.Module()
        emb.token_embedding = nn.Embedding(s.vocab, s.hidden)
        self.token_position_embeddings = _Block(emb)
        self.decoder = nn.ModuleList(_Block(DecoderLayer(s)) for _ in range(s.layers))
        self.final_layer_norm = _Block(RMSNorm(s.hidden, s.rms_eps))
        self.lm_head = _Block(nn.Linear(s.hidden, s.vocab, bias=False))


class TinyLlama(nn.Module):
    """``forward(input_ids, label_ids) -> mean token loss`` (fp32) of one microbatch."""

    def __init__(self, s: TrainSpec) -> None:
        super().__init__()
        self.model = _Body(s)

    def forward(self, input_ids: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.token_position_embeddings.pp_block.token_embedding(input_ids)
        for block in m.decoder:
            x = block.pp_block(x)
        logits = m.lm_head.pp_block(m.final_layer_norm.pp_block(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), label_ids.flatten())


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: TinyLlama, s: TrainSpec) -> None:
    """The project's layout-independent init: a generator per parameter name, seeded by (seed, name)."""
    for name, param in model.named_parameters():
        if "layernorm" in name or name.startswith("model.final_layer_norm"):
            param.fill_(1.0)
            continue
        row = name.endswith("o_proj.weight") or name.endswith("down_proj.weight")
        scale = s.init_std / math.sqrt(2 * s.layers) if row else s.init_std
        gen = torch.Generator(device="cpu").manual_seed(_param_seed(s.seed, name))
        param.copy_(torch.empty(tuple(param.shape), dtype=torch.float32).normal_(0.0, scale, generator=gen))


def build_model(s: TrainSpec) -> TinyLlama:
    model = TinyLlama(s)
    init_weights(model, s)
    return model


# ------------------------------------------------------------------------------------------------ optimizer
def lr_at(s: TrainSpec, step: int) -> float:
    """LR of 1-based step ``step``: nanotron's linear warmup then cosine decay, evaluated at ``step - 1``."""
    k = step - 1
    if s.warmup_steps == 0 and s.decay_steps == 0:
        return s.lr
    if k <= s.warmup_steps:
        return s.lr * k / max(s.warmup_steps, 1)
    if k < s.warmup_steps + s.decay_steps:
        return s.min_lr + (s.lr - s.min_lr) * (1 + math.cos(math.pi * (k - s.warmup_steps) / s.decay_steps)) / 2
    return s.min_lr


def build_optimizer(model: nn.Module, s: TrainSpec) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, eps=s.eps, betas=s.betas)


# ------------------------------------------------------------------------------------------------ data
class KJVStream:
    """The project's own addressable sample stream over a ``prepare-data`` folder (shuffled, as its configs run):
    :class:`nanotron_recover.data.dataset.DatatroveTokenDataset`, which needs only numpy and torch."""

    def __init__(self, s: TrainSpec) -> None:
        from nanotron_recover.data.dataset import DatatroveTokenDataset

        self.dataset = DatatroveTokenDataset(s.data_folder, s.seq, s.micro_batch, s.M, s.data_seed)

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, label ids) ``[mbs, seq]`` of global microbatch ``step * M + index``."""
        batch = self.dataset.microbatch(step, index)
        return batch["input_ids"], batch["label_ids"]


def chunk(M: int, replicas: int, replica: int) -> list[int]:
    """The contiguous share of a step's M microbatches that ``replica`` of ``replicas`` computes (lowest ids
    take the remainder), as the project's planner and nanotron's dp split give it."""
    q, r = divmod(M, replicas)
    start = replica * q + min(replica, r)
    return list(range(start, start + q + (1 if replica < r else 0)))
