"""Random backend inputs that respect the contracts in `deepinfer_core.backends`, for conformance tests.

Every builder works in fp32 on the CPU from a seeded generator, so a case is the same on every machine.
Cache regions that no query may read (ring slots of positions outside a request's window, compressed rows
past a request's entries, blocks and slots no request owns) are filled with NaN when `poison` is set: a
backend that reads them returns NaN and fails the comparison.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from deepinfer_core.backends import (
    AttentionMetadata,
    AttentionSpec,
    MoESpec,
    MoEWeights,
    SamplingSpec,
    SamplingTensors,
)
from deepinfer_core.models.layer_plan import BLOCK_SIZE


@dataclass
class AttentionCase:
    """Inputs of `AttentionBackend.forward` (and, for CSA specs, of `indexer_topk`) for one step."""

    q: torch.Tensor
    kv: torch.Tensor
    window: torch.Tensor
    compressed: torch.Tensor | None
    sinks: torch.Tensor
    metadata: AttentionMetadata
    num_entries: torch.Tensor | None
    topk_indices: torch.Tensor | None
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None

    def to(self, device: torch.device, dtype: torch.dtype) -> AttentionCase:
        """A copy on `device`: activations and caches in `dtype`, sinks, weights and indices unchanged."""
        def move(tensor: torch.Tensor | None, keep_dtype: bool = False) -> torch.Tensor | None:
            if tensor is None:
                return None
            is_index = not tensor.is_floating_point()
            return tensor.to(device) if is_index or keep_dtype else tensor.to(device=device, dtype=dtype)

        metadata = dataclasses.replace(
            self.metadata,
            **{name: getattr(self.metadata, name).to(device)
               for name in ("query_start_loc", "start_positions", "positions", "slots", "block_tables")},
            **({} if self.metadata.window_starts is None else {"window_starts": self.metadata.window_starts.to(device)}),
        )
        return AttentionCase(
            q=move(self.q), kv=move(self.kv), window=move(self.window), compressed=move(self.compressed),
            sinks=move(self.sinks, keep_dtype=True), metadata=metadata, num_entries=move(self.num_entries),
            topk_indices=move(self.topk_indices), index_q=move(self.index_q),
            index_weights=move(self.index_weights, keep_dtype=True), index_keys=move(self.index_keys),
        )


def round_to(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`tensor` rounded through `dtype` and back to fp32, so the reference sees the candidate's values."""
    if tensor is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype).float()


