"""Reference attention: per request, dense attention over [window ring | new keys | compressed entries]."""

from __future__ import annotations

import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec


def gather_entries(pool: torch.Tensor, block_table: torch.Tensor, count: int, entries_per_block: int) -> torch.Tensor:
    """A request's first `count` paged entries, in order: `[count, width]`."""
    ids = torch.arange(count, device=pool.device)
    return pool[block_table[ids // entries_per_block] * entries_per_block + ids % entries_per_block]


class ReferenceAttention:
    """Pure-PyTorch `AttentionBackend`; loops over requests, so it favours clarity over speed."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device

    def forward(self, q, kv, window, compressed, sinks, metadata: AttentionMetadata, topk_indices=None, num_entries=None):
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
