"""Typed configuration: the model's `config.json` (`ModelConfig`) and the engine's knobs (`EngineConfig`).

`ModelConfig` mirrors transformers 5.23's `DeepseekV4Config` field for field, with the same defaults and
the same normalisation of legacy keys, so a config.json means the same thing here as in the oracle.
Unknown keys (real checkpoints carry many) are kept in `model_extra` and otherwise ignored.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from deepinfer_core.backends.parallel import EplbConfig, ParallelConfig
from deepinfer_core.config.speculative import SpeculativeConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")
# field: (what DeepSeek-V4 releases use, the lowest and highest value loaded without a warning)
_FAMILY_VALUES: dict[str, tuple[str, float, float]] = {
    "sliding_window": ("128", 64, 1024),
    f"compress_rates[{CSA!r}]": ("4", 2, 16),
    f"compress_rates[{HCA!r}]": ("128", 32, 512),
    "index_topk": ("512", 64, 4096),
    "routed_scaling_factor": ("1.5", 1.0, 4.0),
    "swiglu_limit": ("10", 1.0, 100.0),
    "rope_theta": ("10000", 1e3, 1e6),
    "compress_rope_theta": ("160000", 1e4, 1e7),
    "rms_norm_eps": ("1e-6 (V4.1: 1e-20)", 0.0, 1e-4),
    "hc_eps": ("1e-6", 0.0, 1e-3),
    "hc_sinkhorn_iters": ("20", 5, 100),
}
logger = logging.getLogger(__name__)


SwaReplay = Literal["bounded", "exact"]
"""How a prefix-cache hit rebuilds the sliding window (docs/structures.md); the one list of the modes.
Each model family's config class declares its default as `swa_replay_default`."""


class ConfigError(ValueError):
    """A configuration file cannot be read or does not describe a supported model."""


class CheckpointError(ValueError):
    """A checkpoint file (weights, index, tokenizer) cannot be read, or does not match the model config
    (missing, unexpected, misshaped, mistyped or non-finite tensors). The message names the file or tensor."""


class QuantizationConfig(BaseModel):
    """The checkpoint's `quantization_config`; only what loading needs is typed, the rest is kept."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    quant_method: str | None = Field(None, description='"fp8" for DeepSeek block-FP8 checkpoints.')
    fmt: str | None = Field(None, description="Storage format name some exporters write (e.g. 'e4m3').")
    scale_fmt: str | None = Field(None, description='Scale encoding, e.g. "ue8m0"; None means float32.')
    activation_scheme: str | None = None
    weight_block_size: tuple[PositiveInt, PositiveInt] = Field(
        (128, 128), description="FP8 scale block (rows, columns) of the dense weights."
    )
    expert_dtype: Literal["fp4", "fp8", "bf16"] | None = Field(
        None, description='Routed-expert storage: "fp4" (e2m1, one scale per 32 inputs) or block "fp8".'
    )


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """`model_dir/config.json` as a dictionary; `ConfigError` naming the file if it is missing, unreadable,
    not JSON or not a JSON object."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: point the model path at a checkpoint directory")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{config_path} must hold a JSON object, got {type(data).__name__}")
    return data


