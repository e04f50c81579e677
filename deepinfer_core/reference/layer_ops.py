"""Reference layer ops: mHC, RMSNorm, RoPE and the compressor window close in plain PyTorch.

Numerics follow transformers' `DeepseekV4ForCausalLM`: fp32 for norms, mixing weights and gates, one
cast to the activation dtype where transformers casts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends.attention import BLOCK_SIZE, AttentionMetadata
from deepinfer_core.backends.compressed_entries import closing_entries
from deepinfer_core.backends.layer_ops import (
    CompressorWeights,
    HyperWeights,
    LayerOpsSpec,
    collapse,
    hyper_residual,
)
from deepinfer_core.backends.paged import write_rings


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the trailing rope channels of `x` `[N, ..., D]` by `cos/sin` `[N, R/2]`."""
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


def mixes(streams: torch.Tensor, hc: HyperWeights, spec: LayerOpsSpec) -> torch.Tensor:
    """`rms(streams.flatten(1)) @ hc.fn.T` in fp32: one row of raw mixing logits per token."""
    return F.linear(unweighted_rms_norm(streams.flatten(1).float(), spec.rms_norm_eps), hc.fn)


def hyper_mix(streams: torch.Tensor, hc: HyperWeights, spec: LayerOpsSpec) -> tuple[torch.Tensor, ...]:
    """`(pre, post, comb)` mixing weights (fp32) of one block site for `streams` `[T, n, D]`."""
    n, eps = spec.hc_mult, spec.hc_eps
    pre_w, post_w, comb_w = mixes(streams, hc, spec).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(spec.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class ReferenceLayerOps:
    supports_cuda_graphs = True  # decode steps read no device value on the host (see `_close_windows`)

    def __init__(self, spec: LayerOpsSpec) -> None:
        self.spec = spec

    def hc_pre(self, streams, hc: HyperWeights, norm_weight):
        pre, post, comb = hyper_mix(streams, hc, self.spec)
        return post, comb, weighted_rms_norm(collapse(streams, pre), norm_weight, self.spec.rms_norm_eps)

    def hc_post_pre(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight):
        new = hyper_residual(streams, block_out, post, comb)
        return (new, *self.hc_pre(new, hc, norm_weight))

    def hc_post_head(self, streams, block_out, post, comb, rows, head: HyperWeights, norm_weight):
        new = hyper_residual(streams[rows], block_out[rows], post[rows], comb[rows])
        pre = torch.sigmoid(mixes(new, head, self.spec) * head.scale + head.base) + self.spec.hc_eps
        return weighted_rms_norm(collapse(new, pre), norm_weight, self.spec.rms_norm_eps)

    def hc_mix(self, streams, hc: HyperWeights, norm_weight, collapse_pre):
        """`SinglePassMixing.hc_mix` (V4.1)."""
        pre, post, comb = hyper_mix(streams, hc, self.spec)
        return pre, post, comb, weighted_rms_norm(collapse(streams, collapse_pre), norm_weight, self.spec.rms_norm_eps)

    def hc_post_mix(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight, collapse_pre):
        """`SinglePassMixing.hc_post_mix` (V4.1)."""
        new = hyper_residual(streams, block_out, post, comb)
        return (new, *self.hc_mix(new, hc, norm_weight, collapse_pre))

    def map_rows(self, fn, *rows):
        return fn(*rows)

    def fp32_linear(self, x, weight):
        return F.linear(x.float(), weight.float())

    def rms_norm(self, x, weight, cos=None, sin=None):
        eps = self.spec.rms_norm_eps
        x = unweighted_rms_norm(x, eps) if weight is None else weighted_rms_norm(x, weight, eps)
        return x if cos is None else apply_rotary(x, cos, sin)

    def rotary(self, x, cos, sin):
        return apply_rotary(x, cos, sin)

    def write_window(self, metadata: AttentionMetadata, window, kv) -> None:
        write_rings(metadata, window, kv)

    def compress(self, kv, gate, weights: CompressorWeights, metadata: AttentionMetadata, kv_tail, gate_tail,
                 entries, no_write_before) -> None:
        gate = gate.float() + weights.position_bias[metadata.positions % weights.rate]
        self._close_windows(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before)
        write_rings(metadata, kv_tail, kv, gate_tail, gate)

    def _close_windows(self, kv, gate, w: CompressorWeights, metadata: AttentionMetadata, kv_tail, gate_tail,
                       entries, no_write_before) -> None:
        """Every token that ends a window closes one entry, from its window's rows (and, for CSA, the
        previous window's), taken from this step's rows or, before the chunk, from the tail ring.

        Under CUDA graphs (`needs_static_shapes`) every token computes a candidate entry and those that
        close no window (or are already cached) are written to the pool's scratch row, so the step needs
        no host round trip; otherwise only closing tokens are computed."""
        rate, ring, width = w.rate, kv_tail.shape[1], w.width
        closing = closing_entries(metadata, rate, no_write_before)
        if closing.token.numel() == 0:  # found on the host: no token of the step closes a window
            return
        entry, seq, keep = closing.entry, closing.seq, closing.keep
        span = 2 * rate if w.overlap else rate
        in_step, flat, ring_at = closing.window_rows(metadata, span, ring)
        kv_rows = torch.where(in_step, kv[flat], kv_tail[ring_at].to(kv.dtype))
        gate_rows = torch.where(in_step, gate[flat], gate_tail[ring_at])
        if w.overlap:
            kv_rows = torch.cat((kv_rows[:, :rate, :width], kv_rows[:, rate:, width:]), dim=1)
            previous = gate_rows[:, :rate, :width].masked_fill((entry == 0).view(-1, 1, 1), float("-inf"))
            gate_rows = torch.cat((previous, gate_rows[:, rate:, width:]), dim=1)
        entry = entry.clamp(min=0)
        closed = self._pool_entries(kv_rows, gate_rows, entry, w)
        epb = BLOCK_SIZE // rate
        target = metadata.block_tables[seq, entry // epb] * epb + entry % epb
        entries[torch.where(keep, target, entries.shape[0] - 1)] = closed.to(entries.dtype)

    def _pool_entries(self, kv_rows, gate_rows, entry, w: CompressorWeights) -> torch.Tensor:
        """Entries `[E, width]` from their rows `[E, span, width]` and gates: softmax-pooled, normed and
        RoPE'd at each entry's first position."""
        pooled = (kv_rows * gate_rows.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1)
        closed = weighted_rms_norm(pooled, w.norm_weight, self.spec.rms_norm_eps)
        freqs = (entry * w.rate).to(torch.float32)[:, None] * w.inv_freq
        return apply_rotary(closed, freqs.cos() * w.rope_scaling, freqs.sin() * w.rope_scaling)


__all__ = ["ReferenceLayerOps", "apply_rotary", "collapse", "hyper_mix", "hyper_residual", "mixes",
           "unweighted_rms_norm", "weighted_rms_norm", "write_rings"]
