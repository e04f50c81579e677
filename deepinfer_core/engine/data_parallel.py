"""Attention data parallelism: one engine core per DP rank, stepped in lockstep, behind one front-end.

`DataParallelEngine` looks like an `Engine` to `LLM`, `AsyncEngine` and the HTTP server. It holds one
`Engine` per data-parallel rank, each with its own scheduler, requests, block manager and cache (sized
from its own ranks' memory), all over one executor. A new request goes to the rank with the least
load (tokens of its unfinished requests, then most free cache blocks), or, with prefix caching, to
the rank that last took a prompt with the same first block when that rank is not much busier
(prefix affinity). Seeds a request does not give are drawn here, in arrival order, so a seeded run
does not depend on the rank a request lands on.

`step()` steps every core at once: each runs `Engine.step` on a thread of its own up to its executor
call, where `Lockstep` holds it until every core has either submitted a plan or finished its step
without one; the plans then go to the ranks together (`Executor.execute_all`), and a core with
nothing to do gets an empty plan: its ranks run a dummy step that joins the MoE layers' collectives,
as vLLM's data parallelism does.
"""

from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from deepinfer_core import plugins
from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine import engine as engine_module
from deepinfer_core.engine.engine import Engine
from deepinfer_core.executor.factory import make_executor
from deepinfer_core.executor.protocol import parallel_stats
from deepinfer_core.models import registry
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plan import StepPlan, StepResult
from deepinfer_core.sampling_params import SamplingParams

_AFFINITY_ENTRIES = 4096
"""First-block keys remembered for prefix affinity."""


def build_engine(config: EngineConfig, weights: dict[str, torch.Tensor] | None = None):
    """The engine `config` asks for: a `DataParallelEngine` when `data_parallel_size > 1`, else `Engine`."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, weights)
    return engine_module.Engine(config, weights)  # looked up on the module, so tests can stand in for it


class Lockstep:
    """Gathers one plan (or none) per DP core, runs them together, hands each core its result."""

    def __init__(self, executor, num_ranks: int) -> None:
        self.executor, self.num_ranks = executor, num_ranks
        self._cond = threading.Condition()
        self._plans: list[StepPlan | None] = [None] * num_ranks
        self._results: dict[int, StepResult] = {}
        self._error: BaseException | None = None

    def view(self, dp_rank: int) -> RankExecutor:
        return RankExecutor(self, dp_rank)

    def submit(self, dp_rank: int, plan: StepPlan) -> StepResult:
        """Called on core `dp_rank`'s thread: wait for the step of every core, return this core's result."""
        with self._cond:
            self._plans[dp_rank] = plan
            self._cond.notify_all()
            self._cond.wait_for(lambda: dp_rank in self._results or self._error is not None)
            if dp_rank not in self._results:
                raise self._error
            return self._results.pop(dp_rank)

    def run(self, futures: list[Future]) -> None:
        """On the caller's thread: serve the cores' submissions until every core's step has returned."""
        for future in futures:
            future.add_done_callback(lambda _: self._notify())
        while True:
            with self._cond:
                self._cond.wait_for(lambda: all(self._plans[d] is not None or futures[d].done()
                                                for d in range(self.num_ranks)))
                submitted = [d for d in range(self.num_ranks) if self._plans[d] is not None]
                if not submitted:
                    return
                plans = [plan if plan is not None else StepPlan(()) for plan in self._plans]
                self._plans = [None] * self.num_ranks
            try:
                results = self.executor.execute_all(plans)
            except BaseException as err:
                with self._cond:
                    self._error = err
                    self._cond.notify_all()
                raise
            with self._cond:
                self._results.update({d: results[d] for d in submitted})
                self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


class RankExecutor:
    """One DP core's executor: its plans go through the `Lockstep`."""

    def __init__(self, lockstep: Lockstep, dp_rank: int) -> None:
        self.lockstep, self.dp_rank = lockstep, dp_rank
        self.info = lockstep.executor.infos[dp_rank]

    def execute(self, plan: StepPlan) -> StepResult:
        return self.lockstep.submit(self.dp_rank, plan)

    def shutdown(self) -> None:
        """The front-end stops the shared executor."""


