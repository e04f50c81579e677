"""Rollback of rejected drafts: the cache rows a verification step writes at draft positions are saved
before the forward and written back for the drafts the target rejected, so the cache after the step
is the cache of a run that computed only the accepted tokens.

A verification step computes positions `start .. start + d` of a request (its last token and d drafts).
At a draft position q it writes, per layer, the sliding-window ring row `q % window` (which held
position `q - window`, still inside the next token's window), the compressor tail rows `q % tail_rows`,
and, when q closes a compression window, one compressed entry and one indexer key in the paged pools.
Those rows are exactly what `capture` gathers; `restore` puts back the ones of rejected positions.
Rings must hold at least `d + 1` rows, so no two positions of one step share a row (checked by
`check_ring_sizes`). Block allocation is rolled back by the scheduler and the runner
(`kept_blocks`); the prefix cache only ever registers computed (accepted) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.block_manager import blocks_for
from deepinfer_core.engine.sampling import host_tensor
from deepinfer_core.models.interface import LayerCache
from deepinfer_core.models.layer_plan import BLOCK_SIZE, LayerPlan

_SLOT_RINGS = ("window", "kv_tail", "gate_tail", "index_kv_tail", "index_gate_tail")
_PAGED_POOLS = ("compressed", "index_keys")


class RingTooSmallError(ValueError):
    """A per-request ring is shorter than the positions one verification step writes."""


def check_ring_sizes(plans: list[LayerPlan], num_speculative_tokens: int) -> None:
    """Every ring (sliding window, compressor tails) must hold the `k + 1` positions of one step.

    :raises RingTooSmallError: naming the layer and the largest k it allows.
    """
    for plan in plans:
        rows = [plan.attention.sliding_window] + ([plan.tail_rows] if plan.has_compressor else [])
        if min(rows) < num_speculative_tokens + 1:
            raise RingTooSmallError(
                f"layer {plan.index} keeps rings of {min(rows)} rows, fewer than the {num_speculative_tokens + 1} "
                f"positions one verification step writes; use num_speculative_tokens <= {min(rows) - 1}")


def kept_blocks(table_len: int, num_new_blocks: int, num_computed_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks a request keeps after a verification step: those it held before the step, plus
    what its accepted tokens need (blocks taken only for rejected drafts go back)."""
    return min(table_len, max(table_len - num_new_blocks, blocks_for(num_computed_tokens, block_size)))


@dataclass(frozen=True)
class DraftRows:
    """One request's drafts in a verification step."""

    slot: int
    start: int
    """Position of the request's last token (the first position computed)."""
    num_drafts: int
    block_table: list[int]


@dataclass
class _Saved:
    tensor: torch.Tensor
    index: tuple[torch.Tensor, ...]
    values: torch.Tensor
    positions: torch.Tensor
    requests: torch.Tensor


class DraftRollback:
    """Saves and restores the cache rows that draft positions write (one object per cache)."""

    def __init__(self, caches: list[LayerCache], plans: list[LayerPlan]) -> None:
        self._slot_rings: list[torch.Tensor] = []
        self._pools: list[tuple[torch.Tensor, int]] = []  # (pool, compress rate)
        seen: set[int] = set()
        for cache, plan in zip(caches, plans, strict=True):
            for name in _SLOT_RINGS:
                tensor = getattr(cache, name)
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    self._slot_rings.append(tensor)
            for name in _PAGED_POOLS:
                tensor = getattr(cache, name)
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    self._pools.append((tensor, plan.compress_rate))

    def capture(self, drafts: list[DraftRows]) -> list[_Saved]:
        """Copy the rows the drafts' positions will write; call before the verification forward."""
        slots, positions, owners = [], [], []
        for r, d in enumerate(drafts):
            for q in range(d.start + 1, d.start + 1 + d.num_drafts):
                slots.append(d.slot)
                positions.append(q)
                owners.append(r)
        if not positions:
            return []
        saved = []
        device = self._slot_rings[0].device
        slot_t, pos_t, owner_t = (host_tensor(v).to(device, non_blocking=True) for v in (slots, positions, owners))
        indices = {}  # one index per ring length: rings share their rows' positions
        for ring in self._slot_rings:
            length = ring.shape[1]
            if length not in indices:
                indices[length] = (slot_t, pos_t % length)
            index = indices[length]
            saved.append(_Saved(ring, index, ring[index], pos_t, owner_t))  # advanced indexing copies
        for pool, rate in self._pools:
            rows, row_pos, row_owner = [], [], []
            per_block = BLOCK_SIZE // rate
            for q, r in zip(positions, owners):
                if (q + 1) % rate:
                    continue
                entry = (q + 1) // rate - 1
                table = drafts[r].block_table
                if entry // per_block < len(table):
                    rows.append(table[entry // per_block] * per_block + entry % per_block)
                    row_pos.append(q)
                    row_owner.append(r)
            if rows:
                index = (host_tensor(rows).to(device, non_blocking=True),)
                saved.append(_Saved(pool, index, pool[index], host_tensor(row_pos).to(device, non_blocking=True),
                                    host_tensor(row_owner).to(device, non_blocking=True)))
        return saved

    @staticmethod
    def restore(saved: list[_Saved], drafts: list[DraftRows], num_accepted: list[int]) -> None:
        """Write back the rows of rejected draft positions (after the forward, acceptance known).

        Every saved row is rewritten, with its saved value where its position was rejected and its
        current one elsewhere: no boolean indexing, so the device never waits for the host here."""
        if not saved:
            return
        device = saved[0].positions.device
        last_kept = host_tensor([d.start + a for d, a in zip(drafts, num_accepted, strict=True)])
        last_kept = last_kept.to(device, non_blocking=True)
        masks = {}  # per positions tensor (every slot ring shares one): which rows were rejected
        for s in saved:
            if id(s.positions) not in masks:
                masks[id(s.positions)] = s.positions > last_kept[s.requests]
            rejected = masks[id(s.positions)].view(-1, *[1] * (s.values.dim() - 1))
            s.tensor[s.index] = torch.where(rejected, s.values, s.tensor[s.index])
