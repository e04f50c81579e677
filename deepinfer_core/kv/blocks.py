"""Whole cache blocks as bytes: what the prefix tiers (host memory, the store) hold of a block.

A block's bytes are, for every layer that owns a compressed pool (in layer order), its
`entries_per_block` compressed entries and then (CSA layers) its indexer keys, each row-major in the
cache dtype; and, for a model that keeps each position's token id in the paged cache (V4.1's Engram
look-back, `LayerPlan.owns_token_ids`), the block's 128 ids (int64). Sliding windows and compressor tails are per-request state and are never part of a block:
a hit rebuilds them by replay. `block_layout` names the segments (it is also written into every store
file's header), `BlockIO` copies blocks between the device cache and host tensors `[n, block_bytes]`
uint8 for the plan's `CacheOp`s.

A request's state (prefill/decode disaggregation) is its slot's rings (every layer's window, every
owner's compressor tails) followed by the bytes of its partial last block, if any: a decode instance
that loads it continues exactly where the prefill instance stopped, with no replay.

Saves are asynchronous: `gather` copies the blocks into a device buffer in stream order (so the step's
forward may overwrite them afterwards) and from there into pinned host memory on a copy stream; it
returns a `PendingCopy` the engine polls (on the CPU the copy is done at once, the same path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.models.interface import LayerCache
from deepinfer_core.models.layer_plan import BLOCK_SIZE, LayerPlan
from deepinfer_core.plan import CACHE_OP_KINDS, LOAD, LOAD_STATE, SAVE, SAVE_STATE, CacheOp

_SLOT_FIELDS = ("window", "kv_tail", "gate_tail", "index_kv_tail", "index_gate_tail")


class PendingCopy:
    """Bytes on their way from the device to pinned host memory (`tensor`, valid once `is_done`).

    Pickles as the finished copy (a worker process waits for it before sending its result)."""

    def __init__(self, tensor: torch.Tensor, event=None) -> None:
        self.tensor, self._event = tensor, event

    def is_done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        """Block until the copy finished; the bytes."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensor

    def __getstate__(self) -> dict:
        return {"tensor": self.wait(), "_event": None}


@dataclass(frozen=True)
class BlockSegment:
    """One tensor's share of a block: `rows` rows of `width` elements of `dtype`, of layer `layer`."""

    layer: int
    name: str
    """The `LayerCache` field: "compressed", "index_keys" or "token_ids"."""
    rows: int
    width: int
    dtype: str
    scratch_rows: int = 1
    """Rows the pool holds after its last block (the compressed pools' scratch row; none for token ids)."""

    @property
    def num_bytes(self) -> int:
        return self.rows * self.width * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def describe(self) -> str:
        return f"{self.layer}.{self.name}[{self.rows},{self.width}]{self.dtype}"


def block_layout(plans: list[LayerPlan], dtype: torch.dtype) -> tuple[BlockSegment, ...]:
    """The segments of one block's bytes, in order (see the module docstring)."""
    name = str(dtype).removeprefix("torch.")
    segments = []
    for plan in plans:
        if not plan.owns_compressed:
            continue
        spec = plan.attention
        segments.append(BlockSegment(plan.index, "compressed", spec.entries_per_block, spec.head_dim, name))
        if plan.has_indexer:
            segments.append(BlockSegment(plan.index, "index_keys", spec.entries_per_block, spec.index_head_dim, name))
    segments += [BlockSegment(plan.index, "token_ids", BLOCK_SIZE, 1, "int64", scratch_rows=0)
                 for plan in plans if plan.owns_token_ids]
    return tuple(segments)


def layout_bytes(layout: tuple[BlockSegment, ...]) -> int:
    """Bytes of one block."""
    return sum(s.num_bytes for s in layout)


def describe_layout(layout: tuple[BlockSegment, ...]) -> str:
    """A one-line text of the layout (store headers carry it; equal text, equal shapes)."""
    return ";".join(s.describe() for s in layout)


