"""The model runner: owns the device, the weights, the backends and the cache; runs one step.

It turns a `ScheduledBatch` into flat tensors (`prepare_*`), runs the model, and samples the requests
whose last known token was computed this step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import accumulate

import torch

from deepinfer_core import plugins
from deepinfer_core.backends import AttentionMetadata, SamplerOutput, SamplingSpec
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine.cuda_graph import DecodeGraphs
from deepinfer_core.engine.kv_cache import BLOCK_SIZE, KVCache, bytes_per_block, bytes_per_slot
from deepinfer_core.engine.sampling import host_tensor, prepare_sampling_tensors
from deepinfer_core.engine.sequence import PENDING_TOKEN
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM, ForwardContext
from deepinfer_core.models.layer_plan import build_layer_plan, layer_ops_spec
from deepinfer_core.models.weights import load_weights

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one executed step produced."""

    sampled: list[int]
    """Indices (into the step's sequences) that were sampled, in `output` row order."""
    output: SamplerOutput | None
    """The sampler's output for them (None when nothing was sampled)."""
    prompt_logits: dict[int, tuple[int, torch.Tensor]]
    """Per sequence asking for prompt logprobs: (position of the first prompt token predicted,
    fp32 logits `[count, vocab]` predicting prompt tokens from that position on)."""