class DataParallelEngine:
    """`Engine`'s interface over `data_parallel_size` engine cores; see the module docstring."""

    def __init__(self, engine_config: EngineConfig, weights: dict[str, torch.Tensor] | None = None) -> None:
        model_config = registry.load_model_config(engine_config.model)
        config = engine_config.resolve(model_config)
        device = torch.device(config.device) if config.device else plugins.select_device()
        self.executor = make_executor(model_config, config, device, weights)
        num_ranks = config.data_parallel_size
        self.lockstep = Lockstep(self.executor, num_ranks)
        self.engines = [Engine(engine_config, executor=self.lockstep.view(d)) for d in range(num_ranks)]
        first = self.engines[0]
        self.config, self.model_config, self.tokenizer = first.config, first.model_config, first.tokenizer
        self.eos_token_ids, self.structured_output = first.eos_token_ids, first.structured_output
        self._pool = ThreadPoolExecutor(num_ranks, thread_name_prefix="deepinfer-dp")
        self._owner: dict[str, int] = {}
        self._tokens = [0] * num_ranks
        self._request_tokens: dict[str, int] = {}
        self._affinity: dict[bytes, int] = {}
        self._seed_source = random.Random(config.seed)

    # -- requests -----------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.engines[0].validate_prompt(prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request on the least loaded DP rank (see the module docstring)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        if sampling_params.seed is None:
            sampling_params = replace(sampling_params, seed=self._seed_source.getrandbits(63))
        rank = self.pick_rank(prompt_token_ids)
        self.engines[rank].add_request(request_id, prompt_token_ids, sampling_params, prompt=prompt)
        cost = (len(prompt_token_ids) + sampling_params.max_tokens) * sampling_params.n
        self._owner[request_id], self._request_tokens[request_id] = rank, cost
        self._tokens[rank] += cost
        if self.config.enable_prefix_caching and len(prompt_token_ids) >= BLOCK_SIZE:
            key = self._first_block(prompt_token_ids)
            self._affinity.pop(key, None)
            self._affinity[key] = rank
            if len(self._affinity) > _AFFINITY_ENTRIES:
                del self._affinity[next(iter(self._affinity))]

    def pick_rank(self, prompt_token_ids: list[int]) -> int:
        """The DP rank a new request goes to: least tokens in flight, then most free blocks; a rank that
        holds the prompt's first block wins while it carries at most one step's budget more."""
        loads = [(self._tokens[d], -engine.block_manager.num_free_blocks, d) for d, engine in enumerate(self.engines)]
        best = min(loads)[2]
        if self.config.enable_prefix_caching and len(prompt_token_ids) >= BLOCK_SIZE:
            cached = self._affinity.get(self._first_block(prompt_token_ids))
            if cached is not None and self._tokens[cached] <= self._tokens[best] + self.config.max_num_batched_tokens:
                return cached
        return best

    @staticmethod
    def _first_block(prompt_token_ids: list[int]) -> bytes:
        return torch.tensor(prompt_token_ids[:BLOCK_SIZE], dtype=torch.int64).numpy().tobytes()

    def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            self.engines[rank].abort(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._tokens[rank] -= self._request_tokens.pop(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def unfinished_request_ids(self) -> list[str]:
        return [request_id for engine in self.engines for request_id in engine.unfinished_request_ids()]

    @property
    def runner(self):
        raise AttributeError("the model runs in worker processes: this engine has no in-process runner")

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Step every DP core together; the outputs of all of them, in DP rank order."""
        futures = [self._pool.submit(engine.step) for engine in self.engines]
        self.lockstep.run(futures)
        outputs = [out for future in futures for out in future.result()]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def stats(self) -> dict:
        """Counters summed over the DP ranks, each rank's own under `data_parallel`, memory and EPLB."""
        per_rank = [engine.stats() for engine in self.engines]
        ratios = ("prefix_cache_hit_rate", "spec_mean_acceptance_length")  # recomputed from the sums
        total = {key: _summed([s[key] for s in per_rank]) for key in per_rank[0] if key not in ratios}
        queried = total.get("prefix_cache_queried_tokens", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
        if "spec_verify_steps" in total:
            steps = total["spec_verify_steps"]
            total["spec_mean_acceptance_length"] = (total["spec_accepted_tokens"] + steps) / steps if steps else 0.0
        total["data_parallel"] = per_rank
        total.update(parallel_stats(self.executor))
        return total

    def shutdown(self) -> None:
        self.executor.shutdown()
        for engine in self.engines:
            engine.structured_output.shutdown()
        self._pool.shutdown(wait=False)


def _summed(values: list):
    """One counter summed over the DP ranks; a histogram (a list) bin by bin."""
    if isinstance(values[0], list):
        return [sum(bins) for bins in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)
