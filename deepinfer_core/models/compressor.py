"""CSA/HCA compressors and the CSA lightning indexer's key compressor.

A compressor projects each token to `(kv, gate)` rows, keeps the rows of not-yet-closed windows in the
request's tail ring (`[slots, tail_rows, width]`, row of position `p` at `p % tail_rows`), and when a
window of `rate` tokens closes, writes one entry `kv_norm(sum softmax(gate) * kv)`, RoPE'd at the
window's first position, into the paged entry pool. CSA ("overlap") entries mix the previous window's
first half-channels (Ca) with the current window's second half-channels (Cb) over `2 * rate` rows.
The window close and the ring writes run in the `LayerOps` backend (`LayerOps.compress`).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.backends.layer_ops import CompressorWeights, LayerOps
from deepinfer_core.models.layers import RMSNorm
from deepinfer_core.models.rope import Rotary


class Compressor(nn.Module):
    """Window-closing compressor; `overlap=True` for CSA."""

    def __init__(self, hidden_size: int, width: int, rate: int, overlap: bool, dtype: torch.dtype) -> None:
        super().__init__()
        proj = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, proj, dtype=torch.float32))
        self.kv_norm = RMSNorm(width)

    def weights(self, rotary: Rotary) -> CompressorWeights:
        return CompressorWeights(self.position_bias, self.kv_norm.weight, self.rate, self.width, self.overlap,
                                 rotary.inv_freq, rotary.scaling)

    def compress(self, x: torch.Tensor, metadata: AttentionMetadata, ops: LayerOps, weights: CompressorWeights,
                 kv_tail: torch.Tensor, gate_tail: torch.Tensor, entries: torch.Tensor,
                 no_write_before: torch.Tensor) -> None:
        """Write every entry this step closes into `entries`, then refresh the tail rings."""
        ops.compress(self.kv_proj(x), self.gate_proj(x), weights, metadata, kv_tail, gate_tail, entries,
                     no_write_before)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False, dtype=dtype)


class Indexer(Compressor):
    """CSA lightning indexer: its own key compressor (`index_head_dim` wide) plus query projection."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        rate = config.compress_rates["compressed_sparse_attention"]
        super().__init__(config.hidden_size, config.index_head_dim, rate, True, dtype)
        self.num_heads = config.index_n_heads
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.width, bias=False, dtype=dtype)
        self.scorer = IndexerScorer(config.hidden_size, self.num_heads, dtype)

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, ops: LayerOps, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries `[T, heads, width]` (RoPE'd) and fp32 head weights `[T, heads]`."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.width)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        return ops.rotary(q, cos, sin), weights
