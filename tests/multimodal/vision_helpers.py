"""A tiny DeepSeek-V4.1 checkpoint with a vision tower (`tiny_v41_config(vision=True)`), engines on it, and
the whole-forward oracle of an image prompt the engine tests compare against."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.worker.runner import ModelRunner

IMAGE_ID = 129264


@functools.lru_cache(maxsize=1)
def _checkpoint(root: str) -> tuple[Path, dict]:
    config = tiny_v41_config(vision=True)
    directory = write_v41_checkpoint(Path(root) / "tiny-v41-vision", config, seed=11)
    weights = load_v41_checkpoint(directory, V41Config.from_dict(config), torch.float32, "cpu")
    return directory, weights


def vision_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """(directory, weights) of the session's tiny V4.1 model with a vision tower."""
    return _checkpoint(str(tmp_path_factory.getbasetemp()))


def make_engine(checkpoint, **options) -> Engine:
    directory, weights = checkpoint
    options = {"dtype": "float32", "max_num_seqs": 4, "num_kv_blocks": 16} | options
    return Engine(EngineConfig(model=str(directory), **options), weights=dict(weights))


def picture(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def text_ids(length: int, seed: int) -> list[int]:
    return torch.randint(3, 129000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.lru_cache(maxsize=1)
def _oracle_runner(directory: Path, weights_id: int, weights: tuple) -> ModelRunner:
    engine_config = EngineConfig(model=str(directory), dtype="float32", max_num_seqs=1, num_kv_blocks=16)
    config = V41Config.from_dir(directory)
    return ModelRunner(config, engine_config.resolve(config), torch.device("cpu"), weights=dict(weights))


def whole_forward_logprobs(checkpoint, token_ids: list[int], images) -> torch.Tensor:
    """Log-probabilities at every position of `token_ids` from one forward over all of them, each image's
    span given the encoder's rows (`encode_image`) directly: no chunking, no cache reuse, no runner image
    path (the plan carries no images)."""
    directory, weights = checkpoint
    runner = _oracle_runner(directory, id(weights), tuple(weights.items()))
    num_blocks = -(-len(token_ids) // 128)
    plan = StepPlan((ScheduledRequest("oracle", 0, tuple(token_ids), True, ()),),
                    (NewRequest("oracle", 0, tuple(range(1, num_blocks + 1)), len(token_ids), SamplingParams(), 0),),
                    freed_request_ids=("oracle",))
    ctx = runner.prepare_inputs(plan, runner.update_states(plan))[0]
    mask = torch.zeros(len(token_ids), dtype=torch.bool)
    embeds = []
    for image in images:
        mask[image.offset : image.end] = True
        embeds.append(runner.model.encode_image(image.pixel_values))
    logits = runner.model(ctx, runner.kv_cache.layers, torch.arange(len(token_ids)), image_mask=mask,
                          image_embeds=torch.cat(embeds))
    return logits.float().log_softmax(-1)
