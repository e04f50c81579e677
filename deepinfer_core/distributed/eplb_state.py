"""Expert placement on one EP rank: which experts it holds, their load, and moving them (EPLB).

`ExpertShards` is built by the runner when expert parallelism is on. It decides the initial
placement (every logical expert once, in order, then the redundant slots holding `e mod E`, as
vLLM lays them out; slots split rank-major, the first ranks holding one more when the EP size does
not divide them, as vLLM's linear placement does; EPLB needs an even split), tells the loader which experts this rank reads, and gives every MoE layer its
`ExpertPlacement`. With EPLB it also keeps the load window: after every step (dummy steps too, so
all ranks count alike) the per-slot counts the MoE backend added on the device are folded into a ring
of `window_size` steps of logical-expert load, on the device, with no host sync. Every
`step_interval` steps all ranks all-reduce the window, run the `EplbBackend` (DeepSeek's policy,
hierarchical over several nodes), and move the expert weights that change place with
torch.distributed point-to-point ops, between two steps (`expert_moves`); the pause is measured.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from deepinfer_core import plugins
from deepinfer_core.backends.eplb import EplbSpec
from deepinfer_core.backends.moe import ExpertPlacement, MoEWeights, ep_slot_share
from deepinfer_core.backends.parallel import GroupInfo, ParallelConfig, ParallelGroups
from deepinfer_core.distributed.expert_moves import move_experts

logger = logging.getLogger(__name__)

EXPERT_TENSORS = ("gate_up", "down", "gate_up_scale", "down_scale")
"""The `MoEWeights` fields that hold one row per local expert slot."""


def make_expert_shards(parallel: ParallelGroups, model_config, device: torch.device,
                       time_dispatch: bool = False) -> ExpertShards | None:
    """This rank's `ExpertShards` under expert parallelism (None without). Under torchrun the EP ranks
    span `WORLD_SIZE / LOCAL_WORLD_SIZE` nodes (hierarchical EPLB when that is above 1)."""
    if not parallel.config.enable_expert_parallel:
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", parallel.world_size))
    num_nodes = max(1, parallel.world_size // max(local_world, 1))
    shards = ExpertShards(parallel.config, parallel.ep, model_config.num_hidden_layers, model_config.n_routed_experts,
                          device, num_nodes)
    for placement in shards.placements:
        placement.time_dispatch = time_dispatch
    return shards


def eplb_split_error(num_experts: int, num_slots: int, ep_size: int) -> str:
    """Why EPLB cannot place `num_slots` over `ep_size` ranks, and the redundant-slot count that would do."""
    redundant = num_slots - num_experts
    fit = redundant + (-num_slots) % ep_size
    return (f"with enable_eplb=True the {num_slots} expert slots (n_routed_experts {num_experts} + "
            f"eplb_config.num_redundant_experts {redundant}) must split evenly over the {ep_size} EP ranks "
            f"(the balancer gives every rank as many slots); set eplb_config.num_redundant_experts to {fit}, "
            f"or turn EPLB off: expert parallelism alone splits the experts unevenly")


def initial_slot_experts(num_experts: int, num_slots: int) -> list[int]:
    """Logical expert of every physical slot before any load is seen: 0..E-1, then `s mod E`."""
    return [slot % num_experts for slot in range(num_slots)]


def placement_maps(slot_experts: torch.Tensor, num_experts: int, max_replicas: int):
    """`(expert_slots [E, max_replicas] padded with -1, replica_counts [E])` of a `phy2log` row."""
    expert_slots = torch.full((num_experts, max_replicas), -1, dtype=torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    for slot, expert in enumerate(slot_experts.tolist()):
        expert_slots[expert, counts[expert]] = slot
        counts[expert] += 1
    return expert_slots, counts


@dataclass
class BalanceStats:
    """What the last rebalance saw and did (reported on /metrics and by `bench/ep_scale.py`)."""

    num_rebalances: int = 0
    balance_before: float = 1.0
    """Busiest EP rank's load / mean rank load over the window, with the placement in use (mean over layers)."""
    balance_after: float = 1.0
    """The same window's balance under the new placement."""
    pause_s: float = 0.0
    """How long serving stopped for the last rebalance (all-reduce, policy, weight moves)."""
    num_moved: int = 0
    """Expert slots whose weights changed on this rank at the last rebalance."""


