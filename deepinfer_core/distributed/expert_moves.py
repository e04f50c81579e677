"""Moving expert weights between EP ranks when the placement changes (EPLB), layer by layer.

For every slot whose expert changes, the new expert's rows come from this rank's own old slots when it
held that expert (a local copy), else from the lowest rank that held it (point-to-point, batched with
`torch.distributed.batch_isend_irecv`). Every rank derives the same sender for every transfer from the
old and new placements, so sends and receives pair up in the same order on both sides. Rows travel as
uint8 views (gloo has no float8). All transfers of a layer finish before any row is overwritten.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer_core.backends.parallel import GroupInfo


def _holders(old_row: list[int], size: int, per_rank: int) -> dict[int, tuple[int, int]]:
    """For each logical expert of `old_row`, the lowest `(rank, local index)` that holds it."""
    holders: dict[int, tuple[int, int]] = {}
    for slot, expert in enumerate(old_row):
        holders.setdefault(expert, (slot // per_rank, slot % per_rank))
    return holders


def layer_transfers(old_row: list[int], new_row: list[int], size: int):
    """Transfers of one layer: `(receiver, local slot, sender, sender's local slot)` for every new slot
    whose expert its rank did not hold, and `(rank, local slot, local source slot)` local copies."""
    per_rank = len(old_row) // size
    holders = _holders(old_row, size, per_rank)
    remote, local = [], []
    for slot, expert in enumerate(new_row):
        rank, index = slot // per_rank, slot % per_rank
        if old_row[slot] == expert:
            continue
        own = old_row[rank * per_rank : (rank + 1) * per_rank]
        if expert in own:
            local.append((rank, index, own.index(expert)))
        else:
            sender, sender_index = holders[expert]
            remote.append((rank, index, sender, sender_index))
    return remote, local


def move_experts(moe_weights, old: torch.Tensor, new: torch.Tensor, ep: GroupInfo, names: tuple[str, ...]) -> int:
    """Rewrite this rank's expert rows for placement `new` (was `old`, both `[L, S]`); return how many of
    this rank's slots changed."""
    moved = 0
    with torch.no_grad():
        for layer, weights in enumerate(moe_weights):
            moved += _move_layer(weights, old[layer].tolist(), new[layer].tolist(), ep, names)
    return moved


def _move_layer(weights, old_row: list[int], new_row: list[int], ep: GroupInfo, names: tuple[str, ...]) -> int:
    """Move one layer's changed slots; the number of this rank's slots rewritten."""
    tensors = [getattr(weights, name) for name in names if getattr(weights, name) is not None]
    remote, local = layer_transfers(old_row, new_row, ep.size)
    ops, writes = [], []
    for receiver, index, sender, sender_index in remote:
        if sender == ep.rank:
            ops += [dist.P2POp(dist.isend, _bytes(t[sender_index]), ep.ranks[receiver], ep.group) for t in tensors]
        if receiver == ep.rank:
            buffers = [torch.empty_like(t[index]) for t in tensors]
            ops += [dist.P2POp(dist.irecv, _bytes(b), ep.ranks[sender], ep.group) for b in buffers]
            writes.append((index, buffers))
    for rank, index, source in local:
        if rank == ep.rank:
            writes.append((index, [t[source].clone() for t in tensors]))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for index, rows in writes:
        for tensor, row in zip(tensors, rows, strict=True):
            tensor[index].copy_(row)
    return len(writes)


def _bytes(row: torch.Tensor) -> torch.Tensor:
    return row.contiguous().view(torch.uint8)
