"""The cache fingerprint: what cached blocks depend on besides their tokens."""

from __future__ import annotations

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.interface import cache_fingerprint, checkpoint_identity, tensors_identity
from deepinfer_core.models.layer_plan import build_layer_plan
from deepinfer_core.models.tiny import random_state_dict, tiny_config, write_checkpoint


def fingerprint(config: dict, identity: bytes, dtype=torch.float32) -> bytes:
    model_config = ModelConfig.from_dict(config)
    return cache_fingerprint(model_config, dtype, build_layer_plan(model_config, dtype), identity)


def test_same_checkpoint_same_fingerprint_and_any_change_another(tmp_path):
    config = tiny_config()
    a = write_checkpoint(tmp_path / "a", config, seed=1)
    again = write_checkpoint(tmp_path / "again", config, seed=1)
    other = write_checkpoint(tmp_path / "other", config, seed=2, shards=2)
    base = fingerprint(config, checkpoint_identity(a))
    assert base == fingerprint(config, checkpoint_identity(a)) == fingerprint(config, checkpoint_identity(again))
    assert base != fingerprint(config, checkpoint_identity(other))  # rewritten weights
    assert base != fingerprint(config, checkpoint_identity(a), torch.bfloat16)  # another compute dtype
    assert base != fingerprint({**config, "sliding_window": config["sliding_window"] // 2}, checkpoint_identity(a))


def test_in_memory_weights_are_told_apart():
    config = tiny_config()
    one, two = random_state_dict(config, seed=1), random_state_dict(config, seed=2)
    assert tensors_identity(one) == tensors_identity(random_state_dict(config, seed=1))
    assert tensors_identity(one) != tensors_identity(two)
