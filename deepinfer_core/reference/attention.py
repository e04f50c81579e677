"""Reference attention: per request, dense attention over [window ring | new keys | compressed entries]."""

from __future__ import annotations

import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec
from deepinfer_core.backends.paged import gather_entries, gather_rows, max_seq_len


class ReferenceAttention:
    """Pure-PyTorch `AttentionBackend`. Prefill loops over requests (clarity over speed); decode is
    batched and reads no host data, so it can be captured in a CUDA graph."""

    supports_cuda_graphs = True

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None, num_entries=None):
        if metadata.is_decode_only:
            return self._decode(q, kv, window, compressed, sinks, metadata, topk_indices, num_entries)
        if metadata.needs_static_shapes:  # a verification step under CUDA graphs: k + 1 queries a request
            return self._decode_multi(q, kv, window, compressed, sinks, metadata, topk_indices, num_entries)
        out = torch.empty_like(q)
        qsl = metadata.query_start_loc.tolist()
        counts = num_entries.tolist() if num_entries is not None else None
        for i, start in enumerate(metadata.start_positions_host):
            a, b = qsl[i], qsl[i + 1]
            keys, bias = self._window_keys(kv[a:b], window[int(metadata.slots[i])], start, metadata, i)
            if compressed is not None and counts[i] > 0:
                entries = gather_entries(compressed, metadata.block_tables[i], counts[i], self.spec.entries_per_block)
                entry_bias = self._entry_bias(metadata.positions[a:b], counts[i], topk_indices, a, b)
                keys, bias = torch.cat((keys, entries)), torch.cat((bias, entry_bias), dim=1)
            out[a:b] = self._attend(q[a:b], keys, bias, sinks)
        return out

    def _decode(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices, num_entries):
        """One query per request, all requests at once, without host round trips."""
        w, positions, slots = self.spec.sliding_window, metadata.positions, metadata.slots
        keys = window[slots].clone()  # ring slot j holds position pos - ((pos - j) % w) once kv is in
        keys[torch.arange(len(slots), device=q.device), positions % w] = kv.to(keys.dtype)
        key_pos = positions[:, None] - (positions[:, None] - torch.arange(w, device=q.device)) % w
        first = metadata.window_starts if metadata.window_starts is not None else torch.zeros_like(positions)
        visible = key_pos >= first[:, None].clamp(min=0)
        if compressed is not None:
            ids = self._decode_entry_ids(metadata, num_entries, topk_indices)
            entry_visible = (ids >= 0) & (ids < ((positions + 1) // self.spec.compress_rate)[:, None])
            entries = gather_rows(compressed, metadata.block_tables, ids.clamp(min=0), self.spec.entries_per_block)
            keys, visible = torch.cat((keys, entries), dim=1), torch.cat((visible, entry_visible), dim=1)
        return self._attend_rows(q, keys, visible, sinks)

    def _decode_multi(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices, num_entries):
        """The same number of queries for every request (its last token and its drafts), all at once and
        without host round trips: each query reads the ring as it was before the step, then the step's
        keys, masked to its own window and causal prefix."""
        num_seqs, w = metadata.num_seqs, self.spec.sliding_window
        width = q.shape[0] // num_seqs
        positions, starts = metadata.positions.view(num_seqs, width), metadata.start_positions
        before = starts[:, None] - 1  # ring slot j holds the latest position before the step that maps to it
        ring_pos = before - (before - torch.arange(w, device=q.device)) % w
        keys = torch.cat((window[metadata.slots], kv.view(num_seqs, width, -1).to(window.dtype)), dim=1)
        key_pos = torch.cat((ring_pos, positions), dim=1)[:, None]  # [S, 1, w + width]
        first = metadata.window_starts if metadata.window_starts is not None else torch.zeros_like(starts)
        q_pos = positions[..., None]
        visible = (key_pos <= q_pos) & (key_pos > q_pos - w) & (key_pos >= first.clamp(min=0)[:, None, None])
        keys = keys[:, None].expand(-1, width, -1, -1).reshape(q.shape[0], w + width, -1)
        visible = visible.reshape(q.shape[0], w + width)
        if compressed is not None:
            tables = metadata.block_tables.repeat_interleave(width, dim=0)
            counts = num_entries.repeat_interleave(width) if num_entries is not None else None
            ids = topk_indices if topk_indices is not None else self._entry_ids(metadata, counts)
            entry_visible = (ids >= 0) & (ids < ((metadata.positions + 1) // self.spec.compress_rate)[:, None])
            entries = gather_rows(compressed, tables, ids.clamp(min=0), self.spec.entries_per_block)
            keys, visible = torch.cat((keys, entries), dim=1), torch.cat((visible, entry_visible), dim=1)
        return self._attend_rows(q, keys, visible, sinks)

    def _attend_rows(self, q, keys, visible, sinks):
        """Each query row `[H, D]` over its own keys `[K, D]`, `visible` `[rows, K]`, with the sink."""
        keys = keys.masked_fill(~visible[..., None], 0)  # rows it may not read must not reach the output
        bias = _mask_bias(visible)
        scores = torch.einsum("bhd,bkd->bhk", q.float(), keys.float()) * self.spec.head_dim**-0.5 + bias[:, None]
        logits = torch.cat((scores, sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)), dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys).to(q.dtype)

    def _decode_entry_ids(self, metadata: AttentionMetadata, num_entries, topk_indices):
        if topk_indices is not None:
            return topk_indices
        return self._entry_ids(metadata, num_entries)

    def _entry_ids(self, metadata: AttentionMetadata, num_entries):
        """Per row, entries `0 .. bound - 1` of the static bound, -1 past the row's `num_entries`."""
        bound = max(max_seq_len(metadata) // self.spec.compress_rate, 1)
        ids = torch.arange(bound, device=num_entries.device).expand(len(num_entries), -1)
        return torch.where(ids < num_entries[:, None], ids, -1)

    def _window_keys(self, new_kv, ring, start, metadata: AttentionMetadata, i: int):
        """Keys `[m + n, D]` = ring positions [start - W + 1, start) then the new keys; bias `[n, m + n]`."""
        w, n = self.spec.sliding_window, new_kv.shape[0]
        first_valid = metadata.window_start_positions_host[i] if metadata.window_start_positions_host else 0
        old = torch.arange(max(start - w + 1, first_valid, 0), start, device=new_kv.device)
        key_pos = torch.cat((old, torch.arange(start, start + n, device=new_kv.device)))
        keys = torch.cat((ring[old % ring.shape[0]], new_kv))
        q_pos = torch.arange(start, start + n, device=new_kv.device)[:, None]
        visible = (key_pos[None] <= q_pos) & (key_pos[None] > q_pos - w)
        return keys, torch.zeros(visible.shape, device=new_kv.device).masked_fill(~visible, float("-inf"))

    def _entry_bias(self, positions, count, topk_indices, a, b):
        ids = torch.arange(count, device=positions.device)
        visible = ids[None] < ((positions + 1) // self.spec.compress_rate)[:, None]
        if topk_indices is not None:
            picked = torch.zeros(b - a, count + 1, dtype=torch.bool, device=positions.device)
            picked.scatter_(1, torch.where(topk_indices[a:b] >= 0, topk_indices[a:b], count), True)
            visible &= picked[:, :count]
        return torch.zeros(visible.shape, device=positions.device).masked_fill(~visible, float("-inf"))

    def _attend(self, q, keys, bias, sinks):
        scores = torch.einsum("thd,kd->thk", q.float(), keys.float()) * self.spec.head_dim**-0.5 + bias[:, None]
        sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys).to(q.dtype)

    def indexer_topk(self, q, weights, index_keys, metadata: AttentionMetadata, num_entries):
        if metadata.is_decode_only or metadata.needs_static_shapes:  # one query a request, or k + 1 under graphs
            return self._indexer_decode(q, weights, index_keys, metadata)
        k = self.spec.index_topk
        out = torch.full((q.shape[0], k), -1, dtype=torch.long, device=q.device)
        qsl = metadata.query_start_loc.tolist()
        for i, count in enumerate(num_entries.tolist()):
            a, b = qsl[i], qsl[i + 1]
            if count == 0 or a == b:
                continue
            keys = gather_entries(index_keys, metadata.block_tables[i], count, self.spec.entries_per_block)
            scores = torch.relu(torch.einsum("thd,ed->the", q[a:b].float(), keys.float())) * self.spec.index_head_dim**-0.5
            scores = (scores * weights[a:b, :, None]).sum(dim=1)
            limit = ((metadata.positions[a:b] + 1) // self.spec.compress_rate)[:, None]
            future = torch.arange(count, device=q.device)[None] >= limit
            scores = scores.masked_fill(future, float("-inf"))
            # Stable sort: on equal scores (ReLU makes exact zeros common) the lower entry number wins.
            top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
            out[a:b, : top.shape[1]] = torch.where(top >= limit, -1, top)
        return out

    def _indexer_decode(self, q, weights, index_keys, metadata: AttentionMetadata):
        rate, k = self.spec.compress_rate, self.spec.index_topk
        bound = max(max_seq_len(metadata) // rate, 1)
        ids = torch.arange(bound, device=q.device).expand(q.shape[0], -1)
        width = q.shape[0] // max(metadata.num_seqs, 1)  # queries per request: 1, or k + 1 (verification)
        tables = metadata.block_tables if width == 1 else metadata.block_tables.repeat_interleave(width, dim=0)
        keys = gather_rows(index_keys, tables, ids, self.spec.entries_per_block)
        scores = torch.relu(torch.einsum("bhd,bed->bhe", q.float(), keys.float())) * self.spec.index_head_dim**-0.5
        scores = (scores * weights[:, :, None]).sum(dim=1)
        limit = ((metadata.positions + 1) // rate)[:, None]
        scores = scores.masked_fill(ids >= limit, float("-inf"))
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        top = torch.where(top >= limit, -1, top)
        if top.shape[1] < k:
            top = torch.cat((top, top.new_full((top.shape[0], k - top.shape[1]), -1)), dim=1)
        return top


def _mask_bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))
