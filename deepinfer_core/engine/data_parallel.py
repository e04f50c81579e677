"""Attention data parallelism: one engine core per DP rank, in that rank's process, behind a thin front end.

`DataParallelEngine` looks like an `Engine` to `LLM`, `AsyncEngine` and the HTTP server. Each DP rank
runs its own engine core (`engine.dp_core`: scheduler, block manager, cache, output processing and
its runner) in a process of its own, stepping on its own loop. The front end only routes and merges:
a new request goes to the rank with the least load (tokens of its unfinished requests, then most free
cache blocks as the rank last reported them), or, with prefix caching, to the rank that last took a
prompt with the same first block when that rank is not much busier (prefix affinity). Seeds a request
does not give are drawn here, in arrival order, so a seeded run does not depend on the rank a request
lands on. `step()` returns whatever outputs the cores have sent since the last call (waiting briefly
for the first): one poll of one socket, whatever the number of ranks. The only coupling between
cores is the MoE lockstep under expert parallelism, which the cores agree on among themselves
(`dp_core.StepRounds`); the front end takes no part in it.

Layouts: each DP rank's core runs in the process of its first rank; with tensor parallelism its other
ranks are processes of their own that the core drives each step over their gloo group
(`executor.broadcast`). Under torchrun each DP rank's first rank hosts its core, addressed by two
tcp:// pyzmq addresses, with rank 0 fronting the API (`engine.dp_torchrun`).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace

import torch

from deepinfer_core import plugins
from deepinfer_core.backends.attention import BLOCK_SIZE
from deepinfer_core.config import EngineConfig
from deepinfer_core.distributed import context_parallel
from deepinfer_core.engine import dp_protocol as proto
from deepinfer_core.engine import dp_torchrun
from deepinfer_core.engine import engine as engine_module
from deepinfer_core.engine.dp_client import CoreClient
from deepinfer_core.engine.input import check_image_layout, check_prompt, check_sampling_params
from deepinfer_core.executor.protocol import WorkerError
from deepinfer_core.executor.torchrun import launched_by_torchrun
from deepinfer_core.models import registry, tensor_parallel
from deepinfer_core.outputs import RequestOutput, SpecDecodeMetrics
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.structured_output.manager import StructuredOutputManager
from deepinfer_core.tokenizer import load_tokenizer

_AFFINITY_ENTRIES = 4096
"""First-block keys remembered for prefix affinity."""

_STEP_WAIT_S = 0.1
"""Longest `step()` waits for the cores' first message before returning nothing."""

_PER_RANK_LISTS = ("rank_memory", "ranks")
"""`stats()` entries that are per-rank lists: concatenated over the cores, not summed."""


def build_engine(config: EngineConfig, weights: dict[str, torch.Tensor] | None = None):
    """The engine `config` asks for: a `DataParallelEngine` when `data_parallel_size > 1`, else `Engine`."""
    if config.data_parallel_size > 1:
        return DataParallelEngine(config, weights)
    return engine_module.Engine(config, weights)  # looked up on the module, so tests can stand in for it


def check_layout(model_config, config: EngineConfig) -> None:
    """Refuse, before any core starts, the data-parallel layouts the cores cannot run yet (context
    parallelism with data parallelism: `ParallelConfig.check_implemented`)."""
    layout = config.parallel_config
    layout.check_implemented()
    tensor_parallel.check_tensor_parallel(model_config, config.tensor_parallel_size)
    context_parallel.check_context_parallel(model_config, config)
    model_config.capabilities.check_parallel(model_config.model_type, "expert", layout.ep_size)


