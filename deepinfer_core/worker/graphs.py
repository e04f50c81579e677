"""CUDA graphs of decode steps, captured once per batch size of a ladder and per number of tokens a
request computes (one; or, under speculative decoding, its last token plus k drafts to verify).

Inputs live in static device buffers; a batch is padded up to the next captured size with rows that
use a scratch state slot and a scratch cache block, and whose compressed entries go to the pools'
scratch row. Every backend must declare `supports_cuda_graphs = True` (no host reads in decode).

A step's host work is O(batch) with a small constant: the six per-row inputs go to the device in one
copy, and block tables are kept on the device per state slot (`SlotBlockTables`), so a step sends only
the block ids appended since the last one and gathers its rows by slot on the device.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from deepinfer_core.backends.graphs import capture_graph
from deepinfer_core.backends.sampling_tensors import host_tensor

NO_WRITE = 2**62  # padding rows never write a compressed entry


def batch_ladder(max_batch: int) -> list[int]:
    """The default capture sizes up to `max_batch`: 1, 2, 4, 8, then steps of 8 to 32, of 16 to 64, of 32
    to 128 and of 64 beyond, and `max_batch` itself (13 graphs for 256, where steps of 16 took 20: each
    capture costs start-up time, a padded row costs little in a memory-bound decode step)."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, *range(192, max_batch, 64)]
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


def capture_sizes(max_batch: int, requested: Sequence[int] | None) -> list[int]:
    """The batch sizes to capture, vLLM's `cuda_graph_sizes` rule: None, the default ladder up to
    `max_batch`; one value N, that ladder up to min(N, max_batch); several, exactly those up to `max_batch`
    (batches above the largest run eagerly)."""
    if not requested:
        return batch_ladder(max_batch)
    if len(requested) == 1:
        return batch_ladder(min(requested[0], max_batch))
    return sorted({size for size in requested if size <= max_batch}) or [min(min(requested), max_batch)]


class SlotBlockTables:
    """Every state slot's block table (`[num_slots + 1, max_blocks]` int64 on the device, 0 padded), kept
    equal to the host tables of the sequences that hold the slots.

    While a request holds a slot its runner-side `block_table` only grows by appends (a new admission
    brings a new list), so a sync writes only the ids appended since the slot's last sync; a slot with a
    new list is rewritten whole. The last row (the scratch slot of
    padding rows) is all `scratch_block`.
    """

    def __init__(self, num_slots: int, max_blocks: int, scratch_block: int, device: torch.device) -> None:
        self.tables = torch.zeros(num_slots + 1, max_blocks, dtype=torch.long, device=device)
        self.tables[num_slots] = scratch_block
        self.max_blocks = max_blocks
        self._synced: dict[int, tuple[list[int], int]] = {}  # slot -> (the list last seen, ids sent)

    def sync(self, states) -> None:
        """Send the block ids of `states` (the runner's `RequestState`s) that the device table lacks (one
        copy, none when nothing changed)."""
        index: list[int] = []
        values: list[int] = []
        synced, width = self._synced, self.max_blocks
        for state in states:
            table, slot = state.block_table, state.slot
            known = synced.get(slot)
            end = len(table)
            if known is not None and known[0] is table and known[1] <= end:
                start, stale = known[1], 0
                if start == end:
                    continue
            else:  # a new list in this slot: rewrite the row, zeroing what the old one left beyond it
                start, stale = 0, 0 if known is None else known[1]
            if end > width:
                raise ValueError(f"the request in slot {slot} holds {end} blocks; decode graphs were built for {width}")
            base = slot * width
            index += range(base + start, base + max(end, stale))
            values += table[start:end]
            values += [0] * (stale - end)
            synced[slot] = (table, end)
        if index:
            update = host_tensor(index + values).to(self.tables.device, non_blocking=True).view(2, -1)
            self.tables.view(-1).index_copy_(0, update[0], update[1])

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """`out[i] = tables[slots[i]]` on the device."""
        torch.index_select(self.tables, 0, slots, out=out)


