"""The model runner: owns the device, the weights, the backends and the cache; runs one step plan.

It keeps its own state per request (`InputBatch`: slot, block table, sampling parameters), updated from
each `StepPlan`, and never reads a `Sequence`: the plan is the only input. It turns a plan into flat
tensors (`InputBatch.prepare_inputs`), runs the model (or a captured decode graph), and samples the
requests the plan marks. The tokens it sampled last stay on the device, so a plan whose input is
`PENDING_TOKEN` (overlapped decode) reads the real id there. Building it (weights, backends, cache
size, graphs) is `model_loader`'s; each helper gets the objects it needs, never the runner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deepinfer_core import plugins
from deepinfer_core.backends import SamplingSpec
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.backends.sampling_tensors import (
    holds_at_later_positions,
    host_tensor,
    prepare_sampling_tensors,
)
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.distributed.context_parallel import ContextParallel
from deepinfer_core.kv.blocks import block_layout
from deepinfer_core.kv.connector_worker import KvConnectorWorker
from deepinfer_core.plan import NONFINITE_TOKEN, StepPlan, StepResult
from deepinfer_core.speculative import verify as spec_verify
from deepinfer_core.speculative.rollback import SavedRows
from deepinfer_core.speculative.runner_side import SpecVerifier
from deepinfer_core.structured_output.manager import apply_bitmask
from deepinfer_core.worker.images import ImageRows
from deepinfer_core.worker.input_batch import CarriedTokens, InputBatch, RequestState
from deepinfer_core.worker.model_loader import (
    capture_graphs,
    load_model,
    make_kv_cache,
    make_mtp_drafter,
    profile_step_memory,
)

__all__ = ["CarriedTokens", "ModelRunner", "RequestState"]


@dataclass
class _Step:
    """What `ModelRunner.execute_model` leaves for `sample`: the plan, its rows' logits and what sampling,
    verification and drafting read after them (`states` None: a plan of cache ops alone)."""

    plan: StepPlan
    states: list[RequestState] | None = None
    rows: list[int] | None = None
    logits: torch.Tensor | None = None
    tensors: object = None
    prompt_logits: dict | None = None
    saved_rows: SavedRows | None = None
    input_ids: torch.Tensor | None = None
    completes: bool = True
    """Verification and the MTP drafter follow sampling (not for a prefill split over the cp ranks)."""
    cache_saved: object = None
    """What the plan's cache ops saved (`KvConnectorWorker.apply`), given back with the result."""


