"""Typed configuration, a contract every unit may import: the model's `config.json` and the engine's knobs.

- `family`: what every model family's config shares (`FamilyConfig`, its fields defined once), the
  capabilities a family declares (`ModelCapabilities`), `ConfigError`/`CheckpointError`.
- `model`: DeepSeek-V4's `ModelConfig` (V4.1's `V41Config` lives with its model, `models/deepseek_v41`).
- `engine`: `EngineConfig`, resolved once against the model (`EngineConfig.resolve`).
- `speculative`, `traffic`: the speculative-decoding options and the prefix store's traffic classes.

Everything is re-exported here: `from deepinfer_core.config import EngineConfig, ModelConfig, ...`.
"""

from deepinfer_core.config.engine import EngineConfig
from deepinfer_core.config.family import (
    CheckpointError,
    ConfigError,
    FamilyConfig,
    ModelCapabilities,
    QuantizationConfig,
    SwaReplay,
    read_config_json,
)
from deepinfer_core.config.model import (
    CSA,
    DEFAULT_COMPRESS_RATES,
    DEFAULT_NUM_HASH_LAYERS,
    DEFAULT_PARTIAL_ROTARY_FACTOR,
    HCA,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    SLIDING,
    ModelConfig,
)

__all__ = [
    "CSA", "DEFAULT_COMPRESS_RATES", "DEFAULT_NUM_HASH_LAYERS", "DEFAULT_PARTIAL_ROTARY_FACTOR", "HCA", "LAYER_TYPES",
    "MLP_LAYER_TYPES", "SLIDING", "CheckpointError", "ConfigError", "EngineConfig", "FamilyConfig",
    "ModelCapabilities", "ModelConfig", "QuantizationConfig", "SwaReplay", "read_config_json",
]
