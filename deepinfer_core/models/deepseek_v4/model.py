"""DeepSeek-V4 forward over a flat batch of tokens from many requests, through the backend objects.

Parameter names mirror transformers' `DeepseekV4ForCausalLM`, so its `save_pretrained` output loads
as is (`deepinfer_core.models.loading.weights` maps the official DeepSeek names onto these).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from deepinfer_core.backends import AttentionBackend, MoEBackend, MoEWeights
from deepinfer_core.backends.layer_ops import CompressorWeights, LayerOps, hyper_residual
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.deepseek_v4.compressor import Compressor, Indexer
from deepinfer_core.models.deepseek_v4.layers import (
    FP32,
    ConcatenatedLinears,
    FP4Experts,
    GroupedLinear,
    HyperConnection,
    HyperHead,
    RMSNorm,
    SharedExpert,
)
from deepinfer_core.models.deepseek_v4.rope import Rotary, rope_tables
from deepinfer_core.models.deepseek_v4.row_trim import (
    TrimmedStep,
    drops_rows,
    kept_logits_rows,
    no_logits,
    replay_keep_from,
)
from deepinfer_core.models.interface import ForwardContext, LayerCache
from deepinfer_core.models.layer_plan import LayerPlan, build_layer_plan


class Attention(nn.Module):
    def __init__(self, config, plan: LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.plan = plan
        heads, dim = config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim, self.o_groups = heads, dim, config.o_groups
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(dim)
        self.o_a_proj = GroupedLinear(heads * dim // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups, dtype)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=FP32))
        if plan.has_compressor:
            self.compressor = Compressor(config.hidden_size, dim, plan.compress_rate, plan.has_indexer, dtype)
            if plan.has_indexer:
                self.compressor.indexer = Indexer(config, dtype)

    def bind(self, rotary: Rotary) -> None:
        """Once the weights are loaded: gather the compressors' parameters (their entries are RoPE'd with
        `rotary`) and concatenate the projections that share an input, so each is one matmul."""
        self.compressor_weights: CompressorWeights | None = None
        self.indexer_weights: CompressorWeights | None = None
        from_x, from_q_residual = [self.q_a_proj, self.kv_proj], [self.q_b_proj]
        if self.plan.has_compressor:
            self.compressor_weights = self.compressor.weights(rotary)
            from_x += [self.compressor.kv_proj, self.compressor.gate_proj]
        if self.plan.has_indexer:
            indexer = self.compressor.indexer
            self.indexer_weights = indexer.weights(rotary)
            from_x += [indexer.kv_proj, indexer.gate_proj, indexer.scorer.weights_proj]
            from_q_residual.append(indexer.q_b_proj)
        self.x_projections = ConcatenatedLinears(from_x)
        self.q_projections = ConcatenatedLinears(from_q_residual)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache: LayerCache, backend: AttentionBackend,
                ops: LayerOps) -> torch.Tensor:
        meta, num_tokens = ctx.metadata, x.shape[0]
        cos, sin, minus_sin = ctx.rope[self.plan.rope]
        # per-token matmuls go through `ops.map_rows` (fixed row tiles in deterministic mode)
        q_a, kv, *compressor_rows = ops.map_rows(self.x_projections, x)
        q_residual = ops.rms_norm(q_a, self.q_a_norm.weight)
        q, *index_q = ops.map_rows(self.q_projections, q_residual)
        q = ops.rms_norm(q.view(num_tokens, self.num_heads, self.head_dim), None, cos, sin)
        kv = ops.rms_norm(kv, self.kv_norm.weight, cos, sin)

        topk = num_entries = None
        if self.plan.has_compressor:
            ops.compress(*compressor_rows[:2], self.compressor_weights, meta, cache.kv_tail, cache.gate_tail,
                         cache.compressed, ctx.no_write_before)
            num_entries = ctx.num_entries[self.plan.compress_rate]
        if self.plan.has_indexer:
            index_kv, index_gate, index_weights = compressor_rows[2:]
            ops.compress(index_kv, index_gate, self.indexer_weights, meta, cache.index_kv_tail,
                         cache.index_gate_tail, cache.index_keys, ctx.no_write_before)
            heads = self.compressor.indexer.num_heads
            index_q = ops.rotary(index_q[0].view(num_tokens, heads, -1), cos, sin)
            topk = backend.indexer_topk(index_q, index_weights.float() * heads**-0.5, cache.index_keys, meta,
                                        num_entries)

        out = backend.forward(q, kv, cache.window, cache.compressed, self.sinks, meta, topk, num_entries)
        ops.write_window(meta, cache.window, kv)
        out = ops.rotary(out, cos, minus_sin)
        return ops.map_rows(self._output, out.reshape(num_tokens, self.o_groups, -1))

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_b_proj(self.o_a_proj(out))


class Router(nn.Module):
    def __init__(self, config, is_hash: bool, dtype: torch.dtype) -> None:
        super().__init__()
        experts, hidden = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=dtype))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=FP32))


class Experts(nn.Module):
    def __init__(self, config, num_slots: int, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = num_slots, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i, dtype=dtype))


class MoE(nn.Module):
    def __init__(self, config, plan: LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(config, plan.moe.is_hash, dtype)
        slots = plan.moe.num_local_slots  # every expert, or this rank's share under expert parallelism
        if plan.moe.expert_format == "fp4":
            self.experts = FP4Experts(slots, config.hidden_size, config.moe_intermediate_size)
        else:
            self.experts = Experts(config, slots, dtype)
        self.shared_experts = SharedExpert(config.hidden_size, config.moe_intermediate_size, float(config.swiglu_limit or 0), dtype)

    def routed_weights(self) -> MoEWeights:
        return MoEWeights(
            router=self.gate.weight, gate_up=self.experts.gate_up_proj, down=self.experts.down_proj,
            score_bias=getattr(self.gate, "e_score_correction_bias", None), tid2eid=getattr(self.gate, "tid2eid", None),
            gate_up_scale=getattr(self.experts, "gate_up_proj_scale", None),
            down_scale=getattr(self.experts, "down_proj_scale", None),
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, backend: MoEBackend, weights: MoEWeights,
                ops: LayerOps) -> torch.Tensor:
        return backend.forward(x, input_ids, weights) + ops.map_rows(self.shared_experts, x)


class DecoderLayer(nn.Module):
    def __init__(self, config, plan: LayerPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, plan, dtype)
        self.mlp = MoE(config, plan, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.attn_hc = HyperConnection(config.hc_mult, config.hidden_size)
        self.ffn_hc = HyperConnection(config.hc_mult, config.hidden_size)


class DeepseekV4Backbone(nn.Module):
    def __init__(self, config, plans: list[LayerPlan], dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, plan, dtype) for plan in plans)
        self.norm = RMSNorm(config.hidden_size)
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size)


class DeepseekV4ForCausalLM(nn.Module):
    """The whole model (a `deepinfer_core.models.interface.CausalLM`). Backends are plain objects chosen
    once (`bind_backends`), never looked up per step."""

    @classmethod
    def layer_plan(cls, config, dtype: torch.dtype) -> list[LayerPlan]:
        """V4's plan: every layer owns its caches (see `build_layer_plan`)."""
        return build_layer_plan(config, dtype)

    @staticmethod
    def host_weight_names(names: Collection[str], engram_placement: str) -> set[str]:
        """None: V4 has no weights that live in host memory."""
        return set()

    def __init__(self, config, plans: list[LayerPlan], dtype: torch.dtype,
                 parallel: ParallelGroups | None = None) -> None:
        super().__init__()
        self.config, self.plans, self.hc_mult = config, plans, config.hc_mult
        self.parallel = parallel if parallel is not None else ParallelGroups.single()
        """This rank's parallel groups (tp, dp, ep, cp)."""
        self.capabilities = config.capabilities
        self.trim_layer: int | None = None
        """Always None: V4 has no decoder-side trimming (`ModelCapabilities.can_trim_decoder`)."""
        self.model = DeepseekV4Backbone(config, plans, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.attention_backends: list[AttentionBackend] = []
        self.moe_backends: list[MoEBackend] = []
        self.moe_weights: list[MoEWeights] = []
        self.ops: LayerOps | None = None
        self.rotary: dict[str, Rotary] = {}
        self.keeps_final_streams = False
        """Keep every token's pre-`hc_head` residual streams in `final_streams` (the MTP drafter reads them)."""
        self.final_streams: torch.Tensor | None = None

    def bind_backends(self, attention: list[AttentionBackend], moe: list[MoEBackend], ops: LayerOps,
                      device: torch.device) -> None:
        """Attach one attention and one MoE backend per layer and the layer ops; call after the weights
        are loaded."""
        rope_dim = self.config.qk_rope_head_dim
        self.rotary = {name: Rotary(params, rope_dim, device) for name, params in self.config.rope_parameters.items()}
        self.attention_backends, self.moe_backends, self.ops = list(attention), list(moe), ops
        self.moe_weights = [layer.mlp.routed_weights() for layer in self.model.layers]
        for layer in self.model.layers:
            layer.self_attn.bind(self.rotary[layer.self_attn.plan.rope])
            layer.mlp.shared_experts.bind()
        self.hc_weights = [(layer.attn_hc.weights(), layer.ffn_hc.weights()) for layer in self.model.layers]
        self.head_weights = self.model.hc_head.weights()

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """A step without tokens: every MoE layer runs its backend on no rows, so an idle data-parallel
        rank joins the other ranks' expert-parallel collectives (vLLM's dummy step)."""
        x = self.model.embed_tokens.weight.new_empty(0, self.config.hidden_size)
        input_ids = torch.empty(0, dtype=torch.long, device=x.device)
        for backend, weights in zip(self.moe_backends, self.moe_weights, strict=True):
            backend.forward(x, input_ids, weights)

    def close(self) -> None:
        """Nothing to stop: V4 runs no worker threads of its own."""

    def backends(self) -> list[object]:
        """Every bound backend object."""
        return [*self.attention_backends, *self.moe_backends, self.ops]

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per rope kind, cos, sin and -sin of `positions`, computed once a step for every layer."""
        return rope_tables(self.rotary, self.ops, positions)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext, caches: list[LayerCache], logits_indices: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's tokens; return fp32 logits `[len(logits_indices), vocab]`."""
        ops, layers, tp = self.ops, self.model.layers, self.parallel.tp
        x = self.model.embed_tokens(ctx.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1)  # read through its strides, never copied
        post, comb, x = ops.hc_pre(streams, self.hc_weights[0][0], layers[0].input_layernorm.weight)
        num_tokens, kept_rows = x.shape[0], None  # the rows still running, once a replay drops some
        for i, layer in enumerate(layers):
            keep_from = replay_keep_from(ctx.replay_hits, i, len(layers), self.config.sliding_window) \
                if ctx.replay_hits is not None and i else None
            if keep_from is not None and drops_rows(ctx.metadata, keep_from):
                trim = TrimmedStep.build(ctx, keep_from)
                if trim.is_empty:
                    return self._no_logits(x, logits_indices, num_tokens)
                streams, post, comb, x = map(trim.take, (streams, post, comb, x))
                kept_rows = trim.rows if kept_rows is None else kept_rows[trim.rows]
                ctx = trim.ctx
            # attention and MoE end in row-parallel projections: their partial sums meet here (tensor parallelism)
            out = tensor_parallel.all_reduce(layer.self_attn(x, ctx, caches[i], self.attention_backends[i], ops), tp)
            streams, post, comb, x = ops.hc_post_pre(streams, out, post, comb, self.hc_weights[i][1],
                                                     layer.post_attention_layernorm.weight)
            out = tensor_parallel.all_reduce(layer.mlp(x, ctx.input_ids, self.moe_backends[i], self.moe_weights[i], ops), tp)
            if i + 1 < len(layers):
                streams, post, comb, x = ops.hc_post_pre(streams, out, post, comb, self.hc_weights[i + 1][0],
                                                         layers[i + 1].input_layernorm.weight)
        if self.keeps_final_streams:
            self.final_streams = self._all_rows(hyper_residual(streams, out, post, comb), kept_rows, num_tokens)
        if kept_rows is not None:
            logits_indices = kept_logits_rows(kept_rows, num_tokens, logits_indices)
        hidden = ops.hc_post_head(streams, out, post, comb, logits_indices, self.head_weights,
                                  self.model.norm.weight)
        return ops.map_rows(self.lm_head, hidden).float()

    def _no_logits(self, x: torch.Tensor, logits_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A step whose every row a replay dropped before the last layer: it computes no logits."""
        logits = no_logits(logits_indices, self.config.vocab_size, x.device)
        if self.keeps_final_streams:
            self.final_streams = x.new_zeros(num_tokens, self.hc_mult, x.shape[-1])
        return logits

    @staticmethod
    def _all_rows(streams: torch.Tensor, kept_rows: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """Every step row's final streams, zeros for rows a replay dropped (the MTP drafter reads rows by
        their place in the step; the dropped ones lie below a hit, where it needs no exact state)."""
        if kept_rows is None:
            return streams
        full = streams.new_zeros(num_tokens, *streams.shape[1:])
        full[kept_rows] = streams
        return full