class BlockIO:
    """Copies whole blocks between the device cache and host bytes (runs the plan's `CacheOp`s).

    :param layout: `block_layout` of the model.
    :param layers: the cache's `LayerCache`s (`KVCache.layers`).
    """

    def __init__(self, layout: tuple[BlockSegment, ...], layers: list[LayerCache]) -> None:
        self.layout = layout
        self.block_bytes = layout_bytes(layout)
        self._pools = [getattr(layers[s.layer], s.name) for s in layout]
        self._slot_rings = [t for layer in layers for name in _SLOT_FIELDS if (t := getattr(layer, name)) is not None]
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self._slot_rings)
        """Bytes of one request's slot state (windows and compressor tails)."""
        self._copy_stream = None

    def _views(self) -> list[torch.Tensor]:
        # [blocks, rows, width] views of each pool (trailing scratch rows left out)
        return [pool[: (pool.shape[0] - s.scratch_rows) // s.rows * s.rows].view(-1, s.rows, s.width)
                for pool, s in zip(self._pools, self.layout)]

    def _gather_device(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The blocks' bytes `[len(block_ids), block_bytes]` uint8, a copy on the cache's device."""
        if not self.layout:
            return torch.empty(len(block_ids), 0, dtype=torch.uint8)
        views = self._views()
        index = torch.tensor(block_ids, dtype=torch.long, device=views[0].device)
        parts = [v.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for v in views]
        return torch.cat(parts, dim=1)

    def gather(self, block_ids: tuple[int, ...]) -> PendingCopy:
        """The blocks' bytes, `[len(block_ids), block_bytes]` uint8, on their way to the host."""
        return self._to_host(self._gather_device(block_ids))

    def gather_state(self, slot: int, tail_block_ids: tuple[int, ...]) -> PendingCopy:
        """A request's state: its slot's rings, then its partial last block (`tail_block_ids`: () or one id)."""
        parts = [t[slot].reshape(-1).view(torch.uint8) for t in self._slot_rings]
        if tail_block_ids:
            parts.append(self._gather_device(tail_block_ids).reshape(-1))
        device = self._slot_rings[0].device if self._slot_rings else torch.device("cpu")
        return self._to_host(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device))

    def scatter_state(self, slot: int, tail_block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        """Write a request's state (`gather_state`'s bytes) into `slot` and its partial last block."""
        expected = self.slot_bytes + len(tail_block_ids) * self.block_bytes
        if tuple(data.shape) != (expected,) or data.dtype != torch.uint8:
            raise ValueError(f"a request state with {len(tail_block_ids)} partial blocks needs uint8 data of shape "
                             f"[{expected}], got {data.dtype} {tuple(data.shape)}")
        offset = 0
        for ring in self._slot_rings:
            size = ring[0].numel() * ring.element_size()
            part = data[offset : offset + size].to(ring.device, non_blocking=data.is_pinned(), copy=True)  # aligned
            ring[slot].copy_(part.view(ring.dtype).view(ring[slot].shape))
            offset += size
        if tail_block_ids:
            self.scatter(tail_block_ids, data[offset:].reshape(len(tail_block_ids), self.block_bytes))

    def _to_host(self, data: torch.Tensor) -> PendingCopy:
        if data.device.type != "cuda":
            return PendingCopy(data if data.device.type == "cpu" else data.cpu())
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=data.device)
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(data.device))  # after the gather
        with torch.cuda.stream(self._copy_stream):
            host.copy_(data, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        data.record_stream(self._copy_stream)  # the device buffer lives until the copy read it
        return PendingCopy(host, event)

    def scatter(self, block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        """Write `data` (`[len(block_ids), block_bytes]` uint8) into the blocks."""
        if tuple(data.shape) != (len(block_ids), self.block_bytes) or data.dtype != torch.uint8:
            raise ValueError(f"a load of {len(block_ids)} blocks needs uint8 data of shape "
                             f"[{len(block_ids)}, {self.block_bytes}], got {data.dtype} {tuple(data.shape)}")
        if not self.layout:
            return
        views = self._views()
        device = views[0].device
        data = data.to(device, non_blocking=data.is_pinned())
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        offset = 0
        for view, segment in zip(views, self.layout):
            part = data[:, offset : offset + segment.num_bytes].contiguous().view(view.dtype)
            view.index_copy_(0, index, part.view(len(block_ids), segment.rows, segment.width))
            offset += segment.num_bytes

    def apply(self, ops: tuple[CacheOp, ...]) -> tuple[PendingCopy, ...]:
        """Run `ops` in order; the gathered bytes of each saving op (`SAVING_KINDS`), in order."""
        saved = []
        for op in ops:
            if op.kind == SAVE:
                saved.append(self.gather(op.block_ids))
            elif op.kind == LOAD:
                self.scatter(op.block_ids, op.data)
            elif op.kind == SAVE_STATE:
                saved.append(self.gather_state(op.slot, op.block_ids))
            elif op.kind == LOAD_STATE:
                self.scatter_state(op.slot, op.block_ids, op.data)
            else:
                raise ValueError(f"unknown cache op kind {op.kind!r}; expected one of {CACHE_OP_KINDS}")
        return tuple(saved)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to cover positions `[0, num_tokens)`."""
    return -(-num_tokens // block_size)


def kept_blocks(table_len: int, num_new_blocks: int, num_computed_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks a request keeps after a verification step: those it held before the step, plus
    what its accepted tokens need (blocks taken only for rejected drafts go back)."""
    return min(table_len, max(table_len - num_new_blocks, blocks_for(num_computed_tokens, block_size)))
