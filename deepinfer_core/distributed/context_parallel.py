"""Context parallelism for prefill: one step's tokens split over the `C` ranks of the cp group.

Each request's tokens of a step are cut into `2C` near-equal pieces and rank `r` computes pieces `r` and
`2C - 1 - r` (`balanced_pieces`): under causal attention a late piece costs more than an early one, so
pairing the `r`-th earliest with the `r`-th latest gives every rank the same work. Every rank then runs
the whole model over its pieces only, each piece a request of its own to the backends (same block
table, its own start), and per layer:

- window keys: every piece's last `window` keys are all-gathered, so each rank fills a scratch window
  ring per piece with the keys just before it (the neighbouring pieces, or the request's ring for
  positions before the step) and, afterwards, every rank writes each request's real ring identically;
- compressors: the same exchange of projected `(kv, gate)` tail rows gives each piece its scratch tail
  ring, so a rank closes exactly the windows that end in its pieces; those compressed entries (and the
  indexer's keys) are all-gathered, so every rank's pool holds every entry before any attention reads it.

The caches every rank holds after the step equal a single-rank prefill's up to fp32 rounding: the
entries come from the same rows through the same ops, but the hidden states reach them through
attention and MoE batched differently (the tests bound the difference and require identical tokens).
Decode-only steps are not split: every rank runs them whole on its identical cache. The logits rows
are all-gathered, so every rank samples the same tokens. The wrappers that do the exchanges
(`context_parallel_ops`) sit around the plugins' backends, which see ordinary requests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch
import torch.distributed as dist

from deepinfer_core.backends.attention import BLOCK_SIZE, AttentionMetadata
from deepinfer_core.plan import StepPlan


def check_context_parallel(model_config, engine_config) -> None:
    """Raise `NotImplementedError` for context parallelism where it is not built: a model family without it
    (`ModelCapabilities.context_parallel`), with speculative decoding (drafts' logits rows and the MTP
    drafter's streams are not split) or with V4.1's decoder-side trimming."""
    size = engine_config.context_parallel_size
    model_config.capabilities.check_parallel(model_config.model_type, "context", size)
    if size > 1 and engine_config.speculative_config is not None:
        raise NotImplementedError(f"context parallelism with speculative decoding: context_parallel_size={size} "
                                  "with speculative_config (drafts are not split over the ranks)")
    if size > 1 and engine_config.decoder_trimming:
        raise NotImplementedError(f"context parallelism with decoder-side trimming: context_parallel_size={size} "
                                  "with decoder_trimming (trimming keeps each request's last prompt rows, and a "
                                  "rank holds only pieces of them)")


def balanced_pieces(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """`2 * size` consecutive `(start, stop)` offsets covering `num_tokens`, sizes differing by at most one."""
    n = 2 * size
    return [(k * num_tokens // n, (k + 1) * num_tokens // n) for k in range(n)]


def piece_owner(piece: int, size: int) -> int:
    """The rank computing piece `piece` of `2 * size`: rank r takes pieces r and 2 * size - 1 - r."""
    return piece if piece < size else 2 * size - 1 - piece


@dataclass(frozen=True)
class Piece:
    """A run of one request's step tokens that one rank computes."""

    request: int
    """Index into `plan.requests`."""
    offset: int
    """First token, counted from the request's first token in this step."""
    length: int
    position: int
    """Absolute position of the first token."""


class StepLayout:
    """Which rank computes which tokens of a step, and what every rank must exchange for it."""

    def __init__(self, plan: StepPlan, states: list, size: int) -> None:
        self.plan, self.states, self.size = plan, states, size
        self.pieces: list[list[Piece]] = [[] for _ in range(size)]
        for i, request in enumerate(plan.requests):
            for k, (a, b) in enumerate(balanced_pieces(request.num_tokens, size)):
                if b > a:
                    self.pieces[piece_owner(k, size)].append(Piece(i, a, b - a, request.start + a))
        self.max_pieces = max(len(p) for p in self.pieces)

    @property
    def is_split(self) -> bool:
        """Worth splitting: a prefill step (not all decodes) that gives every rank some tokens."""
        return not self.plan.is_all_decodes and all(self.pieces)

    def local_plan(self, rank: int) -> tuple[StepPlan, list]:
        """Rank `rank`'s pieces as a plan of their own (piece `j` in state slot `j` of the scratch rings)
        and the matching runner states."""
        requests, states = [], []
        for j, piece in enumerate(self.pieces[rank]):
            request = self.plan.requests[piece.request]
            ends = piece.offset + piece.length == request.num_tokens
            requests.append(replace(request, start=piece.position, new_block_ids=(), is_sampled=request.is_sampled and ends,
                                    token_ids=request.token_ids[piece.offset : piece.offset + piece.length]))
            states.append(replace(self.states[piece.request], slot=j))
        return replace(self.plan, requests=tuple(requests), new_requests=(), freed_request_ids=()), states

    # -- logits rows ------------------------------------------------------------------------------

    def logits_rows(self, rank: int) -> list[tuple[str, int, int]]:
        """Rank `rank`'s logits rows in the order its runner produces them (`InputBatch.prepare_inputs`):
        `("sample", request, 0)` per sampled piece, then `("prompt", request, position)` per row
        predicting a prompt token."""
        sampled, prompt = [], []
        for piece in self.pieces[rank]:
            request, state = self.plan.requests[piece.request], self.states[piece.request]
            end = piece.position + piece.length
            if request.is_sampled and piece.offset + piece.length == request.num_tokens:
                sampled.append(("sample", piece.request, 0))
            if state.sampling_params.prompt_logprobs is not None:
                last = min(end, state.num_prompt_tokens - 1)
                prompt += [("prompt", piece.request, p) for p in range(piece.position, last)]
        return sampled + prompt

    @cached_property
    def _rows_by_rank(self) -> list[list[tuple[str, int, int]]]:
        return [self.logits_rows(rank) for rank in range(self.size)]

    def gather_order(self) -> tuple[list[int], list[int], dict[int, tuple[int, int, int]]]:
        """Where each final logits row sits in the all-gathered `[size, max_rows]` rows, the sampled
        requests, and each prompt-logprobs request's span `(first target position, row, count)`."""
        width = max(len(rows) for rows in self._rows_by_rank)
        where = {row: rank * width + j for rank, rows in enumerate(self._rows_by_rank) for j, row in enumerate(rows)}
        sampled = sorted(i for kind, i, _ in where if kind == "sample")
        order = [where[("sample", i, 0)] for i in sampled]
        spans = {}
        for i in sorted({i for kind, i, _ in where if kind == "prompt"}):
            positions = sorted(p for kind, j, p in where if kind == "prompt" and j == i)
            spans[i] = (positions[0] + 1, len(order), len(positions))
            order += [where[("prompt", i, p)] for p in positions]
        return order, sampled, spans

    # -- exchanges --------------------------------------------------------------------------------

    def ring_plan(self, rank: int, ring: int, device: torch.device) -> RingPlan:
        """Index tensors of the per-layer exchange of every piece's last `ring` rows (see `RingPlan`)."""
        sources = {}  # (request, position) -> row of the gathered [size, max_pieces, ring] tails
        tail_src, tail_dst = [], []
        flat = 0
        for r, pieces in enumerate(self.pieces):
            for j, piece in enumerate(pieces):
                kept = min(piece.length, ring)
                for t in range(kept):
                    sources[(piece.request, piece.position + piece.length - kept + t)] = (r * self.max_pieces + j) * ring + t
                if r == rank:
                    tail_src += range(flat + piece.length - kept, flat + piece.length)
                    tail_dst += [j * ring + t for t in range(kept)]
                    flat += piece.length
        from_gathered, from_ring, to_ring = ([], []), ([], []), ([], [])
        for j, piece in enumerate(self.pieces[rank]):
            request_start, slot = self.plan.requests[piece.request].start, self.states[piece.request].slot
            for q in range(max(piece.position - ring, 0), piece.position):
                target = from_gathered if q >= request_start else from_ring
                target[0].append(j * ring + q % ring)
                target[1].append(sources[(piece.request, q)] if q >= request_start else slot * ring + q % ring)
        for i, request in enumerate(self.plan.requests):
            slot = self.states[i].slot
            for q in range(max(request.start, request.end - ring), request.end):
                to_ring[0].append(slot * ring + q % ring)
                to_ring[1].append(sources[(i, q)])
        tensors = [torch.tensor(v, dtype=torch.long, device=device)
                   for v in (tail_src, tail_dst, *from_gathered, *from_ring, *to_ring)]
        return RingPlan(ring, len(self.pieces[rank]), self.max_pieces, *tensors)

    def entry_rows(self, rate: int) -> list[list[int]]:
        """Per rank, the pool rows of the compressed entries (rate `rate`) its pieces close and write."""
        epb = BLOCK_SIZE // rate
        rows = []
        for pieces in self.pieces:
            mine = []
            for piece in pieces:
                request, table = self.plan.requests[piece.request], self.states[piece.request].block_table
                for p in range(piece.position, piece.position + piece.length):
                    e = (p + 1) // rate - 1
                    if (p + 1) % rate == 0 and (e + 1) * rate > request.no_write_before:
                        mine.append(table[e // epb] * epb + e % epb)
            rows.append(mine)
        return rows


@dataclass(frozen=True)
class RingPlan:
    """One ring length's exchange for one rank: its pieces' tails out, scratch rings and real rings in.

    Rows are flat indices: local tokens; `[pieces, ring]` scratch rings and tails; `[slots, ring]` real
    rings; `[size, max_pieces, ring]` gathered tails."""

    ring: int
    num_pieces: int
    max_pieces: int
    tail_src: torch.Tensor
    tail_dst: torch.Tensor
    scratch_from_gathered: torch.Tensor
    gathered_src: torch.Tensor
    scratch_from_ring: torch.Tensor
    ring_src: torch.Tensor
    ring_dst: torch.Tensor
    ring_from_gathered: torch.Tensor


class ContextParallelMetadata(AttentionMetadata):
    """`AttentionMetadata` of a rank's pieces, plus the step's exchange (`view`), which the
    context-parallel wrappers read; the backends inside see plain metadata of plain requests."""

    view: StepView

    @classmethod
    def wrap(cls, metadata: AttentionMetadata, view: StepView) -> ContextParallelMetadata:
        out = cls(**{f.name: getattr(metadata, f.name) for f in fields(metadata)})
        out.view = view
        return out


class StepView:
    """One rank's side of a split step: the layout, its group, and the index tensors, built on first use."""

    def __init__(self, layout: StepLayout, rank: int, group, device: torch.device) -> None:
        self.layout, self.rank, self.group, self.device = layout, rank, group, device
        self._rings: dict[int, RingPlan] = {}
        self._entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._entry_lists: dict[int, list[list[int]]] = {}

    def ring_plan(self, ring: int) -> RingPlan:
        if ring not in self._rings:
            self._rings[ring] = self.layout.ring_plan(self.rank, ring, self.device)
        return self._rings[ring]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[size, *tensor.shape]`: every rank's `tensor` (same shape on every rank)."""
        parts = [torch.empty_like(tensor) for _ in range(self.layout.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def entry_rows(self, rate: int, scratch_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[size, most]` pool rows each rank writes (padded with `scratch_row`), and this rank's row."""
        key = (rate, scratch_row)  # pools of one rate may differ in size (their scratch rows)
        if key not in self._entries:
            rows = self._entry_lists.get(rate) or self._entry_lists.setdefault(rate, self.layout.entry_rows(rate))
            most = max(max(len(r) for r in rows), 1)
            padded = [r + [scratch_row] * (most - len(r)) for r in rows]
            table = torch.tensor(padded, dtype=torch.long, device=self.device)
            self._entries[key] = (table, table[self.rank])
        return self._entries[key]


class ContextParallel:
    """A rank's context parallelism: which steps it splits, and the split forward pass."""

    def __init__(self, group_info, device: torch.device, model, kv_cache, prepare_inputs) -> None:
        """`group_info`: the rank's `GroupInfo` of the cp group (`ParallelGroups.cp`); `model` and
        `kv_cache`: what a split step runs and writes; `prepare_inputs`: the runner's
        `InputBatch.prepare_inputs`, which builds each rank's pieces' inputs."""
        self.group_info, self.device = group_info, device
        self.model, self.kv_cache, self.prepare_inputs = model, kv_cache, prepare_inputs

    def layout(self, plan: StepPlan, states: list) -> StepLayout | None:
        """The split of `plan` (the runner's `states` of its requests), or None: run it whole."""
        layout = StepLayout(plan, states, self.group_info.size)
        return layout if layout.is_split else None

    def forward(self, layout: StepLayout, carried) -> tuple[torch.Tensor, list[int], dict]:
        """Run this rank's pieces through the model; return every rank's logits rows in the order
        `InputBatch.prepare_inputs` gives for the whole plan, the sampled requests and the
        prompt-logprob spans (`carried`: the runner's `CarriedTokens`, for pending inputs)."""
        rank = self.group_info.rank
        local_plan, local_states = layout.local_plan(rank)
        ctx, rows, _, _, pending = self.prepare_inputs(local_plan, local_states)
        if len(rows) != len(layout.logits_rows(rank)):
            raise RuntimeError(f"context parallelism expected {len(layout.logits_rows(rank))} logits rows on "
                               f"rank {rank}, the runner built {len(rows)}")
        if pending:
            if carried is None:
                raise RuntimeError("the plan has pending tokens but no step sampled before it")
            carried.fill(ctx.input_ids, pending)
        view = StepView(layout, rank, self.group_info.group, self.device)
        ctx.metadata = ContextParallelMetadata.wrap(ctx.metadata, view)
        logits = self.model(ctx, self.kv_cache.layers, rows)
        width = max(len(layout.logits_rows(r)) for r in range(layout.size))
        padded = logits.new_zeros(max(width, 1), logits.shape[-1])
        padded[: len(rows)] = logits
        order, sampled, spans = layout.gather_order()
        gathered = view.all_gather(padded).view(-1, logits.shape[-1])
        return gathered[torch.tensor(order, dtype=torch.long, device=gathered.device)], sampled, spans
