"""CUDA graphs of the MTP layer's passes (`MTPDrafter`), captured per batch size and per rows a request
feeds the layer: a pass where every request feeds `w` rows (its last token plus `w - 1` accepted drafts,
`w = 1 .. k + 1`; `w = 1` also serves every deeper draft, one row a request) replays a graph instead of
launching the layer's kernels one by one, which costs more than the layer's device time at decode.

Inputs live in static buffers; a batch is padded to the next captured size with rows of the MTP cache's
scratch slot (the layer has a sliding window only: no blocks, no compressed entries). After a step whose
requests all verified d drafts, each request feeds d + 1 rows whatever it accepted (`MTPDrafter`), and
the pass returns the logits of each request's last final row (`heads`). A pass with requests of
unequal rows (a prefill chunk in the step) runs eagerly, as verification does (`DecodeGraphs`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch

from deepinfer_core.backends.graphs import capture_graph
from deepinfer_core.backends.sampling_tensors import host_tensor


class MTPGraphs:
    """Per (batch size, rows a request): the MTP layer's pass over static inputs, captured through a
    device's `GraphApi` (None: the same padded passes run eagerly, which the CPU tests use)."""

    def __init__(self, module, cache, target, sizes: Sequence[int], max_seq_len: int, widths: Sequence[int],
                 api=None) -> None:
        """`module`: the `MultiTokenPredictor`; `cache`: its `LayerCache` (one slot per request slot plus
        the scratch slot `target.num_slots`); `target`: the drafter's `DraftTarget` (step contexts, the
        streams' shape); `sizes`: the batch sizes to capture (the decode graphs')."""
        self.module, self.cache, self.make_context, self.api = module, cache, target.make_context, api
        self.max_seq_len = max_seq_len
        self.sizes = sorted(set(sizes))
        self.widths = sorted(set(widths))
        self.scratch_slot = target.num_slots
        dev, n, width = target.device, max(self.sizes), max(self.widths)
        # per row its token id and position, per request its slot, window start, first position and the
        # row whose logits the pass returns (its offset in the request's rows)
        self.inputs = torch.zeros(6, n * width, dtype=torch.long, device=dev)
        self.input_ids, self.positions, self.slots, self.window_starts, self.starts, self.heads = self.inputs.unbind(0)
        config = target.config
        self.prev = torch.zeros(n * width, config.hc_mult, config.hidden_size, dtype=target.dtype, device=dev)
        self.rows = torch.arange(n * width + 1, device=dev)
        self.block_tables = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor, torch.Tensor]] = {}
        """Per (size, width): the graph, its logits (one row a request) and its output streams."""

    def capture(self) -> None:
        api, pool = self.api, None
        for size, width in sorted(((s, w) for s in self.sizes for w in self.widths), key=lambda k: -k[0] * k[1]):
            self._pad(0, size, width)
            graph, (logits, streams) = capture_graph(api, functools.partial(self._forward, size, width), pool)
            pool = graph.pool()
            self.graphs[size, width] = (graph, logits, streams)
        api.synchronize()

    def can_run(self, num_requests: int, width: int) -> bool:
        return num_requests <= self.sizes[-1] and width in self.widths

    def run(self, slots: list[int], starts: list[int], window_starts: list[int], width: int,
            ids: torch.Tensor, prev: torch.Tensor, heads: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of `len(slots)` requests feeding `width` rows each at positions `starts[i] ..
        starts[i] + width - 1` (request-major rows: `ids` `[n * width]`, `prev` `[n * width, hc, D]` the
        streams at the position before each row). Returns fp32 logits `[n, vocab]` of each request's row
        `heads[i]` (0 .. width - 1; None: its last) and the output streams `[n * width, hc, D]`."""
        n = len(slots)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        tokens = size * width
        host = [0] * tokens  # ids: copied from the device below
        host += [s + j for s in starts for j in range(width)]
        host += [j for _ in range(size - n) for j in range(width)]
        heads = [width - 1] * n if heads is None else heads
        for values, fill in ((slots, self.scratch_slot), (window_starts, 0), (starts, 0), (heads, width - 1)):
            host += values
            host += [fill] * (tokens - n)
        self.inputs[:, :tokens] = host_tensor(host).view(6, tokens).to(self.inputs.device, non_blocking=True)
        self.input_ids[: n * width].copy_(ids)
        self.prev[: n * width].copy_(prev)
        if (size, width) not in self.graphs:  # not captured (the CPU): the same padded pass, eagerly
            logits, streams = self._forward(size, width)
        else:
            graph, logits, streams = self.graphs[size, width]
            graph.replay()
        return logits[:n], streams[: n * width]

    def _pad(self, start: int, end: int, width: int) -> None:
        self.input_ids[start * width : end * width] = 0
        self.positions[start * width : end * width] = torch.arange(width, device=self.positions.device).repeat(end - start)
        self.slots[start:end] = self.scratch_slot
        self.window_starts[start:end] = 0
        self.starts[start:end] = 0
        self.heads[start:end] = width - 1

    def _forward(self, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, starts = size * width, self.starts[:size]
        ctx = self.make_context(
            self.input_ids[:tokens], self.positions[:tokens], starts + width, torch.zeros_like(starts),
            query_start_loc=self.rows[: size + 1] * width, start_positions=starts, slots=self.slots[:size],
            block_tables=self.block_tables[:size], query_lens=[width] * size,
            start_positions_host=[0] * size,  # stale under replay: decode paths read device tensors only
            window_starts=self.window_starts[:size], needs_static_shapes=True, max_seq_len=self.max_seq_len,
        )
        heads = self.rows[:size] * width + self.heads[:size]
        return self.module(0, ctx, self.cache, self.prev[:tokens], self.input_ids[:tokens], heads)
