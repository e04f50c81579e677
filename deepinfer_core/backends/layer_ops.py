"""Layer-ops contract: the chains of small operations between a layer's matmuls.

mHC (the `hc_mult` residual streams collapsed into each block's input and the block output folded back
in), RMSNorm, RoPE and the compressors' window close. In a naive implementation these are hundreds of
tiny kernels a step; a backend may fuse them (one kernel per block boundary: the previous block's
residual fold, the next block's mixing weights, collapse and input norm).

Conventions (V4): every norm uses `spec.rms_norm_eps`; RoPE rotates interleaved pairs `(2i, 2i + 1)`
of the trailing `rope_dim` channels (`rope_dim = 2 * cos.shape[-1]`); cos/sin tables are fp32
`[num_tokens, rope_dim // 2]`; mixing weights (`post`, `comb`) are fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer_core.backends.attention import AttentionMetadata
from deepinfer_core.backends.graphs import GraphCapturable


@dataclass(frozen=True)
class LayerOpsSpec:
    """Model-wide shapes and constants; one backend serves every layer."""

    hidden_size: int
    hc_mult: int
    """Residual streams (`n`)."""
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    dtype: torch.dtype = torch.float32
    """Activation dtype (the streams, block inputs and outputs)."""
    deterministic: bool = False
    """Batch-invariant mode (`EngineConfig.deterministic`): every per-token op (and `map_rows`) must give
    a token bit-identical results whatever other tokens share the call, e.g. by running in fixed-size row
    tiles. A backend without such a variant declines the spec."""


@dataclass
class HyperWeights:
    """One mHC site's parameters (transformers' `attn_hc` / `ffn_hc`, or `hc_head`)."""

    fn: torch.Tensor
    """fp32 `[(2 + n) * n, n * hidden]` (a block site: pre, post, comb rows) or `[n, n * hidden]` (head)."""
    base: torch.Tensor
    """fp32, one per `fn` row."""
    scale: torch.Tensor
    """fp32 `[3]` (pre, post, comb) or `[1]` (head)."""


@dataclass
class CompressorWeights:
    """One compressor's non-matmul parameters (the CSA/HCA compressor or the CSA indexer's)."""

    position_bias: torch.Tensor
    """fp32 `[rate, proj]` added to the gate of the token at position `p` by row `p % rate`."""
    norm_weight: torch.Tensor
    """fp32 `[width]` weight of the entry RMSNorm."""
    rate: int
    width: int
    """Entry width; `proj = 2 * width` when `overlap`, else `width`."""
    overlap: bool
    """CSA: entry `e` pools the first `width` channels of window `e - 1` (none for `e = 0`) and the
    last `width` channels of window `e`."""
    inv_freq: torch.Tensor
    """fp32 `[rope_dim // 2]` inverse frequencies of the entry rope."""
    rope_scaling: float
    """Multiplier on the entry rope's cos and sin."""


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The block input `[T, D]` of mHC streams `[T, n, D]`: `sum_i pre[i] * streams[i]`, in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hyper_residual(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams `[T, n, D]`: `post[j] * out + sum_i comb[i, j] * streams[i]` (the fold every `LayerOps`
    boundary method implements; the models apply it directly where no boundary follows)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@runtime_checkable
class SinglePassMixing(Protocol):
    """DeepSeek-V4.1's single-pass mHC block boundaries (research-v41.md §4.1): each site computes its
    mixing weights from the streams it receives, but its block's input is collapsed with the *previous*
    site's `pre` (the first site's: one-hot on stream 0). Part of every `LayerOps` (the V4.1 model runs
    its boundaries through the layer ops it is bound with); the reference implementation is
    `ReferenceLayerOps`'. Mixing weights, collapse and norm follow `LayerOps.hc_pre`; the fold follows
    `LayerOps.hc_post_pre`.
    """

    def hc_mix(self, streams: torch.Tensor, hc: HyperWeights, norm_weight: torch.Tensor, collapse_pre: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mixing weights of `streams` `[T, n, D]` and the block input collapsed with `collapse_pre`.

        :param collapse_pre: `[T, n]` fp32, the previous site's `pre`.
        :returns: `pre` `[T, n]`, `post` `[T, n]`, `comb` `[T, n, n]` (fp32; `pre` may be a strided
            view), and `x = RMSNorm(sum_i collapse_pre[i] * streams[i]) * norm_weight` `[T, D]`.
        """
        ...

    def hc_post_mix(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    hc: HyperWeights, norm_weight: torch.Tensor, collapse_pre: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fold `block_out` into `streams` (as `hc_post_pre`), then `hc_mix` of the new streams.

        :returns: the new streams `[T, n, D]` (contiguous), then `hc_mix`'s four tensors.
        """
        ...


@runtime_checkable
class LayerOps(SinglePassMixing, GraphCapturable, Protocol):
    spec: LayerOpsSpec

    def hc_pre(self, streams: torch.Tensor, hc: HyperWeights, norm_weight: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first block's input from `streams` `[T, n, D]` (may be a stride-0 expand of the embedding).

        `flat = rms(streams.flatten(1))` (unweighted, fp32); `m = flat @ hc.fn.T`, split `[n, n, n*n]`;
        `pre = sigmoid(m_pre * scale[0] + base_pre) + hc_eps`; `post = 2 * sigmoid(m_post * scale[1] +
        base_post)`; `comb = softmax_rows(m_comb.view(n, n) * scale[2] + base_comb) + hc_eps`, then
        normalised by columns once and by rows then columns `hc_sinkhorn_iters - 1` more times (each
        divide by `sum + hc_eps`); `collapsed = sum_i pre[i] * streams[i]` cast to the stream dtype;
        `x = RMSNorm(collapsed) * norm_weight` cast to the stream dtype.

        :returns: `post` `[T, n]`, `comb` `[T, n, n]` (`comb[i, j]`: stream i's weight in new stream j),
            `x` `[T, D]`.
        """
        ...

    def hc_post_pre(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    hc: HyperWeights, norm_weight: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fold a block's output back in, then `hc_pre` of the next block (one block boundary).

        `new[j] = post[j] * block_out + sum_i comb[i, j] * streams[i]` in the stream dtype.

        :returns: `new` `[T, n, D]` contiguous, then `hc_pre(new, hc, norm_weight)`'s three tensors.
        """
        ...

    def hc_post_head(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     rows: torch.Tensor, head: HyperWeights, norm_weight: torch.Tensor) -> torch.Tensor:
        """The last block's fold for token `rows` only, then the head collapse and the final norm.

        `pre = sigmoid(rms(flat) @ head.fn.T * scale[0] + base) + hc_eps`; `hidden = RMSNorm(sum_i pre[i] *
        new[i]) * norm_weight`.

        :param rows: `[R]` int64 token indices whose logits are wanted.
        :returns: `[R, D]` in the stream dtype.
        """
        ...

    def map_rows(self, fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
        """Run `fn(*rows)`, a per-token computation of the model (its projections, the shared expert, the
        head): every tensor in `rows` and in the result (a tensor or a tuple of them) has one row per token.
        A default backend simply calls `fn`; a deterministic one (`spec.deterministic`) runs it on
        fixed-size row tiles, so the kernels `fn` launches never see a batch-dependent shape."""
        ...

    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` in fp32: `x` `[T, K]` fp32, `weight` `[N, K]` of any float dtype, its values taken
        exactly (DeepSeek-V4.1's head: bf16 weights, fp32 math). A backend may read `weight` in its own
        dtype rather than upcast a copy of it; rows must not depend on one another (deterministic mode)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm over the last dim of `x` `[T, ..., W]` (fp32 math, `weight` fp32 or None for unit),
        then, when `cos`/`sin` are given, RoPE on its trailing channels. Returns `x`'s dtype and shape."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the trailing channels of `x` `[T, ..., W]` (pass `-sin` for the inverse rotation)."""
        ...

    def write_window(self, metadata: AttentionMetadata, window: torch.Tensor, kv: torch.Tensor) -> None:
        """Store this step's keys in the window rings: each request's last `ring = window.shape[1]` tokens
        of the step write `kv[t]` to `window[slot, position % ring]` (earlier tokens of a long chunk are
        not written, so no two tokens target one row)."""
        ...

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, weights: CompressorWeights, metadata: AttentionMetadata,
                 kv_tail: torch.Tensor, gate_tail: torch.Tensor, entries: torch.Tensor,
                 no_write_before: torch.Tensor) -> None:
        """Close the windows this step ends and refresh the tail rings.

        `kv`, `gate`: this step's projected rows `[T, proj]` (`gate` before the position bias). The
        gate of position `p` is `gate + position_bias[p % rate]` (fp32). A token at position `p` with
        `(p + 1) % rate == 0` closes entry `e = (p + 1) // rate - 1` of its request, from the rows of
        positions `[e * rate, p]` (CSA: `[(e - 1) * rate, p]`), found in this step's rows when at or
        after the request's `start_positions`, else in its tail ring (`kv_tail[slot, q % ring]`, `gate_tail`
        likewise, `ring = kv_tail.shape[1]`): `entry = RMSNorm(sum_rows softmax_rows(gate) * kv) *
        norm_weight`, RoPE'd at position `e * rate` (cos, sin = `cos/sin(e * rate * inv_freq) *
        rope_scaling`), stored at `entries[block_tables[seq, e // epb] * epb + e % epb]` (`epb = 128 //
        rate`) unless `(e + 1) * rate <= no_write_before[seq]`. Then each request's last `ring` rows of
        this step are written to the rings (`kv` in the tail's dtype, `gate` with its bias, fp32).
        """
        ...


@runtime_checkable
class HostRowGather(Protocol):
    """Layer ops whose device reads host memory itself: rows of a table in pinned host memory gathered
    by a device kernel at indices on the device, with no host step, so decode steps that gather stay
    capturable in CUDA graphs (DeepSeek-V4.1's Engram tables placed in host memory use it; without it,
    their rows are gathered on the host and copied over, and such steps run eagerly)."""

    def gather_host_rows(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None,
                         ) -> torch.Tensor:
        """`table[ids]`, read by the device.

        :param table: `[rows, width]` in pinned host memory.
        :param ids: int64 row indices of any shape, on the device.
        :param out: `[*ids.shape, width]` of `table`'s dtype on the device, or None (allocated).
        :returns: `out`, on `ids`' stream.
        """
        ...
