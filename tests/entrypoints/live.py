"""Helpers for the live-server tests: the real engine on the embedded tiny model (real V4 tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.entrypoints.serve import ServerState
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir

SERVED_NAME = "deepinfer-tiny"


@dataclass
class LiveServer:
    base_url: str
    state: ServerState
    engine: Engine


def tiny_engine(**overrides: object) -> Engine:
    """The real engine on the embedded tiny model, on the CPU."""
    config = {"model": str(embedded_tiny_model_dir()), "device": "cpu", "max_model_len": 2048,
              "enable_prefix_caching": True, **overrides}
    return Engine(EngineConfig(**config))
