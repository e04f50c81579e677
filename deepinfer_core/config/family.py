"""What every DeepSeek model family's config shares: the errors, the quantisation block, the capabilities a
family declares, and the fields V4 and V4.1 spell and bound alike (`FamilyConfig`).

`ModelConfig` (V4, `config/model.py`) and `V41Config` (`models/deepseek_v41/config.py`) derive from
`FamilyConfig`; a field defined here is defined once for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

SwaReplay = Literal["bounded", "exact"]
"""How a prefix-cache hit rebuilds the sliding window (docs/structures.md); the one list of the modes.
Each model family's config class declares its default as `swa_replay_default`."""


class ConfigError(ValueError):
    """A configuration file cannot be read or does not describe a supported model."""


class CheckpointError(ValueError):
    """A checkpoint file (weights, index, tokenizer) cannot be read, or does not match the model config
    (missing, unexpected, misshaped, mistyped or non-finite tensors). The message names the file or tensor."""


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model family can do, declared once by the family (its config's `capabilities`, which its
    model class exposes as `CausalLM.capabilities`); the engine asks this instead of testing names."""

    tensor_parallel: bool
    """Splits heads, output groups and expert width over `tensor_parallel_size` ranks."""
    context_parallel: bool
    """Splits one long prompt's prefill over `context_parallel_size` ranks."""
    expert_parallel: bool
    """Spreads the routed experts over the ranks (`enable_expert_parallel`)."""
    swa_replay_default: SwaReplay
    """How a prefix-cache hit rebuilds the sliding windows unless asked otherwise (`EngineConfig.swa_replay`)."""
    drafters: tuple[str, ...]
    """The speculative drafters the checkpoint carries (`SpeculativeConfig.method`): "mtp" for V4's MTP layer,
    "dspark" for V4.1's DSpark stages."""
    has_engram: bool
    """Has Engram tables (`EngineConfig.engram_placement`)."""
    can_trim_decoder: bool
    """Has decoder-side trimming (`EngineConfig.decoder_trimming`)."""
    has_checkpoint_loader: bool
    """The model class reads its own checkpoint layout (`load_checkpoint`) instead of the shared loader."""
    dspark_block_size: int = 0
    """Drafts one DSpark block proposes (the most `num_speculative_tokens` "dspark" takes); 0 without DSpark."""

    def check_parallel(self, model_type: str, kind: str, size: int) -> None:
        """`NotImplementedError` when `size` ranks of parallelism `kind` ("tensor", "context" or "expert")
        are asked of a family that does not implement it."""
        if size > 1 and not getattr(self, f"{kind}_parallel"):
            raise NotImplementedError(f"a parallelism the model family lacks: {kind}_parallel_size={size} for "
                                      f"{model_type!r} ({kind} parallelism is implemented for deepseek_v4)")


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


class FamilyConfig(BaseModel):
    """The fields DeepSeek-V4 and V4.1 configs spell, type, bound and default alike; each family's class
    adds its own (and its `model_config`, `swa_replay_default` and `capabilities`)."""

    model_config = ConfigDict(frozen=True, protected_namespaces=(), allow_inf_nan=False)

    swa_replay_default: ClassVar[SwaReplay]
    """How this family's prefix-cache hits rebuild the sliding windows unless asked otherwise."""

    vocab_size: PositiveInt = 129280
    num_attention_heads: PositiveInt = 64
    head_dim: PositiveInt = 512
    o_groups: PositiveInt = 8
    o_lora_rank: PositiveInt = 1024
    max_position_embeddings: PositiveInt = 1048576
    sliding_window: PositiveInt = 128
    rope_theta: float = Field(10000.0, gt=0)
    compress_rope_theta: float = Field(160000.0, gt=0)
    index_head_dim: PositiveInt = 128
    num_experts_per_tok: PositiveInt = 6
    hc_mult: PositiveInt = 4
    hc_sinkhorn_iters: PositiveInt = 20
    hc_eps: float = Field(1.0e-6, gt=0)
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    quantization_config: QuantizationConfig | None = None

    @property
    def capabilities(self) -> ModelCapabilities:
        """What this family can do (`ModelCapabilities`)."""
        raise NotImplementedError(f"{type(self).__name__} declares no capabilities")  # internal: a family's own bug

    @property
    def has_engram(self) -> bool:
        """Whether the model has Engram tables (`EngineConfig.engram_placement`)."""
        return self.capabilities.has_engram

    @property
    def expert_dtype(self) -> str | None:
        """The routed experts' storage format (`QuantizationConfig.expert_dtype`), None when unquantised."""
        return self.quantization_config.expert_dtype if self.quantization_config else None