def _read_through(owner: str, name: str, doc: str) -> property:
    """A read-only attribute of the runner that is `owner`'s `name` (kept for the runner's readers)."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=doc)


class ModelRunner:
    """One rank's model side: built by `model_loader`, it keeps the per-request states (`inputs`), the
    cache, the sampler and the speculative and graph helpers, and runs each step plan in two phases (`execute_model`, then `sample`)."""

    config = _read_through("loaded", "config", "The whole model's `ModelConfig`.")
    engine_config = _read_through("loaded", "engine_config", "The resolved `EngineConfig`.")
    device = _read_through("loaded", "device", "The device the model and cache live on.")
    dtype = _read_through("loaded", "dtype", "The activations' and cache's dtype.")
    parallel = _read_through("loaded", "parallel", "This rank's `ParallelGroups`.")
    plans = _read_through("loaded", "plans", "The layer plans (this rank's part under TP and EP).")
    experts = _read_through("loaded", "experts", "This rank's `ExpertShards` under EP (None without).")
    linear_backends = _read_through("loaded", "linear_backends", "The model's bound linear backends.")
    cache_fingerprint = _read_through("loaded", "cache_fingerprint", "What the cache's contents depend on.")
    num_trim_kept = _read_through("loaded", "num_trim_kept", "Rows kept past the trim point (None: off).")
    num_slots = _read_through("kv_cache", "num_slots", "Request slots of the cache (`max_num_seqs`).")
    num_blocks = _read_through("kv_cache", "num_blocks", "Cache blocks (every rank's agreed count).")
    block_layout = _read_through("block_io", "layout", "The bytes of one block (`kv.blocks.block_layout`).")
    requests = _read_through("inputs", "requests", "Per request id, its `RequestState`.")

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 parallel: ParallelGroups | None = None) -> None:
        """`weights` (internal names) replaces loading from `engine_config.model` when given;
        `agree_num_blocks` turns this rank's cache size into the one every rank uses (the minimum);
        `parallel`: this rank's groups (None: a world of one rank)."""
        loaded = self.loaded = load_model(model_config, engine_config, device, weights, parallel)
        self.model = loaded.model
        self.sampler = plugins.make_sampler(
            SamplingSpec(vocab_size=model_config.vocab_size, deterministic=engine_config.deterministic), device)
        self.inputs = InputBatch(self.model, model_config, loaded.plans, loaded.parallel, device, loaded.num_trim_kept)
        self.mtp = make_mtp_drafter(loaded, self.inputs, self.sampler, engine_config.max_num_seqs)
        """The model-side drafter (MTP or DSpark; None without one), built before the cache is sized: its
        weights and the streams the target keeps for it are in what the profile below measures."""
        self.memory_profile = profile_step_memory(loaded, self.sampler)
        """The largest step's measured peak, which the cache was sized beside (`worker.memory_profile`)."""
        self.kv_cache = make_kv_cache(loaded, agree_num_blocks, self.memory_profile)
        self.block_io = KvConnectorWorker(block_layout(loaded.plans, loaded.dtype), self.kv_cache.layers)  # the plan's cache ops
        self.context_parallel = (ContextParallel(loaded.parallel.cp, device, self.model, self.kv_cache,
                                                 self.inputs.prepare_inputs) if loaded.parallel.cp.size > 1 else None)
        self._carried: CarriedTokens | None = None
        self._step: _Step | None = None
        """The step `execute_model` ran and `sample` has not sampled."""
        self._kept_sampling: tuple[list[RequestState], object] | None = None
        """The last step's rows and sampling tensors, while no row's tensors follow its history."""
        self.spec = SpecVerifier.build(engine_config, model_config, loaded.plans, self.kv_cache, device)
        """Speculative verification (None without `speculative_config`)."""
        self.graphs = capture_graphs(loaded, self.kv_cache, self.inputs, self.mtp)
        """The captured decode graphs (None: decode runs eagerly)."""
        self.images = ImageRows(self.model, device, int(engine_config.encoder_cache_mib * 2**20))
        """Each step's image rows and the vision encoder's cache (used only by prompts with images)."""

    # the input batch's steps, as methods of the runner: its readers (tests, benches) call or wrap them here
    def update_states(self, plan: StepPlan) -> list[RequestState]:
        """`InputBatch.update_states`."""
        return self.inputs.update_states(plan)

    def prepare_inputs(self, plan: StepPlan, states: list[RequestState]):
        """`InputBatch.prepare_inputs`."""
        return self.inputs.prepare_inputs(plan, states)

    def make_context(self, *args, **kwargs):
        """`InputBatch.make_context`."""
        return self.inputs.make_context(*args, **kwargs)

    def close(self) -> None:
        """Stop what the model runs beside the steps (V4.1's Engram prefetch worker); idempotent."""
        self.model.close()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan whole, with no grammar mask: `execute_model`, then `sample`."""
        self.execute_model(plan)
        return self.sample(None)

    def execute_model(self, plan: StepPlan) -> None:
        """First phase of a step: take `plan`'s states in, apply its cache ops and queue its forward on the
        device; the logits (and the cache rows that verification may roll back) wait for `sample`, which
        must follow before the next plan. The host may fill the step's grammar masks meanwhile."""
        if self._step is not None:
            raise RuntimeError("execute_model called twice without sample in between")
        if plan.cache_ops:  # prefix-tier transfers first: a block saved here may be rewritten below
            saved = self.block_io.apply(plan.cache_ops)
            if not plan.requests:
                self._step = _Step(plan, cache_saved=saved)
                return
            self.execute_model(replace(plan, cache_ops=()))
            self._step.cache_saved = saved
            return
        states = self.update_states(plan)
        image_inputs = self.images.prepare(plan.requests, states) if any(s.images for s in states) else None
        if image_inputs is None and self._graph_width(plan):  # decode, or verification with the same number of drafts everywhere
            rows = spec_verify.logits_row_requests(plan, list(range(len(states))))
            tensors = self._sampling_tensors(plan, states, rows)  # before the launch: no wait on copies
            saved = self.spec.capture(plan, states) if self.spec is not None else None
            logits = self.graphs.run(plan.requests, states, self._carried)
            self._step = _Step(plan, states, rows, logits, tensors, {}, saved, self.graphs.input_ids[: plan.num_tokens])
            return
        layout = None
        if self.context_parallel is not None and image_inputs is None:  # (images refuse cp at input)
            layout = self.context_parallel.layout(plan, states)
        if layout is not None:  # a prefill step split over the cp ranks
            logits, sampled, prompt_spans = self.context_parallel.forward(layout, self._carried)
            prompt_logits = {i: (first, logits[row : row + count]) for i, (first, row, count) in prompt_spans.items()}
            tensors = self._sampling_tensors(plan, states, sampled)
            self._step = _Step(plan, states, sampled, logits[: len(sampled)], tensors, prompt_logits, completes=False)
            return
        ctx, logits_indices, sampled, prompt_spans, pending = self.prepare_inputs(plan, states)
        if pending:
            if self._carried is None:
                raise RuntimeError("the plan has pending tokens but no step sampled before it")
            self._carried.fill(ctx.input_ids, pending)
        rows = spec_verify.logits_row_requests(plan, sampled)  # d + 1 rows for a request with d drafts
        tensors = self._sampling_tensors(plan, states, rows)
        saved = self.spec.capture(plan, states) if self.spec is not None else None
        logits = self.model(ctx, self.kv_cache.layers, logits_indices, **(image_inputs or {}))
        prompt_logits = {i: (first, logits[row : row + count]) for i, (first, row, count) in prompt_spans.items()}
        self._step = _Step(plan, states, rows, logits[: len(rows)], tensors, prompt_logits, saved, ctx.input_ids)

    def sample(self, grammar_bitmask=None) -> StepResult:
        """Second phase of a step: mask, sample and verify the logits `execute_model` left (see
        `sample_late`), and return the `StepResult`."""
        return self.sample_late(grammar_bitmask)()

    def sample_late(self, grammar_bitmask=None) -> Callable[[], StepResult]:
        """Queue the sampling of the step `execute_model` ran, its constrained rows masked by
        `grammar_bitmask` (`[rows, ceil(vocab / 32)]` int32 on the host, as a tensor or numpy array, the
        rows the plan's `grammar_row`s name; None: no grammar), and return what completes the step: call
        it for the `StepResult`. Completing reads the sampled tokens (verification accepts drafts and rolls
        the rejected ones back, the MTP drafter proposes); the host may do other work in between, such
        as building the previous step's outputs, while the device runs (`Engine` does so for
        verification steps). Complete each step before the next `execute_model`."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample called without execute_model before it")
        if step.states is None:  # cache ops alone
            result = StepResult([], None)
            result.saved = step.cache_saved
            return lambda: result
        if grammar_bitmask is not None and not isinstance(grammar_bitmask, torch.Tensor):
            grammar_bitmask = torch.from_numpy(grammar_bitmask)
        plan = step.plan
        result = self._sample(plan, step.rows, step.logits, step.tensors, step.prompt_logits, grammar_bitmask)
        result.encoder = self.images.take_stats()
        if not step.completes:
            return lambda: result
        complete = functools.partial(self._complete, plan, step.states, step.rows, step.logits, step.tensors,
                                     result, step.saved_rows, step.input_ids)
        if step.cache_saved is None:
            return complete
        result = complete()  # a step with cache ops is read at once (`Engine` never reads one late)
        result.saved = step.cache_saved
        return lambda: result

    def _complete(self, plan: StepPlan, states: list[RequestState], rows: list[int], logits: torch.Tensor, tensors,
                  result: StepResult, saved: SavedRows | None, input_ids: torch.Tensor) -> StepResult:
        """After sampling (`result`): verify drafts (`saved`: the cache rows they overwrote) and let the
        MTP drafter propose the next ones."""
        if saved is not None:
            draft_probs = self.mtp.draft_probs(plan) if self.mtp is not None else None
            result = self.spec.finish(plan, states, rows, logits, tensors, result, saved, draft_probs)
        # DSpark writes its windows at every step's final positions, a prefill chunk that samples nothing too
        if self.mtp is not None and (result.output is not None or self.mtp.reads_every_step):
            result.drafts = self.mtp.propose(plan, states, input_ids, self.model.final_streams, result)
        return result

    def _sampling_tensors(self, plan: StepPlan, states: list[RequestState], sampled: list[int]):
        """`sampled`: per logits row, its request's index in `plan.requests` (repeated for drafts).

        A step whose rows are the last step's requests in the same order (decode after decode) reuses its
        tensors and sends only the new `steps`, unless some row's tensors follow its history (penalties,
        banned ids: `min_tokens` not reached, bad words)."""
        if not sampled:
            return None
        rows = [states[i] for i in sampled]
        offsets = spec_verify.row_token_offsets(plan, sampled)
        steps = [plan.requests[i].end - states[i].num_prompt_tokens + j for i, j in zip(sampled, offsets)]
        kept = self._kept_sampling
        if kept is not None and len(kept[0]) == len(rows) and all(a is b for a, b in zip(kept[0], rows)):
            return replace(kept[1], steps=host_tensor(steps).to(self.device, non_blocking=True))
        history = {}
        if any(s.token_ids is not None for s in rows):  # penalties read the ids (never pending: no overlap)
            history = {"output_token_ids": [s.token_ids[s.num_prompt_tokens :] if s.token_ids else [] for s in rows],
                       "prompt_token_ids": [s.token_ids[: s.num_prompt_tokens] if s.token_ids else [] for s in rows]}
        params = [s.sampling_params for s in rows]
        tensors = prepare_sampling_tensors(params, [s.seed for s in rows], steps, self.config.eos_token_ids,
                                           self.device, self.config.vocab_size, **history)
        self._kept_sampling = (rows, tensors) if holds_at_later_positions(tensors, params) else None
        return tensors

    def _sample(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor, tensors,
                prompt_logits: dict, grammar_bitmask: torch.Tensor | None) -> StepResult:
        if not sampled:
            return StepResult([], None, prompt_logits)
        is_finite = logits.isfinite().all(dim=-1)  # before the grammar mask writes -inf
        if grammar_bitmask is not None:
            apply_bitmask(logits, plan, sampled, grammar_bitmask)  # structured output: disallowed tokens to -inf
        output = self.sampler.sample(logits, tensors)
        self._carried = CarriedTokens(output.token_ids, [plan.requests[i].request_id for i in sampled])
        # a row with NaN or infinite logits gets no made-up token (the carried copy stays a valid id)
        token_ids = torch.where(is_finite, output.token_ids, NONFINITE_TOKEN)
        return StepResult(sampled, replace(output, token_ids=token_ids), prompt_logits)

    def _graph_width(self, plan: StepPlan) -> int:
        """Tokens per request when the plan replays a decode graph (every request computes its last
        token and the same number of drafts, and samples), else 0."""
        if self.graphs is None or not plan.requests:
            return 0
        width = plan.requests[0].num_tokens
        if not all(r.is_sampled and r.num_tokens == width == r.num_draft_tokens + 1 for r in plan.requests):
            return 0
        return width if self.graphs.can_run(len(plan.requests), width) else 0
