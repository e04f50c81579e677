"""DeepSeek-V4.1 configuration: the nested `config.json` and the reference's flat `inference/config.json`.

The release's `config.json` has `model_type "deepseek_v41"` at the root (token ids, `image_token_id`,
`quantization_config`), the language model under `text_config` and the ViT under `vision_config`
(research-v41.md §2). DeepSeek's reference code reads a flat `inference/config.json` with its own names
(`dim`, `n_layers`, `kv_source_layers`, ...). Both become one `V41Config`: the text fields at the top
level (the names `config.json` uses), so the model, the plan and the engine read `config.hidden_size`
as they do for V4. Every field is typed and checked; a bad value raises `ConfigError` naming it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from deepinfer_core.config import ConfigError, FamilyConfig, ModelCapabilities, SwaReplay, read_config_json
from deepinfer_core.config.eos import with_checkpoint_eos

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)


class V41VisionConfig(BaseModel):
    """`vision_config` (`deepseek_v41_vision`): read and checked, not run (no ViT path yet)."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    model_type: Literal["deepseek_v41_vision"] = "deepseek_v41_vision"
    num_hidden_layers: int = Field(32, ge=0)
    hidden_size: PositiveInt = 1024
    num_attention_heads: PositiveInt = 16
    intermediate_size: PositiveInt = 2816
    patch_size: PositiveInt = 14
    downsample_ratio: PositiveInt = 3
    rope_theta: float = Field(10000.0, gt=0)
    max_image_tokens: PositiveInt = 1024
    min_pixels: PositiveInt = 295936
    max_wh_ratio: float | None = None


