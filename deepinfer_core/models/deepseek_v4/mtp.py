"""DeepSeek-V4's multi-token-prediction (MTP) layer: a drafter for speculative decoding.

One MTP layer (`num_nextn_predict_layers`) ships in the checkpoint under `mtp.0.*`: `enorm`, `hnorm`,
separate `e_proj` and `h_proj`, one full decoder layer (attention + MoE, with mHC), its own head
collapse (`hc_head_*`) and `norm`; the embedding and LM head are the target's
(research-algorithms.md §2). Row j of the MTP combines the target's pre-`hc_head` residual streams at
position j - 1 with the embedding of token j and predicts token j + 1:

    streams = h_proj(hnorm(h[j - 1])) + e_proj(enorm(embed(t[j])))      # [hc_mult, D]
    streams = decoder_layer(streams)                                      # attention over its own cache
    logits  = lm_head(norm(hc_head(streams)))

For k > 1 drafts the layer is reused recursively: its output streams at row j stand in for the
target's at j, with the draft it just proposed as token j + 1. Its attention is a sliding-window layer
with its own per-request ring (`deepinfer_core.speculative.mtp_drafter` owns that cache).

Internal parameter names are the target's decoder-layer names under `mtp.<i>.` plus the MTP's own
(`mtp.0.enorm.weight`, `mtp.0.e_proj.weight`, `mtp.0.hc_head.hc_fn`, `mtp.0.norm.weight`, ...). The
layer holds its weights as the target holds its layers' (`models.loading.mtp_weights.build_mtp`): packed FP4 routed experts
(`layers.FP4Experts`) and FP8 projections (`layers.FP8Linear`) where the target keeps those, dense
elsewhere. Under tensor parallelism a rank's module is built from the rank's `shard_config` and holds
its slices (`tensor_parallel.mtp_tensor_shards`); its attention and MoE partial sums are all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.backends.layer_ops import hyper_residual
from deepinfer_core.config import CheckpointError
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.deepseek_v4.layers import HyperHead, RMSNorm
from deepinfer_core.models.deepseek_v4.model import DecoderLayer
from deepinfer_core.models.layer_plan import LayerPlan, build_layer_plan, with_expert_format

MTP_PREFIX = "mtp."


class MTPWeightsMissingError(CheckpointError):
    """`speculative_config.method == "mtp"` on a checkpoint without `mtp.*` weights."""


def mtp_layer_plan(config, dtype: torch.dtype) -> LayerPlan:
    """The MTP decoder layer's plan: sliding-window attention and a routed (not hashed) MoE."""
    single = config.model_copy(update={"num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                       "mlp_layer_types": ["moe"]})
    plan = build_layer_plan(single, dtype)[0]
    return LayerPlan(config.num_hidden_layers, plan.kind, plan.rope, plan.attention, plan.moe)


class MTPLayer(DecoderLayer):
    """A decoder layer plus the MTP's input projections and output head collapse."""

    def __init__(self, config, plan: LayerPlan, dtype: torch.dtype) -> None:
        super().__init__(config, plan, dtype)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden)
        self.hnorm = RMSNorm(hidden)
        self.e_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.h_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.hc_head = HyperHead(config.hc_mult, hidden)
        self.norm = RMSNorm(hidden)


class MultiTokenPredictor(nn.ModuleList):
    """The checkpoint's MTP layers (`mtp.<i>`); draft number `depth` uses layer `depth % len(self)`.
    `expert_format`: how the routed experts are held ("dense", or "fp4": packed, `MoESpec.expert_format`)."""

    def __init__(self, config, dtype: torch.dtype, num_layers: int = 1, expert_format: str = "dense") -> None:
        self.plan = with_expert_format([mtp_layer_plan(config, dtype)], expert_format)[0]
        super().__init__(MTPLayer(config, self.plan, dtype) for _ in range(num_layers))

    def bind(self, target, attention, moe, ops, device: torch.device) -> None:
        """Share the target's embedding and LM head and its tensor-parallel group; attach backends (after
        loading)."""
        self.shared = (target.model.embed_tokens, target.lm_head)  # a tuple: not registered as children
        self.tp = target.parallel.tp
        self.ops = ops
        self.attention, self.moe = attention, moe
        self.rotary = target.rotary
        for layer in self:
            layer.self_attn.bind(self.rotary[self.plan.rope])
            layer.mlp.shared_experts.bind()
        self.bound = [(layer.attn_hc.weights(), layer.ffn_hc.weights(), layer.hc_head.weights(),
                       layer.mlp.routed_weights()) for layer in self]

    @torch.inference_mode()
    def forward(self, depth: int, ctx, cache, prev_streams: torch.Tensor, input_ids: torch.Tensor,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass over a flat batch of rows.

        :param depth: which draft this is (0 for the first); picks the layer.
        :param ctx: the rows' `ForwardContext` (their positions, slots, the MTP cache's metadata).
        :param cache: the MTP layer's `LayerCache`.
        :param prev_streams: `[T, hc_mult, D]` the target's (or the previous pass's) streams at j - 1.
        :param input_ids: `[T]` token j of each row.
        :param rows: `[R]` rows whose logits are wanted.
        :returns: fp32 logits `[R, vocab]` and the output streams `[T, hc_mult, D]`.
        """
        layer, ops = self[depth % len(self)], self.ops
        attn_hc, ffn_hc, head, moe_weights = self.bound[depth % len(self)]
        width = prev_streams.shape[-1]
        embed, lm_head = self.shared
        embedded = ops.rms_norm(embed(input_ids), layer.enorm.weight)
        h = ops.rms_norm(prev_streams.reshape(-1, width), layer.hnorm.weight).view_as(prev_streams)
        # projections take [tokens, in] (an FP8 GEMM backend reads no other shape)
        streams = (layer.h_proj(h.reshape(-1, width)).view_as(h) + layer.e_proj(embedded)[:, None]).contiguous()
        post, comb, x = ops.hc_pre(streams, attn_hc, layer.input_layernorm.weight)
        # row-parallel partial sums meet here, as the target's layers' do (tensor parallelism)
        out = tensor_parallel.all_reduce(layer.self_attn(x, ctx, cache, self.attention, ops), self.tp)
        streams, post, comb, x = ops.hc_post_pre(streams, out, post, comb, ffn_hc,
                                                 layer.post_attention_layernorm.weight)
        out = tensor_parallel.all_reduce(layer.mlp(x, input_ids, self.moe, moe_weights, ops), self.tp)
        new_streams = hyper_residual(streams, out, post, comb)
        hidden = ops.hc_post_head(streams, out, post, comb, rows, head, layer.norm.weight)
        return F.linear(hidden, lm_head.weight).float(), new_streams


def split_mtp_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Internal-name weights split into the target's and the MTP's (prefix `mtp.` stripped)."""
    target = {n: t for n, t in weights.items() if not n.startswith(MTP_PREFIX)}
    mtp = {n[len(MTP_PREFIX) :]: t for n, t in weights.items() if n.startswith(MTP_PREFIX)}
    return target, mtp


__all__ = ["MTPWeightsMissingError", "MultiTokenPredictor", "mtp_layer_plan", "split_mtp_weights"]
