"""DeepSeek-V4.1-Flash forward over a flat batch of tokens from many requests, through the backend objects.

What differs from V4 (research-v41.md §1, §4; DeepSeek's `inference/model.py` decides where they differ):
- single-pass mHC: each sublayer's input is collapsed with the *previous* site's pre-mix (the first
  one-hot on stream 0), and the head collapses with the last FFN site's; no `hc_head`;
- only KV-source layers compress (ratio 2 pairs, ratio 1 projection; `v41_compressor`), and their
  latent also gives the index keys; reindex layers run their own indexer over the source's keys
  (inside the candidate source's blocks), reuse layers attend the source's entries at the latest index
  source's picks, unchanged; no per-head query norm; every compressed layer uses the YaRN rope;
- Engram before the attention of its layers (`models/engram.py`); MoE with `bias` (and `bias_vl` at
  image positions) selecting the experts;
- images (`vision.py`, `vision_tower.py`): `encode_image` gives an image span's embeddings, which
  `forward(..., image_mask, image_embeds)` lays over the span's token embeddings; at every span position
  the router selects with `bias_vl`, Engram's gate is 0 and its n-grams break.
The attention, the indexer of layers that use no candidates, the MoE, the norms/ropes and the single-pass
mixing (`SinglePassMixing`, part of `LayerOps`) run in the bound backends, and so does the two-level
indexer's scoring when the backend hands out scores (`IndexScorer`); the V4.1 compressor close and the two-level selection are plain PyTorch here. Every
per-token computation the model runs itself (projections, compressor, Engram, shared experts, rope
tables, head) goes through `LayerOps.map_rows`, so deterministic mode runs it on fixed row tiles
(docs/deepseek-v41.md). Decode steps read no device value on the host (the compressor and the two-level
indexer size their work from `max_seq_len`), so the runner captures them in CUDA graphs when the backends
allow it. With decoder-side trimming on (`v41_trim`, an option), a prefill step's rows before each request's
`ForwardContext.keep_from` stop after the trim point's compressor.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch
from torch import nn

from deepinfer_core.backends import AttentionBackend, MoEBackend, MoEWeights
from deepinfer_core.backends.attention import BLOCK_SIZE, IndexScorer
from deepinfer_core.backends.layer_ops import (
    HostRowGather,
    HyperWeights,
    LayerOps,
    LayerOpsSpec,
    collapse,
    hyper_residual,
)
from deepinfer_core.backends.paged import write_rings
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.deepseek_v4.layers import RMSNorm
from deepinfer_core.models.deepseek_v4.rope import Rotary, rope_tables
from deepinfer_core.models.deepseek_v4.row_trim import TrimmedStep, no_logits
from deepinfer_core.models.deepseek_v41.compressor import (
    batched_entry_bound,
    closed_groups,
    select_two_level,
    two_level_topk,
    write_entries,
)
from deepinfer_core.models.deepseek_v41.engram import (
    ENGRAM_TABLE_SUFFIXES,
    EngramHasher,
    EngramTable,
    engram_forward,
)
from deepinfer_core.models.deepseek_v41.engram_prefetch import (
    DeviceReadPrefetcher,
    EngramPrefetcher,
    PendingEngram,
)
from deepinfer_core.models.deepseek_v41.modules import Block, moe_weights
from deepinfer_core.models.deepseek_v41.plan import V41LayerPlan, build_v41_plan
from deepinfer_core.models.deepseek_v41.vision import VisionConfig, check_image_input
from deepinfer_core.models.deepseek_v41.vision_tower import Aligner, VisionTower, encode_span
from deepinfer_core.models.interface import ForwardContext, LayerCache, SplitStepExchange


class _HostEngramTables:
    """Stands for Engram tables placed in host memory and gathered on the host among the backends: the
    gather reads the hash ids on the host, so decode steps that run it cannot be captured in a CUDA graph
    (layer ops that are a `HostRowGather` read such tables from the device instead)."""

    supports_cuda_graphs = False


HOST_ENGRAM_TABLES = _HostEngramTables()


class DeepseekV41ForCausalLM(nn.Module):
    """The whole model (a `deepinfer_core.models.interface.CausalLM`) with its vision tower when the config
    has one (`encode_image`); DSpark is run by its drafter (`models.deepseek_v41.dspark`) from the taps this
    model records when asked."""

    engram_placement = "device"
    """Where the Engram tables live: "device" or "host" (pinned host memory; set before `bind_backends`)."""
    engram_prefetch = True
    """Host placement only: start a step's lookups before layer 0 (`engram_prefetch`): on a side stream
    when the device reads the tables (`HostRowGather` layer ops), else on a worker thread; False gathers
    at the Engram layer (for comparison)."""
    prefetcher: EngramPrefetcher | None = None
    trim_layer: int | None = None
    """Decoder-side trimming: the layer after whose compressor a step whose `ForwardContext.keep_from` is
    set runs only its kept rows (`v41_trim.trim_layer`; the runner sets it); None: never trimmed."""
    final_streams: torch.Tensor | None = None
    """With `keeps_final_streams`: the last step's DSpark taps `[T, taps * hidden]`, per row the attention
    input of each `dspark_target_layer_ids` layer (after Engram) averaged over the mHC streams, what the
    DSpark drafter reads (`speculative.dspark_drafter`); else None."""
    keeps_final_streams = False
    """Record the DSpark taps (set when a DSpark drafter is attached; nothing is recorded otherwise)."""

    @classmethod
    def layer_plan(cls, config, dtype: torch.dtype) -> list[V41LayerPlan]:
        return build_v41_plan(config, dtype)

    @classmethod
    def load_checkpoint(cls, model_dir, config, dtype: torch.dtype, device, keep_fp4: bool = False,
                        host: Collection[str] = (), shards: dict | None = None, local_experts=None,
                        digest=None, keep_fp8: Collection[str] = ()):
        """Weights from an official-layout checkpoint, in this model's names (`v41_weights`); those
        named in `host` are read into host memory, never onto `device`; under tensor parallelism only
        the rank's `shards` of the cut tensors (`tensor_parallel.tensor_shards`), under expert
        parallelism only its `local_experts` (layer -> expert per slot); the FP8 projections named in
        `keep_fp8` stay FP8 (with their `_scale`); `digest` (a `WeightDigest`) is given the bytes read."""
        from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint

        return load_v41_checkpoint(model_dir, config, dtype, device, keep_fp4=keep_fp4, host=host, shards=shards,
                                   local_experts=local_experts, digest=digest, keep_fp8=keep_fp8)

    @staticmethod
    def host_weight_names(names: Collection[str], engram_placement: str) -> set[str]:
        """The weights loaded straight into host memory: the Engram tables when they are placed there
        (the release's ~190 GiB would not fit on the device even for a moment)."""
        if engram_placement != "host":
            return set()
        return {n for n in names if n.endswith(ENGRAM_TABLE_SUFFIXES)}

    def __init__(self, config, plans: list[V41LayerPlan], dtype: torch.dtype,
                 parallel: ParallelGroups | None = None) -> None:
        super().__init__()
        self.config, self.plans, self.hc_mult = config, plans, config.hc_mult
        self.parallel = parallel if parallel is not None else ParallelGroups.single()
        self.capabilities = config.capabilities
        for name, kind in (("tp", "tensor"), ("ep", "expert"), ("cp", "context")):
            if getattr(self.parallel, name).size > 1 and not getattr(self.capabilities, f"{kind}_parallel"):
                # internal: check_parallel refuses these layouts before any rank starts
                raise NotImplementedError(f"DeepSeek-V4.1 with {name} size {getattr(self.parallel, name).size}: "
                                          f"{kind} parallelism is not implemented for V4.1 yet")
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(config, plan, dtype) for plan in plans)
        self.norm = RMSNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)  # fp32 math
        if config.engram_layer_ids:
            self.register_buffer("engram_token_map", torch.zeros(config.vocab_size, dtype=torch.long))
        self.vision_config = VisionConfig.of(config)
        """The tower's configuration; None: this model takes no images."""
        self.vision = None
        if self.vision_config is not None:  # replicated on every rank (vision.py says why)
            self.vision = VisionTower(self.vision_config, dtype)
            self.aligner = Aligner(self.vision_config, dtype)
            self.image_start, self.image_newline, self.image_end = (
                nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype)) for _ in range(3))
        self.ops: LayerOps | None = None
        self.moe_weights: list[MoEWeights] = []

    # ------------------------------------------------------------------ binding

    def bind_backends(self, attention: list[AttentionBackend], moe: list[MoEBackend], ops: LayerOps,
                      device: torch.device) -> None:
        """Attach the backends once the weights are loaded; build the ropes, the Engram hasher and tables."""
        rope_dim = self.config.qk_rope_head_dim
        self.rotary = {"main": Rotary(self.config.rope(0), rope_dim, device),
                       "compress": Rotary(self.config.rope(1), rope_dim, device)}
        self.attention_backends, self.moe_backends, self.ops = list(attention), list(moe), ops
        self.index_scorers = [b if isinstance(b, IndexScorer) else None for b in self.attention_backends]
        """Per layer, its attention backend when it hands out indexer scores (`IndexScorer`), else None."""
        self.moe_weights = [moe_weights(layer.ffn) for layer in self.layers]
        self.hc = [(HyperWeights(b.hc_attn_fn, b.hc_attn_base, b.hc_attn_scale),
                    HyperWeights(b.hc_ffn_fn, b.hc_ffn_base, b.hc_ffn_scale)) for b in self.layers]
        self.mix_spec = LayerOpsSpec(self.config.hidden_size, self.hc_mult, self.config.hc_sinkhorn_iters,
                                     self.config.hc_eps, self.config.rms_norm_eps)
        """The mHC shape the model's layer ops serve (what `layer_ops_spec` gives `make_layer_ops`)."""
        self.hasher = self.tables = None
        if self.config.engram_layer_ids:
            self.hasher = EngramHasher(self.config, self.engram_token_map.tolist()).to(device)
            # host tables the device reads itself when the layer ops can (graph-safe), else host gathers
            reader = ops if isinstance(ops, HostRowGather) else None
            self.tables = {p.index: EngramTable(self.layers[p.index].engram.embed.weight,
                                                self.layers[p.index].engram.embed.scale, device,
                                                self.engram_placement, reader)
                           for p in self.plans if p.has_engram}
            self.engram_columns = {i: self.config.engram_layer_ids.index(i) for i in self.tables}
            """Engram layer -> its column in the hash ids' dim 1."""
            self.close()
            if self.engram_placement == "host" and self.engram_prefetch:
                kind = DeviceReadPrefetcher if reader is not None else EngramPrefetcher
                self.prefetcher = kind(self.tables, self.engram_columns, device)

    def close(self) -> None:
        """Stop the Engram prefetch worker, if any (the runner's `close`, at engine shutdown)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """A step without tokens: every MoE backend runs on no rows (`CausalLM.forward_idle`)."""
        x = self.embed.weight.new_empty(0, self.config.hidden_size)
        input_ids = torch.empty(0, dtype=torch.long, device=x.device)
        for backend, weights in zip(self.moe_backends, self.moe_weights, strict=True):
            backend.forward(x, input_ids, weights)

    def backends(self) -> list[object]:
        """Every bound backend, plus `HOST_ENGRAM_TABLES` when Engram tables in host memory are gathered
        on the host (not graph-safe; everything else of a decode step reads no device value on the host)."""
        host = [HOST_ENGRAM_TABLES] if self.tables and not all(t.graph_safe for t in self.tables.values()) else []
        return [*self.attention_backends, *self.moe_backends, self.ops, *host]

    def rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per rope kind, cos, sin and -sin of `positions`, computed once a step for every layer."""
        return rope_tables(self.rotary, self.ops, positions)

    # ------------------------------------------------------------------ the forward pass

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The embeddings `[span length, hidden]` of the whole prompt span of one image (`vision.image_span`
        of its size), in the model's dtype: image_start, the aligner's rows with an image_newline after
        each row, image_end. `pixel_values` `[3, H, W]`: the image processor's normalised pixels, H and W
        multiples of the patch size."""
        check_image_input(self.config, self.parallel.ep.size > 1)
        return encode_span(self.vision, self.aligner, (self.image_start, self.image_newline, self.image_end),
                           pixel_values)

    @torch.inference_mode()
    def forward(self, ctx: ForwardContext, caches: list[LayerCache], logits_indices: torch.Tensor,
                image_mask: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over the step's tokens; fp32 logits `[len(logits_indices), vocab]`. `image_mask`
        `[T]` marks image-span positions (none without a vision input): `bias_vl` routes them, Engram
        skips them; `image_embeds` `[image_mask.sum(), hidden]` (rows of `encode_image`, in order) replace
        their token embeddings."""
        if image_embeds is not None:
            _check_image_embeds(image_mask, image_embeds, self.config.hidden_size)
        engram = self.engram_hashes(ctx, caches, image_mask) if self.hasher is not None else None
        if engram is not None and self.prefetcher is not None:  # every Engram layer's rows, from now on
            engram = self.prefetcher.start(engram)
        try:
            return self.run_layers(ctx, caches, logits_indices, image_mask, engram, image_embeds)
        finally:
            if isinstance(engram, PendingEngram):  # a step that failed part-way leaves nothing in flight
                engram.drain()

    def run_layers(self, ctx: ForwardContext, caches: list[LayerCache], logits_indices: torch.Tensor,
                   image_mask: torch.Tensor | None, engram: torch.Tensor | PendingEngram | None,
                   image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The layers and the head; `engram`: the hash ids `[T, engram layers, cols]`, or their lookups
        in flight (host tables with prefetch)."""
        x = self.embed(ctx.input_ids)
        if image_embeds is not None:  # the reference overwrites the span's embeddings (placeholder id's rows)
            x[image_mask] = image_embeds.to(x.dtype)
        streams = x.unsqueeze(1).repeat(1, self.hc_mult, 1)
        pre = torch.zeros(x.shape[0], self.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0
        mixing, shared = self.ops, {}  # the single-pass mHC boundaries (`SinglePassMixing`)
        pending = None  # the last FFN's (output, post, comb), folded in at the next boundary
        trim = None  # the kept rows, once past the trim point (decoder-side trimming)
        taps = [] if self.keeps_final_streams else None
        for i, (block, plan) in enumerate(zip(self.layers, self.plans)):
            if pending is not None and not plan.has_engram:
                streams, pre_a, post_a, comb_a, x = mixing.hc_post_mix(streams, *pending, self.hc[i][0],
                                                                      block.attn_norm.weight, pre)
            else:  # Engram reads the folded streams before this site mixes them
                if pending is not None:
                    streams = self.ops.map_rows(hyper_residual, streams, *pending)
                if plan.has_engram:
                    streams = self.engram(i, streams, engram, image_mask)
                pre_a, post_a, comb_a, x = mixing.hc_mix(streams, self.hc[i][0], block.attn_norm.weight, pre)
            if taps is not None and i in self.config.dspark_target_layer_ids:  # DSpark reads the attention input
                taps.append(streams.mean(dim=1))
            is_trim_point = i == self.trim_layer and ctx.keep_from is not None
            if is_trim_point:  # every row's compressed entries and index keys, then only the kept rows
                self.compress(i, x, ctx, caches[i])
                trim = TrimmedStep.build(ctx, ctx.keep_from)
                if trim.is_empty:
                    return no_logits(logits_indices, self.config.vocab_size, x.device)
                streams, pre_a, post_a, comb_a, x, image_mask = map(trim.take, (streams, pre_a, post_a, comb_a, x,
                                                                                image_mask))
                shared = {key: trim.take(value) for key, value in shared.items()}
                ctx = trim.ctx
            # attention and MoE end in row-parallel projections: their partial sums meet here (tensor
            # parallelism; `tensor_parallel_v41` says what is cut and what every rank computes whole)
            out = tensor_parallel.all_reduce(self.attention(i, x, ctx, caches[i], shared, compress=not is_trim_point),
                                             self.parallel.tp)
            streams, pre, post_f, comb_f, x = mixing.hc_post_mix(streams, out, post_a, comb_a, self.hc[i][1],
                                                                block.ffn_norm.weight, pre_a)
            pending = (tensor_parallel.all_reduce(self.moe(i, x, ctx, image_mask), self.parallel.tp), post_f, comb_f)
        if taps is not None:
            self.final_streams = torch.cat(taps, dim=-1)
        if trim is not None:
            logits_indices = trim.logits_rows(logits_indices)
        rows = [t[logits_indices] for t in (streams, *pending, pre)]
        return self.ops.map_rows(self.head_logits, *rows)

    def head_logits(self, streams, block_out, post, comb, pre) -> torch.Tensor:
        """The last FFN's fold, the collapse with its site's `pre`, the norm and the fp32 head (per row)."""
        streams = hyper_residual(streams, block_out, post, comb)
        hidden = self.ops.rms_norm(collapse(streams, pre), self.norm.weight)
        return self.ops.fp32_linear(hidden.float(), self.head.weight)

    def engram_hashes(self, ctx: ForwardContext, caches: list[LayerCache], image_mask) -> torch.Tensor:
        """`[T, engram layers, columns]` table rows. Each position's compressed id is stored in the paged
        token pool first, so the look-back of any token (this step's, or cached by an earlier request
        sharing the prefix) reads the pool: chunking and prefix hits see the same ids."""
        pool = next(c.token_ids for c, p in zip(caches, self.plans) if p.holds_token_ids)
        meta, positions = ctx.metadata, ctx.metadata.positions
        ids = self.hasher.token_map[ctx.input_ids]
        if image_mask is not None:
            ids = torch.where(image_mask, -1, ids)
        lens = meta.query_start_loc.diff()
        seq = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), lens, output_size=len(positions))

        def rows(pos: torch.Tensor) -> torch.Tensor:
            page = meta.block_tables[seq, (pos.clamp(min=0) // BLOCK_SIZE).clamp(max=meta.block_tables.shape[1] - 1)]
            return page.clamp(min=0) * BLOCK_SIZE + pos.clamp(min=0) % BLOCK_SIZE

        if isinstance(self.ops, SplitStepExchange):  # a split step's look-back reads other ranks' ids too
            self.ops.share_rows(meta, pool, rows(positions), ids)
        else:
            pool[rows(positions)] = ids
        back = [torch.where(positions - k >= 0, pool[rows(positions - k)], -2) for k in range(self.hasher.max_ngram)]
        return self.hasher.hashes(torch.stack(back, dim=1))

    def engram(self, i: int, streams: torch.Tensor, engram: torch.Tensor | PendingEngram, image_mask) -> torch.Tensor:
        weights = self.layers[i].engram
        weight, eps = weights.q_weight * weights.k_weight, self.config.rms_norm_eps
        if isinstance(engram, PendingEngram):  # gathered since the step began; waits for them only now
            rows = engram.rows(i)
        else:
            rows = self.tables[i].lookup(engram[:, self.engram_columns[i]])

        def run(s, r, *keep):
            return engram_forward(s, r, weights.wkv, weight, eps, *keep)

        return self.ops.map_rows(run, streams, rows, *(() if image_mask is None else (~image_mask,)))

    def attention(self, i: int, x: torch.Tensor, ctx: ForwardContext, cache: LayerCache, shared: dict,
                  compress: bool = True) -> torch.Tensor:
        """Layer `i`'s attention output; a KV source first closes its groups unless `compress` is False
        (the trim point, which closed them for every row before trimming)."""
        plan, weights, ops, meta = self.plans[i], self.layers[i].attn, self.ops, ctx.metadata
        num_tokens = x.shape[0]
        cos, sin, minus_sin = ctx.rope[plan.rope]
        # per-token matmuls go through `ops.map_rows` (fixed row tiles in deterministic mode)
        q_a, kv = ops.map_rows(lambda t: (weights.wq_a(t), weights.wkv(t)), x)
        qr = ops.rms_norm(q_a, weights.q_norm.weight)
        q = ops.rotary(ops.map_rows(weights.wq_b, qr).view(num_tokens, -1, self.config.head_dim), cos, sin)
        kv = ops.rms_norm(kv, weights.kv_norm.weight, cos, sin)
        topk = num_entries = None
        if plan.ratio:
            num_entries = ctx.num_entries[plan.ratio]
            if plan.role == "full" and compress:
                self.compress(i, x, ctx, cache)
            if plan.runs_indexer:
                shared[i] = self.indexer(i, x, qr, ctx, cache, shared, num_entries)
            topk = shared[plan.index_source]
        out = self.attention_backends[i].forward(q, kv, cache.window, cache.compressed, weights.attn_sink, meta,
                                                 topk, num_entries)
        ops.write_window(meta, cache.window, kv)
        out = ops.rotary(out, cos, minus_sin)
        return ops.map_rows(lambda t: weights.wo_b(weights.wo_a(t)), out.reshape(num_tokens, self.config.o_groups, -1))

    def compress(self, i: int, x: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> None:
        """Close this step's groups: compressed entries (RoPE'd at `g * ratio`) and index keys from the
        pre-RoPE latent; the open group's rows to the tail ring."""
        plan, compressor, meta, ops = self.plans[i], self.layers[i].attn.compressor, ctx.metadata, self.ops
        ratio, rotary = plan.ratio, self.rotary["compress"]
        if ratio > 1:
            kv, gate = ops.map_rows(lambda t: (compressor.wkv(t.float()), compressor.wgate(t.float())), x)
        else:
            kv, gate = ops.map_rows(compressor.wkv, x), None
        # context parallelism: a split step's pieces read scratch rings holding the rows before them
        exchange = ops if isinstance(ops, SplitStepExchange) else None
        split = exchange.split_tail_rings(meta, kv, gate, cache.kv_tail, cache.gate_tail) \
            if exchange is not None and ratio > 1 else None
        kv_tail, gate_tail = split if split is not None else (cache.kv_tail, cache.gate_tail)
        pooled, entry, seq, keep = closed_groups(kv, gate, ratio, meta, kv_tail, gate_tail, ctx.no_write_before,
                                                 ops.map_rows)
        if ratio > 1 and split is None:
            write_rings(meta, cache.kv_tail, kv, cache.gate_tail, gate)
        latent = ops.rms_norm(pooled.to(x.dtype), compressor.norm.weight)
        cos, sin = ops.map_rows(rotary.cos_sin, entry * ratio)
        indexer = self.layers[i].attn.indexer
        keys = ops.rms_norm(ops.map_rows(indexer.wk, latent), indexer.k_norm.weight, cos, sin)
        write_entries(cache.index_keys, keys, entry, seq, keep, meta, ratio)
        write_entries(cache.compressed, ops.rotary(latent, cos, sin), entry, seq, keep, meta, ratio)
        if exchange is not None:  # every rank's pools get the entries the other ranks' pieces closed
            exchange.share_entries(meta, [cache.index_keys, cache.compressed], ratio)

    def indexer(self, i: int, x, qr, ctx: ForwardContext, cache: LayerCache, shared: dict, num_entries):
        plan, indexer, ops = self.plans[i], self.layers[i].attn.indexer, self.ops
        cos, sin, _ = ctx.rope[plan.rope]
        q = ops.rotary(ops.map_rows(indexer.wq_b, qr).view(x.shape[0], indexer.num_heads, -1), cos, sin)
        weights = ops.map_rows(indexer.weights_proj, x).float() * indexer.num_heads**-0.5
        if not (plan.is_candidate_source or plan.uses_candidates):
            return self.attention_backends[i].indexer_topk(q, weights, cache.index_keys, ctx.metadata, num_entries)
        scorer, meta, candidates = self.index_scorers[i], ctx.metadata, shared.get("candidates")
        if scorer is not None:  # the backend's kernels score; the selection stays here
            scores = scorer.index_scores(q, weights, cache.index_keys, meta, batched_entry_bound(meta, plan.ratio))
            visible = (meta.positions + 1) // plan.ratio
            picks, masks = select_two_level(scores, visible, plan, self.config, candidates)
        else:
            scale = self.config.index_head_dim**-0.5
            picks, masks = two_level_topk(q, weights * scale, cache.index_keys, meta, num_entries, plan,
                                          self.config, candidates)
        if masks is not None:
            shared["candidates"] = masks
        return picks

    def moe(self, i: int, x: torch.Tensor, ctx: ForwardContext, image_mask) -> torch.Tensor:
        ffn, backend, weights = self.layers[i].ffn, self.moe_backends[i], self.moe_weights[i]
        limit = float(self.config.swiglu_limit)
        if image_mask is None:
            routed = backend.forward(x, ctx.input_ids, weights)
        elif self.parallel.ep.size > 1:  # a rank's dispatches must pair with every other rank's
            check_image_input(self.config, expert_parallel=True)  # raises: images under expert parallelism
        else:  # image positions select with bias_vl
            routed = torch.empty_like(x)
            for mask, chosen in ((~image_mask, weights), (image_mask, replace(weights, score_bias=ffn.gate.bias_vl))):
                routed[mask] = backend.forward(x[mask], ctx.input_ids[mask], chosen)
        return (routed.float() + self.ops.map_rows(lambda t: ffn.shared_experts(t, limit), x).float()).to(x.dtype)


def _check_image_embeds(image_mask: torch.Tensor | None, image_embeds: torch.Tensor, hidden: int) -> None:
    """A clear error unless `image_embeds` has one row of width `hidden` per position `image_mask` marks."""
    if image_mask is None:
        raise ValueError("image_embeds were given without the image_mask saying which positions they replace")
    marked = int(image_mask.sum())
    if image_embeds.dim() != 2 or image_embeds.shape != (marked, hidden):
        raise ValueError(f"image_embeds must be [{marked}, {hidden}] (one row per image position), "
                         f"got {list(image_embeds.shape)}")

