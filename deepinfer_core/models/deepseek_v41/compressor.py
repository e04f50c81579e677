"""DeepSeek-V4.1's compressor and two-level indexer (research-v41.md §4.3, DeepSeek's `inference/model.py`).

Compressor (KV-source layers only): ratio 2 pools each non-overlapping pair of tokens with a per-channel
softmax gate (fp32, no position bias); ratio 1 is the plain projection. A group is emitted only when
complete; the open half-group's fp32 `(kv, gate)` rows wait in the request's tail ring (row of position
`p` at `p % TAIL_RING_ROWS`). Group `g` stands for position `g * ratio`.

The open group needs one row, but the ring keeps `TAIL_RING_ROWS` (one more than the most drafts a
verification step carries): a step computing a request's last token and k drafts writes k + 1
consecutive positions, which then never share a row, so the rows of rejected drafts are put back to
what they held (`speculative/rollback.py`) without clobbering an accepted position's row. Two rows (the
group's width) would make positions p and p + 2 share one, and a rejected p + 2 would restore the row
that accepted p needs. The cost is small: at the release size (head_dim 512, three ratio-2 KV sources)
17 fp32 `(kv, gate)` rows are about 200 KiB a request, against ~5 MiB of sliding windows.

Indexer: `score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])` over the visible entries `j < (p + 1) //
ratio`. The candidate source also keeps, per query, the `candidate_topk_blocks` blocks of
`candidate_block_size` entries with the best maximum score (the block of the newest visible entry always
kept); later index sources score only inside them. The top `index_topk` entries are kept; as in the
reference only picks beyond the visible count become -1 (a candidate-masked pick scored -inf is kept).
Ties go to the lower entry number (stable sorts), so a request's picks do not depend on its batch.
Decode steps (one query per request) and every step under CUDA graphs run batched, without host reads
(`two_level_topk_batched`), so they can be captured; their picks equal the per-request path's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.backends.compressed_entries import closing_entries
from deepinfer_core.backends.paged import gather_entries, gather_rows, max_seq_len
from deepinfer_core.config.speculative import MAX_SPECULATIVE_TOKENS

TAIL_RING_ROWS = MAX_SPECULATIVE_TOKENS + 1
"""Rows of a ratio-2 compressor's tail ring: the k + 1 positions of any verification step (module docstring)."""


def closed_groups(kv: torch.Tensor, gate: torch.Tensor | None, ratio: int, meta: AttentionMetadata,
                  kv_tail: torch.Tensor | None, gate_tail: torch.Tensor | None, no_write_before: torch.Tensor,
                  map_rows: Callable[..., Any] | None = None):
    """The groups this step completes: `(pooled [E, D] fp32, entry [E], seq [E], keep [E])`, `keep`
    False for groups already cached (`(entry + 1) * ratio <= no_write_before`). Under CUDA graphs every
    token yields a row (non-closing ones `keep` False), so nothing reads device values on the host.
    `map_rows` (`LayerOps.map_rows`, fixed row tiles in deterministic mode) runs the pooling. Which
    groups close, and their rows: `backends.compressed_entries`, the rule V4's compressor shares."""
    closing = closing_entries(meta, ratio, no_write_before)
    token, entry, seq, keep = closing.token, closing.entry, closing.seq, closing.keep
    if ratio == 1:
        return kv[token].float(), entry.clamp(min=0), seq, keep
    in_step, flat, ring_at = closing.window_rows(meta, ratio, kv_tail.shape[1])
    kv_rows = torch.where(in_step, kv[flat].float(), kv_tail[ring_at].float())
    gate_rows = torch.where(in_step, gate[flat].float(), gate_tail[ring_at])
    pooled = (map_rows or _call)(pool_group, kv_rows, gate_rows)
    return pooled, entry.clamp(min=0), seq, keep


def pool_group(kv_rows: torch.Tensor, gate_rows: torch.Tensor) -> torch.Tensor:
    """Each group's `[ratio, D]` fp32 rows pooled with a per-channel softmax over the gate."""
    return (kv_rows * gate_rows.softmax(dim=1)).sum(dim=1)


