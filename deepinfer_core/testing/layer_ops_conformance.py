"""Conformance of a `LayerOps` backend: mHC, RMSNorm, RoPE and the compressor against the reference.

    from deepinfer_core.testing.conformance import check_layer_ops
    check_layer_ops(MyLayerOps(spec), device)

The candidate runs on `device` in `dtype`; the reference runs on the CPU in fp32 on the same
(dtype-rounded) inputs. Entry pools are poisoned with NaN: rows a step must not write stay NaN.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.backends import AttentionMetadata, CompressorWeights, HyperWeights, LayerOps
from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.testing.cases import round_to
from deepinfer_core.testing.compare import assert_close, tolerances

CPU = torch.device("cpu")
MIX_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
"""Mixing weights are fp32 but computed from dtype-rounded streams."""


def _hyper(n: int, hidden: int, head: bool, gen: torch.Generator) -> HyperWeights:
    rows = n if head else (2 + n) * n
    return HyperWeights(fn=torch.randn(rows, n * hidden, generator=gen) * 2 / (n * hidden) ** 0.5,  # mixes ~ 1-3
                        base=torch.randn(rows, generator=gen) * 0.5,
                        scale=1 + 0.3 * torch.randn(1 if head else 3, generator=gen))


def _on(weights, device: torch.device):
    return dataclasses.replace(weights, **{f.name: getattr(weights, f.name).to(device)
                                           for f in dataclasses.fields(weights)
                                           if isinstance(getattr(weights, f.name), torch.Tensor)})


def check_hyper_connections(backend: LayerOps, reference: LayerOps, device: torch.device, dtype: torch.dtype,
                            atol: float, rtol: float, gen: torch.Generator, num_tokens: int = 5) -> None:
    spec = backend.spec
    n, hidden, mix = spec.hc_mult, spec.hidden_size, MIX_TOLERANCE.get(dtype, 2e-2)
    streams = round_to(torch.randn(num_tokens, n, hidden, generator=gen), dtype)
    out = round_to(torch.randn(num_tokens, hidden, generator=gen), dtype)
    hc, head = _hyper(n, hidden, False, gen), _hyper(n, hidden, True, gen)
    norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    dev_hc, dev_head, dev_norm = _on(hc, device), _on(head, device), norm.to(device)
    on = streams.to(device, dtype)
    embedded = on[:, 0].unsqueeze(1).expand(-1, n, -1)
    for what, candidate, expected_in in (("hc_pre", on, streams), ("hc_pre of expanded streams", embedded,
                                                                   streams[:, :1].expand(-1, n, -1))):
        post, comb, x = backend.hc_pre(candidate, dev_hc, dev_norm)
        want = reference.hc_pre(expected_in, hc, norm)
        assert_close(post, want[0], mix, mix, f"{what}: post")
        assert_close(comb, want[1], mix, mix, f"{what}: comb")
        assert_close(x, want[2], atol, rtol, f"{what}: block input")
    post, comb, _ = reference.hc_pre(streams, hc, norm)
    got = backend.hc_post_pre(on, out.to(device, dtype), post.to(device), comb.to(device), dev_hc, dev_norm)
    want = reference.hc_post_pre(streams, out, post, comb, hc, norm)
    for name, a, b, tol in zip(("new streams", "post", "comb", "block input"), got, want, (atol, mix, mix, atol)):
        assert_close(a, b, tol, rtol if tol == atol else mix, f"hc_post_pre: {name}")
    rows = torch.tensor([num_tokens - 1, 0])
    got = backend.hc_post_head(on, out.to(device, dtype), post.to(device), comb.to(device), rows.to(device),
                               dev_head, dev_norm)
    assert_close(got, reference.hc_post_head(streams, out, post, comb, rows, head, norm), atol, rtol, "hc_post_head")


def check_norm_and_rope(backend: LayerOps, reference: LayerOps, device: torch.device, dtype: torch.dtype,
                        atol: float, rtol: float, gen: torch.Generator, num_tokens: int = 5) -> None:
    angles = torch.rand(num_tokens, 8, generator=gen) * 6.28
    cos, sin = angles.cos(), angles.sin()
    dc, ds = cos.to(device), sin.to(device)
    for shape, weighted, rope in (((4, 96), False, True), ((64,), True, True), ((48,), True, False)):
        x = round_to(torch.randn(num_tokens, *shape, generator=gen) * 3, dtype)
        weight = 1 + 0.1 * torch.randn(shape[-1], generator=gen) if weighted else None
        got = backend.rms_norm(x.to(device, dtype), None if weight is None else weight.to(device),
                               dc if rope else None, ds if rope else None)
        want = reference.rms_norm(x, weight, cos if rope else None, sin if rope else None)
        assert_close(got, want, atol, rtol, f"rms_norm {list(shape)} weighted={weighted} rope={rope}")
    x = round_to(torch.randn(num_tokens, 4, 32, generator=gen), dtype)
    assert_close(backend.rotary(x.to(device, dtype), dc, -ds), reference.rotary(x, cos, -sin), atol, rtol, "rotary")


def _compress_step(rate: int, overlap: bool, width: int, query_lens: list[int], starts: list[int],
                   no_write: list[int], dtype: torch.dtype, gen: torch.Generator):
    proj, ring = (2 if overlap else 1) * width, (2 if overlap else 1) * rate
    epb, num_seqs = BLOCK_SIZE // rate, len(query_lens)
    blocks = [-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, query_lens)]
    ids = torch.randperm(sum(blocks) + 1, generator=gen)
    tables = torch.full((num_seqs, max(blocks)), -1, dtype=torch.long)
    for i, count in enumerate(blocks):
        tables[i, :count] = ids[sum(blocks[:i]):sum(blocks[:i]) + count]
    slots = torch.randperm(num_seqs + 1, generator=gen)[:num_seqs]
    num_tokens = sum(query_lens)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        start_positions=torch.tensor(starts), slots=slots, block_tables=tables,
        positions=torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)]),
        query_lens=list(query_lens), start_positions_host=list(starts), max_seq_len=max(map(sum, zip(starts, query_lens))),
    )
    tensors = {
        "kv": round_to(torch.randn(num_tokens, proj, generator=gen), dtype),
        "gate": round_to(torch.randn(num_tokens, proj, generator=gen) * 2, dtype),
        "kv_tail": round_to(torch.randn(num_seqs + 1, ring, proj, generator=gen), dtype),
        "gate_tail": torch.randn(num_seqs + 1, ring, proj, generator=gen) * 2,
        "entries": torch.full(((sum(blocks) + 1) * epb + 1, width), float("nan")),
        "no_write_before": torch.tensor(no_write),
    }
    weights = CompressorWeights(
        position_bias=torch.randn(rate, proj, generator=gen), norm_weight=1 + 0.1 * torch.randn(width, generator=gen),
        rate=rate, width=width, overlap=overlap, inv_freq=1.0 / 100 ** (torch.arange(0, 16, 2) / 16), rope_scaling=1.0,
    )
    return metadata, tensors, weights


def check_compress(backend: LayerOps, reference: LayerOps, device: torch.device, dtype: torch.dtype,
                   atol: float, rtol: float, gen: torch.Generator) -> None:
    steps = {  # query lens, start positions, no_write_before per request
        "prefill": ([9, 1, 20], [0, 5, 13], [0, 0, 16]),
        "decode": ([1, 1, 1, 1], [3, 7, 15, 130], [0, 0, 0, 0]),
        "long chunk": ([140, 3], [1, 126], [0, 0]),
    }
    # more requests than a kernel reads in one step when it looks a token's request up (one rate suffices)
    many = {"decode, 70 requests": ([1] * 70, [(7 * i) % 200 for i in range(70)], [0] * 70)}
    for rate, overlap in ((4, True), (16, False), (128, False)):
        for name, (lens, starts, no_write) in (steps | many if rate == 4 else steps).items():
            metadata, t, weights = _compress_step(rate, overlap, 32, lens, starts, no_write, dtype, gen)
            dev = {k: v.to(device, dtype if k in ("kv", "gate", "kv_tail", "entries") else v.dtype, copy=True)
                   for k, v in t.items()}
            dev_meta = dataclasses.replace(metadata, **{f: getattr(metadata, f).to(device) for f in (
                "query_start_loc", "start_positions", "positions", "slots", "block_tables")})
            backend.compress(dev["kv"], dev["gate"], _on(weights, device), dev_meta, dev["kv_tail"], dev["gate_tail"],
                             dev["entries"], dev["no_write_before"])
            reference.compress(t["kv"], t["gate"], weights, metadata, t["kv_tail"], t["gate_tail"], t["entries"],
                               t["no_write_before"])
            what = f"compress rate={rate} overlap={overlap} {name}"
            assert_close(dev["entries"][:-1], t["entries"][:-1], atol, rtol, f"{what}: entries (NaN rows must stay NaN)",
                         equal_nan=True)
            assert_close(dev["kv_tail"], t["kv_tail"], atol, rtol, f"{what}: kv tail")
            assert_close(dev["gate_tail"], t["gate_tail"], atol, rtol, f"{what}: gate tail")
            window = round_to(torch.randn(len(lens) + 1, 16, 8, generator=gen), dtype)
            dev_window, keys = window.to(device, dtype, copy=True), t["kv"][:, :8]
            backend.write_window(dev_meta, dev_window, keys.to(device, dtype))
            reference.write_window(metadata, window, keys)
            assert_close(dev_window, window, 0, 0, f"write_window {name}")


def check_layer_ops(backend: LayerOps, device: torch.device, dtype: torch.dtype | None = None,
                    atol: float | None = None, rtol: float | None = None, seed: int = 0) -> None:
    """Every `LayerOps` method against the reference (mHC at the spec's hidden size and hc_mult)."""
    from deepinfer_core.reference.layer_ops import ReferenceLayerOps

    dtype = dtype or backend.spec.dtype
    atol, rtol = tolerances(dtype, atol, rtol)
    reference = ReferenceLayerOps(dataclasses.replace(backend.spec, dtype=torch.float32))
    gen = torch.Generator().manual_seed(seed)
    check_hyper_connections(backend, reference, device, dtype, atol, rtol, gen)
    check_norm_and_rope(backend, reference, device, dtype, atol, rtol, gen)
    check_compress(backend, reference, device, dtype, atol, rtol, gen)
