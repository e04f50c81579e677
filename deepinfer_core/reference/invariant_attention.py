"""Batch-invariant attention and CSA indexer (deterministic mode): one code path for prefill, chunked
prefill and decode.

The step's query tokens (of any requests) run in tiles of `QUERY_TILE` rows. Each row visits its keys in
splits of `KEY_SPLIT`: window keys by absolute position (split `s` holds positions `[s * KEY_SPLIT,
(s + 1) * KEY_SPLIT)`, key `p` always in column `p % KEY_SPLIT`), then compressed entries by entry number
likewise. A split is two fixed-shape batched GEMMs (one matrix per row) and an online-softmax merge
(flash attention's), started from the sink, in ascending split order. A split a row cannot see is an
exact no-op for it (probabilities 0, rescale exp(0) = 1), so how many splits its tile happens to visit,
and which rows share the tile, change nothing: a query's output depends on its own keys only. The
indexer scores its entries in the same splits; its raw scores also serve V4.1's two-level indexer
(`index_scores`, the `IndexScorer` protocol).
"""

from __future__ import annotations

import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec
from deepinfer_core.backends.paged import gather_rows
from deepinfer_core.reference.invariant import KEY_SPLIT, pad_rows

QUERY_TILE = 16
"""Query rows per tile (a row is one token, all its heads)."""


