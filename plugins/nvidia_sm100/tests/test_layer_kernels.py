"""Layer-op kernels (RMSNorm, RoPE, compressor window close) against `ReferenceLayerOps`.

Runs compiled on a suitable GPU and in Triton's interpreter on the CPU (`kernel_device`).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends.attention import AttentionMetadata
from deepinfer_core.backends.layer_ops import CompressorWeights, LayerOpsSpec
from deepinfer_core.reference.layer_ops import ReferenceLayerOps

EPS = 1e-6
TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 3e-2}}
DTYPES = [torch.float32, torch.bfloat16]


def _reference(dtype: torch.dtype) -> ReferenceLayerOps:
    return ReferenceLayerOps(LayerOpsSpec(hidden_size=64, hc_mult=1, hc_sinkhorn_iters=1, hc_eps=1e-6,
                                          rms_norm_eps=EPS, dtype=dtype))


def _cos_sin(positions: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device)
                                  / rope_dim))
    angles = positions.float()[:, None] * inv_freq
    return angles.cos(), angles.sin()


# name: (shape, rope_dim or 0, weighted)
NORM_CASES = {
    "q_heads_unit_rope": ((2, 64, 512), 64, False),
    "kv_weighted_rope": ((3, 512), 64, True),
    "q_a_weighted": ((3, 1024), 0, True),
    "odd_width_heads_rope": ((5, 3, 96), 32, True),
    "odd_width_unit": ((4, 96), 0, False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_rms_norm_matches_reference(kernel_device: torch.device, name: str, dtype: torch.dtype) -> None:
    from deepinfer_nvidia_sm100.layer_kernels import rms_norm

    shape, rope_dim, weighted = NORM_CASES[name]
    gen = torch.Generator(device=kernel_device).manual_seed(len(name))
    x = (torch.randn(shape, generator=gen, device=kernel_device) * 3).to(dtype)
    weight = torch.rand(shape[-1], generator=gen, device=kernel_device) + 0.5 if weighted else None
    cos = sin = None
    if rope_dim:
        cos, sin = _cos_sin(torch.arange(100, 100 + shape[0], device=kernel_device) * 37, rope_dim)
    out = rms_norm(x, weight, EPS, cos, sin)
    expected = _reference(dtype).rms_norm(x, weight, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_rms_norm_reads_strided_rows(kernel_device: torch.device) -> None:
    """A column slice of a wider projection (row stride != width) is normalised row by row."""
    from deepinfer_nvidia_sm100.layer_kernels import rms_norm

    gen = torch.Generator(device=kernel_device).manual_seed(1)
    wide = torch.randn(4, 160, generator=gen, device=kernel_device)
    x = wide[:, 32:]
    weight = torch.rand(128, generator=gen, device=kernel_device)
    cos, sin = _cos_sin(torch.arange(4, device=kernel_device), 32)
    torch.testing.assert_close(rms_norm(x, weight, EPS, cos, sin), _reference(x.dtype).rms_norm(x, weight, cos, sin),
                               **TOLERANCE[torch.float32])


def test_rms_norm_of_no_rows(kernel_device: torch.device) -> None:
    """Zero rows (a step in which no compressed entry closes) give an empty result, not a reshape error."""
    from deepinfer_nvidia_sm100.layer_kernels import rms_norm

    x = torch.empty(0, 512, device=kernel_device)
    out = rms_norm(x, torch.ones(512, device=kernel_device), EPS)
    assert out.shape == (0, 512)


# name: (shape, rope_dim)
ROTARY_CASES = {
    "attention_output_inverse": ((2, 64, 512), 64),
    "indexer_q": ((2, 64, 128), 64),
    "odd_width": ((3, 96), 32),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROTARY_CASES))
def test_rotary_matches_reference(kernel_device: torch.device, name: str, dtype: torch.dtype) -> None:
    from deepinfer_nvidia_sm100.layer_kernels import rotary

    shape, rope_dim = ROTARY_CASES[name]
    gen = torch.Generator(device=kernel_device).manual_seed(len(name))
    x = torch.randn(shape, generator=gen, device=kernel_device).to(dtype)
    cos, sin = _cos_sin(torch.arange(shape[0], device=kernel_device) * 1000 + 7, rope_dim)
    if name.endswith("inverse"):
        sin = -sin
    out = rotary(x, cos, sin)
    torch.testing.assert_close(out, _reference(dtype).rotary(x, cos, sin), **TOLERANCE[dtype])
    head = x.shape[-1] - rope_dim
    assert torch.equal(out[..., :head], x[..., :head])  # channels before the rope part are copied exactly


def _compressor(width: int, rate: int, overlap: bool, rope_dim: int, device: torch.device,
                gen: torch.Generator) -> CompressorWeights:
    proj = 2 * width if overlap else width
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    return CompressorWeights(
        position_bias=torch.randn(rate, proj, generator=gen, device=device),
        norm_weight=torch.rand(width, generator=gen, device=device) + 0.5,
        rate=rate, width=width, overlap=overlap, inv_freq=inv_freq, rope_scaling=0.75,
    )


def _metadata(requests: list[tuple[int, int, int]], blocks_per_request: int, device: torch.device,
              gen: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Step metadata for `requests` `(start_position, query_len, slot)`; every request gets distinct random
    cache blocks (the table is -1 padded by one column). Returns it and the number of blocks."""
    starts, lens, slots = (list(column) for column in zip(*requests))
    num_blocks = len(requests) * blocks_per_request
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks)).view(len(requests), -1)
    tables = torch.cat((order, torch.full((len(requests), 1), -1)), dim=1)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device),
        start_positions=torch.tensor(starts, device=device), positions=positions.to(device),
        slots=torch.tensor(slots, device=device), block_tables=tables.to(device),
        query_lens=lens, start_positions_host=starts, max_seq_len=max(s + n for s, n in zip(starts, lens)),
    )
    return metadata, num_blocks


