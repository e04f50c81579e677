"""Building one rank's model side, in named phases: layer plans, weights (checkpoint or in-memory, this
rank's tensor-parallel slices and experts, FP4/FP8 formats), the trim point, backend binding, cache
sizing, the MTP drafter and decode-graph capture.

`load_model` returns a `LoadedModel`, the typed bundle of what loading decided (plans, formats, the
model, its linear backends); the runner builds its cache, input batch and helpers from it and hands each
helper only the objects it needs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_core import plugins
from deepinfer_core.backends import supports_cuda_graphs
from deepinfer_core.backends.moe import check_expert_format, check_expert_parallel
from deepinfer_core.backends.parallel import ParallelGroups
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.distributed.context_parallel_ops import ContextParallelAttention, ContextParallelLayerOps
from deepinfer_core.distributed.eplb_state import ExpertShards, make_expert_shards
from deepinfer_core.kv.cache import KVCache, bytes_per_block, bytes_per_slot
from deepinfer_core.models import registry, tensor_parallel
from deepinfer_core.models.deepseek_v4.mtp import split_mtp_weights
from deepinfer_core.models.interface import CausalLM, cache_fingerprint
from deepinfer_core.models.layer_plan import (
    BLOCK_SIZE,
    deterministic_plans,
    layer_ops_spec,
    with_expert_format,
)
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.models.loading.checkpoint_layout import tensor_schema
from deepinfer_core.models.loading.weight_digest import WeightDigest
from deepinfer_core.models.loading.weights import load_weights, match_param_dtypes
from deepinfer_core.speculative.dspark_drafter import build_dspark_drafter
from deepinfer_core.speculative.mtp_drafter import DraftTarget, MTPDrafter
from deepinfer_core.speculative.runner_side import build_mtp_drafter
from deepinfer_core.worker.graphs import DecodeGraphs
from deepinfer_core.worker.input_batch import InputBatch
from deepinfer_core.worker.memory_profile import (
    MemoryProfile,
    configured_too_large,
    no_room,
    not_measured,
    profile_memory,
)

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What loading built for one rank: the model with its weights and backends, and the facts the rest
    of the runner is sized by."""

    config: ModelConfig
    """The whole model's config."""
    engine_config: EngineConfig
    device: torch.device
    parallel: ParallelGroups
    dtype: torch.dtype
    local_config: ModelConfig
    """This rank's part of the model (its query heads, output groups and expert width under TP)."""
    plans: list
    experts: ExpertShards | None
    """This rank's routed experts under expert parallelism (None without)."""
    cache_fingerprint: bytes
    """What cached blocks depend on (`interface.cache_fingerprint`), the weights' bytes included: set once
    they are loaded."""
    model: CausalLM | None = None
    linear_backends: list | None = None
    num_trim_kept: int | None = None
    """Decoder-side trimming: prompt rows each request keeps past the trim point; None: off."""
    mtp_weights: dict[str, torch.Tensor] | None = None
    """The in-memory weights' `mtp.*` layer (None: the MTP drafter reads the checkpoint, if asked for)."""


def load_model(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
               weights: dict[str, torch.Tensor] | None = None, parallel: ParallelGroups | None = None) -> LoadedModel:
    """Plan the layers, load the weights (`weights`: internal names, instead of `engine_config.model`),
    set the trim point and bind the backends (`parallel`: this rank's groups; None: one rank)."""
    parallel = parallel if parallel is not None else ParallelGroups.single()
    dtype = engine_config.torch_dtype(model_config)
    model_cls = registry.model_class(model_config)
    fmt = weight_formats.expert_format(model_config, engine_config, weights)
    local_config = tensor_parallel.shard_config(model_config, parallel.tp.size)
    plans = deterministic_plans(with_expert_format(model_cls.layer_plan(local_config, dtype), fmt),
                                engine_config.deterministic)
    experts = make_expert_shards(parallel, model_config, device, engine_config.time_ep_dispatch)  # None without EP
    if experts is not None:
        plans = experts.plans(plans)
    loaded = LoadedModel(model_config, engine_config, device, parallel, dtype, local_config, plans, experts, b"")
    digest = WeightDigest()
    loaded.model = _load_weights(loaded, model_cls, weights, digest)
    loaded.cache_fingerprint = cache_fingerprint(model_config, dtype, plans, _weights_identity(digest, parallel))
    loaded.num_trim_kept = _set_trim_point(loaded)
    loaded.linear_backends = _bind_backends(loaded)
    return loaded