class DataParallelEngine:
    """`Engine`'s interface over `data_parallel_size` engine cores; see the module docstring."""

    def __init__(self, engine_config: EngineConfig, weights: dict[str, torch.Tensor] | None = None) -> None:
        model_config = registry.load_model_config(engine_config.model)
        config = engine_config.resolve(model_config)
        check_layout(model_config, config)
        device = torch.device(config.device) if config.device else plugins.select_device()
        self.config, self.model_config = config, model_config
        self.tokenizer = load_tokenizer(config.model, model_config)
        self.eos_token_ids = model_config.eos_token_ids
        self.structured_output = StructuredOutputManager(self.tokenizer, model_config.vocab_size,
                                                         self.eos_token_ids, pin_memory=False)
        """Compiles grammars to check them (`LLM` and the server wait on it); each core compiles its own."""
        if launched_by_torchrun():  # every rank hosts its core; only rank 0 returns from here
            self.cores = dp_torchrun.start_cores(model_config, engine_config, device, weights)
        else:
            self.cores = CoreClient.spawn(model_config, engine_config, device, weights)
        num_ranks = config.data_parallel_size
        self._owner: dict[str, int] = {}
        self._tokens = [0] * num_ranks
        self._request_tokens: dict[str, int] = {}
        self._affinity: dict[bytes, int] = {}
        self._seed_source = random.Random(config.seed)
        self._received: list = []
        """Messages read while waiting for something else (stats): handed out by the next `step()`."""
        self._last_heard = time.monotonic()
        self.host_s, self.num_steps, self.num_core_steps = 0.0, 0, 0
        """Time `step()` spent on the host, waiting excluded; its calls; the core steps it merged (bench)."""

    # -- requests -----------------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.config.max_model_len)

    def prepare_images(self, prompt_token_ids: list[int], images: list):
        """Image input is not carried to the DP ranks yet: `NotImplementedError` (`check_image_layout`)."""
        check_image_layout(self.config)  # names the whole layout
        raise NotImplementedError("image input with parallelism: data_parallel_size > 1")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None, images: tuple = ()) -> None:
        """Queue a request on the least loaded DP rank (see the module docstring); raises `ValueError`
        on bad input here, before it is sent."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        check_sampling_params(sampling_params, self.model_config.vocab_size, self.tokenizer, self.eos_token_ids,
                              token_history=True)
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer (none found); use stop_token_ids")
        if sampling_params.seed is None:
            sampling_params = replace(sampling_params, seed=self._seed_source.getrandbits(63))
        rank = self.pick_rank(prompt_token_ids)
        self.cores.send(rank, proto.AddRequest(request_id, list(prompt_token_ids), sampling_params, prompt))
        cost = (len(prompt_token_ids) + sampling_params.max_tokens) * sampling_params.n
        if not self._owner:
            self._last_heard = time.monotonic()
        if self._tokens[rank] == 0:  # an idle core has had nothing to say: its silence starts now
            self.cores.last_heard[rank] = time.monotonic()
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
        free = self.cores.num_free_blocks
        best = min(range(len(self._tokens)), key=lambda d: (self._tokens[d], -free[d], d))
        if self.config.enable_prefix_caching and len(prompt_token_ids) >= BLOCK_SIZE:
            cached = self._affinity.get(self._first_block(prompt_token_ids))
            if cached is not None and self._tokens[cached] <= self._tokens[best] + self.config.max_num_batched_tokens:
                return cached
        return best

    @staticmethod
    def _first_block(prompt_token_ids: list[int]) -> bytes:
        return torch.tensor(prompt_token_ids[:BLOCK_SIZE], dtype=torch.int64).numpy().tobytes()

    def abort(self, request_id: str) -> None:
        """Abort on its core; its outputs still on the way are dropped."""
        rank = self._owner.get(request_id)
        if rank is not None:
            self.cores.send(rank, proto.Abort(request_id))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._tokens[rank] -= self._request_tokens.pop(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._owner)

    @property
    def runner(self):
        raise AttributeError("the model runs in the engine cores' processes: this engine has no in-process runner")

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """The outputs every core sent since the last call, waiting up to `_STEP_WAIT_S` for the first."""
        start = time.perf_counter()
        messages, self._received = self._received, []
        waited = 0.0
        if not messages and self._owner:
            messages = self.cores.receive(_STEP_WAIT_S)
            waited = self.cores.waited_s
        outputs = self._merge(messages)
        self.host_s += time.perf_counter() - start - waited
        self.num_steps += 1
        return outputs

    def _merge(self, messages: list) -> list[RequestOutput]:
        outputs = []
        if messages:
            self._last_heard = time.monotonic()
        elif self._owner and time.monotonic() - self._last_heard > self.config.worker_timeout_s:
            self.cores.shutdown(wait_s=0.5)
            raise WorkerError(f"no engine core sent anything for {self.config.worker_timeout_s:g} s with "
                              f"{len(self._owner)} requests in flight (worker_timeout_s)")
        if self._owner:
            self.cores.check_heartbeats({rank for rank, tokens in enumerate(self._tokens) if tokens > 0},
                                        self.config.worker_heartbeat_timeout_s)
        for message in messages:
            if not isinstance(message, proto.Outputs):
                continue
            self.cores.num_free_blocks[message.dp_rank] = message.num_free_blocks
            self.num_core_steps += 1
            for out in message.outputs:
                if out.request_id not in self._owner:  # aborted here while the core stepped it
                    continue
                if out.finished:
                    self._forget(out.request_id)
                outputs.append(out)
        return outputs

    def stats(self) -> dict:
        """Counters summed over the DP ranks, each rank's own under `data_parallel`, memory and EPLB."""
        for dp in range(self.cores.num_cores):
            self.cores.send(dp, proto.QueryStats())
        per_rank: dict[int, dict] = {}
        while len(per_rank) < self.cores.num_cores:
            for message in self.cores.receive(1.0, what="a stats query"):
                if isinstance(message, proto.Stats):
                    per_rank[message.dp_rank] = message.stats
                else:
                    self._received.append(message)
        return merge_stats([per_rank[dp] for dp in range(self.cores.num_cores)])

    def shutdown(self) -> None:
        self.cores.shutdown()
        self.structured_output.shutdown()


def merge_stats(per_rank: list[dict]) -> dict:
    """The ranks' counters summed (ratios recomputed from the sums), per-rank lists concatenated, rank
    0's EPLB figures, and each rank's own counters under `data_parallel`."""
    ratios = ("prefix_cache_hit_rate", *(key for key, _ in SpecDecodeMetrics.RATIO_STATS))
    skip = (*ratios, *_PER_RANK_LISTS, "eplb")
    total = {key: _summed([s[key] for s in per_rank]) for key in per_rank[0] if key not in skip}
    queried = total.get("prefix_cache_queried_tokens", 0)
    total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
    if "spec_verify_steps" in total:  # acceptance length and per-slot means from the summed counters
        total.update(SpecDecodeMetrics.from_stats(total).to_stats())
    for key in _PER_RANK_LISTS:
        if key in per_rank[0]:
            total[key] = [entry for s in per_rank for entry in s.get(key, [])]
    if "eplb" in per_rank[0]:
        total["eplb"] = per_rank[0]["eplb"]
    total["data_parallel"] = per_rank
    return total


def _summed(values: list):
    """One counter summed over the DP ranks; a histogram (a list) bin by bin."""
    if isinstance(values[0], list):
        return [sum(bins) for bins in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)
