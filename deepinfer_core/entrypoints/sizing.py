"""Sizing a deployment without loading weights (`deepinfer plan`): per rank, the weight bytes by kind, the
KV cache's bytes per token and per request, and how many requests of a given length fit.

The numbers come from the code the engine itself loads with, not from a second description of the model:
a rank's model is built on the meta device (no memory) exactly as `worker.model_loader.load_model`
builds it (the rank's tensor-parallel config, its expert slots, packed FP4 experts, the projections that
stay FP8), and the cache from `kv.cache.bytes_per_block` / `bytes_per_slot` over the same layer plans.
Which projections a checkpoint stores in FP8 is read from its safetensors headers (header bytes only);
without a checkpoint, DeepSeek's release convention is assumed (`models.tiny` writes it the same way).

A layout this build refuses for the model (V4.1 under tensor or expert parallelism, tensor with expert
parallelism) is still sized, by the sharding rules in `SHARDING_RULES`, and marked not runnable.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

KINDS = ("attention", "shared_expert", "routed_expert", "engram", "embedding_head", "mtp", "vision", "other")
"""Weight kinds, as the JSON keys `<kind>_bytes` name them. `vision`: V4.1's image tower and aligner;
`other`: norms, mHC mixing, routers."""
SHARDING_RULES = (
    ("tensor parallelism over T ranks: the query heads, output groups, attention sinks, the shared expert's "
     "width and every routed expert's width are cut 1/T; q_a, kv, compressors, indexer, router, Engram, "
     "embedding, LM head, norms and mHC are replicated; every rank holds the whole KV cache (one K=V head)"),
    ("expert parallelism over E ranks (E = T x D): each rank holds n_routed_experts / E whole routed "
     "experts; everything else as without it"),
    "data parallelism over D ranks: each rank (group of T) has its own requests and KV cache",
)
_HEADER_LIMIT = 256 * 2**20
"""The most header bytes read from one safetensors file (the release's are a few MB)."""
_EMBEDDING_HEAD = ("model.embed_tokens.weight", "lm_head.weight", "embed.weight", "head.weight")


@dataclass(frozen=True)
class Layout:
    """The parallel layout asked for (vLLM's option names)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ep_size(self) -> int:
        return self.world_size if self.enable_expert_parallel else 1


@dataclass(frozen=True)
class Budget:
    """What each rank has and what the engine is asked to keep (`EngineConfig`'s names)."""

    gpu_memory_gib: float
    max_model_len: int
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    engram_placement: str = "device"
    mtp: bool = False
    """Count the MTP drafter's layer (held only with `speculative_config={"method": "mtp"}`)."""
    quantized_weights: str = "native"
    """"native" (FP4 experts packed, FP8 projections kept where whole) or "dequantize" (all bf16)."""


@dataclass
class RankPlan:
    """One rank's bytes and what fits on it."""

    rank: int
    device_bytes: dict[str, int]
    """Weight bytes on the device, by kind (`KINDS`)."""
    host_bytes: dict[str, int]
    """Weight bytes in host memory, by kind (the Engram tables under `engram_placement="host"`)."""
    kv_bytes_per_block: int
    kv_bytes_per_slot: int
    kv_bytes_per_request: int
    concurrent_requests: int
    fits: bool
    shortfall_bytes: int = 0
    """How much more device memory one request of `max_model_len` tokens needs (0 when it fits)."""

    @property
    def device_weight_bytes(self) -> int:
        return sum(self.device_bytes.values())


@dataclass
class DeploymentPlan:
    """The plan for every rank of a layout."""

    model_type: str
    layout: Layout
    budget: Budget
    ranks: list[RankPlan]
    runnable: bool
    refusals: list[str] = field(default_factory=list)
    """Why this build refuses the layout for the model (empty when it runs)."""
    notes: list[str] = field(default_factory=list)

    @property
    def would_fit(self) -> bool:
        """Every rank fits, whether or not this build runs the layout."""
        return all(rank.fits for rank in self.ranks)

    @property
    def fits(self) -> bool:
        """The layout runs in this build and every rank fits."""
        return self.runnable and self.would_fit

    @property
    def concurrent_requests(self) -> int:
        """Requests of `max_model_len` tokens the whole deployment holds at once (each DP rank its own)."""
        return min(rank.concurrent_requests for rank in self.ranks) * self.layout.data_parallel_size


def weight_kind(name: str) -> str:
    """The kind (`KINDS`) of a model tensor, by its name in either family's model."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith(("vision.", "aligner.", "image_start", "image_newline", "image_end")):
        return "vision"
    if ".engram." in name or name == "engram_token_map":
        return "engram"
    if name in _EMBEDDING_HEAD:
        return "embedding_head"
    if ".shared_experts." in name:
        return "shared_expert"
    if ".experts." in name:
        return "routed_expert"
    if ".self_attn." in name or ".attn." in name:
        return "attention"
    return "other"


def bytes_by_kind(tensors) -> dict[str, int]:
    """`{kind: bytes}` of `(name, tensor)` pairs (meta tensors too: only shapes and dtypes are read)."""
    out = dict.fromkeys(KINDS, 0)
    for name, tensor in tensors:
        out[weight_kind(name)] += tensor.numel() * tensor.element_size()
    return out


# ---------------------------------------------------------------------- reading the model, not its weights


def read_model_config(path: str | Path):
    """The model config of a checkpoint directory or of a config.json file (any name), by its family."""
    from deepinfer_core.config import ConfigError
    from deepinfer_core.config.family import read_json_object
    from deepinfer_core.models import registry

    path = Path(path)
    if path.is_dir():
        return registry.load_model_config(path)
    if not path.is_file():
        raise ConfigError(f"{path} is neither a checkpoint directory nor a config.json file")
    data = read_json_object(path)
    config_class = registry.import_object(registry.find_model(data).config_class)
    try:
        return config_class.from_dict(data)
    except ValueError as err:  # pydantic's ValidationError is one
        raise ConfigError(f"{path} does not describe a supported model: {err}") from err


def safetensors_dtypes(model_dir: str | Path) -> dict[str, str] | None:
    """Every tensor's header dtype in the checkpoint at `model_dir` (None: no safetensors files there).
    Only the headers are read: 8 bytes of length, then at most `_HEADER_LIMIT` bytes per file."""
    from deepinfer_core.config import CheckpointError

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    dtypes = {}
    for path in files:
        with path.open("rb") as f:
            raw = f.read(8)
            length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < length <= _HEADER_LIMIT:
                raise CheckpointError(f"{path} has no readable safetensors header (length {length})")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{path}: the safetensors header is not JSON: {err}") from err
        dtypes |= {name: meta["dtype"] for name, meta in header.items() if name != "__metadata__"}
    return dtypes


def _stored_fp8(config, dtypes: dict[str, str] | None):
    """A predicate on internal weight names: is it stored as block-scaled FP8 (one whole source tensor)?"""
    from deepinfer_core.models.loading.checkpoint_layout import (
        FP8_DTYPE,
        detect_layout,
        mtp_source_plans,
        source_plans,
    )
    from deepinfer_core.models.tiny import _FP8_SUFFIXES as RELEASE_FP8_SUFFIXES  # what tiny checkpoints copy

    if config.capabilities.has_checkpoint_loader:  # V4.1's own layout: the model's names are the checkpoint's
        from deepinfer_core.models.deepseek_v41.release import released_tensors

        stored = dtypes if dtypes is not None else {t.name: t.dtype for t in released_tensors(config)}
        return lambda name: stored.get(name) == FP8_DTYPE
    if dtypes is None:  # no checkpoint: DeepSeek's release stores these projections in FP8
        return lambda name: name.endswith(RELEASE_FP8_SUFFIXES)
    layout = detect_layout(list(dtypes))
    plans = source_plans(config, layout)
    mtp_layers = config.num_nextn_predict_layers if "mtp" in config.capabilities.drafters else 0
    if mtp_layers and any(name.startswith(("mtp.", "model.mtp.")) for name in dtypes):
        plans |= {f"mtp.{n}": plan for n, plan in mtp_source_plans(config, layout, mtp_layers).items()}
    return lambda name: (name in plans and plans[name].join == "copy"
                         and dtypes.get(plans[name].sources[0]) == FP8_DTYPE)


# ---------------------------------------------------------------------- one rank's weights


def refusals(config, layout: Layout) -> list[str]:
    """Why this build refuses `layout` for the model of `config` (empty: it runs it)."""
    from deepinfer_core.backends.parallel import ParallelConfig

    reasons = []
    parallel = ParallelConfig(tensor_parallel_size=layout.tensor_parallel_size,
                              data_parallel_size=layout.data_parallel_size,
                              enable_expert_parallel=layout.enable_expert_parallel)
    for check in (parallel.check_implemented,
                  lambda: config.capabilities.check_parallel(config.model_type, "tensor", layout.tensor_parallel_size),
                  lambda: config.capabilities.check_parallel(config.model_type, "expert", layout.ep_size)):
        try:
            check()
        except NotImplementedError as err:
            reasons.append(str(err))
    return reasons


def _local_config(config, size: int):
    """A tensor-parallel rank's config: `shard_config`'s cut, also for a family that refuses the layout
    (the same rule, without the refusal), after the same divisibility checks."""
    from deepinfer_core.config import ConfigError
    from deepinfer_core.models import tensor_parallel

    if config.capabilities.tensor_parallel:
        return tensor_parallel.shard_config(config, size)
    bad = [f"{name} ({getattr(config, name)})" for name in ("num_attention_heads", "o_groups", "moe_intermediate_size")
           if getattr(config, name) % size]
    if bad:
        raise ConfigError(f"tensor_parallel_size={size} does not fit the model: {', '.join(bad)} not a multiple of it")
    if size == 1:
        return config
    return config.model_copy(update={"num_attention_heads": config.num_attention_heads // size,
                                     "o_groups": config.o_groups // size,
                                     "moe_intermediate_size": config.moe_intermediate_size // size})


def rank_model(config, layout: Layout, ep_rank: int, dtype, runnable: bool, fp8=None, quantized_weights: str = "native"):
    """`(model on the meta device, its layer plans)` as `load_model` builds them for EP rank `ep_rank`:
    the rank's tensor-parallel config, packed FP4 experts under "native", its expert slots (runnable
    layouts only) and `FP8Linear`s where `fp8(name)` says a projection is stored FP8 and stays so
    (not under a tensor-parallel cut)."""
    import torch

    from deepinfer_core.backends.parallel import GroupInfo, ParallelConfig, ParallelGroups
    from deepinfer_core.distributed.eplb_state import ExpertShards
    from deepinfer_core.models import registry, tensor_parallel
    from deepinfer_core.models.layer_plan import with_expert_format
    from deepinfer_core.models.loading import weight_formats
    from deepinfer_core.models.loading.checkpoint_layout import tensor_schema

    model_cls = registry.model_class(config)
    native = quantized_weights == "native"
    local = _local_config(config, layout.tensor_parallel_size)
    plans = with_expert_format(model_cls.layer_plan(local, dtype), "fp4" if native and config.expert_dtype == "fp4" else "dense")
    if runnable and layout.enable_expert_parallel:
        parallel = ParallelConfig(tensor_parallel_size=layout.tensor_parallel_size,
                                  data_parallel_size=layout.data_parallel_size, enable_expert_parallel=True)
        ep = GroupInfo(None, ep_rank, layout.ep_size, tuple(range(layout.ep_size)))
        plans = ExpertShards(parallel, ep, config.num_hidden_layers, config.n_routed_experts,
                             torch.device("cpu")).plans(plans)
    with torch.device("meta"):
        model = model_cls(local, plans, dtype, parallel=ParallelGroups.single())
        if native and fp8 is not None and config.quantization_config:
            shards = tensor_parallel.tensor_shards(tensor_schema(model), 0, layout.tensor_parallel_size)
            kept = [n for n in weight_formats.fp8_projection_names(model) if n not in shards and fp8(n)]
            weight_formats.hold_fp8_linears(model, {n.removesuffix(".weight") + ".weight_scale": None for n in kept},
                                            config, dtype)
    return model, plans


def rank_weights(config, layout: Layout, budget: Budget, dtype, runnable: bool, fp8=None,
                 ep_rank: int = 0) -> tuple[dict[str, int], dict[str, int], list]:
    """`(device bytes by kind, host bytes by kind, layer plans)` of one rank."""
    from deepinfer_core.config import ConfigError

    model, plans = rank_model(config, layout, ep_rank, dtype, runnable, fp8, budget.quantized_weights)
    state = model.state_dict()
    host_names = type(model).host_weight_names(state, budget.engram_placement)
    device = bytes_by_kind((n, t) for n, t in state.items() if n not in host_names)
    host = bytes_by_kind((n, t) for n, t in state.items() if n in host_names)
    if not runnable and layout.ep_size > 1:  # whole experts, n / E of them (the rule the runnable layouts follow)
        whole, _ = rank_model(config, replace(layout, tensor_parallel_size=1), 0, dtype, False, fp8,
                              budget.quantized_weights)
        if config.n_routed_experts % layout.ep_size:
            raise ConfigError(f"{config.n_routed_experts} routed experts do not split evenly over {layout.ep_size} "
                              "expert-parallel ranks")
        routed = bytes_by_kind(whole.state_dict().items())["routed_expert"]
        device["routed_expert"] = routed // layout.ep_size
    if budget.mtp and "dspark" in config.capabilities.drafters:
        device["mtp"] = _dspark_held_bytes(config, layout, dtype, fp8, budget.quantized_weights == "native")
    elif budget.mtp:
        device["mtp"] = _mtp_bytes(config, layout, dtype, fp8, budget.quantized_weights == "native")
    return device, host, plans


def _mtp_bytes(config, layout: Layout, dtype, fp8, native: bool) -> int:
    """The MTP drafter's layers on one rank (cut like a target layer; the embedding and head are shared)."""
    import torch

    from deepinfer_core.config import ConfigError
    from deepinfer_core.models import tensor_parallel
    from deepinfer_core.models.deepseek_v4.mtp import MultiTokenPredictor
    from deepinfer_core.models.loading import weight_formats
    from deepinfer_core.models.loading.checkpoint_layout import tensor_schema

    if "mtp" not in config.capabilities.drafters or not config.num_nextn_predict_layers:
        raise ConfigError(f"{config.model_type} carries no MTP layer the engine runs; drop --mtp")
    local = _local_config(config, layout.tensor_parallel_size)
    fmt = "fp4" if native and config.expert_dtype == "fp4" else "dense"
    with torch.device("meta"):
        module = MultiTokenPredictor(local, dtype, config.num_nextn_predict_layers, fmt)
        if native and fp8 is not None and config.quantization_config:  # FP8 as the target's: uncut ones only
            shards = tensor_parallel.mtp_tensor_shards(tensor_schema(module), 0, layout.tensor_parallel_size)
            kept = [n for n in weight_formats.fp8_projection_names(module) if n not in shards and fp8(f"mtp.{n}")]
            weight_formats.hold_fp8_linears(module, {n.removesuffix(".weight") + ".weight_scale": None for n in kept},
                                            config, dtype)
    return sum(bytes_by_kind(module.state_dict().items()).values())


# ---------------------------------------------------------------------- the cache, and what fits


STEP_PEAK_NOTE = ("not counted: the largest step's transient memory (activations, dequantised experts, sampling), "
                  "which the engine measures at start-up and takes from the KV cache (its 'memory:' log line; "
                  "stats' step_peak_bytes): it may hold fewer requests than this plan")


def fit_rank(rank: int, device: dict[str, int], host: dict[str, int], plans, dtype, budget: Budget) -> RankPlan:
    """One rank's cache sizes and what fits, as `worker.model_loader.available_blocks` sizes the cache:
    `gpu_memory_utilization` of the memory the weights leave, less `max_num_seqs` request slots, in blocks."""
    from deepinfer_core.kv.cache import bytes_per_block, bytes_per_slot
    from deepinfer_core.models.layer_plan import BLOCK_SIZE

    per_block, per_slot = bytes_per_block(plans, dtype), bytes_per_slot(plans, dtype)
    blocks_per_request = -(-budget.max_model_len // BLOCK_SIZE)
    per_request = blocks_per_request * per_block + per_slot
    free = budget.gpu_memory_gib * 2**30 - sum(device.values())
    block_budget = free * budget.gpu_memory_utilization - per_slot * budget.max_num_seqs
    blocks = max(0, int(block_budget // max(per_block, 1)))
    concurrent = min(budget.max_num_seqs, blocks // blocks_per_request) if free > 0 else 0
    shortfall = 0
    if concurrent < 1:  # the memory one request (and the slots the engine reserves) would need, minus what is there
        needed = (per_slot * budget.max_num_seqs + blocks_per_request * per_block) / budget.gpu_memory_utilization
        shortfall = math.ceil(needed - free)
    return RankPlan(rank, device, host, per_block, per_slot, per_request, concurrent, concurrent >= 1, shortfall)


def plan_deployment(model: str | Path, layout: Layout, budget: Budget, dtype=None) -> DeploymentPlan:
    """Size every rank of `layout` for the model at `model` (a checkpoint directory or a config.json)."""
    import torch

    dtype = dtype or torch.bfloat16
    config = read_model_config(model)
    path = Path(model)
    dtypes = safetensors_dtypes(path if path.is_dir() else path.parent)
    fp8 = _stored_fp8(config, dtypes)
    refused = refusals(config, layout)
    device, host, plans = rank_weights(config, layout, budget, dtype, not refused, fp8)
    # every rank of these layouts holds the same shapes (its own heads, slices or expert slots)
    ranks = [fit_rank(rank, dict(device), dict(host), plans, dtype, budget) for rank in range(layout.world_size)]
    notes = []
    if dtypes is None and config.quantization_config:
        notes.append("no checkpoint beside the config: FP8 projections assumed as DeepSeek's release stores them")
    if not budget.mtp and "mtp" in config.capabilities.drafters and config.num_nextn_predict_layers:
        notes.append("the MTP layer is not counted (it loads only with speculative decoding; add --mtp)")
    if not budget.mtp and "dspark" in config.capabilities.drafters:
        notes.append(f"the DSpark drafter ({_dspark_bytes(config) / 2**30:.1f} GiB in the checkpoint) is not counted "
                     "(it loads only with speculative_config method 'dspark'; add --mtp)")
    if any(host.values()):
        notes.append(f"{sum(host.values()) / 2**30:.1f} GiB of Engram tables per rank in pinned host memory")
    notes.append(STEP_PEAK_NOTE)
    return DeploymentPlan(config.model_type, layout, budget, ranks, not refused, refused, notes)


def _dspark_held_bytes(config, layout: Layout, dtype, fp8, native: bool) -> int:
    """The DSpark drafter's `mtp.*` weights on one rank as it holds them (its module built on the meta
    device): whole on every rank (it runs under data parallelism only), FP8 projections (`fp8(name)`) kept
    FP8 and FP4 experts packed under `native`, as the target's, else dequantised."""
    import torch

    from deepinfer_core.config import ConfigError
    from deepinfer_core.models.deepseek_v41.dspark import DSparkModule
    from deepinfer_core.models.loading import weight_formats

    if layout.tensor_parallel_size > 1 or layout.enable_expert_parallel:
        raise ConfigError("the DSpark drafter runs under data parallelism only (not under tensor or expert "
                          "parallelism); drop --mtp or the layout")
    fmt = "fp4" if native and config.expert_dtype == "fp4" else "dense"
    with torch.device("meta"):
        module = DSparkModule(config, dtype, fmt)
        if native and fp8 is not None and config.quantization_config:
            kept = [n for n in weight_formats.fp8_projection_names(module) if fp8(n)]
            weight_formats.hold_fp8_linears(module, {n.removesuffix(".weight") + ".weight_scale": None for n in kept},
                                            config, dtype)
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _dspark_bytes(config) -> int:
    from deepinfer_core.models.deepseek_v41.release import released_tensors

    return sum(t.num_bytes for t in released_tensors(config, include_vision=False) if t.name.startswith("mtp."))
