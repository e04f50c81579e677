"""DeepSeek-V4's model configuration: the checkpoint's `config.json` as `ModelConfig`.

`ModelConfig` mirrors transformers 5.23's `DeepseekV4Config` field for field, with the same defaults and
the same normalisation of legacy keys, so a config.json means the same thing here as in the oracle.
Unknown keys (real checkpoints carry many) are kept in `model_extra` and otherwise ignored. The fields
V4.1 shares are defined once in `config.family.FamilyConfig`.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PositiveInt, ValidationError, model_validator

from deepinfer_core.config.eos import with_checkpoint_eos
from deepinfer_core.config.family import (
    ConfigError,
    FamilyConfig,
    ModelCapabilities,
    SwaReplay,
    read_config_json,
)

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


class ModelConfig(FamilyConfig):
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

    _CAPABILITIES: ClassVar[ModelCapabilities] = ModelCapabilities(
        tensor_parallel=True, context_parallel=True, expert_parallel=True, swa_replay_default=swa_replay_default,
        drafters=("mtp",), has_engram=False, can_trim_decoder=False, has_checkpoint_loader=False)

    hidden_size: PositiveInt = 4096
    moe_intermediate_size: PositiveInt = 2048
    num_hidden_layers: PositiveInt = 43
    num_key_value_heads: PositiveInt = 1
    q_lora_rank: PositiveInt = 1024
    n_routed_experts: PositiveInt = 256
    n_shared_experts: PositiveInt = 1
    scoring_func: Literal["sqrtsoftplus", "softmax", "sigmoid"] = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    layer_types: list[str] = Field(default_factory=list)
    compress_rates: dict[str, PositiveInt] = Field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    mlp_layer_types: list[str] = Field(default_factory=list)
    swiglu_limit: float = 10.0
    index_n_heads: PositiveInt = 64
    index_topk: int = 512
    num_nextn_predict_layers: int = Field(1, ge=0)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    hidden_act: str = "silu"
    rms_norm_eps: float = Field(1.0e-6, gt=0)
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, dict[str, Any]] = Field(default_factory=dict)
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    attention_bias: bool = False
    mlp_bias: bool = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Validate a config.json dictionary (not modified). Raises `pydantic.ValidationError`."""
        return cls.model_validate(data)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`, its EOS ids joined by those generation_config.json and the tokenizer
        name (`config.eos`); log a warning for each value far from the family's (`unusual_values`).
        Raises `ConfigError` naming the file if it is missing, unreadable, not JSON, or does not describe
        a supported model."""
        config_path = Path(path) / "config.json"
        data = with_checkpoint_eos(read_config_json(path), path)
        try:
            config = cls.from_dict(data)
        except ValidationError as err:
            raise ConfigError(
                f"{config_path} does not describe a supported DeepSeek-V4 model: {err}"
            ) from err
        for message in config.unusual_values():
            _warn_once(str(config_path), message)
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
    def checkpoint_dtype(self) -> str | None:
        """The `dtype` / `torch_dtype` the checkpoint declares (an extra key), e.g. "bfloat16"."""
        extra = self.model_extra or {}
        value = extra.get("dtype", extra.get("torch_dtype"))
        return value if isinstance(value, str) else None

    @property
    def capabilities(self) -> ModelCapabilities:
        """DeepSeek-V4: every parallelism, exact replay, the MTP drafter; no Engram, no trimming."""
        return self._CAPABILITIES

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


@functools.lru_cache(maxsize=1024)
def _warn_once(config_path: str, message: str) -> None:
    """Log a config warning once per process: building an engine reads its config.json more than once
    (the options are checked against it before the engine is built)."""
    logger.warning("%s: %s", config_path, message)
