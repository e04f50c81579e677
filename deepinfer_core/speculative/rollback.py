"""Rollback of rejected drafts: the cache rows a verification step writes at draft positions are saved
before the forward and written back for the drafts the target rejected, so the cache after the step
is the cache of a run that computed only the accepted tokens.

A verification step computes positions `start .. start + d` of a request (its last token and d drafts).
At a draft position q it writes, per layer, the sliding-window ring row `q % window` (which held
position `q - window`, still inside the next token's window), the compressor tail rows `q % tail_rows`,
when q closes a compression window, one compressed entry and one indexer key in the paged pools, and,
in a model that keeps them (V4.1), its token id in the paged id pool (`token_ids`: a pool of one entry
per position, so its rows are those of a rate-1 pool). Those rows are exactly what `capture` gathers;
`restore` puts back the ones of rejected positions. Rings must hold at least `d + 1` rows, so no two
positions of one step share a row (checked by `check_ring_sizes`). Block allocation is rolled back by
the scheduler and the runner (`kept_blocks`); the prefix cache only ever registers computed (accepted)
tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.backends.sampling_tensors import to_device
from deepinfer_core.kv.cache import CacheStack
from deepinfer_core.models.interface import LayerCache
from deepinfer_core.models.layer_plan import BLOCK_SIZE, LayerPlan

_SLOT_RINGS = ("window", "kv_tail", "gate_tail", "index_kv_tail", "index_gate_tail")
_PAGED_POOLS = ("compressed", "index_keys", "token_ids")


class RingTooSmallError(ValueError):
    """A per-request ring is shorter than the positions one verification step writes."""


def check_ring_sizes(plans: list[LayerPlan], num_speculative_tokens: int) -> None:
    """Every ring (sliding window, compressor tails) must hold the `k + 1` positions of one step.

    :raises RingTooSmallError: naming the layer and the largest k it allows.
    """
    for plan in plans:  # a compressor without an open group (V4.1's ratio 1) keeps no tail rows
        rows = [plan.attention.sliding_window] + ([plan.tail_rows] if plan.has_compressor and plan.tail_rows else [])
        if min(rows) < num_speculative_tokens + 1:
            raise RingTooSmallError(
                f"layer {plan.index} keeps rings of {min(rows)} rows, fewer than the {num_speculative_tokens + 1} "
                f"positions one verification step writes; use num_speculative_tokens <= {min(rows) - 1}")


@dataclass(frozen=True)
class DraftRows:
    """One request's drafts in a verification step."""

    slot: int
    start: int
    """Position of the request's last token (the first position computed)."""
    num_drafts: int
    block_table: list[int]


@dataclass
class _RowGroup:
    """Cache rows that tensors of one shape of ring (one length) or one pool (one rate) save."""

    rows: list[int]
    """The rows, in the tensors' first dimension (a slot ring's slot and ring row flattened)."""
    offsets: list[int]
    """Per row, the distance of its position from its request's last token (1 .. d)."""
    owners: list[int]
    """Per row, the index of its request in the captured drafts."""
    index: torch.Tensor
    """`rows` on the device."""


@dataclass
class SavedRows:
    """What `DraftRollback.capture` saved: per cache tensor, its rows at the drafts' positions."""

    tensors: list[tuple[torch.Tensor, int]]
    """Per saved tensor `[n layers, cache rows, ...]`, and the index of its row group."""
    values: list[torch.Tensor]
    """Per saved tensor, its rows as they were before the forward."""
    groups: list[_RowGroup]