def _block_tables(total_lens: list[int], generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Distinct shuffled block ids per request (two spare blocks nobody owns), -1 padded."""
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in total_lens]
    num_blocks = sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(total_lens), max(blocks_per_seq + [1])), -1, dtype=torch.int64)
    offset = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = ids[offset:offset + n]
        offset += n
    return table, num_blocks


def _paged_rows(block_table: torch.Tensor, num_entries: int, entries_per_block: int) -> torch.Tensor:
    entries = torch.arange(num_entries)
    return block_table[entries // entries_per_block] * entries_per_block + entries % entries_per_block


def _filled(shape: tuple[int, ...], poison: bool) -> torch.Tensor:
    return torch.full(shape, float("nan")) if poison else torch.zeros(shape)


def random_attention_case(spec: AttentionSpec, query_lens: list[int], start_positions: list[int],
                          seed: int = 0, poison: bool = True) -> AttentionCase:
    """A step of `len(query_lens)` requests; request i brings `query_lens[i]` tokens from `start_positions[i]`.

    Caches follow the layout documented in `deepinfer_core.backends.attention`: the window ring holds the
    keys of the `sliding_window` positions before each request's start, the compressed cache (and, for
    CSA, the indexer keys) every entry the request has after this step, at its paged rows.
    """
    if len(query_lens) != len(start_positions) or not query_lens or min(query_lens) < 1:
        raise ValueError("query_lens and start_positions need one entry per request; every query_len >= 1")
    gen = torch.Generator().manual_seed(seed)
    num_seqs, num_tokens = len(query_lens), sum(query_lens)
    width, rate = spec.sliding_window, spec.compress_rate
    total_lens = [s + n for s, n in zip(start_positions, query_lens)]
    slots = torch.randperm(num_seqs + 1, generator=gen)[:num_seqs]
    block_tables, num_blocks = _block_tables(total_lens, gen)

    window = _filled((num_seqs + 1, width, spec.head_dim), poison)
    for i, start in enumerate(start_positions):
        for position in range(max(0, start - width), start):
            window[slots[i], position % width] = torch.randn(spec.head_dim, generator=gen)

    compressed = index_keys = num_entries = None
    if rate:
        entries_per_block = spec.entries_per_block
        num_entries = torch.tensor([n // rate for n in total_lens], dtype=torch.int64)
        compressed = _filled((num_blocks * entries_per_block, spec.head_dim), poison)
        if spec.is_sparse:
            index_keys = _filled((num_blocks * entries_per_block, spec.index_head_dim), poison)
        for i in range(num_seqs):
            rows = _paged_rows(block_tables[i], int(num_entries[i]), entries_per_block)
            compressed[rows] = torch.randn(len(rows), spec.head_dim, generator=gen)
            if index_keys is not None:
                index_keys[rows] = torch.randn(len(rows), spec.index_head_dim, generator=gen)

    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, query_lens)])
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64),
        start_positions=torch.tensor(start_positions, dtype=torch.int64),
        positions=positions, slots=slots, block_tables=block_tables,
        query_lens=list(query_lens), start_positions_host=list(start_positions),
        max_seq_len=max(a + n for a, n in zip(start_positions, query_lens)),
    )
    case = AttentionCase(
        q=torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=gen),
        kv=torch.randn(num_tokens, spec.head_dim, generator=gen),
        window=window, compressed=compressed, sinks=torch.randn(spec.num_heads, generator=gen),
        metadata=metadata, num_entries=num_entries, topk_indices=None,
    )
    if spec.is_sparse:
        case.topk_indices = _random_topk(positions, rate, spec.index_topk, gen)
        case.index_q = torch.randn(num_tokens, spec.index_n_heads, spec.index_head_dim, generator=gen)
        case.index_weights = torch.randn(num_tokens, spec.index_n_heads, generator=gen) * spec.index_n_heads**-0.5
        case.index_keys = index_keys
    return case


def _random_topk(positions: torch.Tensor, rate: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Per token, up to `topk` distinct visible entry numbers in random order, then -1 padding."""
    indices = torch.full((len(positions), topk), -1, dtype=torch.int64)
    for t, position in enumerate(positions.tolist()):
        num_visible = (position + 1) // rate
        chosen = torch.randperm(num_visible, generator=gen)[:topk]
        indices[t, :len(chosen)] = chosen
    return indices


def index_scores(case: AttentionCase, spec: AttentionSpec) -> torch.Tensor:
    """The indexer's score of every entry number for every token, -inf where not visible (fp32, CPU).

    `score(t, e) = sum_h weights[t, h] * relu(q[t, h] . key[e]) / sqrt(index_head_dim)`, as documented in
    `AttentionBackend.indexer_topk`.
    """
    metadata = case.metadata
    max_entries = int(case.num_entries.max())
    scores = torch.full((len(metadata.positions), max(max_entries, 1)), float("-inf"))
    starts = metadata.query_start_loc.tolist()
    for i in range(metadata.num_seqs):
        n = int(case.num_entries[i])
        keys = case.index_keys[_paged_rows(metadata.block_tables[i], n, spec.entries_per_block)].float()
        for t in range(starts[i], starts[i + 1]):
            num_visible = (int(metadata.positions[t]) + 1) // spec.compress_rate
            dots = torch.relu(case.index_q[t].float() @ keys[:num_visible].T) / math.sqrt(spec.index_head_dim)
            scores[t, :num_visible] = case.index_weights[t].float() @ dots
    return scores


