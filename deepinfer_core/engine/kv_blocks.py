"""Whole cache blocks as bytes: what the prefix tiers (host memory, the store) hold of a block.

A block's bytes are, for every layer that owns a compressed pool (in layer order), its
`entries_per_block` compressed entries and then (CSA layers) its indexer keys, each row-major in the
cache dtype. Sliding windows and compressor tails are per-request state and are never part of a block:
a hit rebuilds them by replay. `block_layout` names the segments (it is also written into every store
file's header), `BlockIO` copies blocks between the device cache and host tensors `[n, block_bytes]`
uint8 for the plan's `CacheOp`s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.plan import CacheOp
from deepinfer_core.models.interface import LayerCache
from deepinfer_core.models.layer_plan import LayerPlan

LOAD, SAVE = "load", "save"
CACHE_OP_KINDS = (LOAD, SAVE)


@dataclass(frozen=True)
class BlockSegment:
    """One tensor's share of a block: `rows` rows of `width` elements of `dtype`, of layer `layer`."""

    layer: int
    name: str
    """The `LayerCache` field: "compressed" or "index_keys"."""
    rows: int
    width: int
    dtype: str

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

    def _views(self) -> list[torch.Tensor]:
        # [blocks, rows, width] views of each pool (the trailing scratch row is left out)
        return [pool[: (pool.shape[0] - 1) // s.rows * s.rows].view(-1, s.rows, s.width)
                for pool, s in zip(self._pools, self.layout)]

    def gather(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The blocks' bytes, `[len(block_ids), block_bytes]` uint8 on the host."""
        if not self.layout:
            return torch.empty(len(block_ids), 0, dtype=torch.uint8)
        views = self._views()
        index = torch.tensor(block_ids, dtype=torch.long, device=views[0].device)
        parts = [v.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for v in views]
        return torch.cat(parts, dim=1).cpu()

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

    def apply(self, ops: tuple[CacheOp, ...]) -> tuple[torch.Tensor, ...]:
        """Run `ops` in order; the gathered bytes of each "save" op, in order."""
        saved = []
        for op in ops:
            if op.kind == SAVE:
                saved.append(self.gather(op.block_ids))
            elif op.kind == LOAD:
                self.scatter(op.block_ids, op.data)
            else:
                raise ValueError(f"unknown cache op kind {op.kind!r}; expected one of {CACHE_OP_KINDS}")
        return tuple(saved)
