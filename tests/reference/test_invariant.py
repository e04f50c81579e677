"""The reference's batch-invariant backends: they conform to the reference, and a row's result does not
depend on what shares its call (where the plain formulation's does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.backends import AttentionSpec, HyperWeights, LayerOpsSpec, MoESpec
from deepinfer_core.reference.invariant import ROW_TILE, InvariantLayerOps, tile_rows
from deepinfer_core.reference.invariant_attention import InvariantAttention
from deepinfer_core.reference.invariant_moe import InvariantMoE
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_attention_case, random_moe_case

CPU = torch.device("cpu")
SLIDING = AttentionSpec(num_heads=4, head_dim=16, sliding_window=8, compress_rate=0, deterministic=True)
CSA = dataclasses.replace(SLIDING, compress_rate=4, index_n_heads=2, index_head_dim=8, index_topk=4)
HCA = dataclasses.replace(SLIDING, compress_rate=16)
MOE = MoESpec(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, swiglu_limit=10.0, deterministic=True)
LAYER_OPS = LayerOpsSpec(hidden_size=32, hc_mult=4, hc_sinkhorn_iters=5, hc_eps=1e-6, rms_norm_eps=1e-6,
                         deterministic=True)


@pytest.mark.parametrize("spec", [SLIDING, CSA, HCA], ids=["sliding", "csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_conforms(spec, dtype):
    conformance.check_attention(InvariantAttention(spec, CPU), CPU, dtype=dtype)


@pytest.mark.parametrize("is_hash", [False, True])
def test_invariant_moe_conforms(is_hash):
    spec = dataclasses.replace(MOE, is_hash=is_hash)
    conformance.check_moe(InvariantMoE(spec, CPU), CPU)
    conformance.check_moe(InvariantMoE(spec, CPU), CPU, dtype=torch.bfloat16)


def test_invariant_moe_reads_fp4_experts():
    spec = dataclasses.replace(MOE, intermediate_size=32, expert_format="fp4")
    conformance.check_moe(InvariantMoE(spec, CPU), CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_layer_ops_conform(dtype):
    conformance.check_layer_ops(InvariantLayerOps(dataclasses.replace(LAYER_OPS, dtype=dtype)), CPU)


def test_tiled_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=gen)
    rows = torch.randn(3 * ROW_TILE + 5, 256, generator=gen)
    alone = tile_rows(lambda x: F.linear(x, weight), rows[-1:])
    for batch in (rows[-2:], rows[-7:], rows[-ROW_TILE:], rows):
        assert torch.equal(tile_rows(lambda x: F.linear(x, weight), batch)[-1:], alone)
    # the plain GEMM picks another kernel for one row than for many, so its rows change with the batch
    assert not all(torch.equal(F.linear(b, weight)[-1:], F.linear(rows[-1:], weight))
                   for b in (rows[-2:], rows[-7:], rows[-ROW_TILE:], rows))


def test_tile_rows_returns_tuples_and_handles_no_rows():
    x = torch.arange(12.0).view(6, 2)
    first, second = tile_rows(lambda t: (t * 2, t[:, :1]), x, tile=4)
    assert torch.equal(first, x * 2) and torch.equal(second, x[:, :1])
    assert tile_rows(lambda t: t + 1, x[:0]).shape == (0, 2)
    with pytest.raises(ValueError, match="equal length"):
        tile_rows(lambda a, b: a, x, x[:3])


@pytest.mark.parametrize("spec", [SLIDING, CSA, HCA], ids=["sliding", "csa", "hca"])
def test_attention_row_does_not_depend_on_its_batch(spec):
    """A decode query gives the same bits alone and beside other requests' queries."""
    backend = InvariantAttention(spec, CPU)
    lens, starts = [1, 1, 1, 1], [3, 40, 77, 21]
    case = random_attention_case(spec, lens, starts, seed=3)
    full = backend.forward(case.q, case.kv, case.window, case.compressed, case.sinks, case.metadata,
                           case.topk_indices, case.num_entries)
    single = _select_request(case, 2)
    out = backend.forward(single.q, single.kv, single.window, single.compressed, single.sinks, single.metadata,
                          single.topk_indices, single.num_entries)
    assert torch.equal(out[0], full[2])


def _select_request(case, i: int):
    """`case` restricted to request `i` (one decode token), keeping its cache rows and block table."""
    m = case.metadata
    meta = dataclasses.replace(
        m, query_start_loc=torch.tensor([0, 1]), start_positions=m.start_positions[i : i + 1],
        positions=m.positions[i : i + 1], slots=m.slots[i : i + 1], block_tables=m.block_tables[i : i + 1],
        query_lens=[1], start_positions_host=m.start_positions_host[i : i + 1],
        window_start_positions_host=None, window_starts=None)
    pick = slice(i, i + 1)
    return dataclasses.replace(
        case, q=case.q[pick], kv=case.kv[pick], metadata=meta,
        topk_indices=case.topk_indices[pick] if case.topk_indices is not None else None,
        num_entries=case.num_entries[pick] if case.num_entries is not None else None)


