"""Expert-parallel load balancing contract: where each expert's replicas live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class EplbSpec:
    """Shape of the placement problem."""

    num_layers: int
    """MoE layers."""
    num_experts: int
    """Logical experts per layer."""
    num_slots: int
    """Physical expert slots over all ranks (>= num_experts; the surplus holds replicas)."""
    num_ranks: int = 1
    """Expert-parallel ranks; slots are split evenly across them (EPLB needs it)."""
    num_nodes: int = 1
    """Machines the EP ranks span (ranks node-major, `num_ranks / num_nodes` each). Above 1, with
    `num_groups` a multiple of it, placement is hierarchical: expert groups are packed onto nodes first
    so a group's tokens stay inside one node; otherwise it is global."""
    num_groups: int = 1
    """Expert groups (contiguous expert ids) of group-limited routing; 1 when the model has none."""


@runtime_checkable
class EplbBackend(Protocol):
    """Computes a placement of logical experts onto physical slots from observed load."""

    spec: EplbSpec

    def rebalance(self, load: torch.Tensor) -> torch.Tensor:
        """Place experts so that the heaviest rank carries as little load as possible.

        :param load: `[num_layers, num_experts]` tokens routed to each expert over a window.
        :returns: `[num_layers, num_slots]` int64 logical expert id held by each physical slot; every
            expert appears at least once per layer.
        """
        ...
