"""Batch-invariant Triton layer ops (deterministic mode): they conform to the reference, and a row's result is
bit-identical alone and inside calls of other sizes, and the compressor's entries whatever the chunking;
compiled on a GPU, interpreted by Triton on the CPU (tiny shapes)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.backends import AttentionMetadata, CompressorWeights, HyperWeights, LayerOpsSpec
from deepinfer_core.testing import conformance

SPEC = LayerOpsSpec(hidden_size=160, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                    dtype=torch.bfloat16, deterministic=True)
"""160 channels: the mHC plan's fixed split cuts them into two splits."""


def _ops(spec, device):
    from deepinfer_nvidia_sm100.invariant_layer_ops import InvariantTritonLayerOps

    return InvariantTritonLayerOps(spec, device)


def _hyper_case(device, num_tokens: int, seed: int = 0, spec: LayerOpsSpec = SPEC):
    gen = torch.Generator().manual_seed(seed)
    n, hidden = spec.hc_mult, spec.hidden_size

    def weights(num_rows, num_scales):
        return HyperWeights(fn=(torch.randn(num_rows, n * hidden, generator=gen) * 2 / math.sqrt(n * hidden)).to(device),
                            base=torch.randn(num_rows, generator=gen).to(device),
                            scale=(1 + 2 * torch.rand(num_scales, generator=gen)).to(device))

    inputs = {"streams": torch.randn(num_tokens, n, hidden, generator=gen).to(spec.dtype).to(device),
              "block_out": torch.randn(num_tokens, hidden, generator=gen).to(spec.dtype).to(device),
              "post": (2 * torch.rand(num_tokens, n, generator=gen)).to(device),
              "comb": torch.softmax(torch.randn(num_tokens, n, n, generator=gen), dim=-1).to(device),
              "norm": (0.5 + torch.rand(hidden, generator=gen)).to(device)}
    return weights((2 + n) * n, 3), weights(n, 1), inputs


def _hyper_calls(ops, hc, head, x, rows: slice):
    """Every mHC op (V4's, and V4.1's single pass) on the tokens `rows` of case `x`: a flat tuple of results."""
    s, out, post, comb = (x[k][rows] for k in ("streams", "block_out", "post", "comb"))
    every = torch.arange(s.shape[0], device=s.device)
    return (*ops.hc_pre(s, hc, x["norm"]), *ops.hc_post_pre(s, out, post, comb, hc, x["norm"]),
            ops.hc_post_head(s, out, post, comb, every, head, x["norm"]),
            *ops.hc_mix(s, hc, x["norm"], post), *ops.hc_post_mix(s, out, post, comb, hc, x["norm"], post))


def test_conforms_to_the_reference(kernel_device) -> None:
    spec = dataclasses.replace(SPEC, hidden_size=32)
    conformance.check_layer_ops(_ops(spec, kernel_device), kernel_device)


def test_mhc_rows_do_not_depend_on_the_call(kernel_device) -> None:
    ops = _ops(SPEC, kernel_device)
    hc, head, x = _hyper_case(kernel_device, 20)
    full = _hyper_calls(ops, hc, head, x, slice(0, 20))
    for rows in (slice(19, 20), slice(3, 9)):
        for part, whole in zip(_hyper_calls(ops, hc, head, x, rows), full, strict=True):
            assert torch.equal(part, whole[rows])


def test_the_default_mhc_plan_changes_a_row_with_the_call(kernel_device) -> None:
    """Guard that the check can tell: the default launch plan takes another path for 1 token than for 40."""
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    ops = TritonLayerOps(dataclasses.replace(SPEC, deterministic=False), kernel_device)
    hc, head, x = _hyper_case(kernel_device, 40)
    full = _hyper_calls(ops, hc, head, x, slice(0, 40))
    alone = _hyper_calls(ops, hc, head, x, slice(39, 40))
    assert not all(torch.equal(a, f[39:]) for a, f in zip(alone, full, strict=True))


def test_norm_rope_and_map_rows_do_not_depend_on_the_call(kernel_device) -> None:
    ops = _ops(SPEC, kernel_device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 2, 64, generator=gen).to(torch.bfloat16).to(kernel_device)
    weight = (0.5 + torch.rand(64, generator=gen)).to(kernel_device)
    cos, sin = (t.to(kernel_device) for t in torch.randn(2, 24, 8, generator=gen))
    full = (ops.rms_norm(x, weight), ops.rms_norm(x, weight, cos, sin), ops.rotary(x, cos, sin))
    for rows in (slice(23, 24), slice(5, 12)):
        parts = (ops.rms_norm(x[rows], weight), ops.rms_norm(x[rows], weight, cos[rows], sin[rows]),
                 ops.rotary(x[rows], cos[rows], sin[rows]))
        assert all(torch.equal(p, f[rows]) for p, f in zip(parts, full, strict=True))
    proj = torch.randn(96, 256, generator=gen).to(kernel_device)
    rows = torch.randn(70, 256, generator=gen).to(kernel_device)
    full = ops.map_rows(lambda r: F.linear(r, proj), rows)
    assert all(torch.equal(ops.map_rows(lambda r: F.linear(r, proj), rows[s])[-1], full[s.stop - 1])
               for s in (slice(69, 70), slice(62, 70), slice(0, 70, 1)))