def _call(fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
    return fn(*rows)


def write_entries(pool: torch.Tensor, rows: torch.Tensor, entry: torch.Tensor, seq: torch.Tensor,
                  keep: torch.Tensor, meta: AttentionMetadata, ratio: int) -> None:
    """Store `rows` as entries `entry` of requests `seq` in a paged pool (`keep` False: the scratch row)."""
    epb = BLOCK_SIZE // ratio
    page = (entry // epb).clamp(max=meta.block_tables.shape[1] - 1)
    target = meta.block_tables[seq, page] * epb + entry % epb
    pool[torch.where(keep & (target >= 0), target, pool.shape[0] - 1)] = rows.to(pool.dtype)


# ---------------------------------------------------------------------- the two-level indexer


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`[n, count]` fp32 scores of `n` queries (`q` `[n, heads, d]`, `weights` `[n, heads]`, scale folded
    in) over `keys` `[count, d]` (shared) or `[n, count, d]` (one set per query); -inf at entries
    `>= visible[t]`."""
    pattern = "thd,ed->the" if keys.dim() == 2 else "thd,ted->the"
    scores = torch.relu(torch.einsum(pattern, q.float(), keys.float()))
    scores = (scores * weights.float()[:, :, None]).sum(dim=1)
    future = torch.arange(keys.shape[-2], device=q.device)[None] >= visible[:, None]
    return scores.masked_fill(future, float("-inf"))


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one: per query, the entries of its `topk_blocks` best blocks (block score = its best entry;
    the block of the newest visible entry always kept; unreachable blocks never). `[n, count]` bool."""
    count = scores.shape[1]
    padded = torch.nn.functional.pad(scores, (0, -count % block), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    num_blocks = block_scores.shape[1]
    newest = ((visible - 1).div(block, rounding_mode="floor"))[:, None]
    block_scores = block_scores.masked_fill(torch.arange(num_blocks, device=scores.device) == newest, float("inf"))
    order = block_scores.sort(dim=-1, descending=True, stable=True)
    top = order.indices[:, : min(topk_blocks, num_blocks)]
    reachable = order.values[:, : top.shape[1]] > float("-inf")
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(1, top, reachable)
    return keep.repeat_interleave(block, dim=1)[:, :count]


def top_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Level two: the `min(k, count)` best entries per query in ascending order, those `>= visible` as
    -1, padded with -1 to `k` columns."""
    count = scores.shape[1]
    picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, : min(k, count)].sort(dim=-1).values
    picks = torch.where(picks < visible[:, None], picks, -1)
    if picks.shape[1] < k:
        picks = torch.cat((picks, picks.new_full((picks.shape[0], k - picks.shape[1]), -1)), dim=1)
    return picks


def two_level_topk(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, meta: AttentionMetadata,
                   num_entries: torch.Tensor, plan, config, candidates: list[torch.Tensor] | None):
    """One index source's picks `[T, index_topk]`; the candidate source also returns each request's
    candidate mask (a list of `[n_i, count_i]`), a later source reads `candidates`. Decode steps go to
    `two_level_topk_batched`, and so does every step under CUDA graphs (their masks are one `[T, bound]`
    tensor)."""
    if meta.needs_static_shapes or (meta.is_decode_only and q.shape[0] == meta.num_seqs):
        return two_level_topk_batched(q, weights, index_keys, meta, plan, config, candidates)
    return two_level_topk_per_request(q, weights, index_keys, meta, num_entries, plan, config, candidates)


def two_level_topk_per_request(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                               meta: AttentionMetadata, num_entries: torch.Tensor, plan, config,
                               candidates: list[torch.Tensor] | None):
    """`two_level_topk` one request at a time over exactly its entries (reads the counts on the host)."""
    spec, out = plan.attention, []
    masks: list[torch.Tensor] = []
    qsl = meta.query_start_loc.tolist()
    for i, count in enumerate(num_entries.tolist()):
        a, b = qsl[i], qsl[i + 1]
        visible = (meta.positions[a:b] + 1) // spec.compress_rate
        if count == 0:
            out.append(torch.full((b - a, spec.index_topk), -1, dtype=torch.long, device=q.device))
            masks.append(torch.zeros(b - a, 0, dtype=torch.bool, device=q.device))
            continue
        keys = gather_entries(index_keys, meta.block_tables[i], count, spec.entries_per_block)
        scores = index_scores(q[a:b], weights[a:b], keys, visible)
        if plan.is_candidate_source:
            masks.append(candidate_mask(scores, visible, config.candidate_topk_blocks, config.candidate_block_size))
        elif plan.uses_candidates:
            scores = scores.masked_fill(~candidates[i], float("-inf"))
        out.append(top_entries(scores, visible, spec.index_topk))
    picks = torch.cat(out) if out else torch.empty(0, spec.index_topk, dtype=torch.long, device=q.device)
    return picks, (masks if plan.is_candidate_source else None)


def two_level_topk_batched(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, meta: AttentionMetadata,
                           plan, config, candidates: torch.Tensor | None):
    """`two_level_topk` for every token at once, without host reads (decode steps, and any step under
    CUDA graphs, e.g. a verification step of k + 1 tokens a request): each token scores the first `bound`
    entries of its request's table, `bound` the static `max_seq_len // ratio` (entries it cannot see
    score -inf, so blocks made of them are never candidates and the picks past its visible count become
    -1: the per-request path's picks, mask columns beyond its count added)."""
    spec = plan.attention
    bound = batched_entry_bound(meta, spec.compress_rate)
    lens = meta.query_start_loc.diff()
    seq = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens, output_size=q.shape[0])
    ids = torch.arange(bound, device=q.device).expand(q.shape[0], -1)
    keys = gather_rows(index_keys, meta.block_tables[seq], ids, spec.entries_per_block)
    visible = (meta.positions + 1) // spec.compress_rate
    return select_two_level(index_scores(q, weights, keys, visible), visible, plan, config, candidates)


def batched_entry_bound(meta: AttentionMetadata, ratio: int) -> int:
    """The entries a batched step scores per token: `max_seq_len // ratio` (static under graphs), >= 1."""
    return max(max_seq_len(meta) // ratio, 1)


def select_two_level(scores: torch.Tensor, visible: torch.Tensor, plan, config, candidates: torch.Tensor | None):
    """From `[T, bound]` scores (-inf where not visible): the candidate source's masks, or the restriction
    to the candidates, then the picks: `(picks [T, index_topk], masks [T, bound] or None)`."""
    masks = None
    if plan.is_candidate_source:
        masks = candidate_mask(scores, visible, config.candidate_topk_blocks, config.candidate_block_size)
    elif plan.uses_candidates:
        scores = scores.masked_fill(~candidates, float("-inf"))
    return top_entries(scores, visible, plan.attention.index_topk), masks
