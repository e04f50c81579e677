"""V4.1's two-level indexer scored by the Triton indexer kernel (`TritonAttention.index_scores`, the V4
kernel at V4.1's rates) picks what the reference picks: candidate blocks at the candidate source, picks
inside them at a reindex layer, for a prefill of several requests and a decode step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec, IndexScorer
from deepinfer_core.models.deepseek_v41.compressor import (
    batched_entry_bound,
    select_two_level,
    two_level_topk_per_request,
)
from deepinfer_core.models.deepseek_v41.plan import V41LayerPlan

HEADS, DIM, TOPK = 4, 32, 8
CONFIG = type("Config", (), {"candidate_topk_blocks": 3, "candidate_block_size": 2})


def plans(ratio: int) -> tuple[V41LayerPlan, V41LayerPlan]:
    spec = AttentionSpec(num_heads=4, head_dim=32, sliding_window=8, compress_rate=ratio, index_n_heads=HEADS,
                         index_head_dim=DIM, index_topk=TOPK)
    source = V41LayerPlan(index=5, kind="compressed", attention=spec, moe=None, rope="compress", role="full",
                          index_source=5, is_candidate_source=True)
    return source, replace(source, index=7, role="reindex", kv_source=5, index_source=7,
                           is_candidate_source=False, uses_candidates=True)


def metadata(starts: list[int], lens: list[int], device) -> AttentionMetadata:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device),
        start_positions=torch.tensor(starts, device=device), positions=positions.to(device),
        slots=torch.arange(len(starts), device=device),
        block_tables=torch.tensor([[3, 0], [1, 2], [4, 5]][: len(starts)], device=device),
        query_lens=list(lens), start_positions_host=list(starts), max_seq_len=256)


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize(("starts", "lens"), [([0, 5, 40], [7, 12, 3]), ([9, 30, 77], [1, 1, 1])])
def test_triton_scores_give_the_reference_picks(kernel_device, ratio, starts, lens):
    from deepinfer_nvidia_sm100.attention import TritonAttention

    gen = torch.Generator().manual_seed(ratio + len(starts) + lens[0])
    source, inside = plans(ratio)
    backend = TritonAttention(source.attention)
    assert isinstance(backend, IndexScorer)
    keys = torch.randn(6 * 128 // ratio + 1, DIM, generator=gen)
    meta, ref_meta = metadata(starts, lens, kernel_device), metadata(starts, lens, torch.device("cpu"))
    counts = torch.tensor([s + n for s, n in zip(starts, lens)]) // ratio
    visible = (ref_meta.positions + 1) // ratio
    mine = theirs = None
    for plan in (source, inside):
        q = torch.randn(len(visible), HEADS, DIM, generator=gen)
        weights = torch.randn(len(visible), HEADS, generator=gen)  # negative weights: many exact ReLU ties
        scores = backend.index_scores(q.to(kernel_device), weights.to(kernel_device), keys.to(kernel_device), meta,
                                      batched_entry_bound(meta, ratio)).cpu()
        picks, mine = select_two_level(scores, visible, plan, CONFIG, mine)
        expected, theirs = two_level_topk_per_request(q, weights * DIM**-0.5, keys, ref_meta, counts, plan, CONFIG,
                                                      theirs)
        assert torch.equal(picks, expected), plan.role
        assert (picks < visible[:, None]).all() and (picks >= 0).any()
