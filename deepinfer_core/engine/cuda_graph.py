"""CUDA graphs of decode steps (one token per request), captured once per batch size of a ladder.

Inputs live in static device buffers; a batch is padded up to the next captured size with rows that
use a scratch state slot and a scratch cache block, and whose compressed entries go to the pools'
scratch row. Every backend must declare `supports_cuda_graphs = True` (no host reads in decode).
"""

from __future__ import annotations

import bisect

import torch

from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.models.deepseek_v4 import ForwardContext

NO_WRITE = 2**62  # padding rows never write a compressed entry


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks: int, max_seq_len: int) -> None:
        self.runner, self.max_seq_len = runner, max_seq_len
        self.sizes = batch_ladder(max_batch)
        dev, n = runner.device, max_batch

        def buffer(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.long, device=dev)

        self.input_ids, self.positions, self.slots = buffer(n), buffer(n), buffer(n)
        self.block_tables, self.no_write_before = buffer(n, max_blocks), buffer(n)
        self.window_starts, self.rows = buffer(n), torch.arange(n + 1, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            self._pad(0, size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, ids, positions, slots, tables, no_write_before, window_starts) -> torch.Tensor:
        """Replay the smallest graph that fits; return fp32 logits for the `len(ids)` real rows."""
        n = len(ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        host = torch.tensor([ids, positions, slots, no_write_before, window_starts], dtype=torch.long)
        host = host.to(self.runner.device, non_blocking=True)
        for buf, row in zip((self.input_ids, self.positions, self.slots, self.no_write_before, self.window_starts), host):
            buf[:n] = row
        self.block_tables[:n] = tables.to(self.runner.device, non_blocking=True)  # [n, max_blocks]
        self._pad(n, size)
        if size not in self.graphs:  # not captured (e.g. on the CPU): same padded step, run eagerly
            return self._forward(size)[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _pad(self, start: int, end: int) -> None:
        if start >= end:
            return
        cache = self.runner.kv_cache
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = cache.scratch_slot
        self.block_tables[start:end] = cache.scratch_block
        self.no_write_before[start:end] = NO_WRITE
        self.window_starts[start:end] = 0

    def _forward(self, size: int) -> torch.Tensor:
        positions = self.positions[:size]
        meta = AttentionMetadata(
            query_start_loc=self.rows[: size + 1],
            start_positions=positions,
            positions=positions,
            slots=self.slots[:size],
            block_tables=self.block_tables[:size],
            query_lens=[1] * size,
            start_positions_host=[0] * size,  # stale under replay: decode paths read device tensors only
            window_starts=self.window_starts[:size],
            needs_static_shapes=True,
            max_seq_len=self.max_seq_len,
        )
        model = self.runner.model
        rates = {p.compress_rate for p in self.runner.plans if p.has_compressor}
        ctx = ForwardContext(
            metadata=meta,
            input_ids=self.input_ids[:size],
            rope=model.rope_tables(positions),
            num_entries={rate: (positions + 1) // rate for rate in rates},
            no_write_before=self.no_write_before[:size],
        )
        return model(ctx, self.runner.kv_cache.layers, self.rows[:size])
