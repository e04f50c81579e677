"""Tiny DeepSeek-V4 checkpoints for tests and benches: re-exported from `deepinfer_core.models.tiny`."""

from deepinfer_core.models.tiny import (
    PRESETS,
    TINY_MODEL_VERSION,
    bundled_tokenizer_dir,
    embedded_tiny_config,
    embedded_tiny_model_dir,
    random_state_dict,
    tiny_config,
    write_checkpoint,
)

_tokenizer_dir = bundled_tokenizer_dir  # the name bench/host_overhead.py imports

__all__ = [
    "PRESETS",
    "TINY_MODEL_VERSION",
    "bundled_tokenizer_dir",
    "embedded_tiny_config",
    "embedded_tiny_model_dir",
    "random_state_dict",
    "tiny_config",
    "write_checkpoint",
]
