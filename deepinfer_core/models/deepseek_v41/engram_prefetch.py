"""Engram lookups from host-memory tables, started at the beginning of a step and overlapped with its
first layers.

Where the layer ops read host memory from the device (`HostRowGather`), `DeviceReadPrefetcher` launches
every table's gather kernel at the step's start on a side stream that forks from the step's stream and
joins it at each Engram layer (`PendingReads`): no host step, so decode steps stay in CUDA graphs, and
the reads over the host link overlap layer 0 onwards. Otherwise `EngramPrefetcher` gathers on the host:

Hash ids depend only on token ids, so every Engram layer's ids are known before layer 0 runs. `start`
copies them device -> host into a pinned buffer (an event marks the copy) and queues one gather per
table on a worker thread. The worker waits for the event, gathers the table's raw FP8 / UE8M0 row bytes
(half a bf16 row's) into pinned staging buffers and copies them host -> device on a side stream,
recording an event. The launching thread keeps launching layers; an Engram layer calls
`PendingEngram.rows`, which waits for its table's gather (on the host) and its copy's event (on the
device stream), then dequantises on the device: the rows `EngramTable.lookup` gives, bit for bit. On
the CPU the worker gathers straight into the result. An error in the worker is raised by `rows` as
`EngramGatherError` naming the layer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer_core.models.deepseek_v41.engram import EngramTable

THREAD_NAME = "deepinfer-engram"
"""The worker thread's name prefix (`threading.enumerate()` shows whether one is running)."""


class EngramGatherError(RuntimeError):
    """A host-memory Engram gather failed on the worker thread, or the prefetcher was closed."""


