"""Shared V4.1 test fixtures: one tiny official-layout checkpoint per session, runners and engines on it."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.testing.serving import serve
from deepinfer_core.worker.runner import ModelRunner


@functools.lru_cache(maxsize=2)
def _checkpoint(root: str, key: str) -> tuple[Path, dict]:
    config = tiny_v41_config()
    directory = write_v41_checkpoint(Path(root) / f"tiny-v41-{key}", config, seed=5)
    weights = load_v41_checkpoint(directory, V41Config.from_dict(config), torch.float32, "cpu")
    return directory, weights


def tiny_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """(directory, weights in the model's names, dequantised fp32) of the session's tiny V4.1 model."""
    return _checkpoint(str(tmp_path_factory.getbasetemp()), "main")


def make_runner(directory: Path, weights: dict, num_slots: int = 4, num_blocks: int = 40, **options) -> ModelRunner:
    engine_config = EngineConfig(model=str(directory), dtype="float32", max_num_seqs=num_slots, num_kv_blocks=num_blocks,
                                 **options)
    config = V41Config.from_dir(directory)
    return ModelRunner(config, engine_config.resolve(config), torch.device("cpu"), weights=dict(weights))


def make_engine(directory: Path, weights: dict, **options) -> Engine:
    options = {"dtype": "float32", "max_num_seqs": 4, "num_kv_blocks": 16} | options
    return Engine(EngineConfig(model=str(directory), **options), weights=dict(weights) if weights else None)


def random_prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 129000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompts: list[list[int]], max_tokens: int | list[int], **params) -> list:
    """Greedy outputs (chosen-token logprobs on) of `prompts` served together to the end; `max_tokens`
    one for all or one per prompt, `params` more `SamplingParams` fields."""
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    return serve(engine, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **params)
                                   for n in counts])


@functools.lru_cache(maxsize=1)
def _dspark_checkpoint(root: str) -> tuple[Path, dict]:
    from deepinfer_core.models.v41_tiny import tiny_v41_dspark_config

    config = tiny_v41_dspark_config()
    directory = write_v41_checkpoint(Path(root) / "tiny-v41-dspark", config, seed=5)
    return directory, load_v41_checkpoint(directory, V41Config.from_dict(config), torch.float32, "cpu")


def dspark_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """(directory, target weights) of the session's tiny V4.1 model with the release's three DSpark stages
    (its target weights are `tiny_checkpoint`'s)."""
    return _dspark_checkpoint(str(tmp_path_factory.getbasetemp()))
