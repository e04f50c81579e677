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
    step_peak_bytes: int | None = None
    """What the largest step needs beside the weights and the cache, measured at start-up (its peak,
    memory outside torch's allocator and the decode graphs' pool); None where it was not measured."""


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
    """Runs plans, each in two phases (vLLM v1's shape): `execute_model(plan)` queues the step's forward,
    then `sample(grammar_rows)` samples it with the constrained rows masked. The grammar rows travel as
    data, filled by the engine in between (in-process, while the forward runs on the device), so a
    constrained request whose input is still on the device decodes every step under any executor.
    `info` is fixed once built; steps come in order, each `execute_model` followed by its `sample`."""

    info: ModelSideInfo
    is_in_process: bool
    """The runner lives in the engine's process: `sample(..., late=True)` returns before the device has
    sampled, so the host may report the step before while it runs (`InFlightSteps`). Worker ranks answer
    a step whole. An executor that does not declare it counts as out of process."""

    def execute_model(self, plan: StepPlan) -> None:
        """Send `plan` to every rank: states, cache ops, the forward; the logits stay on the device."""

    def sample(self, grammar_rows=None, *, late: bool = False):
        """Sample the step `execute_model` ran, its constrained rows masked by `grammar_rows` (packed
        `[rows, ceil(vocab / 32)]` int32 on the host, a tensor or numpy array; None: no grammar); return
        rank 0's `StepResult`, or with `late` a function returning it (the in-process executor completes
        the step only when it is called)."""

    def execute(self, plan: StepPlan) -> StepResult:
        """`execute_model(plan)`, then `sample(None)`: a step with no grammar (cache flushes, dummy steps)."""

    def execute_all(self, plans: list[StepPlan]) -> list[StepResult]:
        """Run one plan per data-parallel rank at once (each on that DP rank's ranks, no grammar); their results."""

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""


def runner_info(runner, rank: int = 0) -> ModelSideInfo:
    """What `runner` tells the engine, with its memory share."""
    weights = sum(t.numel() * t.element_size() for t in (*runner.model.parameters(), *runner.model.buffers()))
    cache = sum(t.numel() * t.element_size() for layer in runner.kv_cache.layers
                for t in vars(layer).values() if isinstance(t, torch.Tensor))
    profile = getattr(runner, "memory_profile", None)
    peak = profile.reserved if profile is not None and profile.measured else None
    memory = RankMemory(rank, weights, cache, runner.num_blocks, peak)
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
