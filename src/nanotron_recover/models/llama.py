"""A Llama for training built from nanotron's tensor-parallel modules, runnable on CPU.

nanotron 0.4's ``models/llama.py`` imports flash_attn (and its RMSNorm is a Triton kernel), so it cannot be imported
without a GPU. This model is written independently but keeps the *parameter names and shapes* of nanotron's
``LlamaForTraining``, so nanotron checkpoints (``save_weights`` / ``load_weights``) interchange:

    model.token_position_embeddings.pp_block.token_embedding.weight   [vocab/tp, hidden]
    model.decoder.{i}.pp_block.input_layernorm.weight                 [hidden]
    model.decoder.{i}.pp_block.attn.qkv_proj.weight                   [(nq + 2 nkv) * d / tp, hidden]  (q|k|v chunks)
    model.decoder.{i}.pp_block.attn.o_proj.weight                     [hidden, nq * d / tp]
    model.decoder.{i}.pp_block.post_attention_layernorm.weight        [hidden]
    model.decoder.{i}.pp_block.mlp.gate_up_proj.weight                [2 * ffn / tp, hidden]  (gate|up chunks)
    model.decoder.{i}.pp_block.mlp.down_proj.weight                   [hidden, ffn / tp]
    model.final_layer_norm.pp_block.weight                            [hidden]
    model.lm_head.pp_block.weight                                     [vocab/tp, hidden]

Activations are ``[seq, batch, hidden]`` (sequence-sharded under REDUCE_SCATTER), attention is torch SDPA (causal,
GQA by repeating kv heads), RoPE is the interleaved (GPT-J) form nanotron uses in training, theta 10000.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.config import LlamaConfig, ParallelismArgs
from nanotron.models.base import NanotronModel, build_model
from nanotron.nn.activations import ACT2FN
from nanotron.parallel import ParallelContext
from nanotron.parallel.parameters import NanotronParameter, sanity_check
from nanotron.parallel.pipeline_parallel.block import PipelineBlock, TensorPointer
from nanotron.parallel.tensor_parallel.functional import sharded_cross_entropy
from nanotron.parallel.tensor_parallel.nn import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
)
from torch import nn

from nanotron_recover.nanotron_compat.p2p import NonBlockingP2P
from nanotron_recover.nanotron_compat.tied import mark_tied_parameters

logger = logging.getLogger(__name__)

ROPE_THETA = 10000.0
MaybeTensor = Union[torch.Tensor, TensorPointer]


def resolve_parallel_config(parallel_config: Optional[ParallelismArgs]) -> Tuple[TensorParallelLinearMode, bool]:
    """(tp_mode, async) to build with. Async TP communication is forced off (logged): nanotron 0.4's REDUCE_SCATTER
    async path gives wrong input gradients (upstream #46, fixed after 0.4 by PR #172) and the ALL_REDUCE async path
    is column-only; the math is identical without it, so stock YAMLs that enable it still load."""
    if parallel_config is None:
        return TensorParallelLinearMode.ALL_REDUCE, False
    mode = parallel_config.tp_mode
    if isinstance(mode, str):
        mode = TensorParallelLinearMode[mode.upper()]
    if parallel_config.tp_linear_async_communication:
        logger.warning(
            "tp_linear_async_communication=True is ignored: nanotron 0.4's async TP path is buggy (upstream #46); "
            "running synchronous TP communication (same math)"
        )
    return mode, False


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (nanotron's is a Triton kernel); parameter ``weight`` like nanotron's."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (PipelineBlock key is "input")
        x = input.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(input.dtype)


def _rope_cos_sin(seq_len: int, dim: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # [seq, dim/2]
    return angles.cos(), angles.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x: [batch, heads, seq, dim], cos/sin: [seq, dim/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(
        self, config: LlamaConfig, tp_mode: TensorParallelLinearMode, tp_pg: dist.ProcessGroup
    ) -> None:
        super().__init__()
        tp = tp_pg.size()
        self.d_head = config.hidden_size // config.num_attention_heads
        self.n_q = config.num_attention_heads // tp
        self.n_kv = config.num_key_value_heads // tp
        q_out = config.num_attention_heads * self.d_head
        kv_out = config.num_key_value_heads * self.d_head
        self.qkv_proj = TensorParallelColumnLinear(
            config.hidden_size,
            q_out + 2 * kv_out,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=False,
            contiguous_chunks=(q_out, kv_out, kv_out),
        )
        self.o_proj = TensorParallelRowLinear(
            q_out, config.hidden_size, pg=tp_pg, mode=tp_mode, bias=False, async_communication=False
        )

    def forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        qkv = self.qkv_proj(hidden_states)  # [seq, batch, local (nq + 2 nkv) * d]
        seq, batch, _ = qkv.shape
        q, k, v = torch.split(qkv, [self.n_q * self.d_head, self.n_kv * self.d_head, self.n_kv * self.d_head], -1)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:  # -> [batch, n, seq, d]
            return t.reshape(seq, batch, n, self.d_head).permute(1, 2, 0, 3)

        q, k, v = heads(q, self.n_q), heads(k, self.n_kv), heads(v, self.n_kv)
        cos, sin = _rope_cos_sin(seq, self.d_head, q.device)
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        if self.n_q != self.n_kv:  # GQA: query head h reads kv head h // (n_q / n_kv)
            k = k.repeat_interleave(self.n_q // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_q // self.n_kv, dim=1)
        if bool(sequence_mask.all()):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            allowed = causal & sequence_mask.bool()[:, None, None, :]
            allowed = allowed | torch.eye(seq, dtype=torch.bool, device=q.device)  # no fully masked row
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out.permute(2, 0, 1, 3).reshape(seq, batch, self.n_q * self.d_head)
        return {"hidden_states": self.o_proj(out), "sequence_mask": sequence_mask}


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp_mode: TensorParallelLinearMode, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        ffn = config.intermediate_size
        self.gate_up_proj = TensorParallelColumnLinear(
            config.hidden_size,
            2 * ffn,
            pg=tp_pg,
            mode=tp_mode,
            bias=False,
            async_communication=False,
            contiguous_chunks=(ffn, ffn),
        )
        self.down_proj = TensorParallelRowLinear(
            ffn, config.hidden_size, pg=tp_pg, mode=tp_mode, bias=False, async_communication=False
        )
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> Dict[str, torch.Tensor]:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return {"hidden_states": self.down_proj(self.act(gate) * up)}


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: LlamaConfig, tp_mode: TensorParallelLinearMode, tp_pg: dist.ProcessGroup, layer_idx: int
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = CausalSelfAttention(config, tp_mode, tp_pg)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config, tp_mode, tp_pg)

    def forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden_states = hidden_states + self.attn(self.input_layernorm(hidden_states), sequence_mask)["hidden_states"]
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))["hidden_states"]
        return {"hidden_states": hidden_states, "sequence_mask": sequence_mask}


class Embedding(nn.Module):
    def __init__(self, config: LlamaConfig, tp_mode: TensorParallelLinearMode, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.token_embedding = TensorParallelEmbedding(
            num_embeddings=config.vocab_size,
            embedding_dim=config.hidden_size,
            padding_idx=config.pad_token_id,
            pg=tp_pg,
            mode=tp_mode,
        )

    def forward(self, input_ids: torch.Tensor, input_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        # [batch, seq] -> [seq, batch, hidden]; reduce-scattered along seq under REDUCE_SCATTER
        return {"input_embeds": self.token_embedding(input_ids.transpose(0, 1))}


class Loss(nn.Module):
    """Masked mean of the token losses of one microbatch (fp32), from TP-sharded logits. Without TP the logits are
    whole: torch's fused cross entropy, not nanotron's sharded one (three collectives on a one-rank group and
    several passes over the logits: ~6 % of a step of ``benchmarks/vs_torchft.py``'s model on CPU, py-spy)."""

    def __init__(self, tp_pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.tp_pg = tp_pg

    def forward(
        self, sharded_logits: torch.Tensor, label_ids: torch.Tensor, label_mask: torch.Tensor
    ) -> Dict[str, torch.Tensor]:
        labels = label_ids.transpose(0, 1).contiguous()  # [seq, batch], as the logits
        if self.tp_pg.size() == 1:
            token_loss = F.cross_entropy(sharded_logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            token_loss = token_loss.view_as(labels).transpose(0, 1)
        else:
            token_loss = sharded_cross_entropy(sharded_logits, labels, group=self.tp_pg, dtype=torch.float
                                               ).transpose(0, 1)
        mask = label_mask.to(torch.float)
        return {"loss": (token_loss * mask).sum() / mask.sum()}


def _to_fp32() -> nn.Module:
    class ToFloat(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float()

    return ToFloat()


class LlamaModel(nn.Module):
    """The pipeline graph: embedding -> decoder layers -> final norm -> lm_head -> fp32 cast."""

    def __init__(
        self, config: LlamaConfig, parallel_context: ParallelContext, parallel_config: Optional[ParallelismArgs],
        device: torch.device,
    ) -> None:
        super().__init__()
        tp_mode, _ = resolve_parallel_config(parallel_config)
        tp_pg = parallel_context.tp_pg
        self.p2p = NonBlockingP2P(parallel_context.pp_pg, device=device)
        common = {"config": config, "tp_mode": tp_mode, "tp_pg": tp_pg}
        self.token_position_embeddings = PipelineBlock(
            p2p=self.p2p,
            module_builder=Embedding,
            module_kwargs=common,
            module_input_keys={"input_ids", "input_mask"},
            module_output_keys={"input_embeds"},
        )
        self.decoder = nn.ModuleList(
            PipelineBlock(
                p2p=self.p2p,
                module_builder=LlamaDecoderLayer,
                module_kwargs={**common, "layer_idx": i},
                module_input_keys={"hidden_states", "sequence_mask"},
                module_output_keys={"hidden_states", "sequence_mask"},
            )
            for i in range(config.num_hidden_layers)
        )
        self.final_layer_norm = PipelineBlock(
            p2p=self.p2p,
            module_builder=RMSNorm,
            module_kwargs={"hidden_size": config.hidden_size, "eps": config.rms_norm_eps},
            module_input_keys={"input"},
            module_output_keys={"hidden_states"},
        )
        self.lm_head = PipelineBlock(
            p2p=self.p2p,
            module_builder=TensorParallelColumnLinear,
            module_kwargs={
                "in_features": config.hidden_size,
                "out_features": config.vocab_size,
                "pg": tp_pg,
                "mode": tp_mode,
                "bias": False,
                "async_communication": False,
            },
            module_input_keys={"x"},
            module_output_keys={"logits"},
        )
        self.cast_to_fp32 = PipelineBlock(
            p2p=self.p2p,
            module_builder=_to_fp32,
            module_kwargs={},
            module_input_keys={"x"},
            module_output_keys={"output"},
        )

    def forward(self, input_ids: MaybeTensor, input_mask: MaybeTensor) -> MaybeTensor:
        embeds = self.token_position_embeddings(input_ids=input_ids, input_mask=input_mask)["input_embeds"]
        state = {"hidden_states": embeds, "sequence_mask": input_mask}
        for block in self.decoder:
            state = block(**state)
        hidden = self.final_layer_norm(input=state["hidden_states"])["hidden_states"]
        logits = self.lm_head(x=hidden)["logits"]
        return self.cast_to_fp32(x=logits)["output"]


class LlamaForTraining(NanotronModel):
    """``forward(input_ids, input_mask, label_ids, label_mask) -> {"loss": ...}`` like nanotron's; the loss is a
    tensor on the output pipeline rank and a TensorPointer elsewhere."""

    def __init__(
        self,
        config: LlamaConfig,
        parallel_context: ParallelContext,
        parallel_config: Optional[ParallelismArgs],
        device: torch.device = torch.device("cpu"),
    ) -> None:
        super().__init__()
        self.model = LlamaModel(config, parallel_context, parallel_config, device)
        self.loss = PipelineBlock(
            p2p=self.model.p2p,
            module_builder=Loss,
            module_kwargs={"tp_pg": parallel_context.tp_pg},
            module_input_keys={"sharded_logits", "label_ids", "label_mask"},
            module_output_keys={"loss"},
        )
        self.parallel_context = parallel_context
        self.config = config
        self.parallel_config = parallel_config

    def forward(
        self, input_ids: MaybeTensor, input_mask: MaybeTensor, label_ids: MaybeTensor, label_mask: MaybeTensor
    ) -> Dict[str, MaybeTensor]:
        logits = self.model(input_ids=input_ids, input_mask=input_mask)
        return {"loss": self.loss(sharded_logits=logits, label_ids=label_ids, label_mask=label_mask)["loss"]}

    def init_model_randomly(self, config) -> None:  # nanotron's hook; config is a nanotron Config
        init_weights(self, std=config.model.init_method.std, seed=config.general.seed)

    def get_embeddings_lm_head_tied_names(self) -> list[str]:
        if self.config.tie_word_embeddings:
            return ["model.token_position_embeddings.pp_block.token_embedding.weight", "model.lm_head.pp_block.weight"]
        return []

    def get_block_compute_costs(self) -> Dict[type, int]:
        """Relative cost per PipelineBlock builder, used by nanotron's ``build_model`` to split stages."""
        c = self.config
        d_head = c.hidden_size // c.num_attention_heads
        return {
            LlamaDecoderLayer: 4 * c.num_attention_heads * d_head * c.hidden_size
                               + 3 * c.intermediate_size * c.hidden_size,
            TensorParallelColumnLinear: c.vocab_size * c.hidden_size,
        }


def validate_config(config: LlamaConfig, parallel_context: ParallelContext) -> None:
    tp = parallel_context.tp_pg.size()
    checks = {
        "hidden_size % num_attention_heads": config.hidden_size % config.num_attention_heads,
        "num_attention_heads % tp": config.num_attention_heads % tp,
        "num_key_value_heads % tp": config.num_key_value_heads % tp,
        "num_attention_heads % num_key_value_heads": config.num_attention_heads % config.num_key_value_heads,
        "vocab_size % tp (pad the vocab)": config.vocab_size % tp,
        "intermediate_size % tp": config.intermediate_size % tp,
        "head_dim % 2 (RoPE)": (config.hidden_size // config.num_attention_heads) % 2,
    }
    bad = [k for k, v in checks.items() if v != 0]
    if bad:
        raise ValueError(f"Llama config incompatible with tp={tp}: nonzero {bad}")
    if config.rope_scaling is not None:
        raise ValueError("rope_scaling is not supported")


def build_llama(
    config: LlamaConfig,
    parallel_context: ParallelContext,
    parallel_config: Optional[ParallelismArgs],
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForTraining:
    """Build the local part of the model: place PipelineBlocks on pp ranks (nanotron's ``build_model``, cost-
    balanced), mark tied parameters (embeddings<->lm_head across stages, norms across TP) and create their groups.
    Collective over ``parallel_context.world_pg``. Weights are uninitialised: call ``init_weights`` or load."""
    validate_config(config, parallel_context)
    model = build_model(
        model_builder=lambda: LlamaForTraining(config, parallel_context, parallel_config, device),
        parallel_context=parallel_context,
        dtype=dtype,
        device=device,
    )
    mark_tied_parameters(model, parallel_context, parallel_config)
    sanity_check(root_module=model)
    return model


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_names(model: nn.Module) -> Dict[str, str]:
    """Local parameter name -> the name it is known by across layouts (tied parameters: their tie name)."""
    prefixes = {id(module): f"{name}." for name, module in model.named_modules()}
    prefixes[id(model)] = ""
    return {
        local: param.get_tied_info().get_full_name_from_module_id_to_prefix(prefixes)
        if isinstance(param, NanotronParameter) and param.is_tied
        else local
        for local, param in model.named_parameters()
    }


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int) -> None:
    """Deterministic, layout-independent init: each parameter's full (unsharded) tensor is drawn in fp32 on CPU
    from a generator seeded by (seed, canonical name), then this rank's shard is sliced out. A TP x PP run and a
    single process therefore hold identical weights. Scheme (nanotron's): normal(0, std) for embeddings and column
    linears, normal(0, std / sqrt(2 * num_layers)) for row linears (o_proj, down_proj), ones for norms.
    Memory: one full fp32 tensor at a time (the embedding is the largest)."""
    num_layers = model.config.num_hidden_layers
    names = canonical_names(model)
    for local_name, param in model.named_parameters():
        name = names[local_name]
        owner = model.get_submodule(local_name.rsplit(".", 1)[0])
        if isinstance(owner, RMSNorm):
            param.fill_(1.0)
            continue
        if isinstance(owner, TensorParallelRowLinear):
            scale = std / math.sqrt(2 * num_layers)
        elif isinstance(owner, (TensorParallelColumnLinear, TensorParallelEmbedding)):
            scale = std
        else:
            raise ValueError(f"no init rule for {local_name} ({type(owner).__name__})")
        if local_name.endswith("bias"):
            param.zero_()
            continue
        sharded = isinstance(param, NanotronParameter) and param.is_sharded
        shape = param.get_sharded_info().unsharded_shape if sharded else tuple(param.shape)
        gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
        full = torch.empty(shape, dtype=torch.float32).normal_(0.0, scale, generator=gen)
        if sharded:
            for pair in param.get_sharded_info().local_global_slices_pairs:
                param[pair.local_slices].copy_(full[pair.global_slices])
        else:
            param.copy_(full)
