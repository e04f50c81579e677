"""CSA/HCA compressors and the CSA lightning indexer's key compressor.

A compressor projects each token to `(kv, gate)` rows, keeps the rows of not-yet-closed windows in the
request's tail ring (`[slots, tail_rows, width]`, row of position `p` at `p % tail_rows`), and when a
window of `rate` tokens closes, writes one entry `kv_norm(sum softmax(gate) * kv)`, RoPE'd at the
window's first position, into the paged entry pool. CSA ("overlap") entries mix the previous window's
first half-channels (Ca) with the current window's second half-channels (Cb) over `2 * rate` rows.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.models.layers import RMSNorm
from deepinfer_core.models.rope import Rotary, apply_rotary


class Compressor(nn.Module):
    """Window-closing compressor; `overlap=True` for CSA."""

    def __init__(self, hidden_size: int, width: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        proj = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, proj, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, proj, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, eps)

    def compress(
        self,
        x: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: Rotary,
        kv_tail: torch.Tensor,
        gate_tail: torch.Tensor,
        entries: torch.Tensor,
        no_write_before: torch.Tensor,
    ) -> None:
        """Write every entry this step closes into `entries`, then refresh the tail rings.

        `entries` has one scratch row at the end: under CUDA graphs (`needs_static_shapes`) every token
        computes a candidate entry and those that close no window (or are already cached) are written
        there, so the step needs no host round trip; otherwise only closing tokens are computed.
        """
        kv = self.kv_proj(x)
        gate = self.gate_proj(x).float() + self.position_bias[metadata.positions % self.rate]
        self._close_windows(kv, gate, metadata, rotary, kv_tail, gate_tail, entries, no_write_before)
        write_rings(metadata, kv_tail, kv, gate_tail, gate)

    def _close_windows(self, kv, gate, metadata: AttentionMetadata, rotary: Rotary, kv_tail, gate_tail, entries,
                       no_write_before: torch.Tensor) -> None:
        """Every token that ends a window closes one entry, from its window's rows (and, for CSA, the
        previous window's), taken from this step's rows or, before the chunk, from the tail ring."""
        rate, ring, width = self.rate, kv_tail.shape[1], self.width
        positions = metadata.positions
        lens = metadata.query_start_loc.diff()
        seq = torch.repeat_interleave(torch.arange(len(lens), device=kv.device), lens, output_size=len(positions))
        entry = (positions + 1) // rate - 1
        keep = ((positions + 1) % rate == 0) & ((entry + 1) * rate > no_write_before[seq])
        if metadata.needs_static_shapes:  # every token, no host read: rows that keep nothing go to scratch
            token = torch.arange(len(positions), device=kv.device)
        else:
            token = keep.nonzero().squeeze(1)
            if token.numel() == 0:
                return
            keep, entry, seq = keep[token], entry[token], seq[token]
        span = 2 * rate if self.overlap else rate
        row_pos = positions[token, None] - span + 1 + torch.arange(span, device=kv.device)
        in_step = (row_pos >= metadata.start_positions[seq, None])[..., None]
        flat = (token[:, None] - (positions[token, None] - row_pos)).clamp(min=0)
        ring_at = (metadata.slots[seq, None], row_pos % ring)
        kv_rows = torch.where(in_step, kv[flat], kv_tail[ring_at].to(kv.dtype))
        gate_rows = torch.where(in_step, gate[flat], gate_tail[ring_at])
        if self.overlap:
            kv_rows = torch.cat((kv_rows[:, :rate, :width], kv_rows[:, rate:, width:]), dim=1)
            previous = gate_rows[:, :rate, :width].masked_fill((entry == 0).view(-1, 1, 1), float("-inf"))
            gate_rows = torch.cat((previous, gate_rows[:, rate:, width:]), dim=1)
        closed = self.kv_norm((kv_rows * gate_rows.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1))
        entry = entry.clamp(min=0)
        closed = apply_rotary(closed, *rotary.cos_sin(entry * rate))
        epb = 128 // rate
        target = metadata.block_tables[seq, entry // epb] * epb + entry % epb
        entries[torch.where(keep, target, entries.shape[0] - 1)] = closed.to(entries.dtype)


def write_rings(metadata: AttentionMetadata, *rings_and_rows: torch.Tensor) -> None:
    """Store this step's rows in per-request rings (`ring[slot, position % len]`), given as pairs
    `ring, rows` of equal ring length; only each request's last `len` rows are written, so no two rows
    target one ring slot (and decode steps need no masking, which keeps them graph-safe)."""
    ring = rings_and_rows[0].shape[1]
    positions, slots = metadata.positions, metadata.slots
    live = None
    if not metadata.is_decode_only:
        lens = metadata.query_start_loc.diff()
        live = positions >= (metadata.start_positions + lens).repeat_interleave(lens) - ring
        positions, slots = positions[live], slots.repeat_interleave(lens)[live]
    for target, rows in zip(rings_and_rows[::2], rings_and_rows[1::2]):
        target[slots, positions % ring] = (rows if live is None else rows[live]).to(target.dtype)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False, dtype=dtype)


class Indexer(Compressor):
    """CSA lightning indexer: its own key compressor (`index_head_dim` wide) plus query projection."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        rate = config.compress_rates["compressed_sparse_attention"]
        super().__init__(config.hidden_size, config.index_head_dim, rate, True, config.rms_norm_eps, dtype)
        self.num_heads = config.index_n_heads
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.width, bias=False, dtype=dtype)
        self.scorer = IndexerScorer(config.hidden_size, self.num_heads, dtype)

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries `[T, heads, width]` (RoPE'd) and fp32 head weights `[T, heads]`."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.width)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        return apply_rotary(q, cos, sin), weights
