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

        `entries` has one scratch row at the end: decode steps write every request's candidate entry
        and send those that close no window (or are already cached) there, so the step needs no
        host round trip and can be captured in a CUDA graph.
        """
        positions = metadata.positions
        kv = self.kv_proj(x)
        gate = self.gate_proj(x).float() + self.position_bias[positions % self.rate]
        if metadata.is_decode_only:
            self._compress_decode(kv, gate, metadata, rotary, kv_tail, gate_tail, entries, no_write_before)
        else:
            self._compress_chunks(kv, gate, metadata, rotary, kv_tail, gate_tail, entries, no_write_before.tolist())

    def _compress_decode(self, kv, gate, metadata: AttentionMetadata, rotary: Rotary, kv_tail, gate_tail, entries,
                         no_write_before: torch.Tensor) -> None:
        rate, ring, width = self.rate, kv_tail.shape[1], self.width
        positions, slots = metadata.positions, metadata.slots
        kv_tail[slots, positions % ring] = kv.to(kv_tail.dtype)
        gate_tail[slots, positions % ring] = gate
        entry = (positions + 1) // rate - 1  # the entry this token would close
        span = 2 * rate if self.overlap else rate
        first = entry * rate - (rate if self.overlap else 0)
        rows = (first[:, None] + torch.arange(span, device=kv.device)) % ring
        kv_rows, gate_rows = kv_tail[slots[:, None], rows], gate_tail[slots[:, None], rows]
        if self.overlap:
            kv_rows = torch.cat((kv_rows[:, :rate, :width], kv_rows[:, rate:, width:]), dim=1)
            previous = gate_rows[:, :rate, :width].masked_fill((entry == 0).view(-1, 1, 1), float("-inf"))
            gate_rows = torch.cat((previous, gate_rows[:, rate:, width:]), dim=1)
        closed = self.kv_norm((kv_rows * gate_rows.softmax(dim=1).to(kv_rows.dtype)).sum(dim=1))
        entry = entry.clamp(min=0)
        cos, sin = rotary.cos_sin(entry * rate)
        closed = apply_rotary(closed, cos, sin)
        epb = 128 // rate
        row = metadata.block_tables.gather(1, (entry // epb)[:, None]).squeeze(1) * epb + entry % epb
        closes = ((positions + 1) % rate == 0) & ((entry + 1) * rate > no_write_before)
        entries[torch.where(closes, row, entries.shape[0] - 1)] = closed.to(entries.dtype)

    def _compress_chunks(self, kv, gate, metadata: AttentionMetadata, rotary: Rotary, kv_tail, gate_tail, entries,
                         no_write_before: list[int]) -> None:
        rate, ring = self.rate, kv_tail.shape[1]
        epb = 128 // rate
        qsl = metadata.query_start_loc.tolist()
        slots = metadata.slots.tolist()
        for i, start in enumerate(metadata.start_positions_host):
            end = start + metadata.query_lens[i]
            first, last = start // rate, end // rate
            if last == first:
                continue
            base = max(0, (first - self.overlap) * rate)
            old = torch.arange(base, start, device=kv.device) % ring
            rows_kv = torch.cat((kv_tail[slots[i], old], kv[qsl[i] : qsl[i + 1]]))[: last * rate - base]
            rows_gate = torch.cat((gate_tail[slots[i], old], gate[qsl[i] : qsl[i + 1]]))[: last * rate - base]
            ids = torch.arange(first, last, device=kv.device)
            keep = (ids + 1) * rate > no_write_before[i]
            if not bool(keep.any()):
                continue
            closed = self._close(rows_kv, rows_gate, has_previous=first > 0)
            cos, sin = rotary.cos_sin(ids * rate)
            closed = apply_rotary(closed, cos, sin)
            ids, closed = ids[keep], closed[keep]
            rows = metadata.block_tables[i, ids // epb] * epb + ids % epb
            entries[rows] = closed.to(entries.dtype)
        self._write_tails(kv, gate, metadata, kv_tail, gate_tail)

    def _close(self, kv: torch.Tensor, gate: torch.Tensor, has_previous: bool) -> torch.Tensor:
        """Rows of consecutive windows -> one entry per closed window, `[num_closed, width]`."""
        rate, width = self.rate, self.width
        kv = kv.view(-1, rate, kv.shape[-1])
        gate = gate.view(-1, rate, gate.shape[-1])
        if self.overlap:
            if not has_previous:  # window 0 has no predecessor: its Ca half gets zero weight
                kv = torch.cat((kv.new_zeros(1, rate, kv.shape[-1]), kv))
                gate = torch.cat((gate.new_full((1, rate, gate.shape[-1]), float("-inf")), gate))
            kv = torch.cat((kv[:-1, :, :width], kv[1:, :, width:]), dim=1)
            gate = torch.cat((gate[:-1, :, :width], gate[1:, :, width:]), dim=1)
        weights = gate.softmax(dim=1).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))

    @staticmethod
    def _write_tails(kv, gate, metadata: AttentionMetadata, kv_tail, gate_tail) -> None:
        # Only each request's last `ring` rows matter; skipping the rest keeps index_put free of duplicates.
        ring = kv_tail.shape[1]
        lens = metadata.query_start_loc.diff()
        ends = (metadata.start_positions + lens).repeat_interleave(lens)
        live = metadata.positions >= ends - ring
        token_slots = metadata.slots.repeat_interleave(lens)[live]
        ring_rows = metadata.positions[live] % ring
        kv_tail[token_slots, ring_rows] = kv[live].to(kv_tail.dtype)
        gate_tail[token_slots, ring_rows] = gate[live].to(gate_tail.dtype)


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
