"""The reference's batch-invariant backends: they conform to the reference, and a row's result does not
depend on what shares its call (where the plain formulation's does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec
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
