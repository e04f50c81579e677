"""Reference expert-parallel load balancer: replicate the heaviest experts, then pack slots onto ranks.

Per layer, independently and deterministically (ties go to the lower expert id, then the lower rank):

1. Replication: each surplus slot goes to the expert whose load per replica is currently largest;
   an expert's load is split evenly across its replicas.
2. Packing: replicas are taken heaviest first and each goes to the least loaded rank that still has
   a free slot, so every rank ends with `num_slots / num_ranks` slots (greedy LPT with a slot cap).
   Two replicas of one expert may land on one rank when that balances best.
3. Within a rank, slots are ordered by expert id.

Vectorised over layers; the loops run over slots, not layers.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.eplb import EplbSpec


class ReferenceEplb:
    """Pure-PyTorch `EplbBackend`."""

    def __init__(self, spec: EplbSpec, device: torch.device) -> None:
        if spec.num_slots < spec.num_experts:
            raise ValueError(
                f"num_slots={spec.num_slots} is below num_experts={spec.num_experts}; "
                "every expert needs a slot"
            )
        if spec.num_ranks < 1 or spec.num_slots % spec.num_ranks:
            raise ValueError(
                f"num_slots={spec.num_slots} must split evenly over num_ranks={spec.num_ranks}; "
                "choose a surplus that makes it a multiple"
            )
        self.spec = spec
        self.device = torch.device(device)

    def rebalance(self, load: torch.Tensor) -> torch.Tensor:
        """Return `[num_layers, num_slots]` int64 logical expert per physical slot; see `EplbBackend`."""
        expected = [self.spec.num_layers, self.spec.num_experts]
        if list(load.shape) != expected:
            raise ValueError(f"load must be {expected}, got {list(load.shape)}")
        load = load.to(torch.float64)
        replica_counts = self._replicate(load)
        slot_experts = _expand_replicas(replica_counts, self.spec.num_slots)
        slot_loads = (load / replica_counts).gather(1, slot_experts)
        slot_ranks = self._pack(slot_loads)
        # Order slots rank-major, and by expert id inside a rank.
        order = (slot_ranks * self.spec.num_experts + slot_experts).argsort(dim=1, stable=True)
        return slot_experts.gather(1, order)

    def _replicate(self, load: torch.Tensor) -> torch.Tensor:
        """`[L, E]` int64 replica count per expert (at least 1, summing to num_slots per layer)."""
        counts = torch.ones_like(load, dtype=torch.int64)
        for _ in range(self.spec.num_slots - self.spec.num_experts):
            heaviest = (load / counts).argmax(dim=1, keepdim=True)
            counts.scatter_add_(1, heaviest, torch.ones_like(heaviest))
        return counts

    def _pack(self, slot_loads: torch.Tensor) -> torch.Tensor:
        """`[L, S]` int64 rank of each slot: heaviest first onto the least loaded rank with room."""
        num_layers, num_slots = slot_loads.shape
        num_ranks, device = self.spec.num_ranks, slot_loads.device
        capacity = num_slots // num_ranks
        order = slot_loads.argsort(dim=1, descending=True, stable=True)
        rank_loads = torch.zeros(num_layers, num_ranks, dtype=torch.float64, device=device)
        rank_sizes = torch.zeros(num_layers, num_ranks, dtype=torch.int64, device=device)
        slot_ranks = torch.empty(num_layers, num_slots, dtype=torch.int64, device=device)
        for position in range(num_slots):
            slot = order[:, position : position + 1]
            rank = rank_loads.masked_fill(rank_sizes >= capacity, float("inf")).argmin(dim=1, keepdim=True)
            rank_loads.scatter_add_(1, rank, slot_loads.gather(1, slot))
            rank_sizes.scatter_add_(1, rank, torch.ones_like(rank))
            slot_ranks.scatter_(1, slot, rank)
        return slot_ranks


def _expand_replicas(replica_counts: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`[L, S]` expert id of each replica, experts in id order, each repeated by its count."""
    expert_ids = torch.arange(replica_counts.shape[1], device=replica_counts.device)
    rows = [expert_ids.repeat_interleave(counts) for counts in replica_counts]
    return torch.stack(rows) if rows else expert_ids.new_empty(0, num_slots)