def random_moe_case(spec: MoESpec, num_tokens: int, seed: int = 0, vocab_size: int = 64,
                    bias_decides: bool = False) -> tuple[torch.Tensor, torch.Tensor, MoEWeights]:
    """`(x, input_ids, weights)` whose routing is unambiguous (clear gap after the top-k experts).

    Target router logits put each token's chosen experts well above the rest; when `num_experts <=
    hidden_size` the router has orthonormal rows and `x` is built so that `x @ router.T` equals them.
    With `bias_decides` (top-k layers), `score_bias` lifts `top_k` random experts above every score, so
    selection follows the bias while the routing weights still come from the unbiased scores.
    Expert weights are scaled so some gate pre-activations pass `swiglu_limit` and outputs are O(1).
    """
    gen = torch.Generator().manual_seed(seed)
    experts, hidden = spec.num_experts, spec.hidden_size
    logits = torch.rand(num_tokens, experts, generator=gen) * 3.0 - 2.5
    for t in range(num_tokens):
        chosen = torch.randperm(experts, generator=gen)[:spec.top_k]
        logits[t, chosen] = 1.5 + torch.rand(spec.top_k, generator=gen)
    if experts <= hidden:
        basis, _ = torch.linalg.qr(torch.randn(hidden, experts, generator=gen))
        router = basis.T.contiguous()
        x = logits @ router
    else:
        router = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
        x = torch.randn(num_tokens, hidden, generator=gen)
    x_norm = float(x.norm(dim=-1).mean())
    limit = spec.swiglu_limit or 4.0
    pre_activation_std = limit / 2
    gate_up = torch.randn(experts, 2 * spec.intermediate_size, hidden, generator=gen) * (pre_activation_std / x_norm)
    down = torch.randn(experts, hidden, spec.intermediate_size, generator=gen)
    down *= spec.intermediate_size**-0.5 / pre_activation_std**2
    weights = MoEWeights(router=router, gate_up=gate_up, down=down)
    if spec.is_hash:
        weights.tid2eid = torch.stack([torch.randperm(experts, generator=gen)[:spec.top_k]
                                       for _ in range(vocab_size)])
    else:
        weights.score_bias = (torch.rand(experts, generator=gen) - 0.5) * 0.02
        if bias_decides:
            weights.score_bias[torch.randperm(experts, generator=gen)[:spec.top_k]] += 4.0
    input_ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    return x, input_ids, weights


def random_sampling_case(spec: SamplingSpec, seed: int = 0) -> tuple[torch.Tensor, SamplingTensors]:
    """`(logits, params)` for a batch mixing greedy rows and every filter, with distinct logit values.

    Rows: greedy; greedy with banned ids; plain temperature; top-k; top-p; min-p; top-k 1; all filters
    with banned ids.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size
    rows = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0),
        (1.2, -1, 0.6, 0.0), (1.0, 0, 1.0, 0.2), (0.7, 1, 1.0, 0.0), (0.9, 20, 0.9, 0.05),
    ]
    batch = len(rows)
    logits = torch.randn(batch, vocab, generator=gen) * 3.0
    top_ids = logits.argmax(dim=-1).tolist()
    banned: list[list[int]] = [[] for _ in range(batch)]
    banned[1] = [top_ids[1], (top_ids[1] + 1) % vocab]
    banned[7] = [top_ids[7]]
    params = SamplingTensors(
        temperature=torch.tensor([r[0] for r in rows], dtype=torch.float32),
        top_k=torch.tensor([r[1] for r in rows], dtype=torch.int64),
        top_p=torch.tensor([r[2] for r in rows], dtype=torch.float32),
        min_p=torch.tensor([r[3] for r in rows], dtype=torch.float32),
        seeds=torch.randint(0, 2**62, (batch,), generator=gen),
        steps=torch.randint(0, 1000, (batch,), generator=gen),
        num_logprobs=min(5, spec.max_logprobs, vocab),
        banned_token_ids=banned,
    )
    return logits, params