def test_moe_row_does_not_depend_on_its_batch():
    backend = InvariantMoE(MOE, CPU)
    x, input_ids, weights = random_moe_case(MOE, 70, seed=4)
    full = backend.forward(x, input_ids, weights)
    for rows in (slice(69, 70), slice(60, 70), slice(0, 70, 3)):
        assert torch.equal(backend.forward(x[rows], input_ids[rows], weights), full[rows])


def test_index_scores_rank_as_the_indexer_and_do_not_depend_on_the_batch():
    """`InvariantAttention.index_scores` (V4.1's two-level indexer selects on them): -inf past each row's
    visible entries, `indexer_topk`'s picks are their stable top k, and a decode row's scores are the same
    bits alone and in its batch, whatever the width asked for."""
    backend = InvariantAttention(CSA, CPU)
    case = random_attention_case(CSA, [1, 1, 1, 1], [3, 40, 77, 21], seed=3)
    args = (case.index_q, case.index_weights, case.index_keys, case.metadata)
    scores = backend.index_scores(*args, 30)
    visible = (case.metadata.positions + 1) // CSA.compress_rate
    assert torch.equal(torch.isinf(scores), torch.arange(30)[None] >= visible[:, None])
    top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : CSA.index_topk]
    picks = backend.indexer_topk(*args, case.num_entries)
    assert torch.equal(picks, torch.where(top >= visible[:, None], -1, top))
    single = _select_request(case, 2)
    alone = backend.index_scores(case.index_q[2:3], case.index_weights[2:3], case.index_keys, single.metadata, 64)
    assert torch.equal(alone[0, :30], scores[2]) and alone[0, 30:].eq(float("-inf")).all()


def test_single_pass_mixing_rows_do_not_depend_on_the_batch():
    ops = InvariantLayerOps(LAYER_OPS)
    gen = torch.Generator().manual_seed(1)
    n, hidden, num_tokens = LAYER_OPS.hc_mult, LAYER_OPS.hidden_size, ROW_TILE + 9
    hc = HyperWeights(torch.randn((2 + n) * n, n * hidden, generator=gen) * 0.1,
                      torch.randn((2 + n) * n, generator=gen), torch.ones(3))
    streams, out = torch.randn(num_tokens, n, hidden, generator=gen), torch.randn(num_tokens, hidden, generator=gen)
    post, comb = torch.rand(num_tokens, n, generator=gen), torch.rand(num_tokens, n, n, generator=gen)
    pre, norm = torch.rand(num_tokens, n, generator=gen), torch.rand(hidden, generator=gen)
    full = ops.hc_post_mix(streams, out, post, comb, hc, norm, pre)
    for rows in (slice(num_tokens - 1, num_tokens), slice(5, num_tokens)):
        part = ops.hc_post_mix(streams[rows], out[rows], post[rows], comb[rows], hc, norm, pre[rows])
        assert all(torch.equal(a, b[rows]) for a, b in zip(part, full))
    assert torch.equal(ops.hc_mix(streams[-1:], hc, norm, pre[-1:])[3], ops.hc_mix(streams, hc, norm, pre)[3][-1:])


def test_a_deterministic_reference_sampler_gives_a_rows_logprobs_whatever_its_batch():
    from deepinfer_core.backends import SamplingSpec
    from deepinfer_core.reference.sampling import ReferenceSampler
    from deepinfer_core.testing.cases import random_sampling_case

    spec = SamplingSpec(vocab_size=5000, deterministic=True)
    logits, params = random_sampling_case(spec, seed=2)
    batch = ReferenceSampler(spec, CPU).sample(logits, params)
    torch.testing.assert_close(batch.logprobs, logits.log_softmax(-1).gather(1, batch.token_ids[:, None])[:, 0])
    rows = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
    last = dataclasses.replace(params, **{name: getattr(params, name)[-1:] for name in rows},
                               banned_token_ids=params.banned_token_ids[-1:])
    alone = ReferenceSampler(spec, CPU).sample(logits[-1:], last)
    assert torch.equal(alone.logprobs, batch.logprobs[-1:]) and torch.equal(alone.token_ids, batch.token_ids[-1:])


def test_a_deterministic_sampler_lists_tied_top_logprobs_by_ascending_token_id():
    from deepinfer_core.backends import SamplingSpec
    from deepinfer_core.reference.sampling import ReferenceSampler
    from deepinfer_core.testing.cases import random_sampling_case

    spec = SamplingSpec(vocab_size=5000, deterministic=True)
    logits, params = random_sampling_case(spec, seed=3)
    logits = logits.round(decimals=0)  # coarse values: many exact ties, as bf16 logits have
    params = dataclasses.replace(params, num_logprobs=20)
    out = ReferenceSampler(spec, CPU).sample(logits, params)
    values, ids = out.top_logprobs, out.top_token_ids
    assert torch.equal(values, logits.log_softmax(-1).sort(dim=-1, descending=True).values[:, :20])
    tied = values[:, 1:] == values[:, :-1]
    assert tied.any(), "the case was meant to tie"
    assert bool((ids[:, 1:] > ids[:, :-1])[tied].all())