def _weights_identity(digest: WeightDigest, parallel: ParallelGroups) -> bytes:
    """The hash of the weights every rank read: each rank hashed only its own slices and experts, so the
    ranks' digests are joined in rank order, and every rank (and the engine) gets the same fingerprint."""
    own = digest.digest()
    if parallel.world_size == 1:
        return own
    import torch.distributed as dist

    digests: list[bytes | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, own)
    return hashlib.sha256(b"".join(digests)).digest()


def _load_weights(loaded: LoadedModel, model_cls: type, weights: dict[str, torch.Tensor] | None,
                  digest: WeightDigest) -> CausalLM:
    """The model built on the meta device, then given its weights: checked against the modules (names,
    shapes, finite values) and cast to their declared dtypes; `digest` gets the bytes as they are read
    (in-memory weights: every tensor's)."""
    cfg, config, dtype, device = loaded.engine_config, loaded.config, loaded.dtype, loaded.device
    with torch.device("meta"):
        model = model_cls(loaded.local_config, loaded.plans, dtype, parallel=loaded.parallel)
    shards = tensor_parallel.tensor_shards(tensor_schema(model), loaded.parallel.tp.rank, loaded.parallel.tp.size)
    native = cfg.quantized_weights == "native"
    expert_format = loaded.plans[0].moe.expert_format
    block = weight_formats.fp8_layout(config)[0]
    host_names = model_cls.host_weight_names(
        tensor_schema(model), cfg.engram_placement)  # never on the device, even while loading
    if weights is None:
        weights = _checkpoint_weights(loaded, model_cls, model, shards, host_names, digest)
    else:
        for name, tensor in weights.items():
            digest.add(name, tensor)
        weights, loaded.mtp_weights = split_mtp_weights(weights)
        if loaded.experts is not None:
            weights = loaded.experts.select_local(weights)
        if shards:  # FP8 projections are cut dequantised (their scales are not cut with them)
            weights = weight_formats.prepare_weights(weights, expert_format, dtype, keep_fp8=False, block=block)
            weights = tensor_parallel.shard_weights(weights, shards)
    weights = weight_formats.prepare_weights(weights, expert_format, dtype, keep_fp8=native, block=block)
    weight_formats.hold_fp8_linears(model, weights, config, dtype)
    weights = match_param_dtypes(weights, tensor_schema(model), device, host=host_names)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()


def _checkpoint_weights(loaded: LoadedModel, model_cls: type, model, shards, host_names,
                        digest: WeightDigest) -> dict[str, torch.Tensor]:
    """The checkpoint's weights: through the model class's own loader when it has a checkpoint layout of
    its own, else the common one (under tensor parallelism only this rank's slices are read)."""
    cfg, experts = loaded.engine_config, loaded.experts
    keep_fp4 = loaded.plans[0].moe.expert_format == "fp4"
    keep_fp8 = weight_formats.fp8_projection_names(model) if cfg.quantized_weights == "native" else frozenset()
    if model.capabilities.has_checkpoint_loader:  # reads only the rank's slices and experts itself
        return model_cls.load_checkpoint(cfg.model, loaded.config, loaded.dtype, loaded.device, keep_fp4=keep_fp4,
                                         digest=digest, **({"host": host_names} if host_names else {}),
                                         **({"shards": shards} if shards else {}),
                                         **({"local_experts": experts.local_experts} if experts else {}),
                                         **({"keep_fp8": keep_fp8} if keep_fp8 else {}))
    return load_weights(cfg.model, loaded.config, loaded.dtype, loaded.device, keep_fp4=keep_fp4,
                        keep_fp8=keep_fp8,
                        local_experts=experts.local_experts if experts else None, shards=shards, digest=digest)


def _set_trim_point(loaded: LoadedModel) -> int | None:
    """Tell a V4.1 model where decoder-side trimming starts (`EngineConfig.decoder_trimming`; `resolve`
    checked the model); the rows kept are the last window's."""
    if not loaded.engine_config.decoder_trimming:
        return None
    from deepinfer_core.models.deepseek_v41.trim import trim_layer

    loaded.model.trim_layer = trim_layer(loaded.plans)
    return loaded.config.sliding_window


