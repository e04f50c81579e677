"""Batch-invariant attention and indexer top-k (deterministic mode): a token's output is bit-identical alone,
beside other requests, for any chunking of its prompt and for both launch shapes; runs on the GPU and, through
Triton's interpreter, on the CPU (tiny shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import AttentionMetadata, AttentionSpec
from deepinfer_core.testing import conformance

SLIDING = AttentionSpec(num_heads=4, head_dim=16, sliding_window=100, compress_rate=0, deterministic=True)
CSA = dataclasses.replace(SLIDING, sliding_window=8, compress_rate=4, index_n_heads=2, index_head_dim=16,
                          index_topk=64)
HCA = dataclasses.replace(SLIDING, sliding_window=8, compress_rate=2)
SPECS = {"sliding": SLIDING, "csa": CSA, "hca": HCA}
"""Each with two or three splits of `SPLIT_KEYS` keys at the worlds' longest prompt."""
SPLIT_KEYS = 64
LENGTHS = [300, 41, 170, 9]
"""Prompt lengths of the requests a world holds; request 0 is the one checked."""


class World:
    """Requests with fixed keys, queries, compressed entries and indexer picks per position; `step` lays any
    mix of their token ranges out as one step, the window ring holding each range's earlier keys."""

    def __init__(self, spec: AttentionSpec, device: torch.device, seed: int = 0, lengths=tuple(LENGTHS),
                 dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.device, self.dtype = spec, device, dtype
        d, epb = spec.head_dim, max(spec.entries_per_block, 1)
        self.keys = [torch.randn(n, d, generator=gen) for n in lengths]
        self.queries = [torch.randn(n, spec.num_heads, d, generator=gen) for n in lengths]
        blocks_each = [-(-n // 128) for n in lengths]
        order = torch.randperm(sum(blocks_each), generator=gen)
        self.tables = torch.zeros(len(lengths), max(blocks_each), dtype=torch.int64)
        first = 0
        for r, b in enumerate(blocks_each):
            self.tables[r, :b] = order[first : first + b]
            first += b
        self.pool = torch.randn(sum(blocks_each) * epb, d, generator=gen)
        self.sinks = torch.randn(spec.num_heads, generator=gen)
        self.topk = None
        if spec.is_sparse:  # per position: distinct visible entries in a random order, then -1
            self.topk = []
            for n in lengths:
                rows = torch.full((n, spec.index_topk), -1, dtype=torch.int64)
                for p in range(n):
                    visible = (p + 1) // spec.compress_rate
                    pick = torch.randperm(visible, generator=gen)[: spec.index_topk]
                    rows[p, : len(pick)] = pick
                self.topk.append(rows)

    def step(self, parts: list[tuple[int, int, int]]) -> dict:
        """Forward arguments for the step whose request `i` is `parts[i] = (request, start, num_tokens)`."""
        spec, w = self.spec, self.spec.sliding_window
        window = torch.full((len(parts) + 1, w, spec.head_dim), float("nan"))
        for i, (r, start, _) in enumerate(parts):
            for p in range(max(0, start - w), start):
                window[i + 1, p % w] = self.keys[r][p]
        lens = [n for _, _, n in parts]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
            start_positions=torch.tensor([s for _, s, _ in parts]),
            positions=torch.cat([torch.arange(s, s + n) for _, s, n in parts]),
            slots=torch.arange(1, len(parts) + 1), block_tables=self.tables[[r for r, _, _ in parts]],
            query_lens=lens, start_positions_host=[s for _, s, _ in parts],
            max_seq_len=max(s + n for _, s, n in parts))
        cat = torch.cat
        args = {"q": cat([self.queries[r][s : s + n] for r, s, n in parts]),
                "kv": cat([self.keys[r][s : s + n] for r, s, n in parts]), "window": window,
                "compressed": self.pool if spec.compress_rate else None, "sinks": self.sinks,
                "topk_indices": cat([self.topk[r][s : s + n] for r, s, n in parts]) if self.topk else None}
        moved = {k: None if v is None else v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
                 for k, v in args.items()}
        moved["sinks"] = self.sinks.to(self.device)
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        moved["metadata"] = AttentionMetadata(**{
            k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})
        return moved


def _backend(spec):
    from deepinfer_nvidia_sm100.invariant_attention import InvariantTritonAttention

    return InvariantTritonAttention(spec, split_keys=SPLIT_KEYS)


@pytest.mark.parametrize("name", list(SPECS))
def test_decode_token_is_the_same_alone_and_among_others(kernel_device, name) -> None:
    world, backend = World(SPECS[name], kernel_device), _backend(SPECS[name])
    alone = backend.forward(**world.step([(0, 299, 1)]))
    for others in ([(1, 40, 1)], [(2, 169, 1), (1, 12, 1), (3, 8, 1)]):
        for at in (0, len(others)):
            parts = others[:at] + [(0, 299, 1)] + others[at:]
            assert torch.equal(backend.forward(**world.step(parts))[at], alone[0])


@pytest.mark.parametrize("name", list(SPECS))
def test_prompt_rows_do_not_depend_on_the_chunking(kernel_device, name) -> None:
    """Request 0's last 20 prompt tokens: in one step, in chunks of 7, one a step, and beside another request."""
    world, backend = World(SPECS[name], kernel_device), _backend(SPECS[name])
    whole = backend.forward(**world.step([(0, 280, 20)]))
    chunks = [backend.forward(**world.step([(0, s, min(7, 300 - s))])) for s in range(280, 300, 7)]
    assert torch.equal(torch.cat(chunks), whole)
    singles = [backend.forward(**world.step([(0, s, 1)])) for s in (280, 291, 299)]
    assert torch.equal(torch.cat(singles), whole[[0, 11, 19]])
    mixed = backend.forward(**world.step([(2, 100, 5), (0, 280, 20)]))
    assert torch.equal(mixed[5:], whole)


@pytest.mark.parametrize("name", ["csa", "hca"])
def test_both_launch_shapes_give_the_same_bits(kernel_device, name) -> None:
    world, backend = World(SPECS[name], kernel_device), _backend(SPECS[name])
    step = world.step([(0, 296, 4), (2, 169, 1)])
    folded = backend.forward(**step, split_programs=False)
    assert torch.equal(backend.forward(**step, split_programs=True), folded)


@pytest.mark.parametrize("name", list(SPECS))
def test_conforms_to_the_reference(kernel_device, name) -> None:
    spec = dataclasses.replace(SPECS[name], sliding_window=min(SPECS[name].sliding_window, 16))
    conformance.check_attention(_backend(spec), kernel_device)


def test_the_default_kernel_changes_a_row_with_its_batch(kernel_device) -> None:
    """Guard that the worlds can tell: the default kernel splits a decode token's keys by the step's size."""
    from deepinfer_nvidia_sm100.attention import TritonAttention

    spec = dataclasses.replace(SLIDING, deterministic=False)
    world, backend = World(spec, kernel_device), TritonAttention(spec)
    alone = backend.forward(**world.step([(0, 299, 1)]))
    crowd = [(1, 40, 1)] * 140  # 141 programs: one split each instead of two
    assert not torch.equal(backend.forward(**world.step([(0, 299, 1), *crowd]))[0], alone[0])


def test_topk_breaks_ties_towards_the_lower_entry_and_ignores_the_width() -> None:
    from deepinfer_nvidia_sm100.invariant_attention import invariant_topk

    scores = torch.tensor([[0.0, 2.0, 0.0, -1.5, 2.0, 0.0, -0.0, float("-inf")]])
    assert invariant_topk(scores, 5).tolist() == [[1, 4, 0, 2, 5]]
    assert invariant_topk(scores, 8).tolist() == [[1, 4, 0, 2, 5, 6, 3, -1]]
    padded = torch.cat((scores, torch.full((1, 9), float("-inf"))), dim=1)
    assert torch.equal(invariant_topk(padded, 8), invariant_topk(scores, 8))
    assert invariant_topk(scores[:, :3], 5).tolist() == [[1, 0, 2, -1, -1]]


def test_indexer_topk_is_the_same_alone_and_among_others(kernel_device) -> None:
    from deepinfer_core.testing.cases import random_attention_case

    backend = _backend(CSA)
    case = random_attention_case(CSA, [1, 3, 1], [299, 60, 17], seed=5).to(kernel_device, torch.float32)
    full = backend.indexer_topk(case.index_q, case.index_weights, case.index_keys, case.metadata, case.num_entries)
    m = case.metadata
    alone = dataclasses.replace(
        m, query_start_loc=m.query_start_loc[:2], start_positions=m.start_positions[:1], positions=m.positions[:1],
        slots=m.slots[:1], block_tables=m.block_tables[:1], query_lens=[1], start_positions_host=[299],
        max_seq_len=300)
    single = backend.indexer_topk(case.index_q[:1], case.index_weights[:1], case.index_keys, alone, None)
    assert torch.equal(single, full[:1])
    assert (single[0] >= 0).all() and len(set(single[0].tolist())) == CSA.index_topk


V4_FLASH = {"hca": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=128,
                                 dtype=torch.bfloat16, deterministic=True),
            "csa": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=4, index_n_heads=64,
                                 index_head_dim=128, index_topk=512, dtype=torch.bfloat16, deterministic=True)}


