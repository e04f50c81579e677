"""Reference expert-parallel load balancer: DeepSeek's EPLB policy, in plain PyTorch.

Global policy (one node, or expert groups that do not split over the nodes), per layer:

1. Replication: each surplus slot goes to the expert whose load per replica is currently largest;
   an expert's load is split evenly across its replicas.
2. Packing: replicas are taken heaviest first and each goes to the least loaded rank that still has
   a free slot, so every rank ends with `num_slots / num_ranks` slots (greedy LPT with a slot cap).
   Two replicas of one expert may land on one rank when that balances best.
3. Within a rank, slots are ordered by expert id.

Hierarchical policy (`num_nodes > 1` and `num_groups % num_nodes == 0`): the expert groups are first
packed onto nodes by their summed load (the same capped LPT, `num_groups / num_nodes` groups a node),
so a group's tokens never leave its node; then each node runs the global policy over its own experts,
slots and ranks. Deterministic: ties go to the lower expert id, then the lower rank. Vectorised over
layers; the loops run over slots, not layers.
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
        if spec.num_nodes < 1 or spec.num_ranks % spec.num_nodes:
            raise ValueError(f"num_ranks={spec.num_ranks} must split evenly over num_nodes={spec.num_nodes}")
        if spec.num_groups < 1 or spec.num_experts % spec.num_groups:
            raise ValueError(f"num_groups={spec.num_groups} must divide num_experts={spec.num_experts}")
        self.spec = spec
        self.device = torch.device(device)

    @property
    def is_hierarchical(self) -> bool:
        """Whether groups are packed onto nodes first (several nodes, groups that split over them)."""
        spec = self.spec
        return (spec.num_nodes > 1 and spec.num_groups % spec.num_nodes == 0
                and spec.num_slots % spec.num_nodes == 0)

    def rebalance(self, load: torch.Tensor) -> torch.Tensor:
        """Return `[num_layers, num_slots]` int64 logical expert per physical slot; see `EplbBackend`."""
        expected = [self.spec.num_layers, self.spec.num_experts]
        if list(load.shape) != expected:
            raise ValueError(f"load must be {expected}, got {list(load.shape)}")
        load = load.to(torch.float64)
        if not self.is_hierarchical:
            return place_globally(load, self.spec.num_slots, self.spec.num_ranks)
        return self._place_hierarchically(load)

    def _place_hierarchically(self, load: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        num_layers, nodes = load.shape[0], spec.num_nodes
        group_size = spec.num_experts // spec.num_groups
        group_loads = load.view(num_layers, spec.num_groups, group_size).sum(-1)
        group_nodes = balanced_packing(group_loads, nodes)  # [L, G]
        # experts of each node, in id order: groups sorted by (node, group id)
        group_order = (group_nodes * spec.num_groups + torch.arange(spec.num_groups)).argsort(dim=1)
        experts = (group_order[:, :, None] * group_size + torch.arange(group_size)).view(num_layers, nodes, -1)
        placements = []
        for node in range(nodes):
            node_experts = experts[:, node]  # [L, E / N] global ids
            local = place_globally(load.gather(1, node_experts), spec.num_slots // nodes, spec.num_ranks // nodes)
            placements.append(node_experts.gather(1, local))
        return torch.cat(placements, dim=1)


def place_globally(load: torch.Tensor, num_slots: int, num_ranks: int) -> torch.Tensor:
    """`[L, num_slots]` expert of each slot (rank-major) for float64 `load` `[L, E]`: replicate, then pack."""
    replica_counts = replicate(load, num_slots)
    slot_experts = _expand_replicas(replica_counts, num_slots)
    slot_loads = (load / replica_counts).gather(1, slot_experts)
    slot_ranks = balanced_packing(slot_loads, num_ranks)
    # Order slots rank-major, and by expert id inside a rank.
    order = (slot_ranks * load.shape[1] + slot_experts).argsort(dim=1, stable=True)
    return slot_experts.gather(1, order)


def replicate(load: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`[L, E]` int64 replica count per expert (at least 1, summing to `num_slots` per layer): each
    surplus slot to the expert with the largest load per replica."""
    counts = torch.ones_like(load, dtype=torch.int64)
    for _ in range(num_slots - load.shape[1]):
        heaviest = (load / counts).argmax(dim=1, keepdim=True)
        counts.scatter_add_(1, heaviest, torch.ones_like(heaviest))
    return counts


def balanced_packing(item_loads: torch.Tensor, num_packs: int) -> torch.Tensor:
    """`[L, n]` int64 pack of each item, `n / num_packs` items a pack: heaviest first onto the least
    loaded pack with room (greedy LPT with a cardinality cap)."""
    num_layers, num_items = item_loads.shape
    device = item_loads.device
    capacity = num_items // num_packs
    order = item_loads.argsort(dim=1, descending=True, stable=True)
    pack_loads = torch.zeros(num_layers, num_packs, dtype=torch.float64, device=device)
    pack_sizes = torch.zeros(num_layers, num_packs, dtype=torch.int64, device=device)
    packs = torch.empty(num_layers, num_items, dtype=torch.int64, device=device)
    for position in range(num_items):
        item = order[:, position : position + 1]
        pack = pack_loads.masked_fill(pack_sizes >= capacity, float("inf")).argmin(dim=1, keepdim=True)
        pack_loads.scatter_add_(1, pack, item_loads.gather(1, item).to(torch.float64))
        pack_sizes.scatter_add_(1, pack, torch.ones_like(pack))
        packs.scatter_(1, item, pack)
    return packs


def _expand_replicas(replica_counts: torch.Tensor, num_slots: int) -> torch.Tensor:
    """`[L, S]` expert id of each replica, experts in id order, each repeated by its count."""
    expert_ids = torch.arange(replica_counts.shape[1], device=replica_counts.device)
    rows = [expert_ids.repeat_interleave(counts) for counts in replica_counts]
    return torch.stack(rows) if rows else expert_ids.new_empty(0, num_slots)
