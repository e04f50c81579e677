"""Decode steps as the CUDA-graph runner builds them: stale host lists, `max_seq_len` = the static
`max_model_len` bound, zero-padded block tables, padding rows on a scratch slot and block; CUDA only.

The candidate runs on caches poisoned with NaN wherever no query may read; the expected output is the
reference backend on the same values with unpoisoned caches and exact metadata.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import AttentionCase, random_attention_case, round_to

SPECS = {
    "sliding": AttentionSpec(num_heads=16, head_dim=64, sliding_window=32, compress_rate=0),
    "hca": AttentionSpec(num_heads=20, head_dim=64, sliding_window=32, compress_rate=16),
    "csa": AttentionSpec(
        num_heads=16,
        head_dim=64,
        sliding_window=32,
        compress_rate=4,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=16,
    ),
    "v4_flash_csa": AttentionSpec(
        num_heads=64,
        head_dim=512,
        sliding_window=128,
        compress_rate=4,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=64,
    ),
}
STARTS = [3, 40, 77, 300, 517]  # windows not yet full, full, several compressed entries, past top-k
WINDOW_STARTS = [0, 0, 60, 0, 500]  # SWA replay: keys before these positions are not valid
MAX_MODEL_LEN = 2048
NUM_PADDING_ROWS = 3


def graph_metadata(
    case: AttentionCase, spec: AttentionSpec, device: torch.device, num_padding: int
) -> AttentionMetadata:
    """The case's decode metadata the way `DecodeGraphs` fills its static buffers."""
    meta, n = case.metadata, len(STARTS)
    scratch_slot = case.window.shape[0]  # `grow_pools` appends one ring and one block
    scratch_block = case.compressed.shape[0] // spec.entries_per_block if spec.compress_rate else 0
    max_blocks = math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
    tables = torch.zeros(n + num_padding, max_blocks, dtype=torch.long)  # zero padded, like the runner
    tables[:n, : meta.block_tables.shape[1]] = meta.block_tables.clamp(min=0)
    tables[n:] = scratch_block
    positions = torch.cat((meta.positions, torch.zeros(num_padding, dtype=torch.long)))
    slots = torch.cat((meta.slots, torch.full((num_padding,), scratch_slot, dtype=torch.long)))
    window_starts = torch.tensor(WINDOW_STARTS + [0] * num_padding, dtype=torch.long)
    size = n + num_padding
    return AttentionMetadata(
        query_start_loc=torch.arange(size + 1, device=device),
        start_positions=positions.to(device),
        positions=positions.to(device),
        slots=slots.to(device),
        block_tables=tables.to(device),
        query_lens=[1] * size,
        start_positions_host=[0] * size,  # stale, as under graph replay
        window_starts=window_starts.to(device),
        max_seq_len=MAX_MODEL_LEN,
    )


def grow_pools(case: AttentionCase, spec: AttentionSpec, device: torch.device, dtype: torch.dtype):
    """The case's caches on `device`, plus a scratch ring, a scratch block and a scratch row (zeros),
    like `KVCache`."""
    window = torch.cat((case.window, torch.zeros(1, *case.window.shape[1:]))).to(device, dtype)
    extra = spec.entries_per_block + 1

    def grow(pool):
        if pool is None:
            return None
        return torch.cat((pool, torch.zeros(extra, pool.shape[1]))).to(device, dtype)

    return window, grow(case.compressed), grow(case.index_keys)


def expected_output(spec: AttentionSpec, dtype: torch.dtype, seed: int) -> torch.Tensor:
    clean = random_attention_case(spec, [1] * len(STARTS), STARTS, seed=seed, poison=False)
    meta = dataclasses.replace(
        clean.metadata,
        window_start_positions_host=list(WINDOW_STARTS),
        window_starts=torch.tensor(WINDOW_STARTS),
        max_seq_len=max(STARTS) + 1,
    )
    reference = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), torch.device("cpu"))
    r = {name: round_to(getattr(clean, name), dtype) for name in ("q", "kv", "window", "compressed")}
    return reference.forward(
        r["q"],
        r["kv"],
        r["window"],
        r["compressed"],
        clean.sinks,
        meta,
        clean.topk_indices,
        clean.num_entries,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPECS))
def test_graph_style_decode_matches_reference(
    cuda_device: torch.device, name: str, dtype: torch.dtype
) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    spec = dataclasses.replace(SPECS[name], dtype=dtype)
    backend = TritonAttention(spec)
    case = random_attention_case(spec, [1] * len(STARTS), STARTS, seed=7)
    meta = graph_metadata(case, spec, cuda_device, NUM_PADDING_ROWS)
    window, compressed, _ = grow_pools(case, spec, cuda_device, dtype)
    n, pad = len(STARTS), NUM_PADDING_ROWS
    gen = torch.Generator().manual_seed(11)
    q = torch.cat((case.q, torch.randn(pad, *case.q.shape[1:], generator=gen))).to(cuda_device, dtype)
    kv = torch.cat((case.kv, torch.randn(pad, case.kv.shape[1], generator=gen))).to(cuda_device, dtype)
    topk = None
    if spec.is_sparse:
        topk = torch.cat((case.topk_indices, torch.full((pad, spec.index_topk), -1))).to(cuda_device)
    num_entries = None
    if spec.compress_rate:
        num_entries = ((meta.positions + 1) // spec.compress_rate).to(cuda_device)
    out = backend.forward(q, kv, window, compressed, case.sinks.to(cuda_device), meta, topk, num_entries)
    assert out.shape == q.shape
    atol, rtol = conformance.tolerances(dtype)
    expected = expected_output(spec, dtype, seed=7)
    torch.testing.assert_close(out[:n].float().cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["csa", "v4_flash_csa"])
def test_graph_style_indexer_picks_the_top_entries(
    cuda_device: torch.device, name: str, dtype: torch.dtype
) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    spec = dataclasses.replace(SPECS[name], dtype=dtype)
    case = random_attention_case(spec, [1] * len(STARTS), STARTS, seed=3)
    meta = graph_metadata(case, spec, cuda_device, num_padding=0)
    _, compressed, index_keys = grow_pools(case, spec, cuda_device, dtype)
    candidate = dataclasses.replace(
        case.to(cuda_device, dtype), metadata=meta, compressed=compressed, index_keys=index_keys
    )
    rounded = ("q", "kv", "window", "compressed", "index_q", "index_keys")
    reference = dataclasses.replace(case, **{name: round_to(getattr(case, name), dtype) for name in rounded})
    atol, rtol = conformance.tolerances(dtype)
    conformance.check_indexer_selection(
        TritonAttention(spec), candidate, reference, atol, rtol, "graph decode"
    )


def test_decode_backends_declare_graph_support(cuda_device: torch.device) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention
    from deepinfer_nvidia_sm100.moe import TritonMoE

    assert TritonAttention.supports_cuda_graphs is True
    assert TritonMoE.supports_cuda_graphs is True
