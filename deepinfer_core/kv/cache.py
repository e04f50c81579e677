"""The V4 cache: a paged pool for compressed entries, fixed per-request state for the rest.

Per layer (see `deepinfer_core.backends.attention` for how backends read it):
- `window` `[num_slots, sliding_window, head_dim]`: the sliding-window ring of every layer;
- CSA/HCA: `compressed` `[num_blocks * 128 / rate + 1, head_dim]`, paged by 128-token blocks (the last
  row is a scratch row decode steps write to when they close no window), plus the
  compressor tail rings `kv_tail` / `gate_tail` `[num_slots, tail_rows, proj]` (gate in fp32);
- CSA: `index_keys` `[num_blocks * 32, index_head_dim]` and the indexer's own tail rings;
- a plan with `owns_token_ids`: `token_ids` `[num_blocks * 128]` int64, one id per position, paged.
Blocks are per request (block tables); slots are per running request. A layer whose plan names a
`kv_source` owns no compressed pool and no tails: its `LayerCache` holds the source layer's pools.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from deepinfer_core.models.interface import LayerCache
from deepinfer_core.models.layer_plan import BLOCK_SIZE, LayerPlan


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_block(plans: list[LayerPlan], dtype: torch.dtype) -> int:
    """Bytes one 128-token block takes across all layers (compressed entries + indexer keys)."""
    total = 0
    for plan in plans:
        if plan.owns_compressed:
            total += plan.attention.entries_per_block * plan.attention.head_dim
        if plan.owns_compressed and plan.has_indexer:
            total += plan.attention.entries_per_block * plan.attention.index_head_dim
    token_ids = sum(BLOCK_SIZE * 8 for plan in plans if plan.owns_token_ids)
    return total * _dtype_bytes(dtype) + token_ids


def bytes_per_slot(plans: list[LayerPlan], dtype: torch.dtype) -> int:
    """Bytes of fixed per-request state (windows and compressor tails) across all layers."""
    item, total = _dtype_bytes(dtype), 0
    for plan in plans:
        spec = plan.attention
        total += spec.sliding_window * spec.head_dim * item
        if not plan.owns_compressed:
            continue
        kv_item = 4 if plan.fp32_tails else item
        total += plan.tail_rows * (plan.tail_width * (kv_item + 4) + plan.index_tail_width * (item + 4))
    return total


@dataclass(frozen=True)
class CacheStack:
    """The tensors of one `LayerCache` field, shape and dtype across the layers: rows of one allocation."""

    name: str
    """The `LayerCache` field."""
    tensor: torch.Tensor
    """`[n, *shape]`: row j is the field's tensor of the layers `layers[j]` (theirs is a view of it)."""
    layers: list[list[int]]
    """Per row, the layers (positions in `KVCache.layers`) whose field it is: several where layers share
    one tensor (a `kv_source` reader holds its source's pools)."""


NULL_BLOCK = 0
"""The reserved null block: never handed out by the block pool, so a block table may be padded with it
(an attention kernel that reads every entry of a table, such as `sparse_flash_mla`, reads a block no
request owns)."""


class KVCache:
    """Allocates and holds every layer's cache tensors.

    Block rows: `NULL_BLOCK` (0), the `num_blocks` blocks the scheduler hands out (`1 .. num_blocks`),
    then `scratch_block`; one extra slot (`scratch_slot`) exists beyond the scheduler's too. Padding rows
    of captured decode batches read and write only the scratch block and slot.
    The layers' tensors of one field and shape are contiguous views of one allocation (`stacks`), so
    a speculative step saves and restores a field's rows in every layer with one kernel.
    """

    stacks: list[CacheStack]
    """Every allocation: each layer's tensors are views of one stack's rows."""

    def __init__(self, plans: list[LayerPlan], num_blocks: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.scratch_block, self.scratch_slot = num_blocks + 1, num_slots
        meta = torch.device("meta")  # shapes first: same-shaped tensors of many layers share one allocation
        layers: list[LayerCache] = []
        for plan in plans:
            if plan.kv_source is None:
                layers.append(self._allocate(plan, num_blocks + 2, num_slots + 1, dtype, meta))
                continue
            if plan.kv_source >= plan.index or plans[plan.kv_source].kv_source is not None:
                raise ValueError(f"layer {plan.index} reads the compressed entries of layer {plan.kv_source}, "
                                 "which must be an earlier layer that owns its own")
            source = layers[plan.kv_source]
            window = torch.zeros(num_slots + 1, plan.attention.sliding_window, plan.attention.head_dim,
                                 dtype=dtype, device=meta)
            layers.append(replace(source, window=window, kv_tail=None, gate_tail=None, index_kv_tail=None,
                                  index_gate_tail=None))
        self.layers, self.stacks = _stacked(layers, device)

    @staticmethod
    def _allocate(plan: LayerPlan, num_blocks: int, num_slots: int, dtype, device) -> LayerCache:
        spec = plan.attention

        def zeros(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        cache = LayerCache(window=zeros(num_slots, spec.sliding_window, spec.head_dim))
        if plan.has_compressor:
            rows = num_blocks * spec.entries_per_block + 1
            cache.compressed = zeros(rows, spec.head_dim)
            cache.kv_tail = zeros(num_slots, plan.tail_rows, plan.tail_width,
                                  dt=torch.float32 if plan.fp32_tails else dtype)
            cache.gate_tail = zeros(num_slots, plan.tail_rows, plan.tail_width, dt=torch.float32)
        if plan.has_indexer:
            cache.index_keys = zeros(num_blocks * spec.entries_per_block + 1, spec.index_head_dim)
        if plan.owns_token_ids:
            cache.token_ids = zeros(num_blocks * BLOCK_SIZE, dt=torch.int64)
        if plan.index_tail_width:
            cache.index_kv_tail = zeros(num_slots, plan.tail_rows, plan.index_tail_width)
            cache.index_gate_tail = zeros(num_slots, plan.tail_rows, plan.index_tail_width, dt=torch.float32)
        return cache


def _stacked(layers: list[LayerCache], device: torch.device) -> tuple[list[LayerCache], list[CacheStack]]:
    """The layers' cache tensors allocated on `device`, and their stacks: the tensors of one field, shape
    and dtype are the rows of one tensor, each layer's a contiguous view of it, so work on every layer's
    rows of a field (a draft rollback's gathers) is one kernel. A tensor several layers share stays shared."""
    members: dict[tuple, list[torch.Tensor]] = {}
    holders: dict[int, list[int]] = {}  # per meta tensor, the layers that hold it
    for i, layer in enumerate(layers):
        for f in fields(layer):
            tensor = getattr(layer, f.name)
            if tensor is None:
                continue
            if id(tensor) not in holders:
                members.setdefault((f.name, tuple(tensor.shape), tensor.dtype), []).append(tensor)
            holders.setdefault(id(tensor), []).append(i)
    placed: dict[int, torch.Tensor] = {}
    stacks = []
    for (name, shape, dtype), tensors in members.items():
        stack = torch.zeros(len(tensors), *shape, dtype=dtype, device=device)
        placed.update({id(tensor): stack[j] for j, tensor in enumerate(tensors)})
        stacks.append(CacheStack(name, stack, [holders[id(tensor)] for tensor in tensors]))
    placed_layers = [replace(layer, **{f.name: placed[id(getattr(layer, f.name))] for f in fields(layer)
                                       if getattr(layer, f.name) is not None}) for layer in layers]
    return placed_layers, stacks