class ModelConfig(BaseModel):
    """DeepSeek-V4 model configuration (transformers' `DeepseekV4Config` after normalisation).

    Build it with `ModelConfig.from_dir(checkpoint_dir)` or `ModelConfig.from_dict(d)`. Legacy keys are
    folded exactly as transformers does: `compress_ratios` (per-layer 0/4/128) -> `layer_types`,
    `compress_rate_csa`/`compress_rate_hca` -> `compress_rates`, `num_hash_layers` -> `mlp_layer_types`,
    `qk_rope_head_dim` -> `partial_rotary_factor`, `rope_scaling` -> `rope_parameters` nested as
    `{"main": {...}, "compress": {...}}` (YaRN only on the compress branch, `attention_factor` 1.0).
    """

    model_config = ConfigDict(extra="allow", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    model_type: Literal["deepseek_v4"] = "deepseek_v4"

    swa_replay_default: ClassVar[SwaReplay] = "exact"
    """How this family's prefix-cache hits rebuild the sliding windows unless asked otherwise: V4 was not
    trained for SWA Bounded Replay, so it replays exactly (`EngineConfig.swa_replay`)."""

    vocab_size: PositiveInt = 129280
    hidden_size: PositiveInt = 4096
    moe_intermediate_size: PositiveInt = 2048
    num_hidden_layers: PositiveInt = 43
    num_attention_heads: PositiveInt = 64
    num_key_value_heads: PositiveInt = 1
    head_dim: PositiveInt = 512
    q_lora_rank: PositiveInt = 1024
    num_experts_per_tok: PositiveInt = 6
    n_routed_experts: PositiveInt = 256
    n_shared_experts: PositiveInt = 1
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: PositiveInt = 1048576
    rope_theta: float = Field(10000.0, gt=0)
    layer_types: list[str] = Field(default_factory=list)
    compress_rates: dict[str, PositiveInt] = Field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    compress_rope_theta: float = Field(160000.0, gt=0)
    hc_mult: PositiveInt = 4
    hc_sinkhorn_iters: PositiveInt = 20
    hc_eps: float = Field(1.0e-6, gt=0)
    mlp_layer_types: list[str] = Field(default_factory=list)
    swiglu_limit: float = 10.0
    sliding_window: PositiveInt = 128
    o_groups: PositiveInt = 8
    o_lora_rank: PositiveInt = 1024
    index_n_heads: PositiveInt = 64
    index_head_dim: PositiveInt = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = Field(1, ge=0)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = Field(1.0e-6, gt=0)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    quantization_config: QuantizationConfig | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Validate a config.json dictionary (not modified). Raises `pydantic.ValidationError`."""
        return cls.model_validate(data)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`; log a warning for each value far from the family's
        (`unusual_values`). Raises `ConfigError` naming the file if it is missing, unreadable, not
        JSON, or does not describe a supported model."""
        config_path = Path(path) / "config.json"
        data = read_config_json(path)
        try:
            config = cls.from_dict(data)
        except ValidationError as err:
            raise ConfigError(
                f"{config_path} does not describe a supported DeepSeek-V4 model: {err}"
            ) from err
        for message in config.unusual_values():
            logger.warning("%s: %s", config_path, message)
        return config

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = copy.deepcopy(data)
        model_type = data.get("model_type", "deepseek_v4")
        if model_type == "deepseek_v41":  # its own config class (nested config.json)
            raise ValueError("model_type 'deepseek_v41' is read by deepinfer_core.models.deepseek_v41.config.V41Config; "
                             "load it with deepinfer_core.models.registry.load_model_config(model_dir)")
        if model_type != "deepseek_v4":
            raise ValueError(
                f"model_type {model_type!r} is not supported: this loader reads DeepSeek-V4 "
                f"checkpoints (model_type 'deepseek_v4')"
            )
        _fold_legacy_keys(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} has unknown entries {bad}; allowed: {list(allowed)}")
        for layer_type in {CSA, HCA} & set(self.layer_types):
            if layer_type not in self.compress_rates:
                raise ValueError(f"compress_rates lacks a rate for {layer_type!r}, which layer_types uses")
        if CSA in self.layer_types and self.index_topk <= 0:
            raise ValueError(
                f"index_topk must be positive for compressed_sparse_attention, got {self.index_topk}"
            )
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"o_groups ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_key_value_heads != 1:
            raise ValueError(
                f"num_key_value_heads must be 1 (DeepSeek-V4 shares one KV head), got "
                f"{self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                f"({self.n_routed_experts})"
            )
        rope_dim = self.qk_rope_head_dim
        if not 0 < rope_dim <= self.head_dim or rope_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim (head_dim * partial_rotary_factor = {rope_dim}) must be even and in "
                f"(0, head_dim={self.head_dim}]; check partial_rotary_factor / qk_rope_head_dim"
            )
        for label in ("main", "compress"):
            params = self.rope_parameters.get(label)
            if params is None:
                raise ValueError(f"rope_parameters lacks the {label!r} entry")
            if params.get("rope_type") == "yarn" and not (
                params.get("factor", 0) >= 1 and params.get("original_max_position_embeddings")
            ):
                raise ValueError(
                    f"rope_parameters[{label!r}] is yarn and needs factor >= 1 and "
                    f"original_max_position_embeddings, got {params}"
                )
        return self

    @model_validator(mode="after")
    def _check_token_ids_and_rope(self) -> ModelConfig:
        vocab = self.vocab_size
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, list) else [] if value is None else [value]
            if any(not 0 <= token < vocab for token in ids):
                raise ValueError(
                    f"{name} {value} is outside the vocabulary [0, {vocab}); check vocab_size and {name}"
                )
        for label, params in self.rope_parameters.items():
            bad = {k: v for k, v in params.items() if isinstance(v, float) and not math.isfinite(v)}
            if bad:
                raise ValueError(f"rope_parameters[{label!r}] has non-finite values {bad}")
        return self

    def unusual_values(self) -> list[str]:
        """One line for each field set far from what the DeepSeek-V4 family uses (outside the range in
        `_FAMILY_VALUES`): it loads, but is likely a mistake. A release has none; tiny test models some."""
        values = {name: getattr(self, name) for name in _FAMILY_VALUES if name.isidentifier()}
        for kind in (CSA, HCA):
            if kind in self.layer_types:
                values[f"compress_rates[{kind!r}]"] = self.compress_rates[kind]
        if CSA not in self.layer_types:
            del values["index_topk"]
        return [
            f"{name} is {value}, far from the DeepSeek-V4 family's {_FAMILY_VALUES[name][0]} "
            f"(warned outside [{_FAMILY_VALUES[name][1]:g}, {_FAMILY_VALUES[name][2]:g}])"
            for name, value in values.items()
            if not _FAMILY_VALUES[name][1] <= value <= _FAMILY_VALUES[name][2]
        ]

    # ------------------------------------------------------------------ convenience

    @property
    def qk_rope_head_dim(self) -> int:
        """Dimensions of each head that get RoPE (the trailing part of head_dim)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (`num_hidden_layers`; MTP layers are not counted)."""
        return self.num_hidden_layers

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids as a list (empty if the config names none)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def expert_dtype(self) -> str | None:
        """Storage dtype of the routed experts ("fp4", "fp8", ...) or None when unquantised."""
        return self.quantization_config.expert_dtype if self.quantization_config else None

    @property
    def checkpoint_dtype(self) -> str | None:
        """The `dtype` / `torch_dtype` the checkpoint declares (an extra key), e.g. "bfloat16"."""
        extra = self.model_extra or {}
        value = extra.get("dtype", extra.get("torch_dtype"))
        return value if isinstance(value, str) else None

    @property
    def has_engram(self) -> bool:
        """Whether the model has Engram tables (`EngineConfig.engram_placement`): V4 has none."""
        return False

    def check_decoder_trimming(self) -> None:
        """`ConfigError` unless the model can trim its decoder (`EngineConfig.decoder_trimming`): V4 cannot."""
        raise ConfigError(f"decoder_trimming=True: {self.model_type} has no decoder-side trimming (only "
                          "DeepSeek-V4.1 does); leave decoder_trimming off")

    def compress_rate(self, layer_idx: int) -> int:
        """Compression rate of layer `layer_idx` (0 for sliding-window-only layers)."""
        layer_type = self.layer_types[layer_idx]
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    def to_hf_dict(self, include_quantization: bool = False) -> dict[str, Any]:
        """Keyword arguments for `transformers.DeepseekV4Config(**d)` (extra keys dropped)."""
        data = self.model_dump(exclude={"model_type", "quantization_config"})
        for key in list(data):
            if key not in type(self).model_fields:
                del data[key]
        if include_quantization and self.quantization_config is not None:
            data["quantization_config"] = self.quantization_config.model_dump(exclude_none=True)
        return data


