"""V4.1's compressor (ratio 2 pairs with an open group, ratio 1 projection) and two-level indexer, by hand."""

from __future__ import annotations

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.models.deepseek_v41.compressor import (
    candidate_mask,
    closed_groups,
    index_scores,
    top_entries,
    write_entries,
)
from deepinfer_core.reference.layer_ops import write_rings

INF = float("inf")


def metadata(start: int, n: int) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n]), start_positions=torch.tensor([start]),
        positions=torch.arange(start, start + n), slots=torch.tensor([0]), block_tables=torch.tensor([[0]]),
        query_lens=[n], start_positions_host=[start])


def run_chunks(kv, gate, ratio, chunks, no_write_before=0):
    """Feed positions in `chunks` (lengths); return the pool of entries and what each step closed."""
    tail = torch.zeros(1, ratio if ratio > 1 else 0, kv.shape[1])  # ratio 1 keeps no tail
    gate_tail = torch.zeros_like(tail)
    pool, start, closed = torch.zeros(129, kv.shape[1]), 0, []
    for n in chunks:
        meta = metadata(start, n)
        rows = slice(start, start + n)
        pooled, entry, seq, keep = closed_groups(kv[rows], None if gate is None else gate[rows], ratio, meta,
                                                 tail, gate_tail, torch.tensor([no_write_before]))
        if ratio > 1:
            write_rings(meta, tail, kv[rows], gate_tail, gate[rows])
        write_entries(pool, pooled, entry, seq, keep, meta, ratio)
        closed.append(entry[keep].tolist())
        start += n
    return pool, closed


def test_ratio_2_pools_each_pair_with_a_per_channel_softmax_and_keeps_the_open_half():
    torch.manual_seed(0)
    kv, gate = torch.randn(5, 4), torch.randn(5, 4)
    pool, closed = run_chunks(kv, gate, 2, [3, 2])  # split at an odd length: token 2 waits in the tail
    assert closed == [[0], [1]]
    for g in range(2):
        w = torch.softmax(gate[2 * g : 2 * g + 2], dim=0)
        assert torch.allclose(pool[g], (w * kv[2 * g : 2 * g + 2]).sum(0), atol=1e-7)
    assert pool[2].abs().sum() == 0  # token 4's group is still open
    one_shot, _ = run_chunks(kv, gate, 2, [5])
    by_token, _ = run_chunks(kv, gate, 2, [1] * 5)
    assert torch.equal(pool[:3], one_shot[:3]) and torch.equal(by_token[:3], one_shot[:3])


def test_ratio_1_is_the_projection_itself_and_has_no_open_group():
    kv = torch.randn(4, 3)
    pool, closed = run_chunks(kv, None, 1, [3, 1])
    assert closed == [[0, 1, 2], [3]] and torch.equal(pool[:4], kv)


def test_cached_groups_are_not_rewritten():
    kv, gate = torch.randn(6, 2), torch.randn(6, 2)
    _, closed = run_chunks(kv, gate, 2, [6], no_write_before=4)
    assert closed == [[2]]


def test_index_scores_are_the_weighted_relu_of_the_dot_products():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one query, two heads
    keys = torch.tensor([[2.0, -1.0], [-3.0, 4.0], [1.0, 1.0]])
    scores = index_scores(q, torch.tensor([[0.5, 2.0]]), keys, torch.tensor([2]))
    # head 0 sees k[:, 0], head 1 sees k[:, 1]: 0.5 * relu(.) + 2 * relu(.)
    assert scores.tolist() == [[0.5 * 2 + 0.0, 0.0 + 2 * 4, -INF]]


def test_candidate_blocks_keep_the_best_blocks_and_always_the_newest():
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.2, 0.3, 0.8, 0.05, -INF]])
    mask = candidate_mask(scores, torch.tensor([7]), topk_blocks=2, block=2)
    # block maxima .5 .9 .8 .05; the newest visible entry (6) pins block 3; the best other is block 1
    assert mask.tolist() == [[False, False, True, True, False, False, True, True]]
    nothing = candidate_mask(torch.full((1, 4), -INF), torch.tensor([0]), topk_blocks=2, block=2)
    assert not nothing.any()  # no visible entry: no block is reachable


def test_top_entries_keep_masked_picks_and_drop_only_invisible_ones():
    s = torch.tensor([[-INF, -INF, 0.9, 0.2, -INF, -INF, 0.05, -INF]])
    visible = torch.tensor([7])
    assert top_entries(s, visible, 3).tolist() == [[2, 3, 6]]
    assert top_entries(s, visible, 5).tolist() == [[0, 1, 2, 3, 6]]  # -inf picks kept, as the reference
    assert top_entries(s, visible, 8).tolist() == [[0, 1, 2, 3, 4, 5, 6, -1]]
    assert top_entries(s, visible, 10).tolist() == [[0, 1, 2, 3, 4, 5, 6, -1, -1, -1]]