class InvariantAttention:
    """`AttentionBackend` for `AttentionSpec.deterministic`; pure PyTorch, any device (kernels chosen by
    shape). Tiles and split counts are decided on the host, so it is not graph-capturable."""

    supports_cuda_graphs = False

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None,
                num_entries=None):
        rows = _Rows(metadata, kv, window)
        w, rate = self.spec.sliding_window, self.spec.compress_rate
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], QUERY_TILE):
            tile = rows.tile(a)
            qt = pad_rows(q[a : a + QUERY_TILE].float(), QUERY_TILE)
            state = _initial_state(sinks, qt)
            base = (tile.positions - w + 1).clamp(min=0) // KEY_SPLIT
            for j in range(-(-w // KEY_SPLIT) + 1):
                keys, visible = rows.window_split(tile, base + j, w)
                state = _merge(state, qt, keys, visible, self.spec.head_dim)
            if compressed is not None:
                limit = (tile.positions + 1) // rate
                picked = _picked(topk_indices, a, limit) if topk_indices is not None else None
                for split in range(-(-int(limit.max()) // KEY_SPLIT)):
                    keys, visible = rows.entry_split(tile, compressed, split, limit, self.spec.entries_per_block)
                    if picked is not None:
                        visible &= picked[:, split * KEY_SPLIT : (split + 1) * KEY_SPLIT]
                    state = _merge(state, qt, keys, visible, self.spec.head_dim)
            _, denom, acc = state
            out[a : a + QUERY_TILE] = (acc / denom[..., None])[: tile.num_rows].to(q.dtype)
        return out

    def indexer_topk(self, q, weights, index_keys, metadata: AttentionMetadata, num_entries):
        k, rate = self.spec.index_topk, self.spec.compress_rate
        out = torch.full((q.shape[0], k), -1, dtype=torch.long, device=q.device)
        for a, tile, scores in self._score_tiles(q, weights, index_keys, metadata):
            # stable: on equal scores (ReLU makes exact zeros common) the lower entry number wins
            top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
            limit = (tile.positions[: tile.num_rows, None] + 1) // rate
            out[a : a + tile.num_rows, : top.shape[1]] = torch.where(top >= limit, -1, top)
        return out

    def index_scores(self, q, weights, index_keys, metadata: AttentionMetadata, cap: int) -> torch.Tensor:
        """`IndexScorer.index_scores` (V4.1's two-level indexer selects on them), scored as `indexer_topk`
        scores: a token's scores depend on its own entries only."""
        out = torch.full((q.shape[0], cap), float("-inf"), device=q.device)
        for a, tile, scores in self._score_tiles(q, weights, index_keys, metadata):
            width = min(cap, scores.shape[1])
            out[a : a + tile.num_rows, :width] = scores[:, :width]
        return out

    def _score_tiles(self, q, weights, index_keys, metadata: AttentionMetadata):
        """Per query tile: `(first row, tile, scores [rows, splits * KEY_SPLIT])`, -inf where not visible;
        each split one fixed-shape batched GEMM over `KEY_SPLIT` entries at absolute entry numbers."""
        rate, epb = self.spec.compress_rate, self.spec.entries_per_block
        rows = _Rows(metadata)
        for a in range(0, q.shape[0], QUERY_TILE):
            tile = rows.tile(a)
            limit = (tile.positions + 1) // rate
            num_splits = -(-int(limit.max()) // KEY_SPLIT)
            if num_splits == 0:
                continue
            qt = pad_rows(q[a : a + QUERY_TILE].float(), QUERY_TILE)
            wt = pad_rows(weights[a : a + QUERY_TILE].float(), QUERY_TILE)
            scores = []
            for split in range(num_splits):
                keys, visible = rows.entry_split(tile, index_keys, split, limit, epb)
                s = torch.relu(torch.bmm(qt, keys.float().transpose(1, 2))) * self.spec.index_head_dim**-0.5
                scores.append((s * wt[:, :, None]).sum(dim=1).masked_fill(~visible, float("-inf")))
            yield a, tile, torch.cat(scores, dim=1)[: tile.num_rows]


class _Tile:
    """One tile's rows: per row its request, position and (for window keys) bank offsets; padded rows
    have position -1 and see nothing."""

    def __init__(self, seq, positions, num_rows):
        self.seq, self.positions, self.num_rows = seq, positions, num_rows


class _Rows:
    """Per flat token of the step: its request and position; window keys come from the request's ring
    (positions before the step) or from this step's keys."""

    def __init__(self, metadata: AttentionMetadata, kv=None, window=None) -> None:
        self.metadata = metadata
        lens = metadata.query_start_loc.diff()
        self.seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens,
                                           output_size=len(metadata.positions))
        if kv is not None:
            self.kv, self.ring = kv, window.shape[1]
            self.ring_rows = window.view(-1, window.shape[-1])
            first = metadata.window_starts if metadata.window_starts is not None else torch.zeros_like(lens)
            self.first = first.clamp(min=0)

    def tile(self, a: int) -> _Tile:
        seq, positions = self.seq[a : a + QUERY_TILE], self.metadata.positions[a : a + QUERY_TILE]
        num_rows = len(seq)
        pad = QUERY_TILE - num_rows
        if pad:
            seq = torch.cat((seq, seq.new_zeros(pad)))
            positions = torch.cat((positions, positions.new_full((pad,), -1)))
        return _Tile(seq, positions, num_rows)

    def window_split(self, tile: _Tile, split: torch.Tensor, w: int):
        """Keys `[R, S, D]` of window split `split` `[R]` per row, and which each row sees `[R, S]`."""
        m = self.metadata
        key_pos = split[:, None] * KEY_SPLIT + torch.arange(KEY_SPLIT, device=split.device)
        start = m.start_positions[tile.seq][:, None]
        q_pos = tile.positions[:, None]
        in_step = key_pos >= start
        visible = ((key_pos <= q_pos) & (key_pos > q_pos - w) & (key_pos >= self.first[tile.seq][:, None])
                   & (tile.positions[:, None] >= 0))
        ring_row = m.slots[tile.seq][:, None] * self.ring + key_pos % self.ring
        step_row = m.query_start_loc[tile.seq][:, None] + key_pos - start
        from_ring = self.ring_rows[torch.where(visible & ~in_step, ring_row, 0)].to(self.kv.dtype)
        from_step = self.kv[torch.where(visible & in_step, step_row, 0)]
        keys = torch.where(in_step[..., None], from_step, from_ring).masked_fill(~visible[..., None], 0)
        return keys, visible

    def entry_split(self, tile: _Tile, pool, split: int, limit, entries_per_block: int):
        """Compressed entries `[R, S, W]` numbered `[split * S, (split + 1) * S)` of each row's request, and
        which each row sees (`entry < limit`)."""
        ids = (split * KEY_SPLIT + torch.arange(KEY_SPLIT, device=pool.device)).expand(QUERY_TILE, -1)
        visible = ids < limit[:, None]
        tables = self.metadata.block_tables[tile.seq]
        keys = gather_rows(pool, tables, torch.where(visible, ids, 0), entries_per_block)
        return keys.masked_fill(~visible[..., None], 0), visible


def _picked(topk_indices, a: int, limit) -> torch.Tensor:
    """`[R, n * S + 1]` bool: the entries the indexer chose for each row of the tile starting at `a`."""
    topk = topk_indices[a : a + QUERY_TILE]
    width = -(-max(int(limit.max()), 1) // KEY_SPLIT) * KEY_SPLIT + 1
    picked = torch.zeros(QUERY_TILE, width, dtype=torch.bool, device=topk.device)
    rows = torch.arange(len(topk), device=topk.device)[:, None].expand_as(topk)
    picked[rows, torch.where((topk >= 0) & (topk < width - 1), topk, width - 1)] = True
    return picked


def _initial_state(sinks: torch.Tensor, q: torch.Tensor):
    """Online-softmax state `(max, denominator, accumulator)` holding only the sink."""
    m = sinks.float().view(1, -1).expand(q.shape[0], -1).clone()
    return m, torch.ones_like(m), torch.zeros_like(q)


def _merge(state, q, keys, visible, head_dim: int):
    """Fold one key split into the state: scores `[R, H, S]` and values by fixed-shape batched GEMMs."""
    m, denom, acc = state
    keys = keys.float()
    scores = torch.bmm(q, keys.transpose(1, 2)) * head_dim**-0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    m_new = torch.maximum(m, scores.amax(dim=-1))
    p = torch.exp(scores - m_new[..., None])
    alpha = torch.exp(m - m_new)
    return m_new, denom * alpha + p.sum(dim=-1), acc * alpha[..., None] + torch.bmm(p, keys)
