"""Engram lookups from host-memory tables, started at the beginning of a step and overlapped with its
first layers.

Hash ids depend only on token ids, so every Engram layer's ids are known before layer 0 runs. `start`
copies them device -> host into a pinned buffer (an event marks the copy), and a worker thread, once
the event has passed, gathers each table's raw FP8 / UE8M0 rows into pinned staging buffers and copies
them host -> device on a side stream, recording an event per table. The launching thread keeps
launching layers; an Engram layer calls `PendingEngram.rows`, which waits for its table's gather (on the
host) and its copy's event (on the device stream), then dequantises on the device. On the CPU there are
no streams: the copies are synchronous and the same worker thread gathers, giving the rows
`EngramTable.lookup` gives, bit for bit. An error in the worker is raised by `rows` as `EngramGatherError`
naming the layer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer_core.models.engram import EngramTable


class EngramGatherError(RuntimeError):
    """A host-memory Engram gather failed on the worker thread; raised in the step that needed it."""


class EngramPrefetcher:
    """One worker thread and (on CUDA) one side stream serving host-placed `tables` (layer -> table)."""

    def __init__(self, tables: dict[int, EngramTable], device: torch.device) -> None:
        self.tables, self.device = tables, device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-engram")

    def start(self, hashes: torch.Tensor, columns: dict[int, int]) -> PendingEngram:
        """Begin every table's lookup of `hashes` `[T, engram layers, cols]` (`columns`: layer -> its
        index in dim 1) on the device; returns at once."""
        if self._pool is None:
            raise EngramGatherError("the Engram prefetcher is closed (the engine was shut down)")
        host_ids = torch.empty(hashes.shape, dtype=hashes.dtype, pin_memory=self.is_cuda)
        host_ids.copy_(hashes, non_blocking=self.is_cuda)
        ids_ready = None
        if self.is_cuda:
            ids_ready = torch.cuda.Event()
            ids_ready.record()
        futures = {}
        for layer, table in self.tables.items():
            out = (torch.empty(*hashes.shape[:1], hashes.shape[2], table.weight.shape[1], dtype=torch.uint8,
                               device=self.device),
                   torch.empty(*hashes.shape[:1], hashes.shape[2], table.scale.shape[1], dtype=torch.uint8,
                               device=self.device))
            futures[layer] = self._pool.submit(self._gather, table, host_ids, columns[layer], ids_ready, out)
        return PendingEngram(self, futures)

    def _gather(self, table: EngramTable, host_ids: torch.Tensor, column: int, ids_ready, out):
        """On the worker thread: the raw rows into pinned staging, then to `out` (device) on the side stream."""
        with torch.inference_mode():
            if ids_ready is not None:
                ids_ready.synchronize()
            ids = host_ids[:, column]
            staged = [torch.empty(dst.shape, dtype=torch.uint8, pin_memory=self.is_cuda) for dst in out]
            torch.index_select(table.weight, 0, ids.flatten(), out=staged[0].view(-1, staged[0].shape[-1]))
            torch.index_select(table.scale, 0, ids.flatten(), out=staged[1].view(-1, staged[1].shape[-1]))
            if not self.is_cuda:
                for dst, src in zip(out, staged):
                    dst.copy_(src)
                return out, None
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                for dst, src in zip(out, staged):
                    dst.copy_(src, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            return out, copied

    def close(self) -> None:
        """Stop the worker thread (idempotent); queued gathers finish first."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PendingEngram:
    """One step's in-flight lookups: `rows(layer)` when the layer needs them, `drain()` if the step ends early."""

    def __init__(self, prefetcher: EngramPrefetcher, futures: dict[int, Future]) -> None:
        self._prefetcher, self._futures = prefetcher, futures

    def rows(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s dequantised bf16 rows `[T, cols, dim]` on the device (the stream waits for the copy)."""
        future = self._futures.pop(layer)
        try:
            done = future.result()
        except Exception as err:
            self.drain()
            raise EngramGatherError(f"the host-memory Engram gather of layer {layer} failed: "
                                    f"{type(err).__name__}: {err}") from err
        table = self._prefetcher.tables[layer]
        (values, scales), copied = done
        if copied is not None:
            torch.cuda.current_stream(table.device).wait_event(copied)
        return table.dequantise(values, scales)

    def drain(self) -> None:
        """Wait for every lookup not consumed (a step that failed part-way), ignoring their errors; the
        device stream waits for their copies, so the buffers they write are not reused under them."""
        for layer, future in self._futures.items():
            if future.exception() is None:
                _, copied = future.result()
                if copied is not None:
                    torch.cuda.current_stream(self._prefetcher.tables[layer].device).wait_event(copied)
        self._futures.clear()
