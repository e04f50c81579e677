"""A second implementation of DSpark's drafting, written in the test from DeepSeek's V4.1 reference
(`inference/model.py`: `DSparkBlock`, `DSparkAttention`, `forward_spec`), in fp32, with no cache: every
call recomputes the block from the whole context's taps. It shares no code with the engine's drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, inverse: bool = False):
    """Adjacent pairs of the last `rope_dim` channels as complex numbers, rotated by position."""
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = positions.double()[:, None] * freqs
    cis = torch.polar(torch.ones_like(angles), -angles if inverse else angles).to(torch.complex64)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    z = torch.view_as_complex(x[..., -rope_dim:].contiguous().unflatten(-1, (-1, 2)))
    out = x.clone()
    out[..., -rope_dim:] = torch.view_as_real(z * cis.view(shape)).flatten(-2)
    return out


def sinkhorn_mixes(h: torch.Tensor, fn, scale, base, hc: int, iters: int, hc_eps: float, eps: float):
    mixes = F.linear(h.flatten(-2), fn) * torch.rsqrt(h.flatten(-2).square().mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_post(x, residual, post, comb):
    return post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=1)


def swiglu(x, w1, w2, w3, limit: float, weight=None):
    gate, up = x @ w1.T, x @ w3.T
    if limit:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    y = F.silu(gate) * up
    return (y if weight is None else weight * y) @ w2.T


class ReferenceDSpark:
    """`W`: target weights (`embed.weight`, `head.weight`) and DSpark weights (`mtp.*`, dense fp32)."""

    def __init__(self, config, weights: dict[str, torch.Tensor]) -> None:
        self.c, self.W = config, {k: v.float() for k, v in weights.items()}
        self.eps = config.rms_norm_eps

    def draft(self, taps: torch.Tensor, anchor: int, k: int) -> tuple[list[int], list[float]]:
        """Greedy drafts and raw confidences after the context whose taps `[p + 1, taps * hidden]` are given
        (positions 0 .. p), the target having emitted `anchor` at p + 1."""
        c, W = self.c, self.W
        p, win, bs = taps.shape[0] - 1, c.sliding_window, c.dspark_block_size
        main = rms(taps.float() @ W["mtp.0.main_proj.weight"].T, W["mtp.0.main_norm.weight"], self.eps)
        ctx_pos = torch.arange(max(0, p - win + 1), p + 1)
        ids = torch.tensor([anchor] + [c.dspark_noise_token_id] * (bs - 1))
        pos = p + 1 + torch.arange(bs)
        h = W["embed.weight"][ids].unsqueeze(1).repeat(1, c.hc_mult, 1)
        pre_mix = torch.zeros(bs, c.hc_mult)
        pre_mix[:, 0] = 1
        for s in range(c.num_nextn_predict_layers):
            P = f"mtp.{s}."
            attn_pre, attn_post, attn_comb = self._mixes(h, P + "hc_attn_")
            x = rms(torch.sum(pre_mix.unsqueeze(-1) * h, dim=1), W[P + "attn_norm.weight"], self.eps)
            h = hc_post(self._attention(P, x, main[ctx_pos], ctx_pos, pos), h, attn_post, attn_comb)
            ffn_pre, ffn_post, ffn_comb = self._mixes(h, P + "hc_ffn_")
            x = rms(torch.sum(attn_pre.unsqueeze(-1) * h, dim=1), W[P + "ffn_norm.weight"], self.eps)
            h = hc_post(self._moe(P, x), h, ffn_post, ffn_comb)
            pre_mix = ffn_pre
        last = f"mtp.{c.num_nextn_predict_layers - 1}."
        hidden = torch.sum(pre_mix.unsqueeze(-1) * h, dim=1)
        logits = rms(hidden, W[last + "norm.weight"], self.eps) @ W["head.weight"].T
        prev, tokens, confidences = anchor, [], []
        for i in range(k):
            code = W[last + "markov_head.embed.weight"][prev]
            bias = code @ W[last + "markov_head.head.weight"].T
            confidences.append(float(torch.cat((hidden[i], code)) @ W[last + "confidence_head.proj.weight"][0]))
            prev = int((logits[i] + bias).argmax())
            tokens.append(prev)
        return tokens, confidences

    def _mixes(self, h, prefix):
        W, c = self.W, self.c
        return sinkhorn_mixes(h, W[prefix + "fn"], W[prefix + "scale"], W[prefix + "base"], c.hc_mult,
                              c.hc_sinkhorn_iters, c.hc_eps, self.eps)

    def _attention(self, P, x, main_ctx, ctx_pos, pos):
        W, c = self.W, self.c
        A, rd, theta = P + "attn.", c.qk_rope_head_dim, c.rope_theta
        heads, hd = c.num_attention_heads, c.head_dim
        q = (rms(x @ W[A + "wq_a.weight"].T, W[A + "q_norm.weight"], self.eps) @ W[A + "wq_b.weight"].T)
        q = rope(q.view(len(pos), heads, hd), pos, rd, theta)
        kv_ctx = rope(rms(main_ctx @ W[A + "wkv.weight"].T, W[A + "kv_norm.weight"], self.eps), ctx_pos, rd, theta)
        kv_blk = rope(rms(x @ W[A + "wkv.weight"].T, W[A + "kv_norm.weight"], self.eps), pos, rd, theta)
        keys = torch.cat((kv_ctx, kv_blk))  # every block query sees the whole context window and block
        scores = torch.einsum("mhd,kd->mhk", q, keys) * hd**-0.5
        sink = W[A + "attn_sink"].view(1, heads, 1).expand(len(pos), heads, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        o = rope(torch.einsum("mhk,kd->mhd", probs, keys), pos, rd, theta, inverse=True)
        groups, rank = c.o_groups, c.o_lora_rank
        o = torch.einsum("mgd,grd->mgr", o.reshape(len(pos), groups, -1), W[A + "wo_a.weight"].view(groups, rank, -1))
        return o.flatten(1) @ W[A + "wo_b.weight"].T

    def _moe(self, P, x):
        W, c = self.W, self.c
        F_, limit = P + "ffn.", float(c.swiglu_limit)
        scores = F.softplus(x @ W[F_ + "gate.weight"].T).sqrt()
        top = (scores + W[F_ + "gate.bias"]).topk(c.dspark_num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, top)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        inter = c.moe_intermediate_size
        y = torch.zeros_like(x)
        for row in range(x.shape[0]):
            for j, e in enumerate(top[row].tolist()):
                gate_up, down = W[F_ + "experts.gate_up_proj"][e], W[F_ + "experts.down_proj"][e]
                y[row] += swiglu(x[row:row + 1], gate_up[:inter], down, gate_up[inter:], limit, weights[row, j])[0]
        shared = [W[f"{F_}shared_experts.{w}.weight"] for w in ("w1", "w2", "w3")]
        return y + swiglu(x, *shared, limit)