def _expected_rows(requests, no_write_before: list[int], tables: torch.Tensor, rate: int) -> set[int]:
    """Pool rows the step must write: one per window closed in the step and not cached yet."""
    epb, rows = 128 // rate, set()
    for seq, (start, length, _) in enumerate(requests):
        for position in range(start, start + length):
            entry = (position + 1) // rate - 1
            if (position + 1) % rate == 0 and (entry + 1) * rate > no_write_before[seq]:
                rows.add(int(tables[seq, entry // epb]) * epb + entry % epb)
    return rows


# name: (width, rate, overlap, rope_dim, requests (start, len, slot), no_write_before)
COMPRESS_CASES = {
    # a chunk starting mid-window over a filled tail, a first chunk (entry 0), decode closing / cached
    "csa_mixed": (32, 4, True, 16, [(6, 11, 2), (0, 9, 0), (15, 1, 3), (23, 1, 1)], [0, 0, 16, 0]),
    "csa_decode": (32, 8, True, 16, [(7, 1, 1), (15, 1, 0), (20, 1, 2)], [0, 0, 0]),
    "hca_mixed": (64, 16, False, 16, [(8, 30, 1), (47, 1, 0), (50, 1, 3), (0, 32, 2)], [0, 0, 0, 16]),
    "hca_odd_width": (96, 8, False, 32, [(3, 14, 0), (31, 1, 1)], [0, 0]),
    # a 128-row span, pooled across several row blocks, partly from the ring
    "hca_v4_flash": (512, 128, False, 64, [(100, 30, 1), (255, 1, 0)], [0, 0]),
    "csa_v4_flash": (512, 4, True, 64, [(2, 6, 0), (11, 1, 2), (6, 1, 1)], [0, 0, 0]),
    "indexer_v4_flash": (128, 4, True, 64, [(2, 6, 0), (11, 1, 2), (6, 1, 1)], [0, 0, 0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(COMPRESS_CASES))
def test_compress_matches_reference(kernel_device: torch.device, name: str, dtype: torch.dtype) -> None:
    _check_compress_case(kernel_device, name, dtype)


@pytest.mark.parametrize(("name", "split"), [("csa_mixed", 16), ("hca_mixed", 16), ("hca_odd_width", 32),
                                             ("hca_v4_flash", 0)])
def test_compress_pooling_layouts(kernel_device: torch.device, name: str, split: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Both pooling layouts on every kind of span: channels split over programs (then a finishing pass)
    and one program per closing token; the launcher picks one by span length and step size."""
    from deepinfer_nvidia_sm100 import layer_kernels

    monkeypatch.setattr(layer_kernels, "_channel_split", lambda width, span, num_tokens: split)
    _check_compress_case(kernel_device, name, torch.bfloat16)


def _check_compress_case(kernel_device: torch.device, name: str, dtype: torch.dtype) -> None:
    from deepinfer_nvidia_sm100.layer_kernels import compress

    width, rate, overlap, rope_dim, requests, no_write = COMPRESS_CASES[name]
    gen = torch.Generator(device=kernel_device).manual_seed(len(name) + rate)
    opts = {"device": kernel_device, "generator": gen}
    weights = _compressor(width, rate, overlap, rope_dim, kernel_device, gen)
    metadata, num_blocks = _metadata(requests, 2, kernel_device, gen)
    proj, ring, num_tokens = weights.position_bias.shape[1], 2 * rate if overlap else rate, len(metadata.positions)
    kv = torch.randn(num_tokens, proj, **opts).to(dtype)
    gate = (torch.randn(num_tokens, proj, **opts) * 2).to(dtype)
    kv_tail = torch.randn(4, ring, proj, **opts).to(dtype)
    gate_tail = torch.randn(4, ring, proj, **opts) * 2
    entries = torch.full((num_blocks * (128 // rate) + 1, width), float("nan"), device=kernel_device, dtype=dtype)
    no_write_before = torch.tensor(no_write, device=kernel_device)

    expected = [entries.clone(), kv_tail.clone(), gate_tail.clone()]
    _reference(dtype).compress(kv, gate, weights, metadata, expected[1], expected[2], expected[0], no_write_before)
    compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before, EPS)

    written = set((~entries.isnan().any(dim=1)).nonzero().flatten().tolist())
    assert written == _expected_rows(requests, no_write, metadata.block_tables.cpu(), rate)
    assert entries.isnan().all(dim=1).sum() == len(entries) - len(written)  # a written row is whole
    torch.testing.assert_close(entries, expected[0], equal_nan=True, **TOLERANCE[dtype])
    torch.testing.assert_close(kv_tail, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(gate_tail, expected[2], rtol=1e-6, atol=1e-6)


def test_compress_ignores_graph_flags_and_never_touches_scratch(kernel_device: torch.device) -> None:
    """Under CUDA-graph metadata the result is the same and the pool's scratch row stays untouched."""
    from deepinfer_nvidia_sm100.layer_kernels import compress

    gen = torch.Generator(device=kernel_device).manual_seed(5)
    weights = _compressor(32, 4, True, 16, kernel_device, gen)
    metadata, num_blocks = _metadata([(7, 1, 1), (9, 1, 0), (3, 1, 2)], 1, kernel_device, gen)
    kv = torch.randn(3, 64, generator=gen, device=kernel_device)
    gate = torch.randn(3, 64, generator=gen, device=kernel_device)
    tails = torch.randn(3, 8, 64, generator=gen, device=kernel_device)
    results = []
    for static in (False, True):
        metadata.needs_static_shapes = static
        entries = torch.full((num_blocks * 32 + 1, 32), float("nan"), device=kernel_device)
        kv_tail, gate_tail = tails.clone(), tails.clone()
        compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, torch.zeros(3, dtype=torch.int64,
                 device=kernel_device), EPS)
        assert entries[-1].isnan().all()
        assert (~entries.isnan().any(dim=1)).sum() == 2  # positions 7 and 3 close entries 1 and 0
        results.append((entries, kv_tail, gate_tail))
    for first, second in zip(*results):
        assert torch.equal(first.nan_to_num(), second.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_several_rows_per_program(kernel_device: torch.device, dtype: torch.dtype,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Large batches pack several rows per program; a ragged last program masks the rows past the end."""
    from deepinfer_nvidia_sm100 import layer_kernels

    monkeypatch.setattr(layer_kernels, "_rows_per_program", lambda num_rows, block_w, device: 4)
    gen = torch.Generator(device=kernel_device).manual_seed(3)
    x = torch.randn(7, 3, 96, generator=gen, device=kernel_device).to(dtype)
    weight = torch.rand(96, generator=gen, device=kernel_device)
    cos, sin = _cos_sin(torch.arange(7, device=kernel_device) * 11, 32)
    reference = _reference(dtype)
    torch.testing.assert_close(layer_kernels.rms_norm(x, weight, EPS, cos, sin),
                               reference.rms_norm(x, weight, cos, sin), **TOLERANCE[dtype])
    torch.testing.assert_close(layer_kernels.rms_norm(x, None, EPS), reference.rms_norm(x, None), **TOLERANCE[dtype])
    torch.testing.assert_close(layer_kernels.rotary(x, cos, -sin), reference.rotary(x, cos, -sin), **TOLERANCE[dtype])


@pytest.mark.parametrize("num_rows", [0, 1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp32_linear_matches_reference(kernel_device: torch.device, num_rows: int, dtype: torch.dtype) -> None:
    """V4.1's head: fp32 rows times bf16 (or fp32) weights in fp32, partial tiles both ways, rows beyond one
    program's 16; each row's result does not depend on the other rows."""
    from deepinfer_nvidia_sm100.layer_kernels import fp32_linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_rows, 300, generator=gen)
    weight = torch.randn(70, 300, generator=gen).to(dtype)
    want = _reference(torch.float32).fp32_linear(x, weight)
    got = fp32_linear(x.to(kernel_device), weight.to(kernel_device)).cpu()
    assert got.dtype == torch.float32 and got.shape == (num_rows, 70)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    if num_rows > 1:
        alone = fp32_linear(x[1:2].to(kernel_device), weight.to(kernel_device)).cpu()
        assert torch.equal(alone, got[1:2])