@dataclass
class CarriedTokens:
    """Tokens sampled by the step still in flight: `tokens[rows[request_id]]` on the device is the real
    id of that sequence's trailing `PENDING_TOKEN`."""

    tokens: torch.Tensor
    rows: dict[str, int]

    def fill(self, input_ids: torch.Tensor, seqs, flat_rows: list[int] | None = None) -> None:
        """Write the carried token into `input_ids` for each of `seqs` whose last token is pending;
        seq `i`'s last token sits at `flat_rows[i]` (default `i`)."""
        dst, src = [], []
        for i, seq in enumerate(seqs):
            if seq.token_ids[-1] == PENDING_TOKEN:
                row = self.rows.get(seq.request_id)
                if row is None:
                    raise RuntimeError(f"{seq!r} has a pending token that no step in flight sampled")
                dst.append(i if flat_rows is None else flat_rows[i])
                src.append(row)
        if not dst:
            return
        if dst == src and len(src) == self.tokens.numel():  # the same batch again, in the same order
            input_ids[: len(dst)].copy_(self.tokens)
            return
        index = host_tensor(dst + src).to(input_ids.device, non_blocking=True).view(2, -1)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]).to(input_ids.dtype))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        """`weights` (internal names) replaces loading from `engine_config.model` when given."""
        self.config, self.engine_config, self.device = model_config, engine_config, device
        self.dtype = engine_config.torch_dtype(model_config)
        self.plans = build_layer_plan(model_config, self.dtype)
        self.model = self._load_model(weights)
        self._bind_backends()
        self.sampler = plugins.make_sampler(SamplingSpec(vocab_size=model_config.vocab_size), device)
        self.num_slots = engine_config.max_num_seqs
        self.num_blocks = self._num_blocks()
        self.kv_cache = KVCache(self.plans, self.num_blocks, self.num_slots, self.dtype, device)
        self.graphs = self._capture_graphs()

    # -- build phases -------------------------------------------------------------------------------

    def _load_model(self, weights: dict[str, torch.Tensor] | None) -> DeepseekV4ForCausalLM:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(self.config, self.plans, self.dtype)
        if weights is None:
            weights = load_weights(self.engine_config.model, self.config, self.dtype, self.device)
        weights = {name: t.to(self.device) for name, t in weights.items()}
        model.load_state_dict(_match_param_dtypes(model, weights), strict=True, assign=True)
        return model.eval()

    def _bind_backends(self) -> None:
        attention, moe = {}, {}
        for plan in self.plans:
            if plan.attention not in attention:
                attention[plan.attention] = plugins.make_attention(plan.attention, self.device)
            if plan.moe not in moe:
                moe[plan.moe] = plugins.make_moe(plan.moe, self.device)
        ops = plugins.make_layer_ops(layer_ops_spec(self.config, self.dtype), self.device)
        self.model.bind_backends([attention[p.attention] for p in self.plans], [moe[p.moe] for p in self.plans],
                                 ops, self.device)

    def _num_blocks(self) -> int:
        cfg = self.engine_config
        per_block = max(bytes_per_block(self.plans, self.dtype), 1)
        per_slot = bytes_per_slot(self.plans, self.dtype)
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
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
        backends = [*self.model.attention_backends, *self.model.moe_backends, self.model.ops]
        if self.device.type != "cuda" or self.engine_config.enforce_eager:
            return None
        if not all(getattr(b, "supports_cuda_graphs", False) for b in backends):
            logger.info("decode runs eagerly: a backend does not declare supports_cuda_graphs")
            return None
        max_len = self.engine_config.max_model_len
        graphs = DecodeGraphs(self, self.num_slots, -(-max_len // BLOCK_SIZE), max_len)
        graphs.capture()
        logger.info("captured decode CUDA graphs for batch sizes %s", graphs.sizes)
        return graphs

    # -- one step -----------------------------------------------------------------------------------

    def execute(self, seqs, num_new_tokens: list[int], carried: CarriedTokens | None = None) -> StepResult:
        """Compute `num_new_tokens[i]` tokens of each sequence; sample where its last token was computed.

        A sequence whose last token is `PENDING_TOKEN` takes it from `carried` on the device."""
        if self._is_graph_step(seqs, num_new_tokens):
            sampled = list(range(len(seqs)))
            tensors = self._sampling_tensors(seqs, sampled)  # before the launch: its copies then need no wait
            return self._sample(sampled, self.graphs.run(seqs, carried), tensors, {})
        ctx, logits_indices, sampled, prompt_spans = self.prepare_inputs(seqs, num_new_tokens)
        if carried is not None:
            carried.fill(ctx.input_ids, seqs, list(accumulate(num_new_tokens, initial=-1))[1:])
        tensors = self._sampling_tensors(seqs, sampled)
        logits = self.model(ctx, self.kv_cache.layers, logits_indices)
        prompt_logits = {i: (first, logits[row : row + count]) for i, (first, row, count) in prompt_spans.items()}
        return self._sample(sampled, logits[: len(sampled)], tensors, prompt_logits)

    def _sampling_tensors(self, seqs, sampled: list[int]):
        if not sampled:
            return None
        rows = seqs if len(sampled) == len(seqs) else [seqs[i] for i in sampled]  # `sampled` is increasing
        return prepare_sampling_tensors(
            [s.sampling_params for s in rows], [s.seed for s in rows], [s.num_output_tokens for s in rows],
            self.config.eos_token_ids, self.device, self.config.vocab_size,
        )

    def _sample(self, sampled: list[int], logits: torch.Tensor, tensors, prompt_logits: dict) -> StepResult:
        if not sampled:
            return StepResult([], None, prompt_logits)
        return StepResult(sampled, self.sampler.sample(logits, tensors), prompt_logits)

    def _is_graph_step(self, seqs, num_new_tokens: list[int]) -> bool:
        return (
            self.graphs is not None and self.graphs.can_run(len(seqs)) and all(n == 1 for n in num_new_tokens)
            and all(s.num_computed_tokens + 1 == s.num_tokens for s in seqs)
        )

    @functools.cached_property
    def compress_rates(self) -> set[int]:
        """The compression rates of the model's compressing layers (CSA and HCA)."""
        return {p.compress_rate for p in self.plans if p.has_compressor}

    def prepare_inputs(self, seqs, num_new_tokens: list[int]):
        """Flat step tensors. Logits rows: first one per sampled sequence (in `sampled` order), then, per
        sequence that asked for prompt logprobs, a span `(first target position, row, count)`."""
        ids, positions, totals, sampled, ends = [], [], [], [], []
        prompt_spans, prompt_rows = {}, []
        starts = [s.num_computed_tokens for s in seqs]
        offset = 0
        for i, (seq, start, n) in enumerate(zip(seqs, starts, num_new_tokens)):
            end = start + n
            ids += seq.token_ids[start:end]
            if end == seq.num_tokens and ids[-1] == PENDING_TOKEN:
                ids[-1] = 0  # CarriedTokens.fill writes the real id on the device
            positions += range(start, end)
            totals.append(end)
            if end == seq.num_tokens:
                sampled.append(i)
                ends.append(offset + n - 1)
            if seq.sampling_params.prompt_logprobs is not None:
                count = min(end, seq.num_prompt_tokens - 1) - start  # positions predicting prompt tokens
                if count > 0:
                    prompt_spans[i] = (start + 1, len(prompt_rows), count)
                    prompt_rows += range(offset, offset + count)
            offset += n
        width = max(len(s.block_table) for s in seqs) or 1
        window_starts = [s.replay_start for s in seqs]
        has_window_starts = any(window_starts)
        (start_loc, start_positions, position_t, slots, total_t, input_ids, no_write_before, logits_rows,
         window_t, tables) = _to_device([
            [0, *accumulate(num_new_tokens)], starts, positions, [s.slot for s in seqs], totals, ids,
            [s.no_write_before for s in seqs], ends + prompt_rows, window_starts if has_window_starts else [],
            _flat_block_tables(seqs, width, fill=-1),
        ], self.device)
        meta = AttentionMetadata(
            query_start_loc=start_loc,
            start_positions=start_positions,
            positions=position_t,
            slots=slots,
            block_tables=tables.view(len(seqs), width),
            query_lens=list(num_new_tokens),
            start_positions_host=starts,
            max_seq_len=max(totals),
        )
        if has_window_starts:
            meta.window_start_positions_host = window_starts
            meta.window_starts = window_t
        ctx = ForwardContext(
            metadata=meta,
            input_ids=input_ids,
            rope=self.model.rope_tables(position_t),
            num_entries={rate: total_t // rate for rate in self.compress_rates},
            no_write_before=no_write_before,
        )
        prompt_spans = {i: (first, len(ends) + row, count) for i, (first, row, count) in prompt_spans.items()}
        return ctx, logits_rows, sampled, prompt_spans


_ALIGN = 16
"""Each int64 input starts 128 bytes into the step's shared buffer (kernels may load it vectorised)."""


def _to_device(segments: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One int64 tensor per list, all on `device` through a single host-to-device copy."""
    flat, bounds = [], []
    for values in segments:
        start = len(flat)
        flat += values
        bounds.append((start, len(flat)))
        flat += [0] * (-len(flat) % _ALIGN)
    buffer = host_tensor(flat).to(device, non_blocking=True)
    return [buffer[a:b] for a, b in bounds]


def _flat_block_tables(seqs, width: int, fill: int) -> list[int]:
    """Row-major `[len(seqs), width]` block tables, each row padded with `fill`."""
    flat = []
    for seq in seqs:
        flat += seq.block_table
        flat += [fill] * (width - len(seq.block_table))
    return flat


def _match_param_dtypes(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cast each loaded tensor to the dtype the model declares for it (norms, hc and biases stay fp32)."""
    declared = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: t.to(declared[name].dtype) if name in declared else t for name, t in weights.items()}


def _host_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30