def _bind_backends(loaded: LoadedModel) -> list:
    """Give the model one attention and MoE backend per distinct layer spec, its layer ops and linear
    backends (wrapped for context parallelism under it); returns the linear backends."""
    model, device, cfg = loaded.model, loaded.device, loaded.engine_config
    attention, moe = {}, {}
    for plan in loaded.plans:
        if plan.attention not in attention:
            attention[plan.attention] = plugins.make_attention(plan.attention, device)
        if plan.moe not in moe:
            moe[plan.moe] = plugins.make_moe(plan.moe, device)
            check_expert_format(moe[plan.moe], plan.moe)
            check_expert_parallel(moe[plan.moe], plan.moe)
    ops = plugins.make_layer_ops(layer_ops_spec(loaded.config, loaded.dtype, cfg.deterministic), device)
    linear_backends = weight_formats.bind_linears(model, plugins.make_linear, device)
    if loaded.parallel.cp.size > 1:  # split prefill steps exchange window keys and compressed entries
        attention = {spec: ContextParallelAttention(backend) for spec, backend in attention.items()}
        ops = ContextParallelLayerOps(ops)
    if model.capabilities.has_engram:  # read by `bind_backends` (`resolve` checked the rest)
        model.engram_placement = cfg.engram_placement
        model.engram_prefetch = cfg.engram_prefetch
    model.bind_backends([attention[p.attention] for p in loaded.plans], [moe[p.moe] for p in loaded.plans],
                        ops, device)
    if loaded.experts is not None:
        loaded.experts.attach(model.moe_weights)
    return linear_backends


def make_kv_cache(loaded: LoadedModel, agree_num_blocks: Callable[[int], int] | None = None,
                  profile: MemoryProfile | None = None) -> KVCache:
    """The cache: as many blocks as fit (`available_blocks`, beside `profile`'s measured step), or as every
    rank agrees on (`agree_num_blocks`: this rank's count to the one every rank uses, the minimum)."""
    cfg = loaded.engine_config
    num_blocks = available_blocks(loaded.plans, loaded.dtype, loaded.device, cfg, profile)
    if agree_num_blocks is not None:
        num_blocks = agree_num_blocks(num_blocks)
    return KVCache(loaded.plans, num_blocks, cfg.max_num_seqs, loaded.dtype, loaded.device)