@pytest.mark.parametrize(("width", "rate", "overlap"), [(32, 4, True), (64, 32, False)], ids=["csa", "hca"])
def test_compressed_entries_do_not_depend_on_the_chunking(kernel_device, width, rate, overlap) -> None:
    """One 70-token prompt closed in one step, in chunks of 1-30 tokens, and beside another request."""
    ops = _ops(SPEC, kernel_device)
    gen = torch.Generator().manual_seed(rate)
    proj = 2 * width if overlap else width
    weights = CompressorWeights(
        position_bias=torch.randn(rate, proj, generator=gen).to(kernel_device),
        norm_weight=(torch.rand(width, generator=gen) + 0.5).to(kernel_device), rate=rate, width=width,
        overlap=overlap, inv_freq=(1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16)).to(kernel_device),
        rope_scaling=0.75)
    kv = torch.randn(70, proj, generator=gen).to(torch.bfloat16).to(kernel_device)
    gate = (torch.randn(70, proj, generator=gen) * 2).to(torch.bfloat16).to(kernel_device)
    whole = _close(ops, weights, kv, gate, [(0, 70)])
    written = ~whole.isnan().all(dim=1)
    assert written.sum() == 70 // rate
    for chunks, beside in (([(0, 13), (13, 1), (14, 30), (44, 26)], 0), ([(0, 70)], 9)):
        entries = _close(ops, weights, kv, gate, chunks, beside)
        assert torch.equal(entries.isnan(), whole.isnan()) and torch.equal(entries[written], whole[written])


def _close(ops, weights, kv, gate, chunks, beside: int = 0) -> torch.Tensor:
    """The entries of request 0 after closing `chunks` `(start, len)` of its rows step by step; with
    `beside`, each step also carries that many tokens of a second request (cache block 1, slot 1)."""
    device, proj, ring = kv.device, kv.shape[1], 2 * weights.rate if weights.overlap else weights.rate
    entries = torch.full((2 * 128 // weights.rate + 1, weights.width), float("nan"), dtype=kv.dtype, device=device)
    kv_tail = torch.zeros(2, ring, proj, dtype=kv.dtype, device=device)
    gate_tail = torch.zeros(2, ring, proj, dtype=torch.float32, device=device)
    other = torch.randn(beside, proj, generator=torch.Generator().manual_seed(7)).to(kv.dtype).to(device)
    for start, n in chunks:
        lens = [n, beside] if beside else [n]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device),
            start_positions=torch.tensor([start, 0][: len(lens)], device=device),
            positions=torch.cat([torch.arange(start, start + n), torch.arange(beside)]).to(device),
            slots=torch.tensor([0, 1][: len(lens)], device=device),
            block_tables=torch.tensor([[0], [1]][: len(lens)], device=device), query_lens=lens,
            start_positions_host=[start, 0][: len(lens)], max_seq_len=start + n)
        step_kv, step_gate = torch.cat((kv[start : start + n], other)), torch.cat((gate[start : start + n], other))
        ops.compress(step_kv, step_gate, weights, metadata, kv_tail, gate_tail, entries,
                     torch.zeros(len(lens), dtype=torch.int64, device=device))
    return entries[: 128 // weights.rate]


def test_v4_flash_shapes_on_gpu(cuda_device) -> None:
    """Compiled kernels at V4-Flash width (bf16, hidden 4096): mHC, RMSNorm and cuBLAS projections give a row
    the same bits alone, among 64 and among 5,000 rows (where default mode changes every launch shape)."""
    spec = dataclasses.replace(SPEC, hidden_size=4096)
    ops = _ops(spec, cuda_device)
    hc, head, x = _hyper_case(cuda_device, 5000, spec=spec)
    full = _hyper_calls(ops, hc, head, x, slice(0, 5000))
    for rows in (slice(4999, 5000), slice(4936, 5000)):
        for part, whole in zip(_hyper_calls(ops, hc, head, x, rows), full, strict=True):
            assert torch.equal(part, whole[rows])
    hidden = x["block_out"]
    weight = x["norm"]
    proj = torch.randn(1024, 4096, device=cuda_device).to(torch.bfloat16)
    norm_full = ops.rms_norm(hidden, weight)
    lin_full = ops.map_rows(lambda r: F.linear(r, proj), hidden)
    for rows in (slice(4999, 5000), slice(4936, 5000)):
        assert torch.equal(ops.rms_norm(hidden[rows], weight), norm_full[rows])
        assert torch.equal(ops.map_rows(lambda r: F.linear(r, proj), hidden[rows]), lin_full[rows])
