"""Batch-invariant building blocks of deterministic mode (`EngineConfig.deterministic`).

Kernels are deterministic run to run; a token's result changes with its batch because the kernel
*chosen* (and with it the reduction order) depends on the shapes of the call: torch's CPU matmul picks
different kernels for M = 1 and M > 1, an elementwise op's vectorised body and scalar tail round
differently (silu, sigmoid, softplus), threads split large tensors at size-dependent points, and cuBLAS
picks tiles and split-K by shape. The remedy here is shape discipline, which holds on any device whose
kernels are a function of the call's shapes:

- per-token work runs on fixed-size row tiles (`ROW_TILE` rows, the last one zero-padded), each tile a
  fresh buffer, so every call has the same shape and alignment whatever the batch (`tile_rows`);
- attention reduces over keys in splits of `KEY_SPLIT` positions aligned to absolute key positions
  (a fixed split size, not a fixed number of splits), merged in one order for prefill, chunked prefill
  and decode (`deepinfer_core.reference.invariant_attention`);
- MoE runs each expert's tokens in row tiles and sums a token's experts in ascending expert order
  (`deepinfer_core.reference.invariant_moe`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.backends.layer_ops import CompressorWeights, HyperWeights
from deepinfer_core.reference.layer_ops import ReferenceLayerOps

ROW_TILE = 64
"""Rows per tile of every per-token computation in deterministic mode (decode batches up to this size
run as one tile: one GEMM per weight, as in default mode)."""

KEY_SPLIT = 64
"""Key positions (or compressed entries) per attention and indexer split in deterministic mode."""


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` copied into a fresh zero buffer of `rows` rows (`rows >= len(x)`): contiguous, freshly aligned."""
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def tile_rows(fn: Callable[..., Any], *rows: torch.Tensor, tile: int = ROW_TILE) -> Any:
    """`fn(*rows)` computed tile by tile: each tensor in `rows` (one row per token, equal lengths) is
    zero-padded to a multiple of `tile` rows and `fn` runs on every `tile`-row slice; the results (a tensor
    or a tuple of tensors, one row per input row) are concatenated and cut back to the input length.

    Every call `fn` makes therefore sees the same shapes whatever the number of tokens, so a row's result
    depends only on that row. `fn` must treat rows independently (zero rows must stay finite)."""
    num_rows = rows[0].shape[0]
    if any(t.shape[0] != num_rows for t in rows):
        raise ValueError(f"tile_rows needs tensors of equal length, got {[t.shape[0] for t in rows]}")
    padded = [pad_rows(t, -(-num_rows // tile) * tile) for t in rows]
    outs = [fn(*(t[i : i + tile] for t in padded)) for i in range(0, padded[0].shape[0], tile)]
    if not outs:
        return fn(*rows)
    if len(outs) == 1:  # one tile (every decode step up to `tile` rows): no concatenating copy
        out = outs[0]
        return out[:num_rows] if isinstance(out, torch.Tensor) else tuple(t[:num_rows] for t in out)
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)[:num_rows]
    return tuple(torch.cat(parts)[:num_rows] for parts in zip(*outs))


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax on fixed row tiles: the reference sampler's logprobs for a deterministic
    `SamplingSpec` (on any device whose kernel is a function of the call's shape)."""
    return tile_rows(lambda rows: torch.log_softmax(rows, dim=-1), logits)


class InvariantLayerOps(ReferenceLayerOps):
    """`LayerOps` whose every per-token op (and `map_rows`) runs on fixed `ROW_TILE`-row tiles, and whose
    compressor pools the windows it closes in fixed tiles too. Window and tail writes are copies."""

    supports_cuda_graphs = False  # tiles are sliced on the host

    def map_rows(self, fn, *rows):
        return tile_rows(fn, *rows)

    def hc_pre(self, streams, hc: HyperWeights, norm_weight):
        return tile_rows(lambda s: super(InvariantLayerOps, self).hc_pre(s, hc, norm_weight), streams)

    def hc_post_pre(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight):
        def block(s, out, p, c):
            return super(InvariantLayerOps, self).hc_post_pre(s, out, p, c, hc, norm_weight)
        return tile_rows(block, streams, block_out, post, comb)

    def hc_post_head(self, streams, block_out, post, comb, rows, head: HyperWeights, norm_weight):
        def block(s, out, p, c):
            every = torch.arange(s.shape[0], device=s.device)
            return super(InvariantLayerOps, self).hc_post_head(s, out, p, c, every, head, norm_weight)
        return tile_rows(block, streams[rows], block_out[rows], post[rows], comb[rows])

    def hc_mix(self, streams, hc: HyperWeights, norm_weight, collapse_pre):
        return tile_rows(lambda s, c: super(InvariantLayerOps, self).hc_mix(s, hc, norm_weight, c),
                         streams, collapse_pre)

    def hc_post_mix(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight, collapse_pre):
        def block(s, out, p, c, pre):
            return super(InvariantLayerOps, self).hc_post_mix(s, out, p, c, hc, norm_weight, pre)
        return tile_rows(block, streams, block_out, post, comb, collapse_pre)

    def rms_norm(self, x, weight, cos=None, sin=None):
        base = super()
        if cos is None:
            return tile_rows(lambda t: base.rms_norm(t, weight), x)
        return tile_rows(lambda t, c, s: base.rms_norm(t, weight, c, s), x, cos, sin)

    def rotary(self, x, cos, sin):
        return tile_rows(super().rotary, x, cos, sin)

    def _pool_entries(self, kv_rows, gate_rows, entry, w: CompressorWeights) -> torch.Tensor:
        return tile_rows(lambda k, g, e: super(InvariantLayerOps, self)._pool_entries(k, g, e, w),
                         kv_rows, gate_rows, entry)
