"""DSpark, DeepSeek-V4.1-Flash's drafter (the checkpoint's `mtp.*`): its weights and its forward.

What it computes (DeepSeek's `inference/model.py`, research-v41.md §7 with the §13 corrections):
- context features: the target records, at each tap layer of `dspark_target_layer_ids`, the ATTENTION
  INPUT streams (after Engram) averaged over the hyper-connection streams; `main = main_norm(main_proj(
  [t_a; t_b; t_c]))`;
- three window-only stages (`mtp.0..2`), each a V4.1 block with single-pass mHC (the first collapse
  one-hot on stream 0), its own rope (`rope_theta`, no YaRN), sink attention and a MoE of
  `dspark_n_routed_experts` experts, top `dspark_num_experts_per_tok`, selected with `bias` (drafts are
  text: `bias_vl` is loaded, never used). Each stage keeps its own sliding-window cache of context KV
  `RoPE(kv_norm(wkv(main)))` written at the context positions; the block's own KV is never cached;
- the block: the anchor (the token the target just emitted, at position p + 1 after the last context
  position p) and `dspark_block_size - 1` copies of `dspark_noise_token_id`'s embedding, at positions
  p + 1 .. p + block size; every block query sees the whole block (non-causal) and the context positions
  (p - window, p];
- the head: the last stage's streams collapsed with its FFN site's pre-mix give `h`;
  `logits_i = head(norm(h_i)) + markov.head(markov.embed(prev_i))`, `prev_0` the anchor and `prev_i` the
  draft drawn at slot i - 1; the confidence `proj([h_i; markov.embed(prev_i)])` in fp32, returned RAW
  (no sigmoid: the reference returns the projection itself).

Weights keep the release's names (`mtp.<stage>.attn.wq_a.weight`, ...); FP8 projections are held in FP8
(`FP8Linear`) or dequantised and FP4 experts packed or dequantised, as the target's are (`load_dspark_weights`). The
per-request caches and the drafting loop live on the runner side (`speculative.dspark_drafter`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_core.backends import AttentionSpec, MoESpec
from deepinfer_core.backends.layer_ops import HyperWeights, collapse, hyper_residual
from deepinfer_core.models.deepseek_v4.layers import FP32, RMSNorm
from deepinfer_core.models.deepseek_v41.modules import Block, moe_weights
from deepinfer_core.models.deepseek_v41.plan import V41LayerPlan


def dspark_plans(config, dtype: torch.dtype, expert_format: str = "dense") -> list[V41LayerPlan]:
    """One window-only plan per DSpark stage (layer index `num_hidden_layers + stage`)."""
    moe = MoESpec(hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                  num_experts=config.dspark_n_routed_experts, top_k=config.dspark_num_experts_per_tok,
                  scoring_func=config.scoring_func, routed_scaling_factor=float(config.routed_scaling_factor),
                  swiglu_limit=float(config.swiglu_limit), is_hash=False, dtype=dtype, expert_format=expert_format)
    attention = AttentionSpec(num_heads=config.num_attention_heads, head_dim=config.head_dim,
                              sliding_window=config.sliding_window, compress_rate=0, dtype=dtype)
    return [V41LayerPlan(index=config.num_hidden_layers + s, kind="sliding", rope="main", role="window",
                         attention=attention, moe=moe) for s in range(config.num_nextn_predict_layers)]


class MarkovHead(nn.Module):
    """`embed` `[vocab, rank]` (the previous token's low-rank code) and `head` `[vocab, rank]` (fp32)."""

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.head = nn.Linear(rank, vocab_size, bias=False, dtype=FP32)


class ConfidenceHead(nn.Module):
    """`proj` `[1, hidden + rank]`, fp32 (the reference scores confidence in fp32)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False, dtype=FP32)


class DSparkStage(Block):
    """One stage: a V4.1 window block; the first also holds `main_proj`/`main_norm`, the last `norm`, the
    Markov head and the confidence head."""

    def __init__(self, config, plan: V41LayerPlan, dtype: torch.dtype, first: bool, last: bool) -> None:
        stage_config = config.model_copy(update={"n_routed_experts": config.dspark_n_routed_experts,
                                                 "num_experts_per_tok": config.dspark_num_experts_per_tok})
        super().__init__(stage_config, plan, dtype)
        h, rank = config.hidden_size, config.dspark_markov_rank
        if first:
            self.main_proj = nn.Linear(h * len(config.dspark_target_layer_ids), h, bias=False, dtype=dtype)
            self.main_norm = RMSNorm(h)
        if last:
            self.norm = RMSNorm(h)
            self.markov_head = MarkovHead(config.vocab_size, rank, dtype)
            self.confidence_head = ConfidenceHead(h + rank)


class DSparkModule(nn.Module):
    """The drafter's weights (`mtp.<stage>.*`, the release's names) and its computation, bound to the
    target model's embedding, LM head, rope and layer ops (`bind`)."""

    def __init__(self, config, dtype: torch.dtype, expert_format: str = "dense") -> None:
        super().__init__()
        if config.num_nextn_predict_layers < 1 or config.dspark_block_size < 1:
            raise ValueError("this DeepSeek-V4.1 config has no DSpark drafter (num_nextn_predict_layers or "
                             "dspark_block_size is 0)")
        self.config, self.dtype = config, dtype
        self.plans = dspark_plans(config, dtype, expert_format)
        last = len(self.plans) - 1
        self.mtp = nn.ModuleList(DSparkStage(config, plan, dtype, s == 0, s == last)
                                 for s, plan in enumerate(self.plans))
        self.block_size = config.dspark_block_size
        self.window = config.sliding_window

    def bind(self, target, moe_backends: list) -> None:
        """Use `target`'s (a bound `DeepseekV41ForCausalLM`) embedding, head, window rope and layer ops,
        and one MoE backend per stage."""
        self.target, self.ops, self.rotary = target, target.ops, target.rotary["main"]
        self.moe_backends = list(moe_backends)
        self.moe_weights = [moe_weights(stage.ffn) for stage in self.mtp]
        self.hc = [(HyperWeights(s.hc_attn_fn, s.hc_attn_base, s.hc_attn_scale),
                    HyperWeights(s.hc_ffn_fn, s.hc_ffn_base, s.hc_ffn_scale)) for s in self.mtp]

    # ------------------------------------------------------------------ context

    @torch.inference_mode()
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per stage, the context KV `[N, head_dim]` of context rows with taps `[N, taps * hidden]` at
        `positions` `[N]`: `RoPE(kv_norm(wkv(main_norm(main_proj(taps)))))`."""
        ops, first = self.ops, self.mtp[0]
        main = ops.rms_norm(ops.map_rows(first.main_proj, taps.to(self.dtype)), first.main_norm.weight)
        cos, sin = ops.map_rows(self.rotary.cos_sin, positions)
        return [ops.rms_norm(ops.map_rows(stage.attn.wkv, main), stage.attn.kv_norm.weight, cos, sin)
                for stage in self.mtp]

    # ------------------------------------------------------------------ the block

    @torch.inference_mode()
    def block(self, anchors: torch.Tensor, last_positions: torch.Tensor, context: list[torch.Tensor],
              visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block of each of `B` requests through the stages and the shared head.

        :param anchors: `[B]` the tokens the target emitted after each request's last context position.
        :param last_positions: `[B]` that last context position p (the block sits at p + 1 ..).
        :param context: per stage, `[B, C, head_dim]` context KV rows each request may attend to.
        :param visible: `[B, C]` which of those rows the request's block sees (positions in (p - window, p]).
        :returns: `h` `[B, block, hidden]` (the collapsed pre-norm hidden) and the head's logits
            `[B, block, vocab]` (fp32, without the Markov bias).
        """
        ops, n, bs = self.ops, self.config.hc_mult, self.block_size
        num = anchors.shape[0]
        ids = torch.full((num, bs), self.config.dspark_noise_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        ids = ids.flatten()
        positions = (last_positions[:, None] + 1 + torch.arange(bs, device=anchors.device)).flatten()
        cos, sin = ops.map_rows(self.rotary.cos_sin, positions)
        x = self.target.embed(ids)
        streams = x.unsqueeze(1).repeat(1, n, 1)
        pre = torch.zeros(x.shape[0], n, dtype=FP32, device=x.device)
        pre[:, 0] = 1.0
        pending = None
        for s, stage in enumerate(self.mtp):
            if pending is None:
                pre_a, post_a, comb_a, x = ops.hc_mix(streams, self.hc[s][0], stage.attn_norm.weight, pre)
            else:
                streams, pre_a, post_a, comb_a, x = ops.hc_post_mix(streams, *pending, self.hc[s][0],
                                                                   stage.attn_norm.weight, pre)
            out = self.attention(s, x, cos, sin, context[s], visible)
            streams, pre, post_f, comb_f, x = ops.hc_post_mix(streams, out, post_a, comb_a, self.hc[s][1],
                                                             stage.ffn_norm.weight, pre_a)
            pending = (self.moe(s, x, ids), post_f, comb_f)
        hidden = collapse(ops.map_rows(hyper_residual, streams, *pending), pre)
        last = self.mtp[-1]
        logits = ops.fp32_linear(ops.rms_norm(hidden, last.norm.weight).float(), self.target.head.weight)
        return hidden.view(num, bs, -1), logits.view(num, bs, -1)

    def attention(self, s: int, x: torch.Tensor, cos, sin, context: torch.Tensor, visible: torch.Tensor):
        """Stage `s`'s sink attention of the block rows `x` `[B * block, hidden]` over each request's
        context rows and its whole block (both directions)."""
        weights, ops, cfg = self.mtp[s].attn, self.ops, self.config
        rows, bs = x.shape[0], self.block_size
        num = rows // bs
        q = ops.map_rows(weights.wq_b, ops.rms_norm(ops.map_rows(weights.wq_a, x), weights.q_norm.weight))
        q = ops.rotary(q.view(rows, -1, cfg.head_dim), cos, sin)
        kv = ops.rms_norm(ops.map_rows(weights.wkv, x), weights.kv_norm.weight, cos, sin)
        keys = torch.cat((context.to(kv.dtype), kv.view(num, bs, -1)), dim=1)  # [B, C + block, D]
        seen = torch.cat((visible, visible.new_ones(num, bs)), dim=1)
        out = sink_attention(q.view(num, bs, -1, cfg.head_dim), keys, seen, weights.attn_sink)
        out = ops.rotary(out.reshape(rows, -1, cfg.head_dim), cos, -sin)
        return ops.map_rows(lambda t: weights.wo_b(weights.wo_a(t)), out.reshape(rows, cfg.o_groups, -1))

    def moe(self, s: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ffn, limit = self.mtp[s].ffn, float(self.config.swiglu_limit)
        routed = self.moe_backends[s].forward(x, ids, self.moe_weights[s])
        return (routed.float() + self.ops.map_rows(lambda t: ffn.shared_experts(t, limit), x).float()).to(x.dtype)

    # ------------------------------------------------------------------ the head, slot by slot

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov bias `[B, vocab]` (fp32) of the previous tokens `prev` `[B]`, and their codes `[B, rank]`."""
        markov = self.mtp[-1].markov_head
        code = markov.embed(prev)
        return F.linear(code.float(), markov.head.weight.float()), code

    def confidence(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """The confidence head's raw output `[B]` (fp32, no sigmoid) for slot hidden `[B, hidden]`."""
        features = torch.cat((hidden, code.to(hidden.dtype)), dim=-1).float()
        return F.linear(features, self.mtp[-1].confidence_head.proj.weight.float()).squeeze(-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Each request's queries `[B, M, H, D]` over its keys (also the values) `[B, K, D]`, masked by
    `visible` `[B, K]`, with one sink logit per head (`softmax` over keys and sink, the sink's share dropped)."""
    scores = torch.einsum("bmhd,bkd->bmhk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    sink = sinks.float().view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("bmhk,bkd->bmhd", probs.to(keys.dtype), keys).to(q.dtype)