class EngramPrefetcher:
    """One worker thread and (on CUDA) one side stream serving host-placed `tables` (layer -> table);
    `columns`: layer -> its index in the hash ids' dim 1 (`config.engram_layer_ids`)."""

    def __init__(self, tables: dict[int, EngramTable], columns: dict[int, int], device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise NotImplementedError(f"Engram prefetch off CPU and CUDA: {device.type} devices "
                                      "(set engram_prefetch=False)")
        self.tables, self.columns, self.device = tables, columns, device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)

    def start(self, hashes: torch.Tensor) -> PendingEngram:
        """Queue every table's lookup of `hashes` `[T, engram layers, cols]` (on the device); returns at once."""
        if self.pool is None:
            raise EngramGatherError("the Engram prefetcher is closed (the engine was shut down)")
        host_ids = torch.empty(hashes.shape, dtype=hashes.dtype, pin_memory=self.is_cuda)
        host_ids.copy_(hashes, non_blocking=self.is_cuda)
        ids_ready = torch.cuda.Event() if self.is_cuda else None
        if ids_ready is not None:  # the worker waits for it: also after every earlier use of `out`'s memory
            ids_ready.record(torch.cuda.current_stream(self.device))
        futures = {}
        for layer, table in self.tables.items():
            ids = host_ids[:, self.columns[layer]]
            out = tuple(torch.empty(*ids.shape, t.shape[1], dtype=t.dtype, device=self.device)
                        for t in (table.weight, table.scale))
            futures[layer] = self.pool.submit(self.gather, table, ids, ids_ready, out)
        return PendingEngram(self.tables, futures)

    def gather(self, table: EngramTable, ids: torch.Tensor, ids_ready: torch.cuda.Event | None,
               out: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.cuda.Event | None]:
        """On the worker thread: `table`'s raw rows at `ids` into `out`; (out, the copy's event or None)."""
        with torch.inference_mode():
            if ids_ready is None:
                for src, dst in zip((table.weight, table.scale), out):
                    torch.index_select(src, 0, ids.flatten(), out=dst.view(-1, dst.shape[-1]))
                return out, None
            ids_ready.synchronize()
            staged = tuple(torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True) for dst in out)
            for src, dst in zip((table.weight, table.scale), staged):
                torch.index_select(src, 0, ids.flatten(), out=dst.view(-1, dst.shape[-1]))
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                for src, dst in zip(staged, out):
                    dst.copy_(src, non_blocking=True)  # the pinned allocator keeps `src` until the copy ends
                copied = torch.cuda.Event()
                copied.record(self.stream)
            return out, copied

    def close(self) -> None:
        """Stop the worker thread (idempotent); queued gathers finish first."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class PendingEngram:
    """One step's lookups in flight: `rows(layer)` when the layer needs them, `drain()` when the step ends."""

    def __init__(self, tables: dict[int, EngramTable], futures: dict[int, Future]) -> None:
        self.tables, self.futures = tables, futures

    def rows(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s dequantised bf16 rows `[T, cols, dim]` on the device (the stream waits for the copy)."""
        future = self.futures.pop(layer)
        try:
            (values, scales), copied = future.result()
        except Exception as err:
            self.drain()
            raise EngramGatherError(f"the host-memory Engram gather of layer {layer} failed: "
                                    f"{type(err).__name__}: {err}") from err
        if copied is not None:
            torch.cuda.current_stream(values.device).wait_event(copied)
        return self.tables[layer].dequantise(values, scales)

    def drain(self) -> None:
        """Wait for every lookup not consumed (a step that failed part-way), ignoring their errors; the
        device stream waits for their copies, so the buffers they write are not reused under them."""
        for future in self.futures.values():
            if future.exception() is None:
                (values, _), copied = future.result()
                if copied is not None:
                    torch.cuda.current_stream(values.device).wait_event(copied)
        self.futures.clear()


class DeviceReadPrefetcher:
    """Host-placed `tables` read by the device (each table's `reader`), their gathers launched at the
    step's start on a side stream (CUDA) so they overlap the first layers; graph-capturable. `columns`
    as for `EngramPrefetcher`."""

    def __init__(self, tables: dict[int, EngramTable], columns: dict[int, int], device: torch.device) -> None:
        if any(t.reader is None for t in tables.values()):
            raise ValueError("DeviceReadPrefetcher needs tables the device reads (EngramTable.reader)")
        self.tables, self.columns, self.device = tables, columns, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, hashes: torch.Tensor) -> PendingReads:
        """Launch every table's gather of `hashes` `[T, engram layers, cols]` (on the device)."""
        main = torch.cuda.current_stream(self.device) if self.stream is not None else None
        # the outputs belong to the step's stream (allocated there); the side stream only writes them
        outs = {layer: tuple(torch.empty(*hashes.shape[:1], hashes.shape[2], t.shape[1], dtype=t.dtype,
                                         device=self.device) for t in (table.weight, table.scale))
                for layer, table in self.tables.items()}
        # each table's ids, contiguous, also made on the step's stream; held (with the outputs) until the
        # step's stream joins the side stream, so the allocator cannot hand their memory to later work
        # of the step's stream while the side stream still reads or writes it
        ids = {layer: hashes[:, self.columns[layer]].contiguous() for layer in self.tables}
        if main is None:
            return PendingReads(self.tables, {l: (t.raw_rows(ids[l], outs[l]), None, ids[l])
                                              for l, t in self.tables.items()})
        self.stream.wait_stream(main)  # the hash ids are written on the step's stream
        done = {}
        with torch.cuda.stream(self.stream):
            for layer, table in self.tables.items():
                table.raw_rows(ids[layer], outs[layer])
                event = torch.cuda.Event()
                event.record(self.stream)
                done[layer] = (outs[layer], event, ids[layer])
        return PendingReads(self.tables, done)

    def close(self) -> None:
        """Nothing to stop (no thread)."""


class PendingReads(PendingEngram):
    """`DeviceReadPrefetcher`'s gathers in flight: layer -> ((values, scales), the side stream's event or
    None, the ids it reads)."""

    def __init__(self, tables: dict[int, EngramTable], done: dict) -> None:
        self.tables, self.done = tables, done

    def rows(self, layer: int) -> torch.Tensor:
        (values, scales), event, _ = self.done.pop(layer)  # the ids are released once joined
        if event is not None:
            torch.cuda.current_stream(values.device).wait_event(event)
        return self.tables[layer].dequantise(values, scales)

    def drain(self) -> None:
        """Join the side stream for every gather not consumed (a CUDA graph's capture needs it joined)."""
        for (values, _), event, _ in self.done.values():
            if event is not None:
                torch.cuda.current_stream(values.device).wait_event(event)
        self.done.clear()
