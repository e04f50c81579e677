"""The model runner: owns the device, the weights, the backends and the cache; runs one step plan.

It keeps its own state per request (slot, block table, sampling parameters), updated from each
`StepPlan`, and never reads a `Sequence`: the plan is the only input. It turns a plan into flat
tensors (`prepare_inputs`), runs the model (or a captured decode graph), and samples the requests the
plan marks. The tokens it sampled last stay on the device, so a plan whose input is `PENDING_TOKEN`
(overlapped decode) reads the real id there.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from deepinfer_core import plugins
from deepinfer_core.backends import AttentionMetadata, SamplingSpec, supports_cuda_graphs
from deepinfer_core.backends.moe import check_expert_format, check_expert_parallel
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.backends.sampling_tensors import (
    holds_at_later_positions,
    host_tensor,
    prepare_sampling_tensors,
    to_device,
)
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.distributed.context_parallel import ContextParallel
from deepinfer_core.distributed.context_parallel_ops import ContextParallelAttention, ContextParallelLayerOps
from deepinfer_core.distributed.eplb_state import make_expert_shards
from deepinfer_core.kv.blocks import block_layout
from deepinfer_core.kv.cache import KVCache, bytes_per_block, bytes_per_slot
from deepinfer_core.kv.connector_worker import KvConnectorWorker
from deepinfer_core.models import registry, tensor_parallel
from deepinfer_core.models.deepseek_v4.mtp import split_mtp_weights
from deepinfer_core.models.interface import (
    CausalLM,
    ForwardContext,
    cache_fingerprint,
    checkpoint_identity,
    tensors_identity,
)
from deepinfer_core.models.layer_plan import (
    BLOCK_SIZE,
    deterministic_plans,
    layer_ops_spec,
    with_expert_format,
)
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.models.loading.checkpoint_layout import tensor_schema
from deepinfer_core.models.loading.weights import load_weights, match_param_dtypes
from deepinfer_core.plan import NONFINITE_TOKEN, PENDING_TOKEN, StepPlan, StepResult
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.speculative import verify as spec_verify
from deepinfer_core.speculative.rollback import SavedRows
from deepinfer_core.speculative.runner_side import SpecVerifier, build_mtp_drafter
from deepinfer_core.structured_output.manager import apply_bitmask
from deepinfer_core.worker.graphs import DecodeGraphs

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """What the runner keeps of one request between steps (vLLM's persistent batch, one row)."""

    slot: int
    block_table: list[int]
    """Grows by the plan's `new_block_ids`; a new admission brings a new list."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    token_ids: list[int] | None = None
    """Prompt and generated ids, kept only for requests whose sampling reads them (penalties)."""


@dataclass
class CarriedTokens:
    """The tokens the last step sampled, on the device: `tokens[rows[request_id]]`."""

    tokens: torch.Tensor
    request_ids: list[str]

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def fill(self, input_ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """Write the carried token of each `(flat row, request id)` into `input_ids` on the device."""
        if not pending:
            return
        dst, src = [], []
        for flat_row, request_id in pending:
            row = self.rows.get(request_id)
            if row is None:
                raise RuntimeError(f"request {request_id!r} has a pending token that the last step did not sample")
            dst.append(flat_row)
            src.append(row)
        if dst == src and len(src) == self.tokens.numel():  # the same batch again, in the same order
            input_ids[: len(dst)].copy_(self.tokens)
            return
        index = host_tensor(dst + src).to(input_ids.device, non_blocking=True).view(2, -1)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]).to(input_ids.dtype))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 parallel: ParallelGroups | None = None) -> None:
        """`weights` (internal names) replaces loading from `engine_config.model` when given;
        `agree_num_blocks` turns this rank's cache size into the one every rank uses (the minimum);
        `parallel`: this rank's groups (None: a world of one rank)."""
        self.config, self.engine_config, self.device = model_config, engine_config, device
        self.parallel = parallel if parallel is not None else ParallelGroups.single()
        self.dtype = engine_config.torch_dtype(model_config)
        model_cls = registry.model_class(model_config)
        fmt = weight_formats.expert_format(model_config, engine_config, weights)
        # this rank's part of the model (its query heads, output groups and expert width under TP)
        self.local_config = tensor_parallel.shard_config(model_config, self.parallel.tp.size)
        self.plans = deterministic_plans(
            with_expert_format(model_cls.layer_plan(self.local_config, self.dtype), fmt),
            engine_config.deterministic)
        self.experts = make_expert_shards(self.parallel, model_config, device,  # None without EP
                                          engine_config.time_ep_dispatch)
        if self.experts is not None:
            self.plans = self.experts.plans(self.plans)
        self.cache_fingerprint = cache_fingerprint(
            model_config, self.dtype, self.plans,
            tensors_identity(weights) if weights is not None else checkpoint_identity(engine_config.model))
        self.model: CausalLM = self._load_model(model_cls, weights)
        self.num_trim_kept = self._set_trim_point()
        """Decoder-side trimming: prompt rows each request keeps past the trim point; None: off."""
        self._bind_backends()
        self.context_parallel = ContextParallel(self.parallel.cp, device) if self.parallel.cp.size > 1 else None
        self.sampler = plugins.make_sampler(
            SamplingSpec(vocab_size=model_config.vocab_size, deterministic=engine_config.deterministic), device)
        self.num_slots = engine_config.max_num_seqs
        self.num_blocks = self.available_blocks()
        if agree_num_blocks is not None:
            self.num_blocks = agree_num_blocks(self.num_blocks)
        self.kv_cache = KVCache(self.plans, self.num_blocks, self.num_slots, self.dtype, device)
        self.block_layout = block_layout(self.plans, self.dtype)
        self.block_io = KvConnectorWorker(self.block_layout, self.kv_cache.layers)  # the plan's cache ops
        self.requests: dict[str, RequestState] = {}
        self._carried: CarriedTokens | None = None
        self._kept_sampling: tuple[list[RequestState], object] | None = None
        """The last step's rows and sampling tensors, while no row's tensors follow its history."""
        self.spec = SpecVerifier.build(engine_config, model_config, self.plans, self.kv_cache, device)
        """Speculative verification (None without `speculative_config`)."""
        self.mtp = build_mtp_drafter(self, self._mtp_weights)
        """The MTP drafter (None unless `speculative_config.method == "mtp"`)."""
        self.graphs = self._capture_graphs()

    # -- build phases -------------------------------------------------------------------------------

    def _load_model(self, model_cls: type, weights: dict[str, torch.Tensor] | None) -> CausalLM:
        with torch.device("meta"):
            model = model_cls(self.local_config, self.plans, self.dtype, parallel=self.parallel)
        shards = tensor_parallel.tensor_shards(tensor_schema(model), self.parallel.tp.rank, self.parallel.tp.size)
        native = self.engine_config.quantized_weights == "native"
        block = weight_formats.fp8_layout(self.config)[0]
        keep_fp4 = self.plans[0].moe.expert_format == "fp4"
        host_names = model_cls.host_weight_names(
            tensor_schema(model), self.engine_config.engram_placement)  # never on the device, even while loading
        if weights is None:  # a model class with its own checkpoint layout brings its loader
            if model.capabilities.has_checkpoint_loader:
                weights = model_cls.load_checkpoint(self.engine_config.model, self.config, self.dtype, self.device, keep_fp4=keep_fp4,
                                     **({"host": host_names} if host_names else {}))
                if self.experts is not None:
                    weights = self.experts.select_local(weights)
            else:  # under tensor parallelism only this rank's slices are read
                weights = load_weights(self.engine_config.model, self.config, self.dtype, self.device,
                                       keep_fp4=keep_fp4,
                                       keep_fp8=weight_formats.fp8_projection_names(model) if native else (),
                                       local_experts=self.experts.local_experts if self.experts else None,
                                       shards=shards)
            self._mtp_weights = None  # read from the checkpoint by the MTP drafter, if asked for
        else:
            weights, self._mtp_weights = split_mtp_weights(weights)
            if self.experts is not None:
                weights = self.experts.select_local(weights)
            if shards:  # FP8 projections are cut dequantised (their scales are not cut with them)
                weights = weight_formats.prepare_weights(weights, self.plans[0].moe.expert_format, self.dtype,
                                                         keep_fp8=False, block=block)
                weights = tensor_parallel.shard_weights(weights, shards)
        weights = weight_formats.prepare_weights(weights, self.plans[0].moe.expert_format, self.dtype,
                                                 keep_fp8=native, block=block)
        weight_formats.hold_fp8_linears(model, weights, self.config, self.dtype)
        # checked against the modules (names, shapes, finite values) and cast to their declared dtypes
        weights = match_param_dtypes(weights, tensor_schema(model), self.device, host=host_names)
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval()

    def _set_trim_point(self) -> int | None:
        """Tell a V4.1 model where decoder-side trimming starts (`EngineConfig.decoder_trimming`; `resolve`
        checked the model); the rows kept are the last window's."""
        if not self.engine_config.decoder_trimming:
            return None
        from deepinfer_core.models.deepseek_v41.trim import trim_layer

        self.model.trim_layer = trim_layer(self.plans)
        return self.config.sliding_window

    def _bind_backends(self) -> None:
        attention, moe = {}, {}
        for plan in self.plans:
            if plan.attention not in attention:
                attention[plan.attention] = plugins.make_attention(plan.attention, self.device)
            if plan.moe not in moe:
                moe[plan.moe] = plugins.make_moe(plan.moe, self.device)
                check_expert_format(moe[plan.moe], plan.moe)
                check_expert_parallel(moe[plan.moe], plan.moe)
        ops = plugins.make_layer_ops(layer_ops_spec(self.config, self.dtype, self.engine_config.deterministic),
                                     self.device)
        self.linear_backends = weight_formats.bind_linears(self.model, plugins.make_linear, self.device)
        if self.parallel.cp.size > 1:  # split prefill steps exchange window keys and compressed entries
            attention = {spec: ContextParallelAttention(backend) for spec, backend in attention.items()}
            ops = ContextParallelLayerOps(ops)
        if self.model.capabilities.has_engram:  # read by `bind_backends` (`resolve` checked the rest)
            self.model.engram_placement = self.engine_config.engram_placement
            self.model.engram_prefetch = self.engine_config.engram_prefetch
        self.model.bind_backends([attention[p.attention] for p in self.plans], [moe[p.moe] for p in self.plans],
                                 ops, self.device)
        if self.experts is not None:
            self.experts.attach(self.model.moe_weights)

    def available_blocks(self) -> int:
        """Cache blocks that fit: `num_kv_blocks`, else what device (or host) memory allows."""
        cfg = self.engine_config
        per_block = max(bytes_per_block(self.plans, self.dtype), 1)
        per_slot = bytes_per_slot(self.plans, self.dtype)
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif self.device.type != "cpu":  # torch.cuda, or the vendor's module (torch.npu) of the same shape
            free, _ = getattr(torch, self.device.type).mem_get_info(self.device)
            budget = free * cfg.gpu_memory_utilization - per_slot * self.num_slots
            blocks = int(budget // per_block)
        else:  # host memory: enough for every slot at full length, capped by the utilisation fraction
            wanted = self.num_slots * -(-cfg.max_model_len // BLOCK_SIZE)
            blocks = min(wanted, int(_host_memory() * cfg.gpu_memory_utilization * 0.25 // per_block))
        if blocks < 1:
            raise MemoryError(f"no room for the KV cache: {per_block} bytes per block; lower max_num_seqs or set num_kv_blocks")
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB) + %d request slots (%.1f MiB); %.1f bytes per token "
            "of compressed state, %.2f MiB fixed state per request (windows, compressor tails)",
            blocks, BLOCK_SIZE, blocks * per_block / 2**20, self.num_slots, self.num_slots * per_slot / 2**20,
            per_block / BLOCK_SIZE, per_slot / 2**20,
        )
        return blocks

    def _capture_graphs(self) -> DecodeGraphs | None:
        if self.device.type == "cpu" or self.engine_config.enforce_eager:
            return None
        if not all(supports_cuda_graphs(b) for b in [*self.model.backends(), *self.linear_backends]):
            logger.info("decode runs eagerly: a backend does not declare supports_cuda_graphs")
            return None
        api = plugins.graph_api(self.device)
        if api is None:
            logger.info("decode runs eagerly: no plugin offers graph capture on %s", self.device)
            return None
        max_len = self.engine_config.max_model_len
        spec = self.engine_config.speculative_config
        # verification steps whose requests all carry d <= k drafts replay the graphs of width 1 + d
        widths = range(1, 2 + spec.num_speculative_tokens) if spec is not None else (1,)
        graphs = DecodeGraphs(self, self.num_slots, -(-max_len // BLOCK_SIZE), max_len, api,
                              sizes=self.engine_config.cuda_graph_sizes, widths=widths)
        start = time.perf_counter()
        graphs.capture(progress=logger.isEnabledFor(logging.INFO))
        logger.info("captured decode CUDA graphs for batch sizes %s x tokens per request %s in %.1f s (first "
                    "capture compiles the kernels; cuda_graph_sizes sets the sizes)", graphs.sizes, graphs.widths,
                    time.perf_counter() - start)
        if self.mtp is not None:
            if all(supports_cuda_graphs(b) for b in self.mtp.backends):
                start = time.perf_counter()
                try:
                    self.mtp.capture_graphs(self, api, graphs.sizes, max_len)
                    logger.info("captured the MTP layer's passes as CUDA graphs in %.1f s", time.perf_counter() - start)
                except RuntimeError as err:  # drafts only: their passes run eagerly, the output is the same
                    self.mtp.graphs = None
                    api.synchronize()
                    logger.warning("the MTP layer runs eagerly: capturing its passes failed (%s)", err)
            else:
                logger.info("the MTP layer runs eagerly: a backend of its own does not declare supports_cuda_graphs")
        return graphs

    # -- one step -----------------------------------------------------------------------------------

    def update_states(self, plan: StepPlan) -> list[RequestState]:
        """Apply the plan's bookkeeping (freed, new, appended blocks); the states in `plan.requests` order."""
        for request_id in plan.freed_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(new.slot, list(new.block_ids), new.num_prompt_tokens,
                                                         new.sampling_params, new.seed,
                                                         list(new.token_ids) if new.token_ids else None)
        states = []
        for request in plan.requests:
            state = self.requests.get(request.request_id)
            if state is None:
                raise RuntimeError(f"plan schedules {request.request_id!r}, which the runner holds no state for")
            if request.new_block_ids:
                state.block_table.extend(request.new_block_ids)
            if state.token_ids is not None and request.end > len(state.token_ids):
                state.token_ids.extend(request.token_ids[len(state.token_ids) - request.start :])
            states.append(state)
        return states

    def close(self) -> None:
        """Stop what the model runs beside the steps (V4.1's Engram prefetch worker); idempotent."""
        self.model.close()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan: compute every scheduled token, sample the requests it marks."""
        return self.launch(plan)()

    def launch(self, plan: StepPlan) -> Callable[[], StepResult]:
        """Queue `plan`'s forward and sampling on the device and return what completes the step: call it
        for the `StepResult`. Completing reads the sampled tokens (verification accepts drafts and rolls
        the rejected ones back, the MTP drafter proposes); the host may do other work in between, such
        as building the previous step's outputs, while the device runs (`Engine` does so for
        verification steps). Complete each launch before the next one."""
        if plan.cache_ops:  # prefix-tier transfers first: a block saved here may be rewritten below
            result = self._execute_with_cache_ops(plan)
            return lambda: result
        states = self.update_states(plan)
        if self._graph_width(plan):  # decode, or verification with the same number of drafts everywhere
            rows = spec_verify.logits_row_requests(plan, list(range(len(states))))
            tensors = self._sampling_tensors(plan, states, rows)  # before the launch: no wait on copies
            saved = self.spec.capture(plan, states) if self.spec is not None else None
            logits = self.graphs.run(plan.requests, states, self._carried)
            sampled = self._sample(plan, rows, logits, tensors, {})
            return functools.partial(self._complete, plan, states, rows, logits, tensors, sampled, saved,
                                     self.graphs.input_ids[: plan.num_tokens])
        layout = self.context_parallel.layout(plan, states) if self.context_parallel is not None else None
        if layout is not None:  # a prefill step split over the cp ranks
            logits, sampled, prompt_spans = self.context_parallel.forward(self, layout, self._carried)
            prompt_logits = {i: (first, logits[row : row + count]) for i, (first, row, count) in prompt_spans.items()}
            tensors = self._sampling_tensors(plan, states, sampled)
            result = self._sample(plan, sampled, logits[: len(sampled)], tensors, prompt_logits)
            return lambda: result
        ctx, logits_indices, sampled, prompt_spans, pending = self.prepare_inputs(plan, states)
        if pending:
            if self._carried is None:
                raise RuntimeError("the plan has pending tokens but no step sampled before it")
            self._carried.fill(ctx.input_ids, pending)
        rows = spec_verify.logits_row_requests(plan, sampled)  # d + 1 rows for a request with d drafts
        tensors = self._sampling_tensors(plan, states, rows)
        saved = self.spec.capture(plan, states) if self.spec is not None else None
        logits = self.model(ctx, self.kv_cache.layers, logits_indices)
        prompt_logits = {i: (first, logits[row : row + count]) for i, (first, row, count) in prompt_spans.items()}
        sampled = self._sample(plan, rows, logits[: len(rows)], tensors, prompt_logits)
        return functools.partial(self._complete, plan, states, rows, logits[: len(rows)], tensors, sampled, saved,
                                 ctx.input_ids)

    def _complete(self, plan: StepPlan, states: list[RequestState], rows: list[int], logits: torch.Tensor, tensors,
                  result: StepResult, saved: SavedRows | None, input_ids: torch.Tensor) -> StepResult:
        """After sampling (`result`): verify drafts (`saved`: the cache rows they overwrote) and let the
        MTP drafter propose the next ones."""
        if saved is not None:
            draft_probs = self.mtp.draft_probs(plan) if self.mtp is not None else None
            result = self.spec.finish(plan, states, rows, logits, tensors, result, saved, draft_probs)
        if self.mtp is not None and result.output is not None:
            result.drafts = self.mtp.propose(self, plan, states, input_ids, self.model.final_streams, result)
        return result

    def _execute_with_cache_ops(self, plan: StepPlan) -> StepResult:
        saved = self.block_io.apply(plan.cache_ops)
        result = self.execute(replace(plan, cache_ops=())) if plan.requests else StepResult([], None)
        result.saved = saved
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
                prompt_logits: dict) -> StepResult:
        if not sampled:
            return StepResult([], None, prompt_logits)
        is_finite = logits.isfinite().all(dim=-1)  # before the grammar mask writes -inf
        if plan.grammar_bitmask is not None:
            apply_bitmask(logits, plan, sampled)  # structured output: disallowed tokens to -inf
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

    @functools.cached_property
    def compress_rates(self) -> set[int]:
        """The compression rates of the model's compressing layers (CSA and HCA)."""
        return {p.compress_rate for p in self.plans if p.has_compressor}

    def make_context(self, input_ids: torch.Tensor, positions: torch.Tensor, totals: torch.Tensor,
                     no_write_before: torch.Tensor, keep_from: list[int] | None = None,
                     replay_hits: list[int] | None = None, **metadata) -> ForwardContext:
        """The step's `ForwardContext` (eager steps and decode graphs alike): `metadata` are the
        `AttentionMetadata` fields; `totals` `[num_seqs]` tokens each request has after the step;
        `keep_from` the decoder-side trimming's first kept positions (None: nothing trimmed);
        `replay_hits` the exact replay's hits (`ForwardContext.replay_hits`)."""
        return ForwardContext(
            keep_from=keep_from, replay_hits=replay_hits,
            metadata=AttentionMetadata(positions=positions, **metadata),
            input_ids=input_ids,
            rope=self.model.rope_tables(positions),
            num_entries={rate: totals // rate for rate in self.compress_rates},
            no_write_before=no_write_before,
            parallel=self.parallel,
        )

    def prepare_inputs(self, plan: StepPlan, states: list[RequestState]):
        """Flat step tensors. Logits rows: first one per sampled request (in `sampled` order), then, per
        request asking for prompt logprobs, a span `(first target position, row, count)`. `pending`:
        `(flat row, request id)` of inputs that are `PENDING_TOKEN` (written as 0 here)."""
        ids, positions, totals, sampled, ends, pending = [], [], [], [], [], []
        prompt_spans, prompt_rows = {}, []
        requests = plan.requests
        offset = 0
        for i, (request, state) in enumerate(zip(requests, states)):
            start, n, end = request.start, request.num_tokens, request.end
            ids += request.token_ids
            if request.token_ids[-1] == PENDING_TOKEN:
                ids[-1] = 0
                pending.append((offset + n - 1, request.request_id))
            positions += range(start, end)
            totals.append(end)
            if request.is_sampled:  # a row for the last token and one for each draft before it
                sampled.append(i)
                ends += range(offset + n - 1 - request.num_draft_tokens, offset + n)
            if state.sampling_params.prompt_logprobs is not None:
                count = min(end, state.num_prompt_tokens - 1) - start  # positions predicting prompt tokens
                if count > 0:
                    prompt_spans[i] = (start + 1, len(prompt_rows), count)
                    prompt_rows += range(offset, offset + count)
            offset += n
        width = max(len(s.block_table) for s in states) or 1
        starts = [r.start for r in requests]
        window_starts = [r.window_start for r in requests]
        has_window_starts = any(window_starts)
        (start_loc, start_positions, position_t, slots, total_t, input_ids, no_write_before, logits_rows,
         window_t, tables) = to_device([
            [0, *accumulate(r.num_tokens for r in requests)], starts, positions, [s.slot for s in states], totals,
            ids, [r.no_write_before for r in requests], ends + prompt_rows,
            window_starts if has_window_starts else [], _flat_block_tables(states, width, fill=-1),
        ], self.device)
        ctx = self.make_context(
            input_ids, position_t, total_t, no_write_before, keep_from=self._first_kept_positions(requests, states),
            replay_hits=self._replay_hits(requests),
            query_start_loc=start_loc, start_positions=start_positions, slots=slots,
            block_tables=tables.view(len(states), width), query_lens=[r.num_tokens for r in requests],
            start_positions_host=starts, max_seq_len=max(totals),
            window_start_positions_host=window_starts if has_window_starts else None,
            window_starts=window_t if has_window_starts else None,
        )
        prompt_spans = {i: (first, len(ends) + row, count) for i, (first, row, count) in prompt_spans.items()}
        return ctx, logits_rows, sampled, prompt_spans, pending

    def _replay_hits(self, requests) -> list[int] | None:
        """Per request, the hit its exact replay (`ScheduledRequest.replay`) runs below (0: none), when
        some request of the step computes rows below its hit's last window: the rows a model running the
        replay layer by layer (`row_trim.replay_keep_from`) can drop. None otherwise, and under context
        parallelism, whose ranks exchange every row's window keys."""
        window = self.config.sliding_window
        hits = [r.replay.hit if r.replay is not None and r.replay.exact else 0 for r in requests]
        if self.context_parallel is not None or not any(r.start < hit - window for r, hit in zip(requests, hits)):
            return None
        return hits

    def _first_kept_positions(self, requests, states: list[RequestState]) -> list[int] | None:
        """Per request, the first position that runs the layers after the trim point (`v41_trim`); None
        when trimming is off or changes nothing in this step: no request drops a row or has a window that
        reaches below its first kept position (decode steps never do)."""
        if self.num_trim_kept is None:
            return None
        from deepinfer_core.models.deepseek_v41.trim import first_kept_positions

        keep = [first_kept_positions(s.num_prompt_tokens, s.sampling_params.prompt_logprobs is not None,
                                     self.num_trim_kept) for s in states]
        window = self.config.sliding_window
        return keep if any(k > 0 and k > r.start - window + 1 for k, r in zip(keep, requests)) else None


def _flat_block_tables(states: list[RequestState], width: int, fill: int) -> list[int]:
    """Row-major `[len(states), width]` block tables, each row padded with `fill`."""
    flat = []
    for state in states:
        flat += state.block_table
        flat += [fill] * (width - len(state.block_table))
    return flat


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30