@pytest.mark.parametrize("name", list(V4_FLASH))
def test_v4_flash_shapes_on_gpu(cuda_device, name) -> None:
    """Compiled kernels at V4-Flash sizes (bf16, 5 CSA splits): decode alone and among 100 others, both launch
    shapes, a 64-token prompt chunk against chunks of 7."""
    spec = V4_FLASH[name]
    world = World(spec, cuda_device, lengths=(2200, 900, 1200, 64), dtype=torch.bfloat16)
    backend = _production_backend(spec)
    alone = backend.forward(**world.step([(0, 2199, 1)]))
    crowd = [(r, n - 1 - i, 1) for i in range(25) for r, n in ((1, 900), (2, 1200), (3, 64), (1, 500))]
    assert torch.equal(backend.forward(**world.step([*crowd[:50], (0, 2199, 1), *crowd[50:]]))[50], alone[0])
    step = world.step([(0, 2199, 1), *crowd[:3]])
    assert torch.equal(backend.forward(**step, split_programs=True), backend.forward(**step, split_programs=False))
    whole = backend.forward(**world.step([(0, 2136, 64)]))
    chunks = [backend.forward(**world.step([(0, s, min(7, 2200 - s))])) for s in range(2136, 2200, 7)]
    assert torch.equal(torch.cat(chunks), whole)
    assert torch.equal(whole[-1], alone[0])


def _production_backend(spec):
    from deepinfer_nvidia_sm100.invariant_attention import InvariantTritonAttention

    return InvariantTritonAttention(spec)