class DecodeGraphs:
    """Captured decode steps, one graph per batch size of a ladder and per number of tokens a request
    computes (`widths`: 1 for plain decode; 1 + d for a verification step where every request carries d
    drafts), through a device's `GraphApi` (None: the same padded steps run eagerly, which the CPU tests
    use). Keyed `(batch size, tokens per request)`."""

    def __init__(self, model, kv_cache, inputs, max_batch: int, max_blocks: int, max_seq_len: int, api=None,
                 sizes: Sequence[int] | None = None, widths: Sequence[int] = (1,)) -> None:
        """`model`, `kv_cache`: what each step runs and writes; `inputs`: the runner's `InputBatch` (its
        `make_context` and device); `sizes`: the batch sizes to capture (`capture_sizes`' rule; None:
        the default ladder); `widths`: the tokens per request to capture for (speculative decoding adds
        `1 + k`)."""
        self.model, self.kv_cache, self.input_batch = model, kv_cache, inputs
        self.max_seq_len, self.api = max_seq_len, api
        self.sizes = capture_sizes(max_batch, sizes)
        self.widths = sorted(set(widths))
        dev, n, width = inputs.device, max_batch, max(self.widths)

        def buffer(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.long, device=dev)

        # the six inputs are rows of one buffer, so a step sends them in one copy: per token its id and
        # position, per request (the first entries of a row) its slot, no-write bound, window start, start
        self.inputs = buffer(6, n * width)
        (self.input_ids, self.positions, self.slots, self.no_write_before, self.window_starts,
         self.starts) = self.inputs.unbind(0)
        self.block_tables, self.rows = buffer(n, max_blocks), torch.arange(n * width + 1, device=dev)
        cache = kv_cache
        self.slot_tables = SlotBlockTables(cache.scratch_slot, max_blocks, cache.scratch_block, dev)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor, torch.Tensor | None]] = {}
        """Per (batch size, tokens per request): the graph, its logits, its final residual streams."""

    def capture(self, progress: bool = False) -> None:
        """Capture every (size, width), the most tokens first (the others share its memory pool);
        `progress` shows a bar."""
        api, pool = self.api, None
        keys = sorted(((s, w) for s in self.sizes for w in self.widths), key=lambda k: (-k[0] * k[1], -k[1]))
        for size, width in tqdm(keys, desc="Capturing decode CUDA graphs", unit="graph",
                                disable=not progress, dynamic_ncols=True):
            self._pad(0, size, width)
            graph, logits = capture_graph(api, functools.partial(self._forward, size, width), pool)
            pool = graph.pool()
            self.graphs[size, width] = (graph, logits, self.model.final_streams)
        api.synchronize()

    def can_run(self, num_seqs: int, width: int = 1) -> bool:
        """Whether a step of `num_seqs` requests of `width` tokens each fits a captured shape."""
        return num_seqs <= self.sizes[-1] and width in self.widths

    def run(self, requests, states, carried=None) -> torch.Tensor:
        """Compute every token of `requests` (a plan's `ScheduledRequest`s, each computing its last
        token and maybe drafts, all the same count, with the runner's `states`) by replaying the
        smallest graph that fits; return fp32 logits for all their tokens, request by request. Pending
        tokens come from `carried` (a `CarriedTokens`) on the device. After the call
        `model.final_streams` holds the step's residual streams when the model keeps them."""
        n, width = len(requests), requests[0].num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        tokens, pad = size * width, (size - n) * width
        scratch_slot = self.kv_cache.scratch_slot
        host = [max(t, 0) for r in requests for t in r.token_ids]  # a pending token (-1) is filled below
        host += [0] * pad
        host += [r.start + j for r in requests for j in range(width)]
        host += [j for _ in range(size - n) for j in range(width)]
        for values, fill in (([s.slot for s in states], scratch_slot), ([r.no_write_before for r in requests], NO_WRITE),
                             ([r.window_start for r in requests], 0), ([r.start for r in requests], 0)):
            host += values
            host += [fill] * (tokens - n)
        self.inputs[:, :tokens] = host_tensor(host).view(6, tokens).to(self.input_batch.device, non_blocking=True)
        pending = [(i * width + j, r.request_id) for i, r in enumerate(requests)
                   for j, t in enumerate(r.token_ids) if t < 0]
        if pending:
            if carried is None:
                raise RuntimeError("the plan has pending tokens but no step sampled before it")
            carried.fill(self.input_ids, pending)
        self.slot_tables.sync(states)
        self.slot_tables.gather(self.slots[:size], self.block_tables[:size])
        if (size, width) not in self.graphs:  # not captured (e.g. on the CPU): same padded step, run eagerly
            return self._forward(size, width)[: n * width]
        graph, logits, streams = self.graphs[size, width]
        graph.replay()
        if streams is not None:
            self.model.final_streams = streams
        return logits[: n * width]

    def _pad(self, start: int, end: int, width: int = 1) -> None:
        if start >= end:
            return
        cache = self.kv_cache
        self.input_ids[start * width : end * width] = 0
        self.positions[start * width : end * width] = torch.arange(width, device=self.positions.device).repeat(end - start)
        self.slots[start:end] = cache.scratch_slot
        self.block_tables[start:end] = cache.scratch_block
        self.no_write_before[start:end] = NO_WRITE
        self.window_starts[start:end] = 0
        self.starts[start:end] = 0

    def _forward(self, size: int, width: int) -> torch.Tensor:
        tokens = size * width
        positions = self.positions[:tokens]
        starts = positions if width == 1 else self.starts[:size]
        ctx = self.input_batch.make_context(
            self.input_ids[:tokens], positions, starts + width, self.no_write_before[:size],
            query_start_loc=self.rows[: size + 1] * width if width > 1 else self.rows[: size + 1],
            start_positions=starts, slots=self.slots[:size],
            block_tables=self.block_tables[:size], query_lens=[width] * size,
            start_positions_host=[0] * size,  # stale under replay: decode paths read device tensors only
            window_starts=self.window_starts[:size], needs_static_shapes=True, max_seq_len=self.max_seq_len,
        )
        return self.model(ctx, self.kv_cache.layers, self.rows[:tokens])
