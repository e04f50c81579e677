"""CSA/HCA compressors and the CSA lightning indexer's key compressor.

A compressor projects each token to `(kv, gate)` rows, keeps the rows of not-yet-closed windows in the
request's tail ring (`[slots, tail_rows, width]`, row of position `p` at `p % tail_rows`), and when a
window of `rate` tokens closes, writes one entry `kv_norm(sum softmax(gate) * kv)`, RoPE'd at the
window's first position, into the paged entry pool. CSA ("overlap") entries mix the previous window's
first half-channels (Ca) with the current window's second half-channels (Cb) over `2 * rate` rows.
The model runs the projections; the window close and the ring writes run in the `LayerOps` backend
(`LayerOps.compress`).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.backends.layer_ops import CompressorWeights
from deepinfer_core.models.deepseek_v4.layers import FP32, RMSNorm
from deepinfer_core.models.deepseek_v4.rope import Rotary


class Compressor(nn.Module):
    """Window-closing compressor; `overlap=True` for CSA."""

    def __init__(self, hidden_size: int, width: int, rate: int, overlap: bool, dtype: torch.dtype) -> None:
        super().__init__()
        proj = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, proj, dtype=FP32))
        self.kv_norm = RMSNorm(width)

    def weights(self, rotary: Rotary) -> CompressorWeights:
        return CompressorWeights(self.position_bias, self.kv_norm.weight, self.rate, self.width, self.overlap,
                                 rotary.inv_freq, rotary.scaling)


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