class ExpertShards:
    """This rank's share of the routed experts and (with EPLB) their rebalancing; see the module docstring."""

    def __init__(self, layout: ParallelConfig, ep: GroupInfo, num_layers: int, num_experts: int,
                 device: torch.device, num_nodes: int = 1) -> None:
        self.layout, self.ep, self.device = layout, ep, device
        eplb = layout.eplb_config
        self.num_experts = num_experts
        self.num_slots = num_experts + (eplb.num_redundant_experts if layout.enable_eplb else 0)
        if layout.enable_eplb and self.num_slots % ep.size:
            raise ValueError(eplb_split_error(num_experts, self.num_slots, ep.size))
        self.first_slot, self.num_local_slots = ep_slot_share(self.num_slots, ep.size, ep.rank)
        self.max_replicas = self.num_slots - num_experts + 1
        self.slot_experts = torch.tensor([initial_slot_experts(num_experts, self.num_slots)] * num_layers)
        self.slot_load = torch.zeros(num_layers, self.num_slots, dtype=torch.int64, device=device)
        self.placements = [self._placement(layer) for layer in range(num_layers)]
        self.stats = BalanceStats()
        self.num_steps = 0
        self.window = None
        if layout.enable_eplb:
            self.window = torch.zeros(eplb.window_size, num_layers, num_experts, dtype=torch.int64, device=device)
            self.balancer = plugins.make_eplb(
                EplbSpec(num_layers, num_experts, self.num_slots, ep.size, num_nodes), device)

    def _placement(self, layer: int) -> ExpertPlacement:
        expert_slots, counts = placement_maps(self.slot_experts[layer], self.num_experts, self.max_replicas)
        return ExpertPlacement(self.ep.group, self.ep.rank, self.ep.size, self.num_local_slots,
                               self.slot_experts[layer].to(self.device), expert_slots.to(self.device),
                               counts.to(self.device), self.slot_load[layer])

    def plans(self, plans: list) -> list:
        """`plans` with every layer's `MoESpec` marked expert-parallel (local slots sized for this rank)."""
        return [replace(p, moe=replace(p.moe, expert_parallel=True, ep_size=self.ep.size, ep_rank=self.ep.rank,
                                       num_slots=self.num_slots))
                for p in plans]

    def local_experts(self, layer: int) -> list[int]:
        """Logical expert of each of this rank's slots of `layer` (what the loader reads)."""
        return self.slot_experts[layer, self.first_slot : self.first_slot + self.num_local_slots].tolist()

    def select_local(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-model weights (internal names) cut to this rank's expert slots."""
        out = {}
        for name, tensor in weights.items():
            parts = name.split(".")
            v4 = len(parts) > 4 and parts[0] == "model" and parts[3:5] == ["mlp", "experts"]
            v41 = len(parts) > 3 and parts[0] == "layers" and parts[2:4] == ["ffn", "experts"]  # DeepSeek-V4.1
            if v4 or v41:
                index = torch.tensor(self.local_experts(int(parts[2 if v4 else 1])), device=tensor.device)
                tensor = tensor.index_select(0, index)
            out[name] = tensor
        return out

    @property
    def dispatch_s(self) -> float:
        """Seconds in the dispatch collectives of every layer (while timing is on)."""
        return sum(p.dispatch_s for p in self.placements)

    def attach(self, moe_weights: list[MoEWeights]) -> None:
        """Give every MoE layer's weights its placement."""
        for weights, placement in zip(moe_weights, self.placements, strict=True):
            weights.placement = placement

    # -- EPLB -------------------------------------------------------------------------------------

    def after_step(self, moe_weights: list[MoEWeights]) -> None:
        """Fold this step's counts into the window; every `step_interval` steps, rebalance."""
        if self.window is None:
            return
        eplb = self.layout.eplb_config
        logical = torch.zeros(self.window.shape[1:], dtype=torch.int64, device=self.device)
        slot_experts = torch.stack([p.slot_experts for p in self.placements])
        self.window[self.num_steps % eplb.window_size] = logical.scatter_add_(1, slot_experts, self.slot_load)
        self.slot_load.zero_()
        self.num_steps += 1
        if self.num_steps % eplb.step_interval == 0:
            self.rebalance(moe_weights)

    def rebalance(self, moe_weights: list[MoEWeights]) -> None:
        """All-reduce the window, place experts anew and move the weights that change place."""
        start = time.perf_counter()
        load = self.window.sum(0)
        if self.ep.group is not None and self.ep.size > 1:
            dist.all_reduce(load, group=self.ep.group)
        load = load.cpu()
        new = self.balancer.rebalance(load).cpu()
        before = rank_balance(self.slot_experts, load, self.ep.size)
        after = rank_balance(new, load, self.ep.size)
        moved = move_experts(moe_weights, self.slot_experts, new, self.ep, EXPERT_TENSORS)
        self.slot_experts = new
        for layer, placement in enumerate(self.placements):
            expert_slots, counts = placement_maps(new[layer], self.num_experts, self.max_replicas)
            placement.slot_experts.copy_(new[layer])
            placement.expert_slots.copy_(expert_slots)
            placement.replica_counts.copy_(counts)
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize(self.device)
        pause = time.perf_counter() - start
        self.stats = BalanceStats(self.stats.num_rebalances + 1, before, after, pause, moved)
        logger.info("EPLB rebalance %d: balance %.3f -> %.3f (busiest rank / mean), %d slots moved here, "
                    "paused %.1f ms", self.stats.num_rebalances, before, after, moved, pause * 1e3)


def rank_balance(slot_experts: torch.Tensor, load: torch.Tensor, num_ranks: int) -> float:
    """Mean over layers of busiest rank / mean rank, each expert's `load` split evenly over its replicas."""
    load = load.to(torch.float64)
    counts = torch.zeros_like(load).scatter_add_(1, slot_experts, torch.ones_like(slot_experts, dtype=torch.float64))
    slot_loads = (load / counts.clamp(min=1)).gather(1, slot_experts)
    ranks = slot_loads.view(slot_loads.shape[0], num_ranks, -1).sum(-1)
    mean = ranks.mean(-1)
    per_layer = torch.where(mean > 0, ranks.max(-1).values / mean.clamp(min=1e-30), torch.ones_like(mean))
    return float(per_layer.mean())
