"""DeepSeek-V4.1's parameter containers, named as the official checkpoint names them (`layers.N.attn.wq_a`,
`layers.N.hc_attn_fn`, ...), except the routed experts, stacked as V4's (`ffn.experts.gate_up_proj`
`[E, 2I, H]` = cat(w1, w3) per expert, `ffn.experts.down_proj` `[E, H, I]`), and the Engram table held
as its raw FP8 / UE8M0 bytes (uint8). The projections are built dense; under `quantized_weights="native"`
the loader replaces those the checkpoint stores in FP8 (attention `wq_a`/`wq_b`/`wkv`/`wo_a`/`wo_b`, the
indexers' `wq_b`, the shared experts, Engram's `wkv`, DSpark's `main_proj`) by `layers.FP8Linear`s
(`weight` float8_e4m3fn, `weight_scale` the 32x32 UE8M0 block scales as float32), run by the linear
backend, exactly as V4's (`loading.weight_formats`); the rest of the model calls them as modules.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.backends import MoEWeights
from deepinfer_core.models.deepseek_v4.layers import FP32, FP4Experts, GroupedLinear, RMSNorm
from deepinfer_core.models.deepseek_v4.model import Experts
from deepinfer_core.models.deepseek_v41.plan import V41LayerPlan


def linear(inputs: int, outputs: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False, dtype=dtype)


class Compressor(nn.Module):
    """KV-source compressor: `wkv` (+ `wgate` at ratio > 1, both fp32 as the reference pools in fp32)."""

    def __init__(self, config, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        width = FP32 if ratio > 1 else dtype
        self.wkv = linear(config.hidden_size, config.head_dim, width)
        if ratio > 1:
            self.wgate = linear(config.hidden_size, config.head_dim, FP32)
        self.norm = RMSNorm(config.head_dim)


class Indexer(nn.Module):
    """An index source's query projection and head weights; KV sources also own the index-key path."""

    def __init__(self, config, owns_keys: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.index_n_heads
        self.wq_b = linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, dtype)
        self.weights_proj = linear(config.hidden_size, config.index_n_heads, dtype)
        if owns_keys:
            self.wk = linear(config.head_dim, config.index_head_dim, dtype)
            self.k_norm = RMSNorm(config.index_head_dim)


class AttentionWeights(nn.Module):
    def __init__(self, config, plan: V41LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        h, heads, dim = config.hidden_size, config.num_attention_heads, config.head_dim
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=FP32))
        self.wq_a = linear(h, config.q_lora_rank, dtype)
        self.q_norm = RMSNorm(config.q_lora_rank)
        self.wq_b = linear(config.q_lora_rank, heads * dim, dtype)
        self.wkv = linear(h, dim, dtype)
        self.kv_norm = RMSNorm(dim)
        self.wo_a = GroupedLinear(heads * dim // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups, dtype)
        self.wo_b = linear(config.o_groups * config.o_lora_rank, h, dtype)
        if plan.role == "full":
            self.compressor = Compressor(config, plan.ratio, dtype)
        if plan.runs_indexer:
            self.indexer = Indexer(config, plan.role == "full", dtype)


class Gate(nn.Module):
    """Router: `weight`, the selection bias `bias` and the image-token bias `bias_vl` (fp32)."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=FP32))
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=FP32))


class SharedExpert(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = config.hidden_size, config.moe_intermediate_size
        self.w1, self.w2, self.w3 = linear(h, inter, dtype), linear(inter, h, dtype), linear(h, inter, dtype)

    def forward(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return self.w2((torch.nn.functional.silu(gate) * up).to(x.dtype))


class FFNWeights(nn.Module):
    def __init__(self, config, plan: V41LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Gate(config, dtype)  # routes over every expert, also under expert parallelism
        slots = plan.moe.num_local_slots  # every expert, or this rank's slots under expert parallelism
        if plan.moe.expert_format == "fp4":
            self.experts = FP4Experts(slots, config.hidden_size, config.moe_intermediate_size)
        else:
            self.experts = Experts(config, slots, dtype)
        self.shared_experts = SharedExpert(config, dtype)


class EngramTableWeights(nn.Module):
    """The raw table bytes: `weight` uint8 `[rows, dim]` (FP8 e4m3), `scale` uint8 `[rows, dim / 32]` (UE8M0)."""

    def __init__(self, rows: int, dim: int, block: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim, dtype=torch.uint8), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(rows, dim // block, dtype=torch.uint8), requires_grad=False)


class EngramWeights(nn.Module):
    def __init__(self, config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer)]
        cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
        self.embed = EngramTableWeights(rows, config.engram_head_dim, config.fp8_block[1])
        self.wkv = linear(cols, (config.hc_mult + 1) * config.hidden_size, dtype)
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=FP32))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=FP32))


class Block(nn.Module):
    def __init__(self, config, plan: V41LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        n, h = config.hc_mult, config.hidden_size
        mix = (2 + n) * n
        self.attn_norm, self.ffn_norm = RMSNorm(h), RMSNorm(h)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, n * h, dtype=FP32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=FP32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=FP32)))
        self.attn = AttentionWeights(config, plan, dtype)
        self.ffn = FFNWeights(config, plan, dtype)
        if plan.has_engram:
            self.engram = EngramWeights(config, plan.index, dtype)


def moe_weights(ffn) -> MoEWeights:
    """What a MoE backend reads of a V4.1 block's (or a DSpark stage's) MoE: the router with its `bias`,
    the routed experts (packed FP4 with their scales, or dense)."""
    experts = ffn.experts
    return MoEWeights(router=ffn.gate.weight, gate_up=experts.gate_up_proj, down=experts.down_proj,
                      score_bias=ffn.gate.bias, tid2eid=None,
                      gate_up_scale=getattr(experts, "gate_up_proj_scale", None),
                      down_scale=getattr(experts, "down_proj_scale", None))