class DraftRollback:
    """Saves and restores the cache rows that draft positions write (one object per cache)."""

    def __init__(self, caches: list[LayerCache], plans: list[LayerPlan], stacks: Sequence[CacheStack] = ()) -> None:
        """`stacks`: the allocations the caches' tensors are rows of (`KVCache.stacks`), each read and
        written with one kernel; a tensor outside them (a cache not built by `KVCache`) goes alone."""
        self._slot_rings: list[tuple[torch.Tensor, int]] = []  # ([n, slots * length, ...] ring, its length)
        self._pools: list[tuple[torch.Tensor, int]] = []  # ([n, rows, ...] pool, compress rate)
        for name, tensor, plan in _saved_tensors(caches, plans, stacks):
            if name in _SLOT_RINGS and tensor.shape[2]:  # an empty ring (no tail rows) holds nothing
                # slot and ring row as one dimension, a view: writes land in the cache
                self._slot_rings.append((tensor.view(tensor.shape[0], -1, *tensor.shape[3:]), tensor.shape[2]))
            elif name in _PAGED_POOLS:
                self._pools.append((tensor, 1 if name == "token_ids" else plan.compress_rate))

    def capture(self, drafts: list[DraftRows]) -> SavedRows | None:
        """Copy the rows the drafts' positions will write; call before the verification forward. The
        rows of every tensor go to the device in one copy, and each tensor is read with one gather."""
        positions, owners, offsets = [], [], []
        for r, d in enumerate(drafts):
            positions += range(d.start + 1, d.start + 1 + d.num_drafts)
            owners += [r] * d.num_drafts
            offsets += range(1, d.num_drafts + 1)
        if not positions:
            return None
        groups: list[tuple[list[int], list[int], list[int]]] = []
        keys: dict[tuple[str, int], int | None] = {}
        tensors = []
        for ring, length in self._slot_rings:  # rings of one length share their rows
            if ("ring", length) not in keys:
                keys["ring", length] = len(groups)
                groups.append(([drafts[r].slot * length + q % length for q, r in zip(positions, owners)],
                               offsets, owners))
            tensors.append((ring, keys["ring", length]))
        for pool, rate in self._pools:
            if ("pool", rate) not in keys:
                group = _pool_rows(drafts, positions, owners, offsets, rate)
                keys["pool", rate] = len(groups) if group[0] else None
                if group[0]:
                    groups.append(group)
            if keys["pool", rate] is not None:
                tensors.append((pool, keys["pool", rate]))
        device = tensors[0][0].device
        indices = to_device([rows for rows, _, _ in groups], device)
        row_groups = [_RowGroup(*group, index) for group, index in zip(groups, indices, strict=True)]
        values = [tensor.index_select(1, row_groups[g].index) for tensor, g in tensors]
        return SavedRows(tensors, values, row_groups)

    @staticmethod
    def restore(saved: SavedRows | None, num_accepted: list[int] | None = None) -> None:
        """Write back the rows of rejected draft positions, after the forward (`num_accepted`: per
        captured request, the drafts accepted; None: every draft rejected).

        One copy per tensor, none where every draft was accepted: the rejected rows are known on the
        host (the step has read its tokens), and picking them out of the saved rows takes a gather only
        where a group mixes accepted and rejected rows (the indices of all of them go in one copy)."""
        if saved is None:
            return
        picks: list[tuple[torch.Tensor, int | None] | None] = []  # per group: (rows, selection segment)
        segments: list[list[int]] = []
        for group in saved.groups:
            rejected = list(range(len(group.rows))) if num_accepted is None else [
                n for n, (offset, r) in enumerate(zip(group.offsets, group.owners)) if offset > num_accepted[r]]
            if len(rejected) == len(group.rows):
                picks.append((group.index, None))
            elif rejected:
                picks.append((None, len(segments)))
                segments += [[group.rows[n] for n in rejected], rejected]
            else:
                picks.append(None)
        parts = to_device(segments, saved.groups[0].index.device) if segments else []
        for (tensor, g), values in zip(saved.tensors, saved.values, strict=True):
            if picks[g] is None:
                continue
            index, segment = picks[g]
            if segment is None:
                tensor.index_copy_(1, index, values)
            else:
                tensor.index_copy_(1, parts[segment], values.index_select(1, parts[segment + 1]))


def _pool_rows(drafts: list[DraftRows], positions: list[int], owners: list[int], offsets: list[int],
               rate: int) -> tuple[list[int], list[int], list[int]]:
    """The pool rows written by the positions that close a compression window, with their offsets
    and owners (a position whose entry lies past its block table writes nothing kept)."""
    rows, row_offsets, row_owners = [], [], []
    per_block = BLOCK_SIZE // rate
    for q, r, offset in zip(positions, owners, offsets):
        if (q + 1) % rate:
            continue
        entry = (q + 1) // rate - 1
        table = drafts[r].block_table
        if entry // per_block < len(table):
            rows.append(table[entry // per_block] * per_block + entry % per_block)
            row_offsets.append(offset)
            row_owners.append(r)
    return rows, row_offsets, row_owners


def _saved_tensors(caches: list[LayerCache], plans: list[LayerPlan],
                   stacks: Sequence[CacheStack]) -> Iterator[tuple[str, torch.Tensor, LayerPlan]]:
    """`(field, [n, *shape] tensor, a plan of its layers)` for every tensor of a field drafts write:
    each stack whole (its n layers), then each tensor outside the stacks alone (n = 1), a shared one once."""
    in_stacks = set()
    for stack in stacks:
        if stack.name in _SLOT_RINGS + _PAGED_POOLS:
            in_stacks.update((stack.name, i) for row in stack.layers for i in row)
            # a stack is one shape, so (for a pool) one compress rate: any of its layers' plans says it
            if stack.name in _PAGED_POOLS and len({plans[i].compress_rate for row in stack.layers for i in row}) > 1:
                raise ValueError(f"the {stack.name} stack holds layers of different compress rates")
            yield stack.name, stack.tensor, plans[stack.layers[0][0]]
    seen: set[int] = set()
    for i, (cache, plan) in enumerate(zip(caches, plans, strict=True)):
        for name in _SLOT_RINGS + _PAGED_POOLS:
            tensor = getattr(cache, name)
            if tensor is not None and (name, i) not in in_stacks and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor.unsqueeze(0), plan
