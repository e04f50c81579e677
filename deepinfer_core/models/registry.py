"""Which model class serves a checkpoint: found from config.json's `model_type` (else `architectures`).

Built-in entries are listed here; plugins add theirs through the `register_models` hook. Classes are
imported on first use, so an entry costs nothing until a checkpoint asks for it. A model class
satisfies `deepinfer_core.models.interface.CausalLM`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer_core.config import ConfigError, read_config_json


@dataclass(frozen=True)
class ModelEntry:
    """One model family the engine can serve."""

    model_type: str
    """config.json's `model_type`."""
    architectures: tuple[str, ...]
    """config.json `architectures` names that mean this family (used when `model_type` is absent)."""
    model_class: str
    """`"package.module:Class"` of the model, imported on first use."""
    config_class: str = "deepinfer_core.config:ModelConfig"
    """`"package.module:Class"` of its config, which has `from_dir(path)`."""


BUILTIN_MODELS = (
    ModelEntry("deepseek_v4", ("DeepseekV4ForCausalLM",), "deepinfer_core.models.deepseek_v4.model:DeepseekV4ForCausalLM"),
    ModelEntry("deepseek_v41", ("DeepseekV41ForCausalLM",), "deepinfer_core.models.deepseek_v41.model:DeepseekV41ForCausalLM",
               "deepinfer_core.models.deepseek_v41.config:V41Config"),
)


def model_entries() -> list[ModelEntry]:
    """Every known entry: plugins' first (so a plugin can replace a built-in family), then built-ins."""
    from deepinfer_core import plugins

    return [*(ModelEntry(*fields) for fields in plugins.model_entries()), *BUILTIN_MODELS]


def find_model(config: dict[str, Any]) -> ModelEntry:
    """The entry for a config.json dictionary; `ConfigError` naming the known families if none fits."""
    entries = model_entries()
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    for entry in entries:
        if model_type == entry.model_type:
            return entry
    if model_type is None:
        for entry in entries:
            if any(name in entry.architectures for name in architectures):
                return entry
        if not architectures:
            return next(e for e in entries if e.model_type == "deepseek_v4")  # the family's own default
    known = ", ".join(f"{e.model_type} ({', '.join(e.architectures)})" for e in entries)
    raise ConfigError(f"model_type {model_type!r} (architectures {architectures}) is not a model this "
                      f"installation serves; known: {known}. A plugin can add one with the register_models hook")


def load_model_config(model_dir: str | Path):
    """Read `model_dir/config.json` with its family's config class."""
    return import_object(find_model(read_config_json(model_dir)).config_class).from_dir(model_dir)


def model_class(config) -> type:
    """The model class for a loaded config (anything with `model_type` and `architectures`)."""
    data = {"model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None)}
    return import_object(find_model(data).model_class)


def import_object(path: str) -> Any:
    """Import `"package.module:Name"`."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import {path!r}: {err}") from err