def _fold_legacy_keys(data: dict[str, Any]) -> None:
    """Fold legacy config keys into the modern fields in place, as `DeepseekV4Config.__post_init__`."""
    n = data.get("num_hidden_layers", ModelConfig.model_fields["num_hidden_layers"].default)
    n = n if isinstance(n, int) and n > 0 else 0  # a bad value is reported by field validation
    compress_ratios = data.pop("compress_ratios", None)
    rate_csa = data.pop("compress_rate_csa", None)
    rate_hca = data.pop("compress_rate_hca", None)
    num_hash_layers = data.pop("num_hash_layers", None)
    qk_rope_head_dim = data.pop("qk_rope_head_dim", None)
    expert_dtype = data.pop("expert_dtype", None)

    quant = data.get("quantization_config")
    if isinstance(quant, dict) and expert_dtype is not None and "expert_dtype" not in quant:
        data["quantization_config"] = {**quant, "expert_dtype": expert_dtype}

    rates = dict(data.get("compress_rates") or DEFAULT_COMPRESS_RATES)
    if rate_csa is not None:
        rates[CSA] = rate_csa
    if rate_hca is not None:
        rates[HCA] = rate_hca
    data["compress_rates"] = rates

    if data.get("layer_types") is None and compress_ratios is not None:
        ratio_to_type = {0: SLIDING, rates.get(CSA): CSA, rates.get(HCA): HCA}
        unknown = sorted({r for r in compress_ratios if r not in ratio_to_type})
        if unknown:
            raise ValueError(f"compress_ratios has values {unknown}; expected 0 or the CSA/HCA rates {rates}")
        data["layer_types"] = [ratio_to_type[r] for r in compress_ratios]
    if data.get("layer_types") is None:
        interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        data["layer_types"] = [HCA] * min(n, 2) + interleave
    if isinstance(data["layer_types"], list):  # extra trailing entries describe MTP layers
        data["layer_types"] = data["layer_types"][:n]

    if data.get("mlp_layer_types") is None:
        n_hash = num_hash_layers if num_hash_layers is not None else DEFAULT_NUM_HASH_LAYERS
        data["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if isinstance(data["mlp_layer_types"], list):
        data["mlp_layer_types"] = data["mlp_layer_types"][:n]

    given_factor = data.get("partial_rotary_factor")
    head_dim = data.get("head_dim", ModelConfig.model_fields["head_dim"].default)
    if given_factor is None and isinstance(head_dim, int) and head_dim > 0:
        data["partial_rotary_factor"] = (
            qk_rope_head_dim / head_dim if qk_rope_head_dim is not None else DEFAULT_PARTIAL_ROTARY_FACTOR
        )
    data["rope_parameters"] = _nest_rope_parameters(data, given_factor)


def _nest_rope_parameters(data: dict[str, Any], given_factor: float | None) -> dict[str, Any]:
    """Build `{"main": ..., "compress": ...}` the way transformers' base config and V4 config do."""
    rope = copy.deepcopy(data.pop("rope_scaling", None) or data.get("rope_parameters") or {})
    rope_theta = data.get("rope_theta", ModelConfig.model_fields["rope_theta"].default)
    max_pos = data.get("max_position_embeddings", ModelConfig.model_fields["max_position_embeddings"].default)
    nested_keys = [key for key in rope if key in ("main", "compress")]
    # transformers' generic standardisation: fill theta / factor / type into every (sub-)dict
    for params in [rope[key] for key in nested_keys] or [rope]:
        if not isinstance(params, dict):
            continue
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", rope_theta)
        if given_factor is not None:
            params.setdefault("partial_rotary_factor", given_factor)
        if params["rope_type"] in _SCALED_ROPE_TYPES:
            params.setdefault("original_max_position_embeddings", max_pos)

    factor = data.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        return {"main": rope["main"], "compress": rope["compress"]}
    scaling = {key: value for key, value in rope.items() if key not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": factor}
    compress_theta = data.get("compress_rope_theta", ModelConfig.model_fields["compress_rope_theta"].default)
    compress = {**scaling, "rope_theta": compress_theta, "partial_rotary_factor": factor}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        # the V4 reference does not scale cos/sin by YaRN's mscale on compressed branches
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


# ---------------------------------------------------------------------- engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfig(BaseModel):
    """What the engine is asked to do; `resolve(model_config)` fills the model-dependent defaults.

    Defaults: `max_model_len` = min(max_position_embeddings, 8192); `max_num_batched_tokens` (the
    per-step token budget; prefill is chunked to fit it) = max(8192, max_num_seqs): large enough that a
    prefill step reads each routed expert's weights for many tokens, small enough that a long context
    does not blow up step memory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(description="Checkpoint directory (holds config.json and *.safetensors).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description='Compute dtype; "auto" takes the checkpoint\'s declared float dtype, else bfloat16.',
    )
    seed: int = Field(0, description="Seed for sampling and any random initialisation.")
    max_model_len: PositiveInt | None = Field(None, description="Longest prompt + output, in tokens.")
    max_num_seqs: PositiveInt = Field(256, description="Most requests in one step.")
    max_num_batched_tokens: PositiveInt | None = Field(None, description="Token budget of one step.")
    num_kv_blocks: PositiveInt | None = Field(
        None, description="KV blocks to allocate; None sizes from memory."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of device memory to use.")
    enable_prefix_caching: bool = False
    swa_replay: SwaReplay | None = Field(
        None,
        description='How a prefix-cache hit rebuilds the sliding windows: "exact" recomputes the last '
        'num_layers x sliding_window tokens before the hit, layer l only the last (num_layers - l) windows of them '
        '(same outputs as a cold run), "bounded" only the '
        "last sliding_window (SWA Bounded Replay, approximate, for models built for it); None takes \"exact\" "
        "under deterministic=True (which refuses \"bounded\"), else the model family's default "
        "(its config class's swa_replay_default: exact for V4, bounded for V4.1).",
    )
    host_cache_gib: float = Field(
        0.0, ge=0, description="GiB of (pinned, with CUDA) host memory holding prefix-cache blocks behind the "
        "device cache, least recently used out; 0: no host tier. Needs enable_prefix_caching.")
    prefix_store_path: str | None = Field(
        None, description="Directory (any POSIX path, shared by several engines; a 3FS mount in production) or "
        "plugin URL (scheme://...) of the prefix store: computed blocks are written there and found again by "
        "any engine of the same model, across restarts. Needs enable_prefix_caching.")
    prefix_store_gib: float | None = Field(
        None, gt=0, description="Capacity of the prefix store in GiB (the blocks expiring first go beyond it); "
        "None: unlimited.")
    prefix_store_ttl_s: dict[str, float] | None = Field(
        None, description="Seconds a stored block lives after its last use, per traffic class "
        "(SamplingParams.traffic_class); None: agent 3 days, chat 7 days.")
    default_traffic_class: str = Field("chat", description="Traffic class of requests that name none.")
    kv_transfer_role: Literal["prefill", "decode"] | None = Field(
        None, description='Prefill/decode disaggregation: "prefill" exports computed blocks (from the host tier) '
        'for decode instances, "decode" reads them by NIXL (deepinfer_core.kv.nixl_transfer); None: neither.')
    device: str | None = Field(None, description='Torch device string ("cpu", "cuda:0"); None detects it.')
    enforce_eager: bool = Field(False, description="Never capture CUDA graphs for decode steps.")
    cuda_graph_sizes: tuple[PositiveInt, ...] | None = Field(
        None,
        description="Decode batch sizes captured as CUDA graphs (vLLM's name). None: 1, 2, 4, 8, then steps "
        "of 8 to 32, 16 to 64, 32 to 128, 64 beyond, up to max_num_seqs; one value N: that ladder up to "
        "min(N, max_num_seqs); several: exactly those. Fewer sizes start faster; larger batches than the "
        "largest size decode eagerly.",
    )
    quantized_weights: Literal["native", "dequantize"] = Field(
        "native",
        description='Quantised checkpoint weights: "native" keeps FP4 routed experts in their packed bytes '
        "(the MoE backend decodes them per step; the reference dequantises per call) and FP8 projections "
        "in theirs (run by the make_linear backend; the reference dequantises per call); FP8 routed experts "
        "are dequantised at load. \"dequantize\" expands every quantised tensor to the compute dtype at load.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Overlap decode steps: launch the next step from the sampled tokens still on the "
        "device while the host handles the last one's outputs; None turns it on for CUDA devices.",
    )
    distributed_executor_backend: Literal["uni", "mp"] = Field(
        "uni",
        description='Where the model runs: "uni" in this process, "mp" in one spawned worker process per '
        "rank (world_size ranks, joined by torch.distributed). Under torchrun the ranks are torchrun's.",
    )
    world_size: PositiveInt = Field(
        1, description="Worker ranks of the mp executor when no parallel layout is set (each then holds the whole "
        "model and runs every plan); with tensor/data/context parallel sizes the world is their product."
    )
    worker_timeout_s: float = Field(
        600.0, gt=0, description="Longest a worker rank may take to answer one step before the engine fails."
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description='Speculative decoding, vLLM\'s spelling: {"method": "ngram" | "mtp", '
        '"num_speculative_tokens": k, ...} (see `deepinfer_core.config.speculative.SpeculativeConfig`); '
        "None decodes one token per request and step.")
    tensor_parallel_size: PositiveInt = Field(1, description="Ranks splitting attention heads and dense projections.")
    data_parallel_size: PositiveInt = Field(
        1, description="Attention data-parallel ranks, each with its own scheduler, requests and cache.")
    context_parallel_size: PositiveInt = Field(1, description="Ranks splitting one long prompt's prefill.")
    enable_expert_parallel: bool = Field(
        False, description="Spread the routed experts over every rank (EP size = TP x DP x CP).")
    enable_eplb: bool = Field(False, description="Rebalance expert replicas by observed load (needs expert parallelism).")
    time_ep_dispatch: bool = Field(
        False, description="Time the expert-parallel all-to-alls on every rank, synchronising the device around "
        "each (bench/ep_scale.py reads it from stats()['ranks']); off for serving.")
    eplb_config: EplbConfig = Field(
        default_factory=EplbConfig,
        description='EPLB knobs: {"num_redundant_experts": R, "window_size": W, "step_interval": S}.')
    deterministic: bool = Field(
        False,
        description="Batch-invariant inference: a request's greedy tokens and logprobs are bit-identical "
        "whatever shares its batch, however its prompt is chunked, after a preemption and after a prefix-cache "
        "hit (every backend is built in its invariant variant; prefix hits replay exactly). Costs throughput.",
    )
    engram_placement: Literal["device", "host"] = Field(
        "device", description='Where a model\'s Engram tables live (DeepSeek-V4.1): "device", or "host" (pinned '
        'host memory: the release\'s ~190 GiB of tables fit no GPU). Layer ops that read host memory from the '
        'device (`HostRowGather`: the NVIDIA plugin\'s) gather the rows with a kernel and decode keeps its CUDA '
        'graphs; others gather on the host, and decode then runs without CUDA graphs. '
        '"host" for a model without Engram tables is an error.')
    engram_prefetch: bool = Field(
        True, description="Host-placed Engram tables: start a step's lookups before its first layer, on a side "
        "stream when the device reads the tables, else gathered on a worker thread and copied on a side stream "
        "(models/engram_prefetch.py); False gathers at the layer. Changes nothing for tables on the device or a "
        "model without Engram.")
    decoder_trimming: bool = Field(
        False, description="DeepSeek-V4.1's decoder-side trimming: in prefill, once the candidate source layer "
        "(20 in the release) has written every row's compressed KV and index keys, the rest of that layer and the "
        "later ones run only on each request's last sliding_window (128) prompt rows and what follows them; "
        "requests asking for prompt logprobs are never trimmed. Faster prefill, not exact (those rows lose "
        "receptive field in the later layers; models/v41_trim.py). Any other model is an error.")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        try:
            parallel = self.parallel_config
        except ValidationError as err:
            raise ValueError(f"parallel layout: {err}") from err
        if parallel.world_size > 1 and self.world_size not in (1, parallel.world_size):
            raise ValueError(
                f"world_size={self.world_size} does not match the parallel layout's {parallel.world_size} ranks "
                f"(tensor x data x context parallel sizes); leave world_size at 1 or set it to that product"
            )
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model!r} is not a checkpoint directory (no config.json in it)")
        if (self.host_cache_gib or self.prefix_store_path or self.kv_transfer_role) and not self.enable_prefix_caching:
            raise ValueError("host_cache_gib, prefix_store_path and kv_transfer_role extend the prefix cache: set "
                             "enable_prefix_caching=True too")
        if self.prefix_store_path:
            from deepinfer_core.config.traffic import DEFAULT_TRAFFIC_TTL_S, check_traffic_classes

            check_traffic_classes(self.prefix_store_ttl_s or DEFAULT_TRAFFIC_TTL_S, self.default_traffic_class)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step; raise it or lower "
                f"max_num_seqs"
            )
        if self.deterministic and self.swa_replay == "bounded":
            raise ValueError(
                'deterministic=True needs exact window replay on prefix hits: swa_replay="bounded" changes a '
                'hit\'s outputs by design; leave swa_replay unset or set it to "exact"'
            )
        return self

    @property
    def parallel_config(self) -> ParallelConfig:
        """The parallel layout these options describe (`deepinfer_core.backends.parallel`)."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            context_parallel_size=self.context_parallel_size, enable_expert_parallel=self.enable_expert_parallel,
            enable_eplb=self.enable_eplb, eplb_config=self.eplb_config)

    @property
    def num_ranks(self) -> int:
        """Ranks of the world: the parallel layout's, else `world_size` (replicas of the whole model)."""
        return max(self.parallel_config.world_size, self.world_size)

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """Return a copy with every None default made concrete for `model_config` (and checked)."""
        if self.engram_placement != "device" and not model_config.has_engram:
            raise ConfigError(f"engram_placement={self.engram_placement!r}: {model_config.model_type} has no Engram "
                              "tables (only DeepSeek-V4.1 does); leave engram_placement at 'device'")
        if self.decoder_trimming:
            model_config.check_decoder_trimming()
        max_model_len = self.max_model_len or min(model_config.max_position_embeddings, 8192)
        if max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}); lower max_model_len"
            )
        budget = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        replay = self.swa_replay or ("exact" if self.deterministic else model_config.swa_replay_default)
        try:
            return EngineConfig.model_validate(
                {**self.model_dump(), "max_model_len": max_model_len, "max_num_batched_tokens": budget,
                 "swa_replay": replay}
            )
        except ValidationError as err:  # pragma: no cover - inputs were validated already
            raise ConfigError(str(err)) from err

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The compute dtype: explicit, or the checkpoint's declared float dtype, else bfloat16."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        return _DTYPES.get(model_config.checkpoint_dtype or "", torch.bfloat16)
