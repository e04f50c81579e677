"""Parallel layout: how the ranks of a world split the model (vLLM's option names and semantics).

A world of `tensor_parallel_size x data_parallel_size x context_parallel_size` ranks, laid out with
tensor parallelism innermost (vLLM's order): global rank `r = (dp * cp_size + cp) * tp_size + tp`.

- TP: the ranks of one `(dp, cp)` split attention heads and dense projections; they run one plan.
- CP: the ranks of one `(dp, tp)` split a long prompt's prefill.
- DP (attention data parallelism): each `(cp, tp)` slice of ranks has its own scheduler, requests
  and caches; with expert parallelism the MoE layers run in lockstep over all of them.
- EP: with `enable_expert_parallel`, the routed experts are spread over every rank of the world
  (EP size = TP x DP x CP, i.e. TP x DP without context parallelism, as vLLM defines it); without
  it every rank holds all experts and the EP group is the rank alone.

`ParallelConfig` is the validated layout; `ParallelGroups` the torch.distributed groups one rank
builds from it (`build_groups`, called by every rank in the same order, as `new_group` requires).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator


class EplbConfig(BaseModel):
    """Expert-parallel load balancing knobs (vLLM's `eplb_config`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_redundant_experts: NonNegativeInt = Field(
        0, description="Extra physical expert slots per MoE layer, over all EP ranks, holding replicas of "
        "busy experts; counts only with enable_eplb=True, and then num_experts + this must split evenly over "
        "the EP ranks (without EPLB the experts split unevenly, the first ranks taking one more).")
    window_size: PositiveInt = Field(1000, description="Steps of per-expert load the balancer looks back on.")
    step_interval: PositiveInt = Field(3000, description="Steps between two rebalances of the expert placement.")


class ParallelConfig(BaseModel):
    """The parallel layout of one engine's world (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: PositiveInt = Field(1, description="Ranks splitting attention heads and dense projections.")
    data_parallel_size: PositiveInt = Field(1, description="Attention data-parallel ranks, each with its own requests.")
    context_parallel_size: PositiveInt = Field(1, description="Ranks splitting one long prompt's prefill.")
    enable_expert_parallel: bool = Field(False, description="Spread the routed experts over every rank.")
    enable_eplb: bool = Field(False, description="Rebalance expert replicas by observed load (needs expert parallelism).")
    eplb_config: EplbConfig = Field(default_factory=EplbConfig)

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel=True (EPLB moves experts between EP ranks)")
        if self.eplb_config.num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_config.num_redundant_experts needs enable_eplb=True")
        return self

    @property
    def world_size(self) -> int:
        """Ranks in the world: TP x DP x CP."""
        return self.tensor_parallel_size * self.data_parallel_size * self.context_parallel_size

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks: the whole world with expert parallelism, else 1."""
        return self.world_size if self.enable_expert_parallel else 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """`(dp, cp, tp)` of global `rank`."""
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return rank // (tp * cp), rank // tp % cp, rank % tp

    def rank_of(self, dp: int, cp: int, tp: int) -> int:
        """Global rank at `(dp, cp, tp)`."""
        return (dp * self.context_parallel_size + cp) * self.tensor_parallel_size + tp

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of `kind` ("tp", "cp", "dp", "ep") as lists of global ranks, in a fixed order."""
        dp_n, cp_n, tp_n = self.data_parallel_size, self.context_parallel_size, self.tensor_parallel_size
        if kind == "tp":
            return [[self.rank_of(d, c, t) for t in range(tp_n)] for d in range(dp_n) for c in range(cp_n)]
        if kind == "cp":
            return [[self.rank_of(d, c, t) for c in range(cp_n)] for d in range(dp_n) for t in range(tp_n)]
        if kind == "dp":
            return [[self.rank_of(d, c, t) for d in range(dp_n)] for c in range(cp_n) for t in range(tp_n)]
        if kind == "ep":
            ranks = list(range(self.world_size))
            return [ranks] if self.enable_expert_parallel else [[r] for r in ranks]
        raise ValueError(f"unknown parallel group kind {kind!r}; one of {GROUP_KINDS}")

    def dp_leader(self, dp: int) -> int:
        """The global rank whose step result stands for DP rank `dp` (its first TP/CP rank)."""
        return self.rank_of(dp, 0, 0)

    def check_implemented(self) -> None:
        """Raise `NotImplementedError` naming the first layout this build cannot run yet."""
        if self.tensor_parallel_size > 1 and self.enable_expert_parallel:
            raise NotImplementedError(
                f"tensor and expert parallelism together: tensor_parallel_size={self.tensor_parallel_size} with "
                "enable_expert_parallel=True (tensor-parallel ranks hold a slice of every expert; expert "
                "parallelism a whole share)")
        if self.context_parallel_size > 1 and (self.world_size != self.context_parallel_size or self.enable_expert_parallel):
            raise NotImplementedError(
                f"context parallelism with other parallelism: context_parallel_size={self.context_parallel_size} "
                "combined with tensor, data or expert parallelism (context parallelism runs alone)")


GROUP_KINDS = ("tp", "cp", "dp", "ep")


@dataclass(frozen=True)
class GroupInfo:
    """One rank's view of one parallel dimension."""

    group: Any
    """The `torch.distributed` process group (None in a single-process world: no collectives needed)."""
    rank: int
    """This rank's index inside the group."""
    size: int
    """Ranks in the group."""
    ranks: tuple[int, ...] = (0,)
    """The group's global ranks, in group order (peers for point-to-point ops)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank belongs to, one `GroupInfo` per dimension, plus the layout it came from."""

    config: ParallelConfig
    rank: int
    """Global rank."""
    tp: GroupInfo
    cp: GroupInfo
    dp: GroupInfo
    ep: GroupInfo

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @classmethod
    def single(cls, config: ParallelConfig | None = None) -> ParallelGroups:
        """A world of one rank, no torch.distributed needed (every group is the rank alone)."""
        config = config or ParallelConfig()
        if config.world_size != 1:
            raise ValueError(f"ParallelGroups.single needs a world of 1 rank; this layout has {config.world_size}")
        one = GroupInfo(None, 0, 1, (0,))
        return cls(config, 0, one, one, one, one)


def build_groups(config: ParallelConfig, rank: int, timeout_s: float | None = None) -> ParallelGroups:
    """Create every group of `config` with `torch.distributed.new_group` and keep this rank's.

    Call on every rank of an initialised default group of `config.world_size` ranks, in the same order:
    each `new_group` call is collective over the whole world, whether or not the rank belongs to it.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    if config.world_size == 1:  # no layout: every rank a replica of the whole model, alone in each group
        alone = GroupInfo(dist.group.WORLD if world == 1 else None, 0, 1, (rank,))
        return ParallelGroups(config, rank, alone, alone, alone, alone)
    if world != config.world_size:
        raise ValueError(f"the torch.distributed world has {world} ranks but the parallel layout needs "
                         f"{config.world_size} (tensor x data x context parallel sizes)")
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    infos = {}
    for kind in GROUP_KINDS:
        for ranks in config.group_ranks(kind):
            group = dist.new_group(ranks, timeout=timeout) if world > 1 else dist.group.WORLD
            if rank in ranks:
                infos[kind] = GroupInfo(group, ranks.index(rank), len(ranks), tuple(ranks))
    return ParallelGroups(config, rank, infos["tp"], infos["cp"], infos["dp"], infos["ep"])
