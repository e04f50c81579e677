"""Expert-parallel dispatch and combine over `torch.distributed.all_to_all_single` (uneven splits).

One MoE layer on one EP rank: route the rank's tokens (top-k or hash), pick a physical replica for
each (token, expert) assignment, send each assignment's input row to the rank holding that slot, run
the received rows through the local experts, send the outputs back and combine them in the original
order, weighted by the routing weights. Every rank calls the same collectives per layer, also with
no tokens (a data-parallel rank's dummy step), so the world stays in lockstep.

Messages: one `all_to_all_single` of per-rank counts, one of the rows (each row the activation bytes
followed by the int64 local slot id, as uint8: gloo has no float8 and this needs one message), one
of the outputs. The counts come to the host (the split sizes are host lists): one sync per layer.
A plugin with a faster dispatch (DeepEP-style kernels) provides its own `MoEBackend` for specs with
`expert_parallel` set and reads the same `ExpertPlacement`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepinfer_core.backends.moe import ExpertPlacement, MoESpec, MoEWeights

_SLOT_BYTES = 8  # int64 local slot id appended to each dispatched row


def choose_slots(ids: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """`[T, k]` physical slot of each assignment: replica `(row + j) % count` of expert `ids[row, j]`
    (spreads a busy expert's tokens evenly over its replicas, deterministically)."""
    num_tokens, top_k = ids.shape
    offsets = torch.arange(num_tokens, device=ids.device)[:, None] + torch.arange(top_k, device=ids.device)
    replica = offsets % placement.replica_counts[ids]
    return placement.expert_slots[ids, replica]


def count_load(slots: torch.Tensor, placement: ExpertPlacement) -> None:
    """Add this step's assignments per physical slot to `placement.slot_load`, on the device (no sync)."""
    flat = slots.reshape(-1)
    placement.slot_load.index_add_(0, flat, torch.ones_like(flat))


class AllToAllDispatch:
    """Sends assignment rows to their slots' ranks and brings the outputs back (see the module docstring)."""

    def __init__(self, placement: ExpertPlacement) -> None:
        self.placement = placement

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor):
        """`x` `[T, H]`, `slots` `[T, k]` -> (received rows `[M, H]`, their local slot ids `[M]`, handle)."""
        p = self.placement
        flat = slots.reshape(-1)
        dest, local = p.slot_owners(flat)
        order = dest.argsort(stable=True)
        rows = x.repeat_interleave(slots.shape[1], dim=0)[order]
        local = local[order]
        send_counts = torch.bincount(dest, minlength=p.size) if flat.numel() else dest.new_zeros(p.size)
        recv_counts = torch.empty_like(send_counts)
        self._exchange(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        payload = torch.cat([_as_bytes(rows), _as_bytes(local[:, None])], dim=1)
        received = payload.new_empty(sum(recv_split), payload.shape[1])
        self._exchange(received, payload, recv_split, send_split)
        width = payload.shape[1] - _SLOT_BYTES
        recv_x = received[:, :width].contiguous().view(x.dtype).view(-1, x.shape[1])
        recv_local = received[:, width:].contiguous().view(torch.int64).view(-1)
        return recv_x, recv_local, (order, send_split, recv_split, slots.shape)

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        """Outputs `[M, H]` of the received rows -> `[T, k, H]` outputs of this rank's assignments."""
        order, send_split, recv_split, shape = handle
        back = y.new_empty(sum(send_split), y.shape[1])
        self._exchange(_as_bytes(back), _as_bytes(y), send_split, recv_split)
        out = torch.empty_like(back)
        out[order] = back
        return out.view(*shape, y.shape[1])

    def _exchange(self, output, input, output_split=None, input_split=None) -> None:
        placement = self.placement
        if placement.group is None:  # a process of its own: everything stays here
            output.copy_(input)
            return
        start = _synchronized_time(output.device) if placement.time_dispatch else 0.0
        dist.all_to_all_single(output, input, output_split, input_split, group=placement.group)
        if placement.time_dispatch:
            placement.dispatch_s += _synchronized_time(output.device) - start


def _synchronized_time(device: torch.device) -> float:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)
    return time.perf_counter()


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """`[N, W]` -> `[N, W * element size]` uint8 view (float8 and every dtype travel over gloo so)."""
    rows = rows.contiguous()
    return rows.view(torch.uint8).view(rows.shape[0], rows.shape[1] * rows.element_size())


def expert_parallel_forward(x: torch.Tensor, input_ids: torch.Tensor, weights: MoEWeights, spec: MoESpec,
                            route, expert_outputs) -> torch.Tensor:
    """One MoE layer's routed experts under expert parallelism.

    :param route: `(x, input_ids, weights, spec) -> (ids [T, k], routing weights [T, k])`.
    :param expert_outputs: `(rows [M, H], local slot ids [M], weights) -> [M, H]` unweighted outputs.
    """
    placement = weights.placement
    ids, routing = route(x, input_ids, weights, spec)
    slots = choose_slots(ids, placement)
    count_load(slots, placement)
    dispatcher = AllToAllDispatch(placement)
    rows, local, handle = dispatcher.dispatch(x, slots)
    y = dispatcher.combine(expert_outputs(rows, local, weights), handle)
    return (y * routing[..., None].to(y.dtype)).sum(dim=1).to(x.dtype)