class RopeScaling(BaseModel):
    """`text_config.rope_scaling`: YaRN on the compressed layers' rope (V4.1 spells the key `rope_type`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rope_type: Literal["yarn"] = "yarn"
    factor: float = Field(16.0, ge=1)
    original_max_position_embeddings: PositiveInt = 65536
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _type_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "type" in data and "rope_type" not in data:
            data = {("rope_type" if k == "type" else k): v for k, v in data.items()}
        return data


class V41Config(FamilyConfig):
    """DeepSeek-V4.1 model configuration (`text_config` fields at the top level, plus the root's).

    Build it with `V41Config.from_dir(checkpoint_dir)`, `from_dict(nested_config_json)` or
    `from_inference_dict(flat_inference_config)`.
    """

    model_config = _STRICT

    swa_replay_default: ClassVar[SwaReplay] = "bounded"
    """V4.1 was trained for SWA Bounded Replay: its prefix-cache hits replay only the last window."""

    # root of config.json
    model_type: Literal["deepseek_v41"] = MODEL_TYPE
    architectures: list[str] = Field(default_factory=lambda: [ARCHITECTURE])
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    bos_token_id: int = Field(0, ge=0)
    eos_token_id: int | list[int] = 1
    pad_token_id: int = Field(2, ge=0)
    image_token_id: int = Field(129264, ge=0)
    transformers_version: str | None = None
    vision_config: V41VisionConfig | None = None
    # text_config: size
    hidden_size: PositiveInt = 5120
    num_hidden_layers: PositiveInt = 40
    num_key_value_heads: Literal[1] = 1
    qk_rope_head_dim: PositiveInt = 64
    q_lora_rank: PositiveInt = 1280
    # rope
    rope_scaling: RopeScaling | None = Field(default_factory=RopeScaling)
    # compression, sharing and the indexer
    compress_ratios: list[Literal[0, 1, 2]] = Field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0] * 3)
    kv_source_layer_ids: list[int] = Field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list[int] = Field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    """-1: no candidate pre-filter."""
    candidate_block_size: int = Field(8, ge=0)
    candidate_topk_blocks: int = Field(2048, ge=0)
    index_n_heads: PositiveInt = 32
    index_topk: PositiveInt = 512
    # MoE
    n_routed_experts: PositiveInt = 384
    n_shared_experts: Literal[1] = 1
    moe_intermediate_size: PositiveInt = 2304
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    norm_topk_prob: Literal[True] = True
    routed_scaling_factor: float = Field(1.5, gt=0)
    swiglu_limit: float = Field(10.0, ge=0)
    hidden_act: Literal["silu"] = "silu"
    # mHC
    # Engram
    engram_layer_ids: list[int] = Field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list[PositiveInt] = Field(default_factory=lambda: [384006168, 384016682])
    engram_head_dim: PositiveInt = 256
    engram_n_heads: PositiveInt = 8
    engram_max_ngram_size: int = Field(4, ge=2)
    engram_vocab_size: PositiveInt = 16000000
    engram_compressed_vocab_size: PositiveInt = 99092
    engram_pad_token_id: int = Field(2, ge=0)
    # DSpark (read, not run)
    num_nextn_predict_layers: int = Field(3, ge=0)
    dspark_block_size: int = Field(5, ge=0)
    dspark_markov_rank: PositiveInt = 256
    dspark_noise_token_id: int = Field(128799, ge=0)
    dspark_target_layer_ids: list[int] = Field(default_factory=lambda: [37, 38, 39])
    dspark_n_routed_experts: PositiveInt = 128
    dspark_num_experts_per_tok: PositiveInt = 3
    # other
    rms_norm_eps: float = Field(1e-20, gt=0)
    attention_bias: Literal[False] = False
    tie_word_embeddings: Literal[False] = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> V41Config:
        """The nested `config.json` dictionary (root + `text_config` + `vision_config`)."""
        if not isinstance(data.get("text_config"), dict):
            raise ConfigError("a deepseek_v41 config.json needs a `text_config` object (the language model)")
        text = dict(data["text_config"])
        if text.pop("model_type", "deepseek_v41_text") != "deepseek_v41_text":
            raise ConfigError("text_config.model_type must be 'deepseek_v41_text'")
        root = {k: v for k, v in data.items() if k != "text_config"}
        clash = sorted(set(root) & set(text) - {"vocab_size"})
        if clash:
            raise ConfigError(f"config.json sets {clash} both at the root and in text_config")
        return _validate(cls, {**text, **root}, "config.json")

    @classmethod
    def from_inference_dict(cls, data: dict[str, Any]) -> V41Config:
        """The reference's flat `inference/config.json` (its own names; see `INFERENCE_NAMES`)."""
        from deepinfer_core.models.deepseek_v41.release import from_inference_names

        return _validate(cls, from_inference_names(data), "inference/config.json")

    @classmethod
    def from_dir(cls, path: str | Path) -> V41Config:
        """`<path>/config.json` (nested), else `<path>/inference/config.json` (flat)."""
        path = Path(path)
        if not (path / "config.json").is_file() and (path / "inference" / "config.json").is_file():
            return cls.from_inference_dict(json.loads((path / "inference" / "config.json").read_text()))
        return cls.from_dict(with_checkpoint_eos(read_config_json(path), path))

    # ------------------------------------------------------------------ checks

    @model_validator(mode="after")
    def _check(self) -> V41Config:
        n, ratios = self.num_hidden_layers, self.compress_ratios
        if len(ratios) != n + self.num_nextn_predict_layers:
            raise ValueError(f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n}) + "
                             f"num_nextn_predict_layers ({self.num_nextn_predict_layers})")
        if any(ratios[n:]):
            raise ValueError(f"compress_ratios: the DSpark stages (entries {n}..) must be 0, got {ratios[n:]}")
        _check_layer_ids("kv_source_layer_ids", self.kv_source_layer_ids, n)
        _check_layer_ids("index_source_layer_ids", self.index_source_layer_ids, n)
        _check_layer_ids("engram_layer_ids", self.engram_layer_ids, n)
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            zero = [i for i in getattr(self, name) if ratios[i] == 0]
            if zero:
                raise ValueError(f"{name}: layers {zero} have compress ratio 0 and cannot be sources")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            raise ValueError("kv_source_layer_ids must all be index sources too (their latent gives the index keys)")
        self._check_consumers()
        if self.candidate_source_layer_id >= 0:
            if self.candidate_source_layer_id not in self.index_source_layer_ids:
                raise ValueError(f"candidate_source_layer_id {self.candidate_source_layer_id} is not an index source")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                raise ValueError("candidate_block_size and candidate_topk_blocks must be positive with a candidate source")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                             f"{len(self.engram_layer_ids)} engram_layer_ids")
        self._check_widths()
        return self

    def _check_consumers(self) -> None:
        """Every compressed layer has a KV source and an index source at or before it, of its ratio."""
        for layer, ratio in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if not ratio:
                continue
            for name in ("kv_source_layer_ids", "index_source_layer_ids"):
                earlier = [s for s in getattr(self, name) if s <= layer]
                if not earlier:
                    raise ValueError(f"{name}: compressed layer {layer} has no source at or before it")
                if self.compress_ratios[max(earlier)] != ratio:
                    raise ValueError(f"{name}: layer {layer} (ratio {ratio}) would read layer {max(earlier)}, "
                                     f"whose ratio is {self.compress_ratios[max(earlier)]}")

    def _check_widths(self) -> None:
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and fit head_dim and index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts")
        ids = [self.bos_token_id, self.pad_token_id, *self.eos_token_ids]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"bos/eos/pad token ids {ids} must lie in the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ what the engine reads

    @property
    def capabilities(self) -> ModelCapabilities:
        """DeepSeek-V4.1 shards under tensor parallelism (`tensor_parallel_v41`) and spreads its routed
        experts under expert parallelism (context parallelism not yet), replays bounded, carries the DSpark
        drafter in its `mtp.*` slot when the config declares its stages and block (`has_dspark`), reads its
        own checkpoint layout, and has Engram tables when `engram_layer_ids` names any."""
        return ModelCapabilities(
            tensor_parallel=True, context_parallel=False, expert_parallel=True,
            swa_replay_default=self.swa_replay_default, drafters=("dspark",) if self.has_dspark else (),
            has_engram=bool(self.engram_layer_ids), can_trim_decoder=True, has_checkpoint_loader=True,
            dspark_block_size=self.dspark_block_size if self.has_dspark else 0)

    @property
    def has_dspark(self) -> bool:
        """The config declares DSpark: stages (`num_nextn_predict_layers`) and a block of at least one draft
        (whether the checkpoint holds their weights is checked when the drafter loads)."""
        return self.num_nextn_predict_layers > 0 and self.dspark_block_size > 0

    def check_decoder_trimming(self) -> None:
        """`ConfigError` unless this layer plan can be trimmed (`EngineConfig.decoder_trimming`)."""
        import torch

        from deepinfer_core.models.deepseek_v41.plan import build_v41_plan
        from deepinfer_core.models.deepseek_v41.trim import trim_layer

        trim_layer(build_v41_plan(self, torch.float32))

    @property
    def num_layers(self) -> int:
        """Decoder layers (DSpark stages not counted)."""
        return self.num_hidden_layers

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def checkpoint_dtype(self) -> str:
        return self.dtype

    @property
    def fp8_block(self) -> tuple[int, int]:
        """The FP8 scale block of dense weights (32x32 in the release)."""
        return tuple(self.quantization_config.weight_block_size) if self.quantization_config else (32, 32)

    def rope(self, ratio: int) -> dict[str, Any]:
        """Rope parameters of a layer of compress `ratio`: base theta for window-only layers, the
        compressed theta with YaRN (cos/sin unscaled, as the reference) for ratios 1 and 2."""
        if ratio == 0 or self.rope_scaling is None:
            theta = self.rope_theta if ratio == 0 else self.compress_rope_theta
            return {"rope_type": "default", "rope_theta": theta}
        return {"rope_type": "yarn", "rope_theta": self.compress_rope_theta, "attention_factor": 1.0,
                "truncate": True, **self.rope_scaling.model_dump(exclude={"rope_type"})}


def _validate(cls, data: dict[str, Any], source: str) -> V41Config:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        fields = sorted({".".join(map(str, e["loc"])) or "(config)" for e in err.errors()})
        raise ConfigError(f"{source} does not describe a supported DeepSeek-V4.1 model; fields {fields}: {err}") from err


def _check_layer_ids(name: str, ids: list[int], num_layers: int) -> None:
    if ids != sorted(set(ids)) or any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"{name} {ids} must be increasing, distinct layer numbers in [0, {num_layers})")
