"""Random cases follow the cache layout and poison exactly what no query may read."""

from __future__ import annotations

import torch

from deepinfer_core.backends import AttentionSpec, MoESpec
from deepinfer_core.testing.cases import random_attention_case, random_moe_case

CSA = AttentionSpec(num_heads=2, head_dim=8, sliding_window=8, compress_rate=4, index_n_heads=2,
                    index_head_dim=4, index_topk=3)


def test_attention_case_layout_and_poison():
    case = random_attention_case(CSA, query_lens=[2, 1], start_positions=[3, 130], seed=1)
    metadata = case.metadata
    assert metadata.query_start_loc.tolist() == [0, 2, 3]
    assert metadata.positions.tolist() == [3, 4, 130]
    assert case.num_entries.tolist() == [5 // 4, 131 // 4]
    # request 0 starts at 3: ring slots 0..2 hold keys, the rest of its ring is poison
    ring = case.window[metadata.slots[0]]
    assert torch.isfinite(ring[:3]).all() and torch.isnan(ring[3:]).all()
    # request 1 starts at 130 with a window of 8: positions 122..129 are valid, so the whole ring is
    ring = case.window[metadata.slots[1]]
    assert torch.isfinite(ring).all()
    unused_slot = (set(range(case.window.shape[0])) - set(metadata.slots.tolist())).pop()
    assert torch.isnan(case.window[unused_slot]).all()
    # exactly the entries requests own are finite, at their paged rows
    finite_rows = torch.isfinite(case.compressed).all(dim=1)
    assert int(finite_rows.sum()) == int(case.num_entries.sum())
    # request 1 has 131 tokens: entries 0..31 fill its first block; its second block has none yet
    assert bool(finite_rows[int(metadata.block_tables[1, 0]) * 32 + 31])
    assert not bool(finite_rows[int(metadata.block_tables[1, 1]) * 32])
    assert torch.equal(finite_rows, torch.isfinite(case.index_keys).all(dim=1))
    # top-k indices: distinct visible entries, -1 padded
    assert case.topk_indices[0].tolist()[:1] == [0] and case.topk_indices[0].tolist()[1:] == [-1, -1]
    last = case.topk_indices[2]
    assert len(set(last.tolist())) == 3 and int(last.max()) < 131 // 4


def test_moe_case_routing_is_unambiguous():
    spec = MoESpec(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2, scoring_func="sigmoid",
                   routed_scaling_factor=1.0, swiglu_limit=5.0)
    x, input_ids, weights = random_moe_case(spec, num_tokens=9, seed=3)
    keys = torch.sigmoid(x @ weights.router.T) + weights.score_bias
    top3 = keys.topk(3, dim=-1).values
    assert bool(((top3[:, 1] - top3[:, 2]) > 0.1).all())
    gate = torch.einsum("eih,th->tei", weights.gate_up[:, :8], x)
    assert bool((gate > spec.swiglu_limit).any())  # the clamp matters
    assert weights.tid2eid is None and input_ids.shape == (9,)
