"""The start-up memory profile: run the largest step the scheduler can produce once, after the weights
load and before the KV cache is sized, and measure what it allocates beyond the weights.

Estimates miss transients (FP4 prefill dequantises a layer's whole expert set per call, 12.9 GB at
V4-Flash size); a cache sized without them runs out of memory mid-request. The worst step: the whole
token budget (`max_num_batched_tokens`) in one step over `max_num_seqs` sequences, one of them a chunk
at the end of a `max_model_len` context (attention reads a full context), every sequence sampled with
top-k, top-p and logprobs. When decode graphs will be captured, a decode step at their largest batch is
measured too: their private pool holds that much beside the cache. The step runs on a temporary cache
and input batch of its own, which are freed after it, so no request, cache block, RNG or expert-load
counter is left changed.

A device whose plugin offers no `MemoryCounters` (the CPU) is "not measured": the cache is sized from
free memory alone, as before, and the log says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from deepinfer_core.backends.memory import MemoryCounters
from deepinfer_core.backends.sampling_tensors import prepare_sampling_tensors
from deepinfer_core.kv.cache import KVCache
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.worker.graphs import capture_sizes
from deepinfer_core.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

GIB = 2**30
WORST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)
"""Every filter the sampler has on every row: its largest working set (sorts and log-softmax over the vocabulary)."""


@dataclass(frozen=True)
class MemoryProfile:
    """What the largest step needs beyond the weights and the cache, in bytes (zeros when not measured)."""

    measured: bool
    free: int = 0
    """Device bytes free after the weights, before the profile (the cache's budget is a fraction of it)."""
    peak_transient: int = 0
    """The most torch allocated during the largest step above what was live before it (the step's own
    temporary cache excluded)."""
    non_torch: int = 0
    """Device bytes the step took outside torch's allocator (library workspaces, communicators)."""
    graph_reserve: int = 0
    """The peak of a decode step at the largest captured batch: what the decode graphs' pool will hold."""
    num_tokens: int = 0
    num_seqs: int = 0
    seconds: float = 0.0
    reason: str = ""
    """Why the peak was not measured (empty when it was)."""

    @property
    def reserved(self) -> int:
        """Bytes the cache's budget leaves to the steps: the peak, non-torch memory and the graphs' pool."""
        return self.peak_transient + self.non_torch + self.graph_reserve

    def describe(self) -> str:
        """One line for the log."""
        if not self.measured:
            return f"the largest step's peak not measured ({self.reason}): the KV cache is sized without it"
        return (f"the largest step ({self.num_tokens} tokens over {self.num_seqs} sequences, sampling included) "
                f"peaks at {size(self.peak_transient)} above the weights, +{size(self.non_torch)} outside "
                f"torch's allocator; decode graphs reserve {size(self.graph_reserve)} (measured in "
                f"{self.seconds:.1f} s, {size(self.free)} free after the weights)")


def size(num_bytes: int) -> str:
    """Bytes for a person: GiB from 1 GiB up, else MiB."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def not_measured(reason: str) -> MemoryProfile:
    return MemoryProfile(measured=False, reason=reason)


def worst_step(num_tokens: int, num_seqs: int, max_model_len: int, first_block: int = 1
               ) -> tuple[StepPlan, int]:
    """The largest step: `num_tokens` tokens over `num_seqs` new sequences (at most `max_model_len` each),
    the first a chunk ending at `max_model_len` (a full context behind it), each sampled; and the cache
    blocks it holds (ids from `first_block`)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths, left = [], num_tokens
    for i in range(num_seqs):
        take = min(max_model_len, left - (num_seqs - 1 - i))
        if take < 1:
            break
        lengths.append(take)
        left -= take
    news, requests, block = [], [], first_block
    for i, length in enumerate(lengths):
        start = max_model_len - length if i == 0 else 0
        num_blocks = -(-(start + length) // BLOCK_SIZE)
        blocks = tuple(range(block, block + num_blocks))
        block += num_blocks
        request_id = f"memory-profile-{i}"
        news.append(NewRequest(request_id, i, blocks, start + length, WORST_SAMPLING, seed=i))
        requests.append(ScheduledRequest(request_id, start, tuple([1] * length), is_sampled=True))
    return StepPlan(tuple(requests), new_requests=tuple(news)), block - first_block


def decode_step(num_seqs: int, width: int) -> tuple[StepPlan, int]:
    """A decode-shaped step: `num_seqs` sequences of `width` tokens each (the last token and its drafts)."""
    news = [NewRequest(f"memory-profile-{i}", i, (i + 1,), width, WORST_SAMPLING, seed=i) for i in range(num_seqs)]
    requests = [ScheduledRequest(n.request_id, 0, (1,) * width, is_sampled=True, num_draft_tokens=width - 1)
                for n in news]
    return StepPlan(tuple(requests), new_requests=tuple(news)), num_seqs


def run_step(loaded, sampler, counters: MemoryCounters, plan: StepPlan, num_blocks: int) -> int:
    """Run `plan`'s forward and sampling on a temporary cache of `num_blocks` blocks; the peak bytes
    allocated above what was live once that cache was built."""
    cache = KVCache(loaded.plans, num_blocks, len(plan.requests), loaded.dtype, loaded.device)
    inputs = InputBatch(loaded.model, loaded.config, loaded.plans, loaded.parallel, loaded.device,
                        loaded.num_trim_kept)
    counters.synchronize()
    base = counters.allocated()
    counters.reset_peak()
    states = inputs.update_states(plan)  # as the runner's steps do (the model's forward is in inference mode)
    ctx, logits_rows, sampled, _, _ = inputs.prepare_inputs(plan, states)
    logits = loaded.model(ctx, cache.layers, logits_rows)
    rows = [r for i in sampled for r in [i] * (plan.requests[i].num_draft_tokens + 1)]
    tensors = prepare_sampling_tensors([states[i].sampling_params for i in rows], [states[i].seed for i in rows],
                                       [0] * len(rows), loaded.config.eos_token_ids, loaded.device,
                                       loaded.config.vocab_size)
    sampler.sample(logits[: len(rows)], tensors)
    counters.synchronize()
    return max(0, counters.peak_allocated() - base)


def profile_memory(loaded, sampler, counters: MemoryCounters | None, graphs_width: int = 0) -> MemoryProfile:
    """Measure the largest step (and, `graphs_width` > 0, a decode step at the largest captured batch of
    that many tokens per request) on `loaded`'s model; not measured without `counters`.

    :raises MemoryError: the largest step itself does not fit beside the weights, with the numbers and
        what to change.
    """
    cfg = loaded.engine_config
    if counters is None:
        return not_measured(f"no plugin offers memory counters for {loaded.device}")
    if loaded.parallel.cp.size > 1:
        return not_measured("context-parallel prefill splits its steps over the ranks")
    start = time.perf_counter()
    counters.synchronize()
    counters.empty_cache()
    free, _ = counters.mem_get_info()
    reserved = counters.reserved()
    plan, num_blocks = worst_step(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len)
    with torch.random.fork_rng(devices=[loaded.device] if loaded.device.type != "cpu" else [],
                               device_type=loaded.device.type):
        try:
            peak = run_step(loaded, sampler, counters, plan, num_blocks)
            graphs = 0
            if graphs_width:
                size = capture_sizes(cfg.max_num_seqs, cfg.cuda_graph_sizes)[-1]
                graphs = run_step(loaded, sampler, counters, *decode_step(size, graphs_width))
        except torch.OutOfMemoryError as err:
            raise MemoryError(_step_too_large(cfg, plan, free)) from err
        finally:
            if loaded.experts is not None:  # the step's expert loads are no traffic to balance
                loaded.experts.slot_load.zero_()
            if getattr(loaded.model, "final_streams", None) is not None:  # kept for a drafter: not a real step's
                loaded.model.final_streams = None
    now_free, _ = counters.mem_get_info()
    non_torch = max(0, (free - now_free) - (counters.reserved() - reserved))
    counters.empty_cache()
    return MemoryProfile(True, free, peak, non_torch, graphs, plan.num_tokens, len(plan.requests),
                         time.perf_counter() - start)


def _step_too_large(cfg, plan: StepPlan, free: int) -> str:
    return (f"the largest step ({plan.num_tokens} tokens over {len(plan.requests)} sequences, max_model_len "
            f"{cfg.max_model_len}) ran out of device memory at start-up: {size(free)} were free after the "
            f"weights. Lower max_num_batched_tokens (the largest prefill chunk, now {cfg.max_num_batched_tokens}), "
            f"max_num_seqs (now {cfg.max_num_seqs}) or max_model_len, or spread the model over more devices "
            "(tensor or expert parallelism).")


def no_room(cfg, profile: MemoryProfile, free: int, per_block: int, per_slot: int, blocks: int) -> str:
    """The start-up error of a cache too small for one max-length request, with the sum that led to it."""
    needed = -(-cfg.max_model_len // BLOCK_SIZE)
    step = (f" - {size(profile.reserved)} for the largest step ({profile.num_tokens} tokens over "
            f"{profile.num_seqs} sequences, measured: {size(profile.peak_transient)} peak + "
            f"{size(profile.non_torch)} outside torch + {size(profile.graph_reserve)} decode graphs)"
            if profile.measured else " (the largest step's peak not measured)")
    return (f"the KV cache has no room for one {cfg.max_model_len}-token request: gpu_memory_utilization "
            f"{cfg.gpu_memory_utilization} of {size(free)} free after the weights"
            f" - {size(cfg.max_num_seqs * per_slot)} of state for max_num_seqs={cfg.max_num_seqs} slots"
            f"{step} leaves {blocks} blocks of {per_block / 2**20:.2f} MiB, and one request needs {needed}. "
            f"Lower max_num_batched_tokens (the largest prefill chunk, now {cfg.max_num_batched_tokens}), "
            f"max_num_seqs or max_model_len, raise gpu_memory_utilization, or spread the model over more "
            "devices (tensor or expert parallelism).")


def configured_too_large(cfg, profile: MemoryProfile, per_block: int, per_slot: int) -> str:
    """The start-up error of a `num_kv_blocks` that does not fit beside the measured step."""
    cache = cfg.num_kv_blocks * per_block + cfg.max_num_seqs * per_slot
    return (f"num_kv_blocks={cfg.num_kv_blocks} does not fit: its cache ({size(cache)} with "
            f"max_num_seqs={cfg.max_num_seqs} slots) and the largest step ({size(profile.reserved)} measured, "
            f"{profile.num_tokens} tokens over {profile.num_seqs} sequences) exceed the {size(profile.free)} "
            "free after the weights. Lower num_kv_blocks, max_num_batched_tokens (the largest prefill chunk) "
            "or max_num_seqs.")
