"""The executor protocol: what the engine calls to run a `StepPlan` on the model side, and what it
learns from the model side at start-up. The executors: `uni.py` (one runner in this process), `mp.py`
(worker processes, `worker.py` their side) and `torchrun.py` (rank 0 of a torchrun launch);
`factory.make_executor` picks one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.backends.parallel import ParallelConfig
from deepinfer_core.plan import StepPlan, StepResult


class WorkerError(RuntimeError):
    """A worker rank failed, died or hung; the engine cannot continue."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's share of the model and its cache, in bytes."""

    rank: int
    weights_bytes: int
    """Parameters and buffers this rank holds (its experts only, under expert parallelism)."""
    cache_bytes: int
    """Its KV cache and per-request state (sized from its own device's free memory)."""
    num_blocks: int


@dataclass(frozen=True)
class ModelSideInfo:
    """What the engine learns from the model side at start-up."""

    num_blocks: int
    num_slots: int
    block_size: int
    cache_fingerprint: bytes
    device: torch.device
    memory: RankMemory | None = None
    block_layout: tuple = ()
    """`kv_blocks.block_layout` of the model: what a cache block's bytes are (the prefix tiers' unit)."""


class Executor(Protocol):
    """Runs plans. `info` is fixed once built; `execute` is called once per step, in order."""

    info: ModelSideInfo
    is_in_process: bool
    """The runner lives in the engine's process and takes plans as they are (unpickled): a plan's grammar
    bitmask may be a function filled once the step's forward is launched, and a step may be launched
    (`launch`) and read later. Worker ranks (plans that must pickle) answer each plan whole. An executor
    that does not declare it counts as out of process."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run `plan` on every rank; return rank 0's result."""

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        """Run one plan per data-parallel rank at once (each on that DP rank's ranks); their results."""

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""


def runner_info(runner, rank: int = 0) -> ModelSideInfo:
    """What `runner` tells the engine, with its memory share."""
    weights = sum(t.numel() * t.element_size() for t in (*runner.model.parameters(), *runner.model.buffers()))
    cache = sum(t.numel() * t.element_size() for layer in runner.kv_cache.layers
                for t in vars(layer).values() if isinstance(t, torch.Tensor))
    memory = RankMemory(rank, weights, cache, runner.num_blocks)
    return ModelSideInfo(runner.num_blocks, runner.num_slots, BLOCK_SIZE, runner.cache_fingerprint, runner.device,
                         memory, runner.block_layout)


def parallel_stats(executor) -> dict:
    """Per-rank memory and rank 0's EPLB figures, as far as `executor` knows them (for `stats()`)."""
    stats = {}
    memory = getattr(executor, "memory", None)
    if memory:
        stats["rank_memory"] = [vars(m) for m in memory if m is not None]
    eplb = getattr(executor, "eplb_stats", None)
    if eplb:
        stats["eplb"] = dict(eplb)
    reports = getattr(executor, "rank_reports", None)
    if reports and all(r is not None for r in reports):
        stats["ranks"] = [{k: v for k, v in r.items() if k != "eplb"} for r in reports]
    return stats


def dp_rank_of(layout: ParallelConfig, rank: int) -> int:
    """The data-parallel rank whose plans global `rank` runs (0 for a world of replicas)."""
    return layout.coordinates(rank)[0] if layout.world_size > 1 else 0


def dp_leaders(layout: ParallelConfig) -> list[int]:
    """Per data-parallel rank, the global rank that answers its steps."""
    return [layout.dp_leader(dp) for dp in range(layout.data_parallel_size)]


def signalled_peer(procs: dict[int, object], grace_s: float = 1.0) -> tuple[int, int] | None:
    """The first of `procs` (rank -> `subprocess.Popen`) killed by a signal within `grace_s`, as
    `(rank, exit code)`; None once every one has exited otherwise, or the time is up. A rank that fails
    is most often the echo of another rank's death (a collective lost its peer): this finds that one."""
    deadline = time.monotonic() + grace_s
    while True:
        codes = {rank: proc.poll() for rank, proc in procs.items()}
        for rank, code in codes.items():
            if code is not None and code < 0:
                return rank, code
        if all(code is not None for code in codes.values()) or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