def available_blocks(plans, dtype: torch.dtype, device: torch.device, cfg: EngineConfig,
                     profile: MemoryProfile | None = None) -> int:
    """Cache blocks that fit: `num_kv_blocks`, else what device (or host) memory allows once the largest
    step's measured peak (`profile`; not measured: nothing) is set aside.

    :raises MemoryError: no room for one `max_model_len` request (device memory), or the configured
        blocks do not fit beside the measured step; the message gives the numbers and what to change.
    """
    profile = profile if profile is not None else not_measured("no profile was run")
    logger.info("memory: %s", profile.describe())
    num_slots = cfg.max_num_seqs
    per_block = max(bytes_per_block(plans, dtype), 1)
    per_slot = bytes_per_slot(plans, dtype)
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
        if profile.measured and blocks * per_block + num_slots * per_slot + profile.reserved > profile.free:
            raise MemoryError(configured_too_large(cfg, profile, per_block, per_slot))
    elif device.type != "cpu" or profile.measured:  # torch.cuda, or the vendor's module (torch.npu) of the same shape
        free = profile.free if profile.measured else getattr(torch, device.type).mem_get_info(device)[0]
        budget = free * cfg.gpu_memory_utilization - per_slot * num_slots - profile.reserved
        blocks = max(0, int(budget // per_block))
        if blocks < -(-cfg.max_model_len // BLOCK_SIZE):
            raise MemoryError(no_room(cfg, profile, free, per_block, per_slot, blocks))
    else:  # host memory: enough for every slot at full length, capped by the utilisation fraction
        wanted = num_slots * -(-cfg.max_model_len // BLOCK_SIZE)
        blocks = min(wanted, int(_host_memory() * cfg.gpu_memory_utilization * 0.25 // per_block))
    if blocks < 1:
        raise MemoryError(f"no room for the KV cache: {per_block} bytes per block; lower max_num_seqs or set num_kv_blocks")
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB) + %d request slots (%.1f MiB); %.1f bytes per token "
        "of compressed state, %.2f MiB fixed state per request (windows, compressor tails)",
        blocks, BLOCK_SIZE, blocks * per_block / 2**20, num_slots, num_slots * per_slot / 2**20,
        per_block / BLOCK_SIZE, per_slot / 2**20,
    )
    return blocks


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def make_mtp_drafter(loaded: LoadedModel, inputs: InputBatch, sampler, num_slots: int) -> MTPDrafter | None:
    """The MTP drafter when `speculative_config.method == "mtp"`, the DSpark drafter when "dspark" (else
    None), drafting against the target's step contexts (`inputs`) and `sampler`."""
    target = DraftTarget(loaded.config, inputs.make_context, sampler, num_slots, loaded.dtype, loaded.device)
    spec = loaded.engine_config.speculative_config
    if spec is not None and spec.method == "dspark":  # V4.1's drafter, in its checkpoint's mtp.* slot
        return build_dspark_drafter(loaded.engine_config, target, loaded.model, loaded.parallel, loaded.plans[0].moe,
                                    loaded.num_trim_kept is not None)
    return build_mtp_drafter(loaded.engine_config, target, loaded.model, loaded.local_config,
                             loaded.plans[0].moe.expert_format, loaded.parallel.tp, loaded.mtp_weights)


def profile_step_memory(loaded: LoadedModel, sampler) -> MemoryProfile:
    """Measure the largest step's peak on `loaded`'s model through the device's `memory_counters` (and a
    decode step at the largest captured batch where decode graphs will be captured)."""
    counters = plugins.memory_counters(loaded.device)
    if counters is None:
        return not_measured(f"no plugin offers memory counters for {loaded.device}")
    cfg, model = loaded.engine_config, loaded.model
    spec = cfg.speculative_config
    captures = (not cfg.enforce_eager and loaded.device.type != "cpu"
                and all(supports_cuda_graphs(b) for b in [*model.backends(), *loaded.linear_backends])
                and plugins.graph_api(loaded.device) is not None)
    width = (1 + (spec.num_speculative_tokens if spec is not None else 0)) if captures else 0
    return profile_memory(loaded, sampler, counters, width)


def capture_graphs(loaded: LoadedModel, kv_cache: KVCache, inputs: InputBatch,
                   mtp: MTPDrafter | None) -> DecodeGraphs | None:
    """The decode graphs (and the MTP layer's), or None where decode runs eagerly: on the CPU, under
    `enforce_eager`, when a backend cannot be captured or no plugin offers capture on the device."""
    model, device, cfg = loaded.model, loaded.device, loaded.engine_config
    if device.type == "cpu" or cfg.enforce_eager:
        return None
    if not all(supports_cuda_graphs(b) for b in [*model.backends(), *loaded.linear_backends]):
        logger.info("decode runs eagerly: a backend does not declare supports_cuda_graphs")
        return None
    api = plugins.graph_api(device)
    if api is None:
        logger.info("decode runs eagerly: no plugin offers graph capture on %s", device)
        return None
    max_len = cfg.max_model_len
    spec = cfg.speculative_config
    # verification steps whose requests all carry d <= k drafts replay the graphs of width 1 + d
    widths = range(1, 2 + spec.num_speculative_tokens) if spec is not None else (1,)
    graphs = DecodeGraphs(model, kv_cache, inputs, kv_cache.num_slots, -(-max_len // BLOCK_SIZE), max_len, api,
                          sizes=cfg.cuda_graph_sizes, widths=widths)
    start = time.perf_counter()
    graphs.capture(progress=logger.isEnabledFor(logging.INFO))
    logger.info("captured decode CUDA graphs for batch sizes %s x tokens per request %s in %.1f s (first "
                "capture compiles the kernels; cuda_graph_sizes sets the sizes)", graphs.sizes, graphs.widths,
                time.perf_counter() - start)
    if mtp is not None:
        _capture_mtp_graphs(mtp, api, graphs.sizes, max_len)
    return graphs


def _capture_mtp_graphs(mtp: MTPDrafter, api, sizes, max_len: int) -> None:
    """The MTP layer's passes as graphs; a failure leaves them eager (drafts only: the output is the same)."""
    if not all(supports_cuda_graphs(b) for b in mtp.backends):
        logger.info("the MTP layer runs eagerly: a backend of its own does not declare supports_cuda_graphs")
        return
    start = time.perf_counter()
    try:
        mtp.capture_graphs(api, sizes, max_len)
        logger.info("captured the MTP layer's passes as CUDA graphs in %.1f s", time.perf_counter() - start)
    except RuntimeError as err:
        mtp.graphs = None
        api.synchronize()
        logger.warning("the MTP layer runs eagerly: capturing its passes failed (%s)", err)
